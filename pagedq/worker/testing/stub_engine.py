"""A fake LLMEngine for queue tests and the queue-layer benchmark.

Faithful to the interface the worker uses: priority-ordered waiting queue, max_num_seqs, a KV block pool
(blocks reserved at admission for prompt + max_tokens, freed on finish or abort), max_tokens, EOS, stop
token ids and stop strings, DELTA / CUMULATIVE / FINAL_ONLY outputs, seeded sampling, abort. Tokens are
one character each, so text concatenates exactly like token ids. ``step_delay_s`` makes steps slow.
LoRA adapters (add_lora/remove_lora/list_loras, add_request's `lora`): an adapter's greedy tokens differ from the
base model's and from other adapters' (its name is hashed in), and add_lora refuses a folder that does not exist.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import random
import time
from dataclasses import dataclass, field

from pagedq.worker.service.engine_api import (
    CompletionOutput,
    LoRARequest,
    RequestOutput,
    RequestOutputKind,
    RequestRejected,
    SamplingParams,
    check_context_fits,
)

EOS_ID = 2
FIRST_TEXT_ID = 3
ALPHABET = "abcdefghijklmnopqrstuvwxyz ."


class StubTokenizer:
    vocab_size = 512
    eos_token_id = EOS_ID
    max_chars_per_token = 1  # one token per byte (protocol/prompt_size.py reads it)

    def __init__(self, chat_template: str | None = None) -> None:
        self.chat_template = chat_template  # a jinja template, as in a checkpoint's tokenizer_config.json

    def apply_chat_template(
        self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False
    ) -> str | list[int]:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        import jinja2

        template = jinja2.Template(self.chat_template)
        text = template.render(messages=messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text) if tokenize else text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [FIRST_TEXT_ID + b % 256 for b in text.encode()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(ALPHABET[(t - FIRST_TEXT_ID) % len(ALPHABET)] for t in ids if t >= FIRST_TEXT_ID)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    seq: int
    rng: random.Random
    generated: list[int] = field(default_factory=list)
    reported: int = 0
    blocks: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    lora: str = ""  # the adapter's name, "" for the base model


class StubEngine:
    def __init__(
        self,
        model_dir: str | None = None,
        *,
        block_size: int = 16,
        num_kv_blocks: int | None = 4096,
        max_num_seqs: int = 256,
        max_model_len: int = 2048,
        step_delay_s: float = 0.0,
        eos_every: int = 0,
        chat_template: str | None = None,
        max_loras: int = 4,
        **_ignored: object,
    ) -> None:
        self.tokenizer = StubTokenizer(chat_template)
        self.max_model_len = max_model_len
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.num_total_blocks = num_kv_blocks or 4096
        self.num_free_blocks = self.num_total_blocks
        self.step_delay_s = step_delay_s
        self.eos_every = eos_every  # >0: greedy streams emit EOS at this position (to exercise "stop")
        self._waiting: list[_Request] = []
        self._running: dict[str, _Request] = {}
        self._seq = itertools.count()
        self._ids: set[str] = set()  # unfinished request ids
        self.loras: dict[str, str] = {}  # adapter name -> its folder
        self.max_loras = max_loras  # reported only: the stub holds any number

    # --- counters the worker reads
    @property
    def num_waiting_requests(self) -> int:
        return len(self._waiting)

    @property
    def num_running_requests(self) -> int:
        return len(self._running)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._waiting) + len(self._running)

    @property
    def kv_slot_utilization(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    # --- LoRA adapters
    def add_lora(self, lora: LoRARequest) -> None:
        if not os.path.isdir(lora.path):
            raise ValueError(f"LoRA adapter {lora.name!r}: {lora.path} is not a folder")
        self.loras[lora.name] = lora.path

    def remove_lora(self, name: str) -> None:
        if self.loras.pop(name, None) is None:
            raise KeyError(f"LoRA adapter {name!r} is not loaded")

    def list_loras(self) -> list[LoRARequest]:
        return [LoRARequest(name, path) for name, path in sorted(self.loras.items())]

    # --- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        lora: LoRARequest | None = None,
    ) -> None:
        if lora is not None and self.loras.get(lora.name) != lora.path:
            raise ValueError(f"LoRA adapter {lora.name!r} is not loaded")
        if request_id in self._ids:
            raise RequestRejected(f"request_id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestRejected("prompt must not be empty")
        bad = [t for t in ids if not 0 <= t < self.tokenizer.vocab_size]
        if bad:
            raise RequestRejected(f"prompt token id {bad[0]} is out of vocabulary (size {self.tokenizer.vocab_size})")
        check_context_fits(self.max_model_len, len(ids), params.max_tokens)
        if self._blocks_for(len(ids) + params.max_tokens) > self.num_total_blocks:
            raise RequestRejected("prompt + max_tokens needs more KV blocks than the cache holds")
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        self._ids.add(request_id)
        self._waiting.append(
            _Request(
                request_id,
                prompt if isinstance(prompt, str) else None,
                ids,
                params,
                priority,
                next(self._seq),
                random.Random(seed),
                lora="" if lora is None else lora.name,
            )
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self._running.pop(request_id, None)
        if req is None:
            found = [r for r in self._waiting if r.request_id == request_id]
            if not found:
                return None
            req = found[0]
            self._waiting.remove(req)
        self.num_free_blocks += req.blocks
        self._ids.discard(request_id)
        req.blocks, req.finish_reason = 0, "abort"
        return self._output(req, cumulative=True)

    def step(self) -> list[RequestOutput]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self._schedule()
        outputs = []
        for req in list(self._running.values()):
            self._advance(req)
            if req.finish_reason is not None:
                del self._running[req.request_id]
                self._ids.discard(req.request_id)
                self.num_free_blocks += req.blocks
                req.blocks = 0
            kind = req.params.output_kind
            if req.finish_reason is not None or kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self._output(req, cumulative=kind != RequestOutputKind.DELTA))
        return outputs

    # --- admission queries (the WorkerEngine protocol)
    def num_prompt_tokens(self, prompt: str | list[int]) -> int:
        return len(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)

    def blocks_needed(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> int:
        """What _schedule reserves for a request (the stub runs one sample whatever n is)."""
        return self._blocks_for(num_prompt_tokens + max_tokens)

    @property
    def waiting_blocks_needed(self) -> int:
        return sum(self.blocks_needed(len(r.prompt_ids), r.params.max_tokens) for r in self._waiting)

    # --- internals
    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def _schedule(self) -> None:
        self._waiting.sort(key=lambda r: (r.priority, r.seq))  # vLLM's sense, as the engine: lower first
        while self._waiting and len(self._running) < self.max_num_seqs:
            req = self._waiting[0]
            need = self.blocks_needed(len(req.prompt_ids), req.params.max_tokens)
            if need > self.num_free_blocks:
                break
            self._waiting.pop(0)
            self.num_free_blocks -= need
            req.blocks = need
            self._running[req.request_id] = req

    def _next_token(self, req: _Request) -> int:
        pos = len(req.generated)
        if req.params.temperature == 0:
            if self.eos_every and pos + 1 == self.eos_every:
                return EOS_ID
            key = f"{req.prompt_ids[-8:]}|{pos}" + (f"|{req.lora}" if req.lora else "")
            digest = hashlib.blake2b(key.encode(), digest_size=4).digest()
            return FIRST_TEXT_ID + int.from_bytes(digest, "little") % len(ALPHABET)
        return FIRST_TEXT_ID + req.rng.randrange(len(ALPHABET))

    def _advance(self, req: _Request) -> None:
        token = self._next_token(req)
        params = req.params
        req.generated.append(token)
        if token == EOS_ID and not params.ignore_eos:
            req.generated.pop()
            req.finish_reason = "stop"
        elif token in params.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", token
        elif len(req.generated) >= params.max_tokens:
            req.finish_reason = "length"
        req.text = self.tokenizer.decode(req.generated)
        for stop in params.stop:
            cut = req.text.find(stop)
            if cut >= 0:
                req.text, req.finish_reason, req.stop_reason = req.text[:cut], "stop", stop
                req.generated = req.generated[:cut]  # one character per token
                break

    def _output(self, req: _Request, cumulative: bool) -> RequestOutput:
        start = 0 if cumulative else req.reported
        tokens = req.generated[start:]
        text = req.text if cumulative else req.text[min(start, len(req.text)) :]
        req.reported = len(req.generated)
        completion = CompletionOutput(0, text, tokens, None, None, req.finish_reason, req.stop_reason)
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_ids, [completion], req.finish_reason is not None, {}
        )
