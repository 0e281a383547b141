"""Sliding-window models at full context: tiny Mistral (every layer slides) and Qwen2 (use_sliding_window, its
first layer full and the second sliding, as max_window_layers says) with a window of 20 tokens, prompts and
outputs far longer than it, greedy token-exact against transformers in fp32 through chunked prefill, preemption
(recompute and swap), and prefix caching; prompt log-probabilities within 1e-4."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from pagedq.engine import LLM, SamplingParams
from pagedq.engine.config.engine import ModelConfig
from tests.conftest import VOCAB_SIZE, build_tokenizer
from tests.engine.parity import assert_greedy_parity, hf_greedy

WINDOW = 20  # not a multiple of the block size (8)
NEW_TOKENS = 40
PROMPT_LENGTHS = (70, 45, 21, 96)


def _config(architecture: str):
    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, initializer_range=0.2, sliding_window=WINDOW, tie_word_embeddings=False,
    )  # fmt: skip
    if architecture == "mistral":
        return transformers.MistralConfig(**common)
    return transformers.Qwen2Config(**common, use_sliding_window=True, max_window_layers=1)


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def sliding_checkpoint(request, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp(f"sliding-{request.param}")
    torch.manual_seed(0)
    config = _config(request.param)
    config._attn_implementation = "sdpa"  # the CPU path the oracle runs: checked to apply the window below
    model = getattr(transformers, f"{request.param.capitalize()}ForCausalLM")(config)
    model.save_pretrained(folder)
    build_tokenizer(folder)
    return folder


def _prompts(seed: int, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in lengths]


def _hf(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()


def test_config_serves_full_context_and_reads_layer_types(sliding_checkpoint):
    config = ModelConfig.from_pretrained(sliding_checkpoint)
    assert config.max_position_embeddings == 512  # no longer cut to the window
    assert config.sliding_window == WINDOW
    if config.architecture == "MistralForCausalLM":
        assert config.layer_types == ("sliding_attention", "sliding_attention") and config.every_layer_slides
    else:
        assert config.layer_types == ("full_attention", "sliding_attention") and not config.every_layer_slides
    assert [config.layer_window(i) for i in range(2)] == [WINDOW if kind == "sliding_attention" else 0
                                                           for kind in config.layer_types]  # fmt: skip


def test_oracle_applies_the_window(sliding_checkpoint):
    """transformers' sdpa path masks by the window: the same weights with full attention give other logits past
    it (and the same ones within it), so the parity below does test the window."""
    hf = _hf(sliding_checkpoint)
    prompt = torch.tensor(_prompts(1, (60,)))
    full_config = transformers.AutoConfig.from_pretrained(sliding_checkpoint)
    full_config.sliding_window, full_config.layer_types = None, ["full_attention"] * full_config.num_hidden_layers
    full = AutoModelForCausalLM.from_pretrained(
        sliding_checkpoint, config=full_config, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    with torch.no_grad():
        windowed, unwindowed = hf(prompt).logits[0], full(prompt).logits[0]
    torch.testing.assert_close(windowed[:WINDOW], unwindowed[:WINDOW])
    assert (windowed[WINDOW:] - unwindowed[WINDOW:]).abs().max() > 1e-3


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_greedy_parity_past_the_window(sliding_checkpoint, preemption_mode):
    hf = _hf(sliding_checkpoint)
    prompts = _prompts(seed=2)
    shared = prompts[0][:48]  # cached by a first request, then a prefix of a later prompt
    prompts.append(shared + _prompts(3, (30,))[0])
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # Five requests of up to 136 tokens in 16-token chunks: 24 blocks of 8 cannot hold them with full tables
    # (Qwen2), 12 cannot with Mistral's, each at most 4-6 blocks from its window on: preemption either way.
    blocks = 12 if ModelConfig.from_pretrained(sliding_checkpoint).every_layer_slides else 24
    llm = LLM(sliding_checkpoint, block_size=8, num_kv_blocks=blocks, max_num_batched_tokens=16, max_num_seqs=8,
              preemption_mode=preemption_mode)  # fmt: skip
    llm.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0.0))
    outputs = llm.generate(prompts, params)
    assert llm.stats()["num_preemptions"] > 0
    assert llm.stats()["prefix_cache_hit_rate"] > 0
    ties = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        expected, logits = hf_greedy(hf, prompt, NEW_TOKENS)
        ties += assert_greedy_parity(output.outputs[0].token_ids, expected, logits)
    assert ties == 0, f"{ties} near-ties where none were measured (see tests/engine/parity.py)"


def test_prompt_logprobs_past_the_window(sliding_checkpoint):
    hf = _hf(sliding_checkpoint)
    prompts = _prompts(seed=4, lengths=(64, 41))
    llm = LLM(sliding_checkpoint, block_size=8, max_num_batched_tokens=16)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
        entries = output.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        for j in range(1, len(prompt)):
            assert set(entries[j]) == set(reference[j - 1].topk(2).indices.tolist()) | {prompt[j]}, j
            for token_id, logprob in entries[j].items():
                assert logprob == pytest.approx(reference[j - 1, token_id].item(), abs=1e-4)


def test_every_layer_sliding_gives_back_blocks_before_the_window(sliding_checkpoint):
    """A 250-token sequence on a pool of 8 blocks of 8 (64 slots): with full tables it needs 32 blocks and is
    refused (Qwen2, whose first layer attends to everything); where every layer slides (Mistral) its blocks before
    the window go back as it goes, and it runs to the end without preemption, token-exact, never holding more
    than the window's blocks, and with the slot utilisation of what it holds."""
    prompt = _prompts(seed=5, lengths=(100,))[0]
    params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    llm = LLM(sliding_checkpoint, block_size=8, num_kv_blocks=8, max_num_batched_tokens=16)
    if not ModelConfig.from_pretrained(sliding_checkpoint).every_layer_slides:
        with pytest.raises(ValueError, match="needs 32 KV blocks but the whole cache has 8"):
            llm.generate([prompt], params)
        return
    output = llm.generate([prompt], params)[0]
    stats = llm.stats()
    assert stats["num_preemptions"] == 0 and stats["num_free_blocks"] == 8
    # at most the blocks of the window (19 earlier positions) and a 16-token chunk: ceil(35 / 8) + 1
    assert stats["peak_used_blocks"] <= 6
    assert stats["mean_kv_slot_utilization"] > 0.6  # given-back blocks count neither as used nor as filled
    expected, logits = hf_greedy(_hf(sliding_checkpoint), prompt, 150)
    assert assert_greedy_parity(output.outputs[0].token_ids, expected, logits) == 0


def test_given_back_blocks_and_the_prefix_cache(sliding_checkpoint):
    """Requests sharing a prefix far longer than the window, on a tight pool, after and alongside each other: a
    given-back block is served from the prefix cache only while it still holds its prefix (evicted, it is
    recomputed), with n > 1 samples forking a table whose first entries were given back. Token-exact."""
    hf = _hf(sliding_checkpoint)
    shared = _prompts(seed=6, lengths=(60,))[0]
    prompts = [shared + tail for tail in _prompts(seed=7, lengths=(9, 30, 1))]
    blocks = 14 if ModelConfig.from_pretrained(sliding_checkpoint).every_layer_slides else 20  # 20: full tables
    llm = LLM(sliding_checkpoint, block_size=8, num_kv_blocks=blocks, max_num_batched_tokens=16, max_num_seqs=4)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompts[0]], params)  # its early blocks are given back to the cache as it runs
    outputs = first + llm.generate(prompts[1:], params)
    assert llm.stats()["prefix_cache_hit_rate"] > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        expected, logits = hf_greedy(hf, prompt, 30)
        assert assert_greedy_parity(output.outputs[0].token_ids, expected, logits) == 0
    forked = llm.generate([prompts[1]], SamplingParams(max_tokens=12, n=3, temperature=0.0, ignore_eos=True))[0]
    expected, _ = hf_greedy(hf, prompts[1], 12)
    assert [sample.token_ids for sample in forked.outputs] == [expected] * 3
    assert llm.stats()["num_free_blocks"] == blocks


@pytest.mark.parametrize(
    "patch,message",
    [
        ({"sliding_window": -4}, "sliding_window must be a positive integer, 0 or null, got -4"),
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types must name 'full_attention' or"),
    ],
)
def test_bad_window_settings_are_refused_before_any_weight(tmp_path, patch, message):
    config = _config("mistral")
    config.architectures = ["MistralForCausalLM"]
    config.save_pretrained(tmp_path)  # a config alone: the error comes before any weight would load
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **patch}))
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_pretrained(tmp_path)


def test_speculative_verify_rows_past_the_window(sliding_checkpoint):
    """ngram speculation on a sliding model: verify rows (short chunks past the window, the native kernel's) and
    the lookahead slots that rejected drafts trim, on a pool where blocks before the window go back. Token-exact."""
    hf = _hf(sliding_checkpoint)
    pattern = _prompts(seed=8, lengths=(7,))[0]
    prompts = [pattern * 9, pattern[2:] * 6 + pattern[:3]]  # prompt lookup finds drafts in the repeats
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    blocks = 16 if ModelConfig.from_pretrained(sliding_checkpoint).every_layer_slides else 40
    llm = LLM(sliding_checkpoint, block_size=8, num_kv_blocks=blocks, max_num_batched_tokens=16,
              speculative_config=json.dumps(config))  # fmt: skip
    outputs = llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    assert llm.stats()["num_verify_rows"] > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        expected, logits = hf_greedy(hf, prompt, 30)
        assert assert_greedy_parity(output.outputs[0].token_ids, expected, logits) == 0
    assert llm.stats()["num_free_blocks"] == blocks
