"""Greedy parity against transformers' own generate, tolerant only of genuine near-ties."""

from __future__ import annotations

import torch

TIE_GAP = 1e-4  # fp32 summation order moves logits by ~1e-6; a divergence is only excused below this gap


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy continuation (EOS ignored) and the logits at every step."""
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        # ignored as our ignore_eos ignores it: never a stop, never masked (min_new_tokens would mask EOS, and a
        # model whose argmax is EOS would then diverge from ours)
        eos_token_id=None,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=0,
    )
    return out.sequences[0, len(prompt_ids) :].tolist(), [step[0] for step in out.logits]


def assert_greedy_parity(ours: list[int], theirs: list[int], logits: list[torch.Tensor]) -> int:
    """Equal token for token, except that a divergence at a near-tie ends the comparison. Returns ties seen.

    Callers assert the count. On the seeded fp32 tiny checkpoints and on the demo model it is 0: the smallest
    top-2 gap over every parity call site's steps measured 3e-4 (3x TIE_GAP), most are above 1e-2. A tie there
    means the numerics moved (or a seed changed), which a test should say rather than excuse.
    """
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        top2 = logits[step].topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < TIE_GAP, f"diverged at step {step}: ours {a}, transformers {b}, top-2 gap {gap:.3g}"
        return 1  # after a tie the two continuations legitimately differ
    assert len(ours) == len(theirs), f"ours has {len(ours)} tokens, transformers {len(theirs)}"
    return 0
