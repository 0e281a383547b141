"""Errors the engine raises for its callers to tell apart."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request the caller must fix: the worker rejects its job permanently; any other exception is the engine's
    fault and is retried."""
