"""The offline API (vLLM's `LLM`): a batch of prompts in, finished outputs out, in input order."""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Sequence
from pathlib import Path

from pagedq.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedq.engine.errors import RequestRejected
from pagedq.engine.llm_engine import LLMEngine
from pagedq.engine.lora.request import LoRARequest
from pagedq.engine.output.outputs import CompletionOutput, RequestOutput
from pagedq.engine.sample.sampling_params import RequestOutputKind, SamplingParams

ChatMessage = dict[str, str]  # {"role": ..., "content": ...}, what tokenizer.apply_chat_template takes


class LLM:
    def __init__(self, model: str | Path | None = None, **engine_kwargs) -> None:
        self.llm_engine = LLMEngine(model, **engine_kwargs)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in input order. `use_tqdm`: a progress bar on stderr (None: only when stderr is a terminal).
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base model), as vLLM."""
        prompts = _as_prompt_list(prompts)
        loras = _per_prompt_loras(lora_request, len(prompts))
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise RequestRejected(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        engine = self.llm_engine
        request_ids = []
        try:
            for prompt, params, lora in zip(prompts, params_list, loras):
                request_id = f"llm-{next(self._ids)}"
                final_only = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                engine.add_request(request_id, prompt, final_only, lora=lora)
                request_ids.append(request_id)
            finished = self._run_until_finished(set(request_ids), use_tqdm)
        except BaseException:
            for request_id in request_ids:  # leave the engine clean for the next call
                engine.abort_request(request_id)
            raise
        return [finished[request_id] for request_id in request_ids]

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (vLLM's `LLM.chat`).

        Each is rendered with the tokenizer's chat template (or `chat_template`) and tokenized without special
        tokens, as the worker does for `messages` jobs: the template writes BOS itself where the model wants one.
        """
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise RequestRejected("chat needs a tokenizer: this engine was built without one")
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise RequestRejected(
                "the model has no chat template: pass chat_template=..., or format the prompt "
                "yourself and call generate()"
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations:
            raise RequestRejected("chat needs at least one conversation")
        prompts: list[str | list[int]] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                list(conversation),
                chat_template=chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Per prompt, the beam_width best beams, best first (all prompts' beams batched together); lora_request as
        generate's."""
        prompts = _as_prompt_list(prompts)
        loras = _per_prompt_loras(lora_request, len(prompts))
        engine = self.llm_engine
        request_ids = [f"beam-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, lora in zip(request_ids, prompts, loras):
                engine.add_beam_search_request(request_id, prompt, params, lora=lora)
            finished = self._run_until_finished(set(request_ids))
        except BaseException:
            for request_id in request_ids:
                engine.abort_request(request_id)
            raise
        results = []
        for request_id in request_ids:
            output = finished[request_id]
            sequences = [_beam_sequence(c, params.length_penalty) for c in output.outputs]
            results.append(BeamSearchOutput(request_id, output.prompt_token_ids, sequences))
        return results

    def _run_until_finished(self, request_ids: set[str], use_tqdm: bool | None = False) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(request_ids), use_tqdm)
        num_output_tokens = 0
        try:
            while len(finished) < len(request_ids):
                for output in self.llm_engine.step():
                    if output.finished and output.request_id in request_ids:
                        finished[output.request_id] = output
                        if bar is not None:
                            num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                            elapsed = bar.format_dict["elapsed"]
                            bar.set_postfix_str(
                                f"output: {num_output_tokens / max(elapsed, 1e-9):.2f} toks/s", refresh=False
                            )
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return finished

    def stats(self) -> dict[str, float]:
        return self.llm_engine.stats()


def _per_prompt_loras(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise RequestRejected(f"got {len(loras)} LoRA requests for {num_prompts} prompts")
    return loras


def _as_prompt_list(prompts) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _progress_bar(total: int, use_tqdm: bool | None):
    """vLLM's "Processed prompts" bar, or None: off when asked, by default unless stderr is a terminal, and when
    tqdm is not installed (the engine does not depend on it)."""
    if use_tqdm is None:
        use_tqdm = sys.stderr.isatty()
    if not use_tqdm:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)


def _beam_sequence(beam: CompletionOutput, length_penalty: float) -> BeamSearchSequence:
    """A finished beam as beam_search returns it; beams always carry their cumulative logprob and finish reason."""
    if beam.cumulative_logprob is None or beam.finish_reason is None:
        raise RuntimeError(f"beam {beam.index} came back unfinished or without its cumulative logprob")
    score = beam.cumulative_logprob / max(1, len(beam.token_ids)) ** length_penalty
    return BeamSearchSequence(beam.token_ids, beam.cumulative_logprob, score, beam.text, beam.finish_reason)
