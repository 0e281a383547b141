"""A mixture-of-experts checkpoint's expert facts (ModelConfig.moe), read from its transformers config: which layers
are sparse, how many experts a token goes to, and how they route and activate."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts model's expert facts, named as transformers' configs name them."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # each routed expert's SwiGLU width
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the expert block; the others are dense
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    # transformers' Qwen routers cast the top-k weights to the model dtype before the experts use them; Mixtral's
    # keep them in fp32
    weights_in_model_dtype: bool = True
    # gpt-oss: "topk_softmax" (the k largest router logits, then a softmax over those k, in the logits' dtype) where
    # the others take "softmax_topk"; a bias on the router and on both expert projections; the clamped SwiGLU; and a
    # checkpoint whose stacked experts are [E, in, out] with gate and up columns interleaved (the loader reorders)
    scoring: str = "softmax_topk"
    biases: bool = False
    activation: str = "silu"
    interleaved_gate_up: bool = False

    @classmethod
    def from_hf(cls, architecture: str, hf) -> MoeConfig | None:
        """None for a dense architecture; ValueError naming the field for a routing we do not serve."""
        if architecture == "MixtralForCausalLM":
            moe = cls(
                num_experts=hf.num_local_experts,
                num_experts_per_tok=hf.num_experts_per_tok,
                moe_intermediate_size=hf.intermediate_size,
                norm_topk_prob=True,
                sparse_layers=tuple(range(hf.num_hidden_layers)),
                weights_in_model_dtype=False,
            )
        elif architecture in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
            step, dense = hf.decoder_sparse_step, set(hf.mlp_only_layers or ())
            if not isinstance(step, int) or step < 1:
                raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
            moe = cls(
                num_experts=hf.num_experts,
                num_experts_per_tok=hf.num_experts_per_tok,
                moe_intermediate_size=hf.moe_intermediate_size,
                norm_topk_prob=bool(hf.norm_topk_prob),
                sparse_layers=tuple(
                    i
                    for i in range(hf.num_hidden_layers)
                    if i not in dense and hf.num_experts > 0 and (i + 1) % step == 0
                ),
                shared_expert_intermediate_size=getattr(hf, "shared_expert_intermediate_size", 0) or 0,
            )
        elif architecture == "GptOssForCausalLM":
            _check_swiglu_oai(hf)
            moe = cls(
                num_experts=hf.num_local_experts,
                num_experts_per_tok=hf.num_experts_per_tok,
                moe_intermediate_size=hf.intermediate_size,
                norm_topk_prob=False,
                sparse_layers=tuple(range(hf.num_hidden_layers)),
                weights_in_model_dtype=False,
                scoring="topk_softmax",
                biases=True,
                activation="swiglu_oai",
                interleaved_gate_up=True,
            )
        else:
            return None
        if not isinstance(moe.num_experts, int) or moe.num_experts < 0:
            raise ValueError(f"num_experts must be a non-negative integer, got {moe.num_experts!r}")
        if moe.sparse_layers and not 1 <= moe.num_experts_per_tok <= moe.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in 1..num_experts ({moe.num_experts}), got {moe.num_experts_per_tok!r}"
            )
        if moe.sparse_layers and moe.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be a positive integer, got {moe.moe_intermediate_size!r}")
        return moe


def _check_swiglu_oai(hf) -> None:
    """gpt-oss's clamped SwiGLU runs with the kernels' alpha and limit (transformers' defaults, every released
    checkpoint's); ValueError naming the field for another value."""
    from pagedq.kernels.reference import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

    for name, served in (("swiglu_alpha", SWIGLU_OAI_ALPHA), ("swiglu_limit", SWIGLU_OAI_LIMIT)):
        value = getattr(hf, name, served)
        if value != served:
            raise ValueError(f"unsupported {name} {value!r}: pagedq's gpt-oss experts serve {served} only")
