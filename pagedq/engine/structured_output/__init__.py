"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice or EBNF grammar (xgrammar).

    params.py     StructuredOutputsParams (vLLM's names), validated without xgrammar; the schema keyword check
    schema.py     JSON-schema keywords xgrammar cannot honour, found up front
    backend.py    the lazy xgrammar import, with the error that says how to install it
    compiler.py   grammars compiled on a small thread pool, cached by spec in a byte-bounded cache
    step_mask.py  one step's bitmask over its structured draws: filled by the host, applied before sampling
    manager.py    what the engine drives: compiles waiting, one matcher per sequence, the per-step masks

Only params.py and schema.py are imported by producers (SamplingParams); everything that needs xgrammar imports it
when the first request carrying structured_outputs arrives.
"""

from pagedq.engine.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
