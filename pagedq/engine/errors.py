"""What the engine raises when a request, not the engine, is at fault."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request the engine refuses as given: bad sampling, structured-output or beam-search parameters, a prompt
    that does not fit, a feature this engine cannot serve. The same request fails the same way on every try, so a
    caller that retries errors (the queue worker) rejects the job on this one instead. A ValueError, as before.

    The engine's own configuration (EngineConfig, its flags) stays a plain ValueError: no request is to blame."""
