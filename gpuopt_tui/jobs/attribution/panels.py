"""The panels of `n_steps = "auto"` (adaptive.py): where each sample's points lie, what its token scores and
their error estimate are, which panels its next pass splits, and the weight of every point at the end.

A panel [lo, lo + w] holds 5 equally spaced points. On it, Simpson's rule on all 5 (S5) and on the ends and the
middle (S3) differ by w/12 x (-1, 4, -6, 4, -1) . g, a fourth difference of the integrand g: that is the panel's
error estimate, per token. Its value is Boole's rule, w/90 x (7, 32, 12, 32, 7) . g (Simpson's S5 plus (S5 - S3)
/ 15, one order higher). Splitting a panel keeps all 5 of its points (the ends and middles of the two halves)
and adds the 4 quarter points of the halves. Positions are integers on [0, GRID], so that every point is exact
and found again by its position.

The integrand g here is each token's projection of the gradient, sum_h (x - baseline)_h x dF/dx_h: its
integral over a panel is that panel's share of the token's attribution. Full gradients, where they are kept
(per-dimension attributions), are weighted only at the end, once the panels are final (every point evaluated is a
node of a final panel).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

GRID = 1 << 40  # positions: panel widths stay divisible by 4 for 38 splits, far below any step cap
FIRST_PANELS = 4  # the first pass: 4 panels, 17 points (the least a sample uses); with 2 panels (9 points) a
# bump of the integrand between two of them went unseen (a fine-tuned BERT, ig_rules_offline_H100.md)
MIN_STEPS = 4 * FIRST_PANELS + 1
SPLITS = 2  # panels split per sample in each later pass: 8 new points
NEW_POINTS = 4 * SPLITS
BOOLE = np.array([7.0, 32.0, 12.0, 32.0, 7.0]) / 90.0
FOURTH_DIFFERENCE = np.array([-1.0, 4.0, -6.0, 4.0, -1.0]) / 12.0
QUARTERS = np.arange(5)  # a panel's points: lo + q x width / 4


def first_positions() -> np.ndarray:
    """[17] the points of the first pass (every sample's)."""
    return np.arange(MIN_STEPS, dtype=np.int64) * (GRID // (MIN_STEPS - 1))


def step_counts(max_steps: int) -> list[int]:
    """The points a sample can stop at: 17, 25, 33, ..., the largest within `max_steps`."""
    return list(range(MIN_STEPS, max_steps + 1, NEW_POINTS))


class Estimate(NamedTuple):
    """What a sample's panels say now (all per token [tokens] but `panel_errors`)."""

    scores: np.ndarray  # Boole's rule on every panel
    error: np.ndarray  # the sum of the panels' |S5 - S3|
    panel_errors: np.ndarray  # [panels] each panel's largest |S5 - S3| over the tokens (what `split` takes)
    magnitude: np.ndarray  # the integral of |g| (Boole's rule on |values|): the size rounding is relative to


class SamplePanels:
    """One sample's points (positions and integrand values [points, tokens]) and its current panels."""

    def __init__(self, tokens: int) -> None:
        self.column: dict[int, int] = {}  # position -> row of `values`
        self.values = np.zeros((0, tokens))
        width = GRID // FIRST_PANELS
        self.panels = [(i * width, width) for i in range(FIRST_PANELS)]  # (lo, width)

    @property
    def points(self) -> int:
        return len(self.column)

    def add(self, positions: np.ndarray, values: np.ndarray) -> None:
        """Record the integrand `values` [n, tokens] at `positions` [n]."""
        start = len(self.column)
        self.column.update((int(p), start + i) for i, p in enumerate(positions))
        self.values = np.concatenate([self.values, values])

    def _nodes(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows of `values` of each panel's 5 points [panels, 5] and the widths as fractions of [0, 1]."""
        lo, width = np.array(self.panels, dtype=np.int64).T
        positions = lo[:, None] + QUARTERS[None, :] * (width[:, None] // 4)
        rows = np.vectorize(self.column.__getitem__, otypes=[np.int64])(positions)
        return rows, width / GRID

    def estimate(self) -> Estimate:
        """The token scores, their error estimate and its parts, from the current panels."""
        rows, fraction = self._nodes()
        nodes = self.values[rows]  # [panels, 5, tokens]
        errors = np.abs(np.einsum("p,k,pkt->pt", fraction, FOURTH_DIFFERENCE, nodes))
        return Estimate(
            scores=np.einsum("p,k,pkt->t", fraction, BOOLE, nodes),
            error=errors.sum(0),
            panel_errors=errors.max(1),
            magnitude=np.einsum("p,k,pkt->t", fraction, BOOLE, np.abs(nodes)),
        )

    def split(self, panel_errors: np.ndarray) -> np.ndarray:
        """Split the SPLITS panels of largest error (`Estimate.panel_errors`); the new points' positions
        [NEW_POINTS], in increasing order."""
        worst = sorted(np.argsort(-panel_errors, kind="stable")[:SPLITS].tolist())
        new, kept = [], [p for i, p in enumerate(self.panels) if i not in worst]
        for i in worst:
            lo, width = self.panels[i]
            half = width // 2
            kept += [(lo, half), (lo + half, half)]
            new += [lo + q * (width // 8) for q in (1, 3, 5, 7)]
        self.panels = sorted(kept)
        return np.array(sorted(new), dtype=np.int64)

    def weights(self) -> dict[int, float]:
        """Each point's weight in the final rule (Boole's on every panel): position -> weight."""
        out: dict[int, float] = dict.fromkeys(self.column, 0.0)
        for lo, width in self.panels:
            for q, w in zip(QUARTERS, BOOLE):
                out[int(lo + q * (width // 4))] += w * width / GRID
        return out
