"""RequestRejected: every refusal that is the request's fault raises it (a ValueError still), so a caller that
retries failures (the queue worker) can tell a request it must reject from an engine that failed; the engine's own
configuration stays a plain ValueError. Oracle: the exception's exact type, and a request of the same shape
that passes."""

from __future__ import annotations

import sys

import pytest

from pagedq import RequestRejected as RootRequestRejected
from pagedq.engine import LLM, BeamSearchParams, LLMEngine, RequestRejected, SamplingParams, StructuredOutputsParams
from pagedq.engine.config.engine import EngineConfig
from pagedq.engine.errors import ContextLengthExceeded
from pagedq.engine.structured_output.backend import xgrammar
from pagedq.engine.structured_output.manager import StructuredOutputManager


def rejected(call, *args, kind: type[RequestRejected] = RequestRejected, **kwargs) -> RequestRejected:
    """The refusal, of exactly `kind` (a prompt past the context is its own kind, worded as vLLM words it)."""
    with pytest.raises(RequestRejected) as caught:
        call(*args, **kwargs)
    assert type(caught.value) is kind and isinstance(caught.value, ValueError)
    return caught.value


def test_the_root_package_and_the_engine_export_one_type():
    assert RootRequestRejected is RequestRejected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"n": 3, "best_of": 2},
        {"min_tokens": 9, "max_tokens": 8},
        {"stop": [""]},
        {"stop_token_ids": ["eos"]},
        {"logit_bias": {5: 101.0}},
        {"logit_bias": {-1: 1.0}},
        {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
        {"structured_outputs": {"json": "{not json"}},
        {"structured_outputs": {"pattern": "a+"}},
    ],
)
def test_bad_sampling_params_are_rejected(kwargs):
    rejected(SamplingParams, **kwargs)


def test_bad_structured_and_beam_params_are_rejected():
    rejected(StructuredOutputsParams, choice=[])
    rejected(StructuredOutputsParams, grammar="x" * (64 * 1024 + 1))
    rejected(StructuredOutputsParams.from_dict, ["json"])
    rejected(BeamSearchParams, beam_width=0, max_tokens=4)
    rejected(BeamSearchParams, beam_width=2, max_tokens=4, early_stopping="sometimes")


def test_a_constraint_without_xgrammar_or_a_tokenizer_is_rejected(monkeypatch):
    manager = StructuredOutputManager(None, 32, (2,), compile_timeout_s=1.0, cache_mib=1.0)
    constrained = SamplingParams(structured_outputs={"regex": "a+"})
    manager.check_available(SamplingParams())  # nothing to check without a constraint
    assert "tokenizer" in str(rejected(manager.check_available, constrained))
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar then fails, as on a box without it
    assert "xgrammar" in str(rejected(xgrammar))


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(str(tiny_llama_dir), device="cpu", num_kv_blocks=16, max_num_seqs=4)


def test_requests_the_engine_cannot_serve_are_rejected_and_leave_no_trace(engine):
    vocab, length = engine.model_config.vocab_size, engine.max_model_len
    params = SamplingParams(max_tokens=4)
    for prompt, request_params in [
        ("", params),
        ([], params),
        ([1, vocab], params),
        ([1, 2.5], params),
        ([1, 2], SamplingParams(max_tokens=16 * engine.block_manager.block_size)),  # past the whole KV cache
        ([1, 2], SamplingParams(logit_bias={vocab: 1.0})),
    ]:
        rejected(engine.add_request, "r", prompt, request_params)
    past = rejected(engine.add_request, "r", [1, 2], SamplingParams(max_tokens=length), kind=ContextLengthExceeded)
    assert f"maximum context length is {length} tokens" in str(past) and f"{length + 2} tokens" in str(past)
    rejected(engine.add_request, "r", [1, 2], {"max_tokens": 4})
    rejected(engine.add_beam_search_request, "b", [1, 2], BeamSearchParams(beam_width=5, max_tokens=4))
    assert not engine.has_unfinished_requests()
    engine.add_request("r", [1, 2], params)  # the same shape, in range, is taken
    rejected(engine.add_request, "r", [3, 4], params)  # its id is in use
    engine.abort_request("r")


def test_the_offline_api_rejects_what_the_caller_got_wrong(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=16)
    rejected(llm.generate, ["a", "b"], [SamplingParams()])
    rejected(llm.chat, [])
    rejected(
        llm.generate, [[1, 2]], SamplingParams(max_tokens=llm.llm_engine.max_model_len), kind=ContextLengthExceeded
    )


def test_engine_configuration_errors_stay_plain_value_errors(tiny_llama_dir):
    for kwargs in ({"max_num_seqs": 0}, {"preemption_mode": "sometimes"}, {"device": "tpu"}):
        with pytest.raises(ValueError) as caught:
            EngineConfig(model=str(tiny_llama_dir), **kwargs)
        assert not isinstance(caught.value, RequestRejected)
