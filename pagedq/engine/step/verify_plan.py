"""A step's speculative verify rows in the layout of its draws (host data; spec_decode/verify.py uses it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class VerifyPlan:
    """A step's verify rows (R of them, d_r drafts each) in the layout of its draws."""

    rows: np.ndarray  # [R] batch-state rows
    first: np.ndarray  # [R] index of each verify row's first draw
    draws: np.ndarray  # [V] every draw of a verify row (V = sum of d_r + 1)
    draw_row: np.ndarray  # [V] its verify row (0..R-1)
    draw_step: np.ndarray  # [V] j: the draw after the row's j-th draft
    drafts: np.ndarray  # [D] the drafts, row by row (D = sum of d_r)
    draft_draws: np.ndarray  # [D] the draw each draft is compared with (the one drawn at its position)
    pad_index: np.ndarray  # [D] r * width + j: the draft's cell in an [R, width] matrix
    width: int  # the most drafts of a row

    def count_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(draw, token) pairs: each draft counted as an output by the penalties of every later draw of its row."""
        row, step = self.pad_index // self.width, self.pad_index % self.width
        per_row = np.bincount(row, minlength=len(self.rows))
        later = per_row[row] - step  # draws after draft j-1 (steps j .. d) in its row
        draws = np.repeat(self.first[row] + step + 1, later)
        draws += np.arange(len(draws)) - np.repeat(np.cumsum(later) - later, later)
        return draws, np.repeat(self.drafts, later)
