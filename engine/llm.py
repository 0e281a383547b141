"""The offline API (vLLM's `LLM`): a batch of prompts in, finished outputs out, in input order."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Sequence

from engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams


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
    ) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        engine = self.llm_engine
        request_ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_id = f"llm-{next(self._ids)}"
                final_only = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                engine.add_request(request_id, prompt, final_only)
                request_ids.append(request_id)
            finished = self._run_until_finished(set(request_ids))
        except BaseException:
            for request_id in request_ids:  # leave the engine clean for the next call
                engine.abort_request(request_id)
            raise
        return [finished[request_id] for request_id in request_ids]

    def beam_search(self, prompts: str | list[int] | Sequence[str | list[int]],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Per prompt, the beam_width best beams, best first (all prompts' beams batched together)."""
        prompts = _as_prompt_list(prompts)
        engine = self.llm_engine
        request_ids = [f"beam-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt in zip(request_ids, prompts):
                engine.add_beam_search_request(request_id, prompt, params)
            finished = self._run_until_finished(set(request_ids))
        except BaseException:
            for request_id in request_ids:
                engine.abort_request(request_id)
            raise
        results = []
        for request_id in request_ids:
            output = finished[request_id]
            sequences = [BeamSearchSequence(c.token_ids, c.cumulative_logprob,
                                            c.cumulative_logprob / max(1, len(c.token_ids)) ** params.length_penalty,
                                            c.text, c.finish_reason) for c in output.outputs]
            results.append(BeamSearchOutput(request_id, output.prompt_token_ids, sequences))
        return results

    def _run_until_finished(self, request_ids: set[str]) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(request_ids):
            for output in self.llm_engine.step():
                if output.finished and output.request_id in request_ids:
                    finished[output.request_id] = output
        return finished

    def stats(self) -> dict[str, float]:
        return self.llm_engine.stats()


def _as_prompt_list(prompts) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts
