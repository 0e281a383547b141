"""RoPE scalings (YaRN, LongRoPE, dynamic NTK) and Phi-3: the tables against transformers' own rotary embedding
classes, greedy parity and prompt log-probabilities against transformers through chunked prefill, preemption and
the prefix cache, and one clear error per checkpoint option pagedq does not serve."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from pagedq.engine import LLM, SamplingParams
from pagedq.engine.config.engine import SUPPORTED_ROPE_TYPES, ModelConfig
from pagedq.engine.layers.rotary import rope_cos_sin_cache, rope_table_rows
from tests.conftest import VOCAB_SIZE
from tests.engine.parity import assert_greedy_parity, hf_greedy

ORIGINAL_MAX = 32  # LongRoPE's and YaRN's original_max_position_embeddings, dynamic NTK's max_position_embeddings
HALF = 8  # head_dim 16 (hidden 64, 4 heads): 8 frequencies
COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.2,
    tie_word_embeddings=False,
)
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.25 * i for i in range(HALF)],
    "long_factor": [1.5 + 1.5 * i for i in range(HALF)],
    "original_max_position_embeddings": ORIGINAL_MAX,
}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX}
DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}


def _config(kind: str) -> transformers.PretrainedConfig:
    if kind == "phi3-longrope":  # Phi-3 128k's shape: max_position_embeddings 8x its original
        return transformers.Phi3Config(
            **COMMON,
            max_position_embeddings=8 * ORIGINAL_MAX,
            original_max_position_embeddings=ORIGINAL_MAX,
            rope_parameters=LONGROPE,
            sliding_window=None,
        )
    if kind == "qwen3-yarn":  # Qwen3's long-context recipe: YaRN over its original window
        return transformers.Qwen3Config(
            **COMMON, head_dim=16, max_position_embeddings=ORIGINAL_MAX, rope_parameters=YARN, use_sliding_window=False
        )
    if kind == "llama-dynamic":
        return transformers.LlamaConfig(**COMMON, max_position_embeddings=ORIGINAL_MAX, rope_parameters=DYNAMIC)
    raise ValueError(kind)


_MODEL_CLASSES = {
    "phi3-longrope": "Phi3ForCausalLM",
    "qwen3-yarn": "Qwen3ForCausalLM",
    "llama-dynamic": "LlamaForCausalLM",
}


@pytest.fixture(scope="module")
def rope_checkpoint(tmp_path_factory):
    cache: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in cache:
            torch.manual_seed(0)
            folder = tmp_path_factory.mktemp(kind)
            getattr(transformers, _MODEL_CLASSES[kind])(_config(kind)).save_pretrained(folder)  # no tokenizer: ids
            cache[kind] = folder
        return cache[kind]

    return make


def _hf_rotary(folder: Path):
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return hf.model.rotary_emb


def _hf_cos_sin(rotary, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin [len, HALF] for one sequence's positions (a forward of that sequence)."""
    cos, sin = rotary(torch.zeros(1), torch.tensor([positions]))
    return cos[0, :, :HALF], sin[0, :, :HALF]


def _assert_rows(table: torch.Tensor, rows: list[int], cos: torch.Tensor, sin: torch.Tensor) -> None:
    assert torch.equal(table[rows, :HALF], cos) and torch.equal(table[rows, HALF:], sin)


# ---- the tables, against transformers' rotary embedding classes ---------------------------------------------------


def test_yarn_table_is_transformers_with_its_mscale(rope_checkpoint):
    folder = rope_checkpoint("qwen3-yarn")
    config = ModelConfig.from_pretrained(folder)
    assert config.max_position_embeddings == 4 * ORIGINAL_MAX  # original * factor, as vLLM serves it
    table = rope_cos_sin_cache(config)
    rotary = _hf_rotary(folder)
    assert rotary.attention_scaling > 1.0  # the mscale is in the table, not 1
    positions = list(range(config.max_position_embeddings))
    _assert_rows(table, positions, *_hf_cos_sin(rotary, positions))


def test_longrope_table_short_rows_then_long_rows(rope_checkpoint):
    folder = rope_checkpoint("phi3-longrope")
    config = ModelConfig.from_pretrained(folder)
    max_len = config.max_position_embeddings
    assert (max_len, config.rope_short_until) == (8 * ORIGINAL_MAX, ORIGINAL_MAX)
    table = rope_cos_sin_cache(config)
    assert table.shape == (max_len + ORIGINAL_MAX, 2 * HALF)
    rotary = _hf_rotary(folder)
    short = list(range(ORIGINAL_MAX))  # a sequence within the original window: short factors
    _assert_rows(table, [max_len + p for p in short], *_hf_cos_sin(rotary, short))
    long = list(range(3 * ORIGINAL_MAX))  # a longer one: long factors at every position
    _assert_rows(table, long, *_hf_cos_sin(rotary, long))
    assert not torch.equal(table[:ORIGINAL_MAX], table[max_len:])  # the two sets differ


def test_longrope_rows_follow_each_sequences_longest_length(rope_checkpoint):
    config = ModelConfig.from_pretrained(rope_checkpoint("phi3-longrope"))
    max_len = config.max_position_embeddings
    positions = np.array([0, 31, 32, 0, 31, 32], dtype=np.int64)
    # prompt + max_tokens: fits the original window (a draft past it reads the long row), then does not
    longest = np.array([32, 32, 32, 33, 33, 33], dtype=np.int64)
    assert rope_table_rows(config, positions, longest).tolist() == [max_len, max_len + 31, 32, 0, 31, 32]


def test_dynamic_ntk_table_rows_are_transformers_decode_steps(rope_checkpoint):
    folder = rope_checkpoint("llama-dynamic")
    config = ModelConfig.from_pretrained(folder)
    assert config.max_position_embeddings == 4 * ORIGINAL_MAX  # max_position_embeddings * factor, as vLLM
    table = rope_cos_sin_cache(config)
    rotary = _hf_rotary(folder)
    within = list(range(ORIGINAL_MAX))
    _assert_rows(table, within, *_hf_cos_sin(rotary, within))
    for length in range(ORIGINAL_MAX + 1, config.max_position_embeddings + 1):  # growing, as a decode does
        cos, sin = _hf_cos_sin(rotary, list(range(length)))
        _assert_rows(table, [length - 1], cos[-1:], sin[-1:])
    assert not torch.equal(table[-1, :HALF], torch.cos(torch.tensor(float(len(table) - 1)) * rotary.original_inv_freq))


# ---- greedy parity and prompt log-probabilities ----------------------------------------------------------------


def _prompts(lengths: tuple[int, ...], seed: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB_SIZE) for _ in range(shared)]
    return [prefix + [rng.randrange(3, VOCAB_SIZE) for _ in range(n - shared)] for n in lengths]


def _hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """log p(prompt[j] | prompt[:j]) for j >= 1, from one forward of the whole prompt."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]


def _check_parity(folder: Path, prompts: list[list[int]], new_tokens: list[int], **engine) -> LLM:
    llm = LLM(folder, block_size=16, **engine)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, prompt_logprobs=0) for n in new_tokens]
    outputs = llm.generate(prompts, params)
    ties = 0
    for prompt, n, output in zip(prompts, new_tokens, outputs):
        # A fresh model per sequence: transformers' dynamic RoPE keeps the frequencies a longer sequence grew to
        # for the next sequence of the trained length, and the oracle is a single sequence's result.
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        expected, logits = hf_greedy(hf, prompt, n)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ties += assert_greedy_parity(output.outputs[0].token_ids, expected, logits)
        ours = torch.tensor([entry[token] for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])])
        assert torch.allclose(ours, _hf_prompt_logprobs(hf, prompt), atol=1e-4, rtol=0)
    assert ties == 0, f"{ties} near-ties where none were measured (see tests/engine/parity.py)"
    return llm


TIGHT = dict(num_kv_blocks=14, max_num_batched_tokens=24, max_num_seqs=8)  # chunked prefill and preemption


def test_phi3_longrope_parity_short_and_long_prompts_chunked_and_preempted(rope_checkpoint):
    """Prompts that stay within the original window with their outputs (short factors) and prompts past it (long
    factors), around 16-token blocks."""
    short, long = (5, 15, 16, 17), (33, 47, 60)
    prompts = _prompts(short + long, seed=1)
    new_tokens = [ORIGINAL_MAX - n for n in short] + [24] * len(long)
    llm = _check_parity(rope_checkpoint("phi3-longrope"), prompts, new_tokens, **TIGHT)
    assert llm.stats()["num_preemptions"] > 0


def test_phi3_longrope_sequence_that_may_outgrow_the_window_reads_long_factors_throughout(rope_checkpoint, tmp_path):
    """A short prompt whose max_tokens may take it past the original window uses the long factors from its first
    position on, as transformers' Phi-3 does once a sequence outgrows it (it then recomputes the whole cache): the
    oracle is the same weights with short_factor = long_factor, where transformers uses the long set throughout."""
    folder = rope_checkpoint("phi3-longrope")
    all_long = tmp_path / "all-long"
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf.config.rope_parameters = {**hf.config.rope_parameters, "short_factor": LONGROPE["long_factor"]}
    hf.save_pretrained(all_long)
    prompts = _prompts((9, 17, 31), seed=7)  # each + 24 passes the window
    outputs = LLM(folder, block_size=16, **TIGHT).generate(
        prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )
    oracle = AutoModelForCausalLM.from_pretrained(all_long, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs):
        expected, logits = hf_greedy(oracle, prompt, 24)
        assert assert_greedy_parity(output.outputs[0].token_ids, expected, logits) == 0
    short_oracle = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert hf_greedy(short_oracle, prompts[0], 24)[0] != outputs[0].outputs[0].token_ids  # the two sets differ


def test_phi3_longrope_prefix_cache_keeps_short_and_long_prompts_apart(rope_checkpoint):
    """Prompts sharing 32 tokens, one within the original window and two past it: the first long one must not
    reuse the short one's block (other rotations); the second reuses the first's two."""
    folder = rope_checkpoint("phi3-longrope")
    prefix = _prompts((ORIGINAL_MAX,), seed=2)[0]
    rng = random.Random(2)
    prompts = [prefix[:24], *(prefix + [rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (8, 13))]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(folder, block_size=16)
    manager = llm.llm_engine.block_manager
    hits = []
    for prompt in prompts:  # one at a time: each finds what the earlier ones cached
        before = manager.num_prefix_hits
        output = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
        hits.append(manager.num_prefix_hits - before)
        expected, logits = hf_greedy(hf, prompt, 8)
        assert assert_greedy_parity(output.outputs[0].token_ids, expected, logits) == 0
    assert hits == [0, 0, 2 * 16]


def test_phi3_parity_through_the_prefix_cache(checkpoint_factory):
    """The default-RoPE Phi-3 (tests/conftest.py; tests/engine/test_parity.py runs it chunked and preempted): prompts
    sharing two full blocks, the later ones served from the prefix cache, and prompt logprobs without it."""
    folder = checkpoint_factory("phi3")
    prompts = _prompts((37, 40, 53), seed=8, shared=33)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(folder, block_size=16, max_num_batched_tokens=24)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = [llm.generate([prompt], params)[0] for prompt in prompts]  # one at a time: the cache fills first
    assert llm.llm_engine.block_manager.num_prefix_hits == 2 * 2 * 16
    for prompt, output in zip(prompts, outputs):
        expected, logits = hf_greedy(hf, prompt, 16)
        assert assert_greedy_parity(output.outputs[0].token_ids, expected, logits) == 0
    _check_parity(folder, prompts, [4] * len(prompts), max_num_batched_tokens=24)  # with prompt logprobs


def test_qwen3_yarn_parity_chunked_and_preempted(rope_checkpoint):
    lengths = (5, 17, 33, 47, 60)  # past the original window too: YaRN's table is static
    llm = _check_parity(rope_checkpoint("qwen3-yarn"), _prompts(lengths, seed=3), [40] * len(lengths), **TIGHT)
    assert llm.stats()["num_preemptions"] > 0


def test_llama_dynamic_ntk_parity_decoding_past_the_trained_length(rope_checkpoint):
    lengths = (5, 16, 17, 31, 32)  # prompts within it; 40 decodes each, past it
    llm = _check_parity(rope_checkpoint("llama-dynamic"), _prompts(lengths, seed=4), [40] * len(lengths), **TIGHT)
    assert llm.stats()["num_preemptions"] > 0


# ---- checkpoint options pagedq does not serve: one error each, from the config alone -------------------------


def _config_only(tmp_path: Path, config: transformers.PretrainedConfig, **extra) -> Path:
    """A folder holding only config.json (no weights: the error must come before any would load)."""
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(tmp_path)
    if extra:
        path = tmp_path / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))
    return tmp_path


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config (quant_method 'gptq')"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config (quant_method 'awq')"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config (quant_method 'fp8')"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config (quant_method 'mxfp4')"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'; supported: silu"),
        ({"mlp_bias": True}, "unsupported mlp_bias"),
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
    ],
)
def test_unsupported_option_is_one_clear_error(tmp_path, extra, message):
    folder = _config_only(tmp_path, transformers.LlamaConfig(**COMMON), **extra)
    with pytest.raises(ValueError, match=r"^unsupported") as error:
        ModelConfig.from_pretrained(folder)
    assert message in str(error.value)
    with pytest.raises(ValueError, match=r"^unsupported"):  # the engine says the same, before building anything
        LLM(folder)


def test_unsupported_rope_type_names_the_supported_ones(tmp_path):
    rope = {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    folder = _config_only(tmp_path, transformers.LlamaConfig(**COMMON, rope_parameters=rope))
    with pytest.raises(ValueError) as error:
        ModelConfig.from_pretrained(folder)
    assert str(error.value) == f"unsupported rope type 'proportional'; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"


def test_per_layer_type_rope_parameters_are_checked_each(tmp_path):
    """Gemma 3's shape of rope_parameters, one entry per layer type: an unsupported type in any is refused."""
    from pagedq.engine.config.engine import check_checkpoint_options

    config = transformers.LlamaConfig(**COMMON)
    config.rope_parameters = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
    }
    with pytest.raises(ValueError, match=r"^unsupported rope type 'proportional'"):
        check_checkpoint_options(config)
    config.rope_parameters["full_attention"] = {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    check_checkpoint_options(config)


def test_per_layer_type_table_is_transformers_for_each_layer_type():
    """rope_cos_sin_cache(config, layer_type): Gemma 3's local and global tables, each against transformers'."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    hf = transformers.Gemma3TextConfig(**COMMON, head_dim=16, layer_types=["sliding_attention", "full_attention"])
    hf.rope_parameters["full_attention"] = {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    config = ModelConfig(architecture="Gemma3ForCausalLM", hf_config=hf, head_dim=16, max_position_embeddings=64)
    rotary = Gemma3RotaryEmbedding(hf)
    tables = []
    for layer_type in ("sliding_attention", "full_attention"):
        cos, sin = rotary(torch.zeros(1), torch.arange(64)[None], layer_type=layer_type)
        table = rope_cos_sin_cache(config, layer_type)
        _assert_rows(table, list(range(64)), cos[0, :, :HALF], sin[0, :, :HALF])
        tables.append(table)
    assert not torch.equal(*tables)


def test_partial_rotary_factor_is_refused(tmp_path):
    """Phi-4-mini's shape: Phi3ForCausalLM rotating 3/4 of each head."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    folder = _config_only(tmp_path, transformers.Phi3Config(**COMMON, rope_parameters=rope, sliding_window=None))
    with pytest.raises(ValueError, match=r"^unsupported partial_rotary_factor 0.75: pagedq rotates the whole head"):
        ModelConfig.from_pretrained(folder)


# ---- Phi-3's sliding window (Phi-3-mini-4k: 2047), through the attention kernels' window ----------------------


def test_phi3_sliding_window_parity_past_the_window(tmp_path):
    torch.manual_seed(0)
    config = transformers.Phi3Config(**COMMON, max_position_embeddings=256, sliding_window=16)
    transformers.Phi3ForCausalLM(config).save_pretrained(tmp_path)
    assert ModelConfig.from_pretrained(tmp_path).max_position_embeddings == 256  # served whole, not cut to 16
    lengths = (5, 17, 33, 47)  # past the window, and decodes past it
    tight = dict(TIGHT, num_kv_blocks=8)
    llm = _check_parity(tmp_path, _prompts(lengths, seed=5), [24] * len(lengths), **tight)
    assert llm.stats()["num_preemptions"] > 0


def test_phi3_longrope_decodes_through_the_cuda_graph_buffers(rope_checkpoint):
    """Decode steps through the graph runner's padded buffers (capture=False on CPU) read each sequence's rows."""
    from tests.engine.test_cuda_graphs import _padded_runner

    folder = rope_checkpoint("phi3-longrope")
    prompts = _prompts((9, 20, 40), seed=9)
    max_tokens = [ORIGINAL_MAX - 9, 12, 12]  # the short factors, the long ones from a short prompt, a long prompt
    llm = LLM(folder, max_num_seqs=4, block_size=16, num_kv_blocks=32)
    graphs = _padded_runner(llm)
    outputs = llm.generate(
        prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    )
    assert graphs.num_runs >= max(max_tokens) - 1
    all_long = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    all_long.config.rope_parameters = {**all_long.config.rope_parameters, "short_factor": LONGROPE["long_factor"]}
    for prompt, n, output in zip(prompts, max_tokens, outputs):
        short = len(prompt) + n <= ORIGINAL_MAX
        oracle = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32) if short else _reload(all_long)
        expected, logits = hf_greedy(oracle.eval(), prompt, n)
        assert assert_greedy_parity(output.outputs[0].token_ids, expected, logits) == 0


def _reload(model):
    """A fresh copy of `model` built from its (edited) config: the rotary embedding reads the config at init."""
    fresh = type(model)(model.config)
    fresh.load_state_dict(model.state_dict())
    return fresh
