"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice or EBNF grammar (xgrammar).

    params.py     StructuredOutputsParams (vLLM's names), validated without xgrammar; the schema keyword check
    schema.py     what a JSON schema may not be, found up front: keywords xgrammar cannot honour, too deep, no value
    backend.py    the lazy xgrammar import, with the error that says how to install it
    compiler.py   grammars compiled on threads shared by source, cached by spec in a byte-bounded cache
    step_mask.py  one step's bitmask over its structured draws: filled by the host, applied before sampling
    interfaces.py what the manager reads of the engine's objects (Protocols: it sits below core/ and output/)
    filler.py     who fills the masks and when: the filler thread, its barrier (settle), the recycled buffers
    manager.py    what the engine drives, in four phases: compiles waiting, one matcher per sequence, the masks

Only params.py and schema.py are imported by producers (SamplingParams); everything that needs xgrammar imports it
when the first request carrying structured_outputs arrives.
"""

from pagedq.engine.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
