"""`speculative_config`: vLLM's names, defaults and checks, every number bounded. Torch-free (the CLIs parse it).

vLLM's rules for the ngram method (vllm/config/speculative.py): `num_speculative_tokens` is required and > 0;
`prompt_lookup_min` and `prompt_lookup_max` are both 5 when neither is given, one given alone stands for both,
each is >= 1 and min <= max. On top of vLLM: unknown keys, wrong types (a bool is not an int) and values past the
bounds below are refused, each error naming its key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

METHODS = ("ngram",)
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default for both bounds when neither is given
# Bounds: a verification row carries 1 + num_speculative_tokens tokens; the proposer keeps one index entry per
# token for each n in [prompt_lookup_min, prompt_lookup_max] (pagedq/engine/spec_decode/ngram.py), so both stay small.
MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 32
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding with drafts looked up in the request's own prompt + output (prompt lookup)."""

    method: str  # "ngram", the only method so far
    num_speculative_tokens: int  # k: drafts proposed per sequence and step, at most
    prompt_lookup_max: int  # the longest suffix n-gram looked up
    prompt_lookup_min: int  # the shortest

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {', '.join(map(repr, METHODS))}, got {self.method!r}"
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, MAX_PROMPT_LOOKUP)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, MAX_PROMPT_LOOKUP)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} must be <= "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, object] | str | None) -> SpeculativeConfig | None:
        """A config from a dict (`LLM(speculative_config=...)`), JSON text (`--speculative-config`), an instance
        (returned as is) or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config: not valid JSON ({error})") from None
            if value is None:
                return None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config: expected a JSON object or dict, got {type(value).__name__}")
        return cls._from_mapping(value)

    @classmethod
    def _from_mapping(cls, value: Mapping[str, object]) -> SpeculativeConfig:
        unknown = [str(key) for key in value if key not in KEYS]
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(map(repr, sorted(unknown)))} (known: {', '.join(KEYS)})"
            )
        method = value.get("method")
        if method is None:
            raise ValueError("speculative_config: method is required (one of: " + ", ".join(METHODS) + ")")
        if not isinstance(method, str):
            raise ValueError(f"speculative_config: method must be a string, got {type(method).__name__}")
        if value.get("num_speculative_tokens") is None:
            raise ValueError("speculative_config: num_speculative_tokens is required for method 'ngram'")
        num_tokens = _check_int("num_speculative_tokens", value["num_speculative_tokens"], MAX_SPECULATIVE_TOKENS)
        given = {
            key: _check_int(key, value[key], MAX_PROMPT_LOOKUP)
            for key in ("prompt_lookup_min", "prompt_lookup_max")
            if value.get(key) is not None
        }
        low = given.get("prompt_lookup_min", given.get("prompt_lookup_max", DEFAULT_PROMPT_LOOKUP))
        high = given.get("prompt_lookup_max", low)
        return cls(method, num_tokens, prompt_lookup_max=high, prompt_lookup_min=low)

    def to_dict(self) -> dict[str, object]:
        """The config as `parse` reads it back (for JSON records and the worker's settings)."""
        return {key: getattr(self, key) for key in KEYS}


def _check_int(key: str, value: object, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config: {key} must be an integer, got {value!r}")
    if not 1 <= value <= high:
        raise ValueError(f"speculative_config: {key} must be an integer in [1, {high}], got {value}")
    return value
