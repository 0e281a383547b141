"""Mixture-of-experts models (Qwen3-MoE with and without norm_topk_prob, Mixtral, Qwen2-MoE's shared expert) against
transformers in fp32: greedy token-exact through chunked prefill, preemption and prefix caching, prompt logprobs,
every expert hit, routing ties broken where transformers breaks them, and the loader's checkpoint layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pagedq.engine import LLM, SamplingParams
from pagedq.engine.config.engine import ModelConfig, MoeConfig
from pagedq.engine.layers.moe import SparseMoeBlock, route
from tests.conftest import MOE_ARCHITECTURES, build_checkpoint, random_tokens
from tests.engine.parity import assert_greedy_parity, hf_greedy

NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 15, 16, 17, 33, 47)


class ExpertCounter:
    """Forward hooks on every router of our model: which experts the top-k sent tokens to, per sparse layer, and
    the router logits seen (for the tie checks)."""

    def __init__(self, llm: LLM) -> None:
        model = llm.llm_engine.model_runner.model
        self.blocks = {name: m for name, m in model.named_modules() if isinstance(m, SparseMoeBlock)}
        self.hits: dict[str, torch.Tensor] = {}
        self.logits: dict[str, list[torch.Tensor]] = {name: [] for name in self.blocks}
        for name, block in self.blocks.items():
            self.hits[name] = torch.zeros(block.moe.num_experts, dtype=torch.long)
            block.gate.register_forward_hook(self._hook(name, block))

    def _hook(self, name: str, block: SparseMoeBlock):
        def record(_module, _inputs, logits: torch.Tensor) -> None:
            _, ids = route(logits, block.moe)
            self.hits[name] += torch.bincount(ids.flatten(), minlength=block.moe.num_experts)
            self.logits[name].append(logits.detach().clone())

        return record


def _parity(llm: LLM, hf, prompts: list[list[int]], params: SamplingParams) -> list:
    outputs = llm.generate(prompts, params)
    ties = 0
    for prompt, output in zip(prompts, outputs):
        expected, logits = hf_greedy(hf, prompt, params.max_tokens)
        ties += assert_greedy_parity(output.outputs[0].token_ids, expected, logits)
    assert ties == 0, f"{ties} near-ties where none were measured (see tests/engine/parity.py)"
    return outputs


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_greedy_parity_under_chunking_and_preemption_hits_every_expert(checkpoint_factory, architecture):
    folder = checkpoint_factory(architecture)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = ModelConfig.from_pretrained(folder)
    assert config.moe is not None
    prompts = [random_tokens(n, seed=n + len(architecture)) for n in PROMPT_LENGTHS]
    # 12 blocks of 16 slots cannot hold six requests of up to 79 tokens at once; a 24-token budget chunks prompts
    llm = LLM(folder, block_size=16, num_kv_blocks=12, max_num_batched_tokens=24, max_num_seqs=8)
    counter = ExpertCounter(llm)
    assert sorted(int(name.split(".")[2]) for name in counter.blocks) == list(config.moe.sparse_layers)
    _parity(llm, hf, prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert llm.stats()["num_preemptions"] > 0
    for name, hits in counter.hits.items():
        assert (hits > 0).all(), f"{name}: experts never chosen: {(hits == 0).nonzero().flatten().tolist()}"


def test_sparse_and_dense_layers_follow_the_config(checkpoint_factory):
    # qwen3_moe: mlp_only_layers [1] of 3; the unnormalised one: decoder_sparse_step 2 of 2 layers
    assert ModelConfig.from_pretrained(checkpoint_factory("qwen3_moe")).moe.sparse_layers == (0, 2)
    assert ModelConfig.from_pretrained(checkpoint_factory("qwen3_moe_unnormalised")).moe.sparse_layers == (1,)
    mixtral = ModelConfig.from_pretrained(checkpoint_factory("mixtral")).moe
    assert (mixtral.num_experts, mixtral.norm_topk_prob, mixtral.sparse_layers) == (4, True, (0, 1))
    assert ModelConfig.from_pretrained(checkpoint_factory("qwen2_moe")).moe.shared_expert_intermediate_size == 64


def test_prefix_caching_and_prompt_logprobs_match_transformers(checkpoint_factory):
    folder = checkpoint_factory("qwen3_moe")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    shared = random_tokens(40, seed=11)  # 2.5 blocks of 16: the second request reuses the first one's full blocks
    prompts = [shared + random_tokens(7, seed=12), shared + random_tokens(9, seed=13)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(folder, block_size=16, enable_prefix_caching=True, max_num_batched_tokens=32)
    _parity(llm, hf, prompts[:1], params)  # alone, so the second finds its prefix cached
    _parity(llm, hf, prompts[1:], params)
    assert llm.llm_engine.block_manager.num_prefix_hits >= 32  # two full blocks of the shared prefix

    scored = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))
    for prompt, output in zip(prompts, scored):
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
        for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
            assert prompt[position] in entry and len(entry) >= 2
            for token, logprob in entry.items():
                assert abs(logprob - float(want[position - 1, token])) < 1e-4


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_routing_ties_break_as_transformers_routers_do(norm_topk_prob):
    """Equal router logits: our top-k picks the expert (and weight) transformers' router picks."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hidden = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    qwen = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob)
    mixtral = MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2)
    for router, moe in (
        (Qwen3MoeTopKRouter(qwen), _moe(qwen, "Qwen3MoeForCausalLM")),
        (MixtralTopKRouter(mixtral), _moe(mixtral, "MixtralForCausalLM")),
    ):
        with torch.no_grad():
            router.weight.copy_(torch.randn(8, 16, generator=torch.Generator().manual_seed(1)))
            router.weight[5] = router.weight[2]  # experts 2 and 5: equal logits for every token
            router.weight[6] = router.weight[1]
            logits, want_weights, want_ids = router(hidden)
        assert torch.equal(logits[:, 2], logits[:, 5]) and torch.equal(logits[:, 1], logits[:, 6])
        weights, ids = route(logits, moe)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights.float())
        chosen = [set(row) for row in ids.tolist()]
        assert any(len(row & {2, 5}) == 1 for row in chosen), "no token had the tie decide its expert"


def _moe(hf_config, architecture: str) -> MoeConfig:
    hf_config.num_hidden_layers = 1
    moe = MoeConfig.from_hf(architecture, hf_config)
    assert moe is not None
    return moe


def test_greedy_parity_with_tied_experts(tmp_path):
    """A checkpoint whose routers give two experts equal logits: which of them a token gets decides the output,
    and ours equals transformers' token for token."""
    folder = build_checkpoint(tmp_path / "tied", "qwen3_moe_unnormalised", seed=3)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith("mlp.gate.weight")]:
        tensors[name][5] = tensors[name][2]
    save_file(tensors, path, metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(folder, block_size=16, max_num_batched_tokens=24)
    counter = ExpertCounter(llm)
    _parity(
        llm,
        hf,
        [random_tokens(n, seed=n) for n in (9, 30)],
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    )
    (name,) = counter.blocks
    logits = torch.cat(counter.logits[name])
    assert torch.equal(logits[:, 2], logits[:, 5])  # our router kept the tie exact
    _, ids = route(logits, counter.blocks[name].moe)
    assert any(len(set(row) & {2, 5}) == 1 for row in ids.tolist()), "no token had the tie decide its expert"


def test_stacked_expert_tensors_load_like_per_expert_ones(checkpoint_factory, tmp_path):
    """A checkpoint holding every expert in one tensor per projection (transformers 5's in-memory layout) loads
    the same weights as the per-expert names."""
    source = checkpoint_factory("mixtral")
    tensors = load_file(source / "model.safetensors")
    stacked = {}
    for name, tensor in tensors.items():
        if ".experts." not in name:
            stacked[name] = tensor
    for layer in range(2):
        prefix = f"model.layers.{layer}.block_sparse_moe.experts"
        experts = range(4)
        gate_up = [torch.cat([tensors[f"{prefix}.{e}.w1.weight"], tensors[f"{prefix}.{e}.w3.weight"]]) for e in experts]
        stacked[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        stacked[f"{prefix}.down_proj"] = torch.stack([tensors[f"{prefix}.{e}.w2.weight"] for e in experts])
    folder = _copy_with(source, tmp_path / "stacked", stacked)
    per_expert = dict(LLM(source).llm_engine.model_runner.model.named_parameters())
    for name, param in LLM(folder).llm_engine.model_runner.model.named_parameters():
        assert torch.equal(param, per_expert[name]), name


def test_a_missing_expert_tensor_is_named(checkpoint_factory, tmp_path):
    source = checkpoint_factory("qwen3_moe")
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    folder = _copy_with(source, tmp_path / "missing", tensors)
    with pytest.raises(ValueError, match=r"missing 1 tensors.*model\.layers\.2\.mlp\.experts\.3\.up"):
        LLM(folder)


def test_bad_routing_configs_are_refused_before_weights_load(checkpoint_factory, tmp_path):
    source = checkpoint_factory("qwen3_moe")
    for field, value, message in (
        ("num_experts_per_tok", 9, "num_experts_per_tok must be in 1..num_experts"),
        ("decoder_sparse_step", 0, "decoder_sparse_step must be a positive integer"),
    ):
        folder = _copy_with(source, tmp_path / field, None)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_pretrained(folder)


def _copy_with(source: Path, folder: Path, tensors: dict[str, torch.Tensor] | None) -> Path:
    """The checkpoint folder `source` copied to `folder`, with `tensors` as its weights if given."""
    folder.mkdir()
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            (folder / path.name).write_bytes(path.read_bytes())
    save_file(tensors if tensors is not None else load_file(source / "model.safetensors"), folder / "model.safetensors")
    return folder
