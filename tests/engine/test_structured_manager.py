"""The structured-output manager on its own: requests are handed over as data (stand-ins with only the fields its
Protocols name, no engine), and what it decides comes back as data (admitted, failed with their error, finishes
with theirs); it never finishes a request itself. The tokens are checked against the tokenizer's own encoding."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
import transformers

from pagedq.engine.structured_output.manager import StructuredOutputManager
from pagedq.engine.structured_output.params import StructuredOutputsParams

pytest.importorskip("xgrammar")


@dataclass
class Params:
    structured_outputs: StructuredOutputsParams | None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass
class Sequence:
    request_id: str
    sampling_params: Params
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2])
    output_token_ids: list[int] = field(default_factory=list)
    is_finished: bool = False
    epoch: int = 0
    fan_out: int = 0
    later_waves: list[Sequence] = field(default_factory=list)

    @property
    def group_id(self) -> str:
        return self.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@pytest.fixture
def tokenizer(tiny_llama_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)


def manager_for(tokenizer) -> StructuredOutputManager[Sequence]:
    return StructuredOutputManager(tokenizer, len(tokenizer), (tokenizer.eos_token_id,), 30.0, 16.0)


def admitted(manager: StructuredOutputManager[Sequence], count: int):
    ready, failed = [], []
    deadline = time.monotonic() + 30
    while len(ready) + len(failed) < count and time.monotonic() < deadline:
        admission = manager.admit(idle=True)
        ready += admission.ready
        failed += admission.failed
    return ready, failed


def test_admit_hands_back_the_ready_and_the_failed_with_their_error(tokenizer):
    manager = manager_for(tokenizer)
    good = Sequence("good", Params(StructuredOutputsParams(regex="[a-z]+")))
    bad = Sequence("bad", Params(StructuredOutputsParams(regex="([a-z")))
    manager.submit(good)
    manager.submit(bad)
    assert manager.waiting_requests == [good, bad]
    ready, failed = admitted(manager, 2)
    assert ready == [good] and [r for r, _ in failed] == [bad]
    assert "structured_outputs regex does not compile" in failed[0][1]
    assert not bad.is_finished and set(manager.sequences) == {"good"}  # the engine finishes it, not the manager
    manager.close()


def test_advance_hands_back_finishes_and_the_groups_error(tokenizer):
    manager = manager_for(tokenizer)
    done = Sequence("done", Params(StructuredOutputsParams(choice=["hello"])))
    refused = Sequence("refused", Params(StructuredOutputsParams(regex="[a-z]{3,9}")))
    going = Sequence("going", Params(StructuredOutputsParams(regex="[a-z]{3,9}")))
    for request in (done, refused, going):
        manager.submit(request)
    assert len(admitted(manager, 3)[0]) == 3
    done.output_token_ids = tokenizer.encode("hello", add_special_tokens=False)
    refused.output_token_ids = tokenizer.encode("12", add_special_tokens=False)
    going.output_token_ids = tokenizer.encode("ab", add_special_tokens=False)
    verdict = manager.advance([done, refused, going])
    assert [(r.request_id, error is None) for r, error in verdict.finishes] == [("done", True), ("refused", False)]
    assert "does not match the structured_outputs grammar" in (verdict.finishes[1][1] or "")
    assert verdict.errors == {"refused": verdict.finishes[1][1]}  # that group is done: its final output's error
    assert set(manager.sequences) == {"going"} and set(manager.grammars) == {"going"} and not manager.errors
    going.is_finished = True  # finished by the engine (a stop string, max_tokens): the manager lets it go
    assert manager.advance([going]).finishes == [] and not manager.sequences and not manager.grammars
    manager.close()


def slow_grammar(tag: str) -> str:
    """A grammar xgrammar takes over a second to compile for this tokenizer (2,000 optional literals)."""
    return "root ::= " + " ".join(f'"{tag}{i}"?' for i in range(2000))


@pytest.mark.abuse
def test_a_sources_compiles_past_their_time_limit_hold_up_that_source_alone(tokenizer):
    """Two slow compiles of source "a" time out but keep running (xgrammar cannot be stopped): a later compile of
    "a" waits behind them and times out too, while a `choice` of source "b" compiles at once and is admitted."""
    manager = StructuredOutputManager(tokenizer, len(tokenizer), (tokenizer.eos_token_id,), 0.3, 16.0)

    def request(name: str, source: str, **kind: object) -> Sequence:
        return Sequence(name, Params(StructuredOutputsParams(**kind, compile_source=source)))  # type: ignore[arg-type]

    for i in range(2):
        manager.submit(request(f"slow{i}", "a", grammar=slow_grammar(f"s{i}_")))
    ready, failed = admitted(manager, 2)
    assert not ready and [(r.request_id, error) for r, error in failed] == [
        (f"slow{i}", "structured_outputs grammar did not compile within 0.3 s") for i in range(2)
    ]
    assert manager.pool.running("a") == 2  # past their limit, still compiling
    manager.submit(request("again", "a", choice=["yes", "no"]))
    manager.submit(request("other", "b", choice=["yes", "no"]))
    ready, failed = admitted(manager, 2)
    assert [r.request_id for r in ready] == ["other"] and [r.request_id for r, _ in failed] == ["again"]
    assert manager.pool.waiting("a") == 0 and manager.pool.running("a") == 2  # "again" left the queue at its limit
    manager.close()


def test_a_repeated_spec_is_converted_once_at_add(monkeypatch):
    """The converter runs on the caller's thread at add_request: a schema every request repeats (a client's
    response_format), or the same bad one again, is converted once; the verdicts kept are bounded."""
    from pagedq.engine.errors import RequestRejected
    from pagedq.engine.structured_output import compiler

    converted: list[str] = []
    convert = compiler.check_converts
    monkeypatch.setattr(compiler, "check_converts", lambda params: (converted.append(params.kind), convert(params)))
    check = compiler.ConversionCheck(size=2)
    good, bad = StructuredOutputsParams(json={"type": "object"}), StructuredOutputsParams(regex="([a-z")
    for _ in range(3):
        check(good)
        check(StructuredOutputsParams(json='{"type":  "object"}'))  # the same schema, as text
        with pytest.raises(RequestRejected, match=r"^structured_outputs regex does not compile: "):
            check(bad)
    assert converted == ["json", "regex"]
    check(StructuredOutputsParams(regex="[a-z]"))  # a third verdict: the least recently used one (good) goes
    check(good)
    assert converted == ["json", "regex", "regex", "json"]
