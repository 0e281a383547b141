"""fused_moe's reference against transformers' own experts, and the "cpu" backend's grouped path against the
reference."""

from __future__ import annotations

import json

import pytest
import torch
from moe_cases import CASES, MoeCase, make_experts, make_routing
from paged_cases import assert_close
from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from pagedq import kernels
from pagedq.bench import kernels_moe
from pagedq.kernels import cpu_moe, moe, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ORACLE_CASE = MoeCase(tokens=9, top_k=3, experts=8, hidden=64, intermediate=32, idle_experts=(6,))


def _random_parameters(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.3)


@pytest.mark.parametrize(
    "experts_class,config_class", [(Qwen3MoeExperts, Qwen3MoeConfig), (MixtralExperts, MixtralConfig)]
)
def test_reference_matches_transformers_silu_experts(experts_class, config_class):
    case = ORACLE_CASE
    config = config_class(
        hidden_size=case.hidden, intermediate_size=case.intermediate, moe_intermediate_size=case.intermediate,
        num_experts=case.experts, num_local_experts=case.experts, hidden_act="silu", experts_implementation="eager",
    )  # fmt: skip
    experts = experts_class(config)
    _random_parameters(experts)
    hidden = torch.randn(case.tokens, case.hidden)
    weights, ids = make_routing(case, "cpu")
    expected = experts(hidden, ids, weights)
    out = reference.fused_moe(hidden, experts.gate_up_proj.detach(), experts.down_proj.detach(), weights, ids)
    assert_close(out, expected.detach())


def test_reference_matches_transformers_gpt_oss_experts():
    """gpt-oss stores gate/up interleaved and transposed ([E, H, 2I], columns g0 u0 g1 u1 ...): the model
    de-interleaves them at load, as done here, so fused_moe always sees [gate; up] halves."""
    case = ORACLE_CASE
    config = GptOssConfig(
        hidden_size=case.hidden, intermediate_size=case.intermediate, num_local_experts=case.experts,
        experts_implementation="eager",
    )  # fmt: skip
    assert (config.swiglu_limit, config.swiglu_alpha) == (reference.SWIGLU_OAI_LIMIT, reference.SWIGLU_OAI_ALPHA)
    experts = GptOssExperts(config)
    _random_parameters(experts)
    with torch.no_grad():
        experts.gate_up_proj.mul_(8.0)  # gate/up values past the limit of 7: both clamps act
    hidden = torch.randn(case.tokens, case.hidden)
    weights, ids = make_routing(case, "cpu")
    expected = experts(hidden, ids, weights).detach()
    gate_up, gate_up_bias = experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach()
    w13 = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
    w13_bias = torch.cat([gate_up_bias[:, ::2], gate_up_bias[:, 1::2]], dim=-1)
    w2 = experts.down_proj.detach().transpose(1, 2).contiguous()
    w2_bias = experts.down_proj_bias.detach()
    projected = torch.cat([hidden @ gate_up[e] for e in range(case.experts)])
    assert projected.max() > 7 and projected.min() < -7
    biases = {"w13_bias": w13_bias, "w2_bias": w2_bias}
    out = reference.fused_moe(hidden, w13, w2, weights, ids, **biases, activation="swiglu_oai")
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation,with_bias", [("silu", False), ("silu", True), ("swiglu_oai", True)])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cpu_grouped_path_matches_reference(dtype, activation, with_bias, case):
    hidden = torch.randn(case.tokens, case.hidden).to(dtype)
    weights, ids = make_routing(case, "cpu")
    experts = make_experts(case, dtype, "cpu", with_bias)
    kwargs = {"w13_bias": experts["w13_bias"], "w2_bias": experts["w2_bias"], "activation": activation}
    out = cpu_moe.fused_moe(hidden, experts["w13"], experts["w2"], weights, ids, **kwargs)
    expected = reference.fused_moe(hidden, experts["w13"], experts["w2"], weights, ids, **kwargs)
    assert expected.abs().max() > 0.5  # not a vacuous comparison of near-zero outputs
    assert_close(out, expected)


@pytest.mark.parametrize("impl", [reference.fused_moe, cpu_moe.fused_moe, moe.fused_moe])
def test_no_tokens_gives_an_empty_output(impl):
    case = MoeCase(tokens=0, top_k=2, experts=4)
    weights, ids = make_routing(case, "cpu")
    experts = make_experts(case, torch.float32, "cpu", with_bias=False)
    out = impl(torch.randn(0, case.hidden), experts["w13"], experts["w2"], weights, ids)
    assert out.shape == (0, case.hidden) and out.dtype == torch.float32


@pytest.mark.parametrize("impl", [reference.fused_moe, cpu_moe.fused_moe, moe.fused_moe])
def test_an_unknown_activation_is_refused(impl):
    case = MoeCase(tokens=2, top_k=1, experts=2)
    weights, ids = make_routing(case, "cpu")
    experts = make_experts(case, torch.float32, "cpu", with_bias=False)
    with pytest.raises(ValueError, match=r"activation must be one of .*'gelu'"):
        impl(torch.randn(2, case.hidden), experts["w13"], experts["w2"], weights, ids, activation="gelu")


@pytest.mark.parametrize("bad_id", [-1, 4])
def test_cpu_path_refuses_routing_ids_outside_the_experts(bad_id):
    case = MoeCase(tokens=3, top_k=2, experts=4)
    weights, ids = make_routing(case, "cpu")
    ids[1, 0] = bad_id
    experts = make_experts(case, torch.float32, "cpu", with_bias=False)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\)"):
        cpu_moe.fused_moe(torch.randn(3, case.hidden), experts["w13"], experts["w2"], weights, ids)


def test_each_backend_binds_its_fused_moe(monkeypatch):
    monkeypatch.setenv("PAGEDQ_KERNELS", "cpu")
    assert kernels.bind("cpu").fused_moe is cpu_moe.fused_moe
    monkeypatch.setenv("PAGEDQ_KERNELS", "reference")
    assert kernels.bind("cpu").fused_moe is reference.fused_moe
    monkeypatch.setenv("PAGEDQ_KERNELS", "triton")
    assert kernels.bind("cpu").fused_moe is moe.fused_moe


def test_cpu_moe_bench_compares_both_paths_on_tiny_shapes(capsys):
    records = kernels_moe.bench_cpu_fused_moe([1, 5], repeats=1, shapes=[("tiny", 4, 2, 16, 8)])
    printed = [json.loads(line[5:]) for line in capsys.readouterr().out.splitlines() if line.startswith("JSON ")]
    assert printed == records and [r["shape"] for r in records] == [
        "tiny T=1 E=4 K=2 H=16 I=8 fp32",
        "tiny T=5 E=4 K=2 H=16 I=8 fp32",
    ]
    assert all(r["max_abs_diff_vs_reference"] < 1e-5 and r["grouped_ms"] > 0 for r in records)
