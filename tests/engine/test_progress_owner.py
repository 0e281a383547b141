"""Request progress has one owner (pagedq/engine/core/request.py), and a step's draw layout reads its input only.

The first test reads the source: no module but the owner assigns a progress field. The second checks
pagedq/engine/step/draws.py against a plain per-chunk loop that lays the draws out one by one.
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedq.engine.core.step_plan import CachedRequestData
from pagedq.engine.step.draws import draw_layout

ROOT = Path(__file__).resolve().parents[2] / "pagedq"
PROGRESS = {
    "num_computed_tokens",
    "num_placeholders",
    "num_in_flight",
    "runner_num_tokens",
    "runner_num_blocks",
    "epoch",
}
OWNER = ROOT / "engine" / "core" / "request.py"


def _assigned_attributes(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for leaf in ast.walk(target):  # tuple targets: a.x, a.y = ...
                if isinstance(leaf, ast.Attribute) and leaf.attr in PROGRESS:
                    found.append((node.lineno, leaf.attr))
    return found


def test_only_the_owner_assigns_request_progress() -> None:
    outside = {
        f"{path.relative_to(ROOT.parent)}:{line} {name}"
        for path in ROOT.rglob("*.py")
        if path != OWNER
        for line, name in _assigned_attributes(ast.parse(path.read_text()))
    }
    assert outside == set()


@dataclass
class _Row:
    fan_out: int
    num_prompt_tokens: int


def _expected(chunks, infos, rows, lengths) -> list[tuple[int, int, int, int, int]]:
    """(last index, row, draw index, position, chunk) per draw, chunk by chunk."""
    draws, end = [], 0
    for i, (chunk, info) in enumerate(zip(chunks, infos)):
        end += int(lengths[i])
        if not chunk.needs_sample:
            continue
        position = chunk.start_position + int(lengths[i]) - info.num_prompt_tokens
        drafts = len(chunk.draft_token_ids)
        if drafts:
            draws += [(end - 1 - (drafts - j), int(rows[i]), 0, position - (drafts - j), i) for j in range(drafts + 1)]
        else:
            draws += [(end - 1, int(rows[i]), k, position, i) for k in range(1 + info.fan_out)]
    return draws


def test_draw_layout_against_a_loop_and_leaves_its_input_alone() -> None:
    rng = random.Random(0)
    for trial in range(200):
        chunks, infos = [], []
        for i in range(rng.randint(1, 8)):
            num_prompt = rng.randint(1, 20)
            kind = rng.choice(["prefill", "decode", "decode", "fork", "verify"]) if trial else "decode"
            drafts = tuple(rng.randrange(100) for _ in range(rng.randint(1, 4))) if kind == "verify" else ()
            num_new = rng.randint(1, num_prompt) if kind == "prefill" else 1 + len(drafts)
            start = rng.randint(0, num_prompt - num_new) if kind == "prefill" else num_prompt + rng.randint(0, 9)
            needs_sample = kind != "prefill" or rng.random() < 0.5
            chunks.append(CachedRequestData(f"r{i}", (), 0, (), num_new, start, needs_sample, drafts))
            infos.append(_Row(rng.randint(1, 3) if kind == "fork" else 0, num_prompt))
        rows = np.array(rng.sample(range(32), len(chunks)), dtype=np.int64)
        lengths = np.array([c.num_new_tokens for c in chunks], dtype=np.int64)
        before = [(r.fan_out, r.num_prompt_tokens) for r in infos]
        layout = draw_layout(chunks, infos, rows, lengths)
        assert [(r.fan_out, r.num_prompt_tokens) for r in infos] == before
        expected = _expected(chunks, infos, rows, lengths)
        if not expected:
            assert layout is None
            continue
        assert layout is not None
        got = list(zip(*(a.tolist() for a in (layout.last_index, layout.rows, layout.draw_index, layout.positions))))
        got = [(*draw, chunk) for draw, chunk in zip(got, layout.draw_chunk.tolist())]
        assert got == expected
        forking = [i for i, (c, r) in enumerate(zip(chunks, infos)) if c.needs_sample and r.fan_out]
        assert layout.forking.tolist() == forking
        has_drafts = any(c.needs_sample and c.draft_token_ids for c in chunks)
        assert (layout.verify is not None) == has_drafts
