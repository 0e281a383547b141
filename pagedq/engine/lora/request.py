"""What a request names to run under a LoRA adapter: torch-free, so producers (the worker, the gateway) can build
and check one without the engine."""

from __future__ import annotations

import re
from dataclasses import dataclass

# An adapter's name is its identity in the engine, in a job and in the OpenAI `model` field, and a metrics label:
# short, printable, no spaces or quotes. "/" is allowed (hub-style names, "org/adapter").
MAX_LORA_NAME_CHARS = 128
MAX_LORA_PATH_CHARS = 4096
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")


def check_lora_name(name: object) -> str:
    """The name, or a ValueError saying what is wrong with it."""
    if not isinstance(name, str):
        raise ValueError(f"a LoRA adapter name must be a string, got {type(name).__name__}")
    if not name:
        raise ValueError("a LoRA adapter name must not be empty")
    if len(name) > MAX_LORA_NAME_CHARS:
        raise ValueError(f"a LoRA adapter name has at most {MAX_LORA_NAME_CHARS} characters, got {len(name)}")
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"a LoRA adapter name starts with a letter or digit and holds only letters, digits and . _ / -, "
            f"got {name!r}"
        )
    return name


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter by name, and the PEFT folder (adapter_config.json + adapter_model.safetensors) it loads from.

    The name is the adapter's identity: two requests naming the same adapter share its slot and its prefix cache;
    an engine refuses a name it already holds from another path."""

    name: str
    path: str

    def __post_init__(self) -> None:
        check_lora_name(self.name)
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"LoRA adapter {self.name!r}: the path must be a non-empty string, got {self.path!r}")
        if len(self.path) > MAX_LORA_PATH_CHARS:
            raise ValueError(f"LoRA adapter {self.name!r}: the path has more than {MAX_LORA_PATH_CHARS} characters")
