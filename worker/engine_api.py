"""The engine types the worker needs, imported from engine/ without pulling in torch.

engine/__init__.py imports the model code (torch); the worker's queue layer, the stub engine and the
producer clients only need the plain dataclasses, so load those modules directly.
"""

from __future__ import annotations

from engine.outputs import CompletionOutput, RequestOutput  # noqa: F401
from engine.sampling_params import RequestOutputKind, SamplingParams  # noqa: F401
