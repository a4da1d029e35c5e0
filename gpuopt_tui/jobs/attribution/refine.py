"""The passes of `n_steps = "auto"` for the samples of one precision (the rules are in adaptive.py).

A `Refinement` runs the first pass (17 points) for its samples, then pass after pass for those not yet within the
tolerance, each at its own new points. With a `probe` (bf16/fp16 steps with a full-precision fallback) it also
measures each sample's rounding after the first pass, and hands back the samples that are to move to full
precision (`Level.escalate`) instead of refining them further.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gpuopt_tui.jobs.attribution.adaptive import (
    PROBE_POINTS,
    accumulation_rounding,
    check_max_steps,
    probe_rounding,
    rounding_too_large,
    standing,
)
from gpuopt_tui.jobs.attribution.panels import GRID, NEW_POINTS, SamplePanels, first_positions
from gpuopt_tui.jobs.attribution.passes import Passes, Rows

ESCALATED_BY_PROBE, ESCALATED_AT_CAP = 2, 3  # indices in precision.FALLBACK_REASONS


@dataclass
class Level:
    """What the samples of one precision got: their integrated gradients [b, numel] (or token scores [b, tokens]
    without per_dimension), points [b], relative error estimates [b], and which are to run again in full precision
    (0, else the reason's index in precision.FALLBACK_REASONS) [b]."""

    total: Tensor
    steps: Tensor
    error: Tensor
    escalate: Tensor


@dataclass
class Limits:
    """When a sample of the level stops: `tolerance`, `max_steps` (its points), and `cap` (points after which it
    moves to full precision instead; None: it never moves)."""

    tolerance: float
    max_steps: int
    cap: int | None = None


class Refinement:
    """The auto-steps passes of some rows in one precision (`passes`); `probe` runs the full-precision points."""

    def __init__(
        self,
        passes: Passes,
        rows: Rows,
        ends: tuple[Tensor, Tensor],
        limits: Limits,
        per_dimension: bool,
        probe: Passes | None = None,
    ) -> None:
        check_max_steps(limits.max_steps)
        self.passes, self.rows, self.limits, self.probe = passes, rows, limits, probe
        self.per_dimension = per_dimension
        self.dtype = rows.diff.dtype
        self.diff = rows.diff.reshape(rows.rows, -1, rows.diff.shape[-1])
        self.ends = [(float(x), float(b)) for x, b in zip(ends[0].double().tolist(), ends[1].double().tolist())]
        self.samples = [SamplePanels(self.diff.shape[1]) for _ in range(rows.rows)]
        self.rounding = [accumulation_rounding(self.dtype)] * rows.rows
        self.error = [0.0] * rows.rows
        self.escalate = [0] * rows.rows
        self.evaluated: list[tuple[Tensor, np.ndarray, Tensor]] = []  # each pass: samples, positions, gradients

    def run(self, share: tuple[int, int] = (0, 1)) -> Level:
        """Refine every sample until it stops; `share` (index, parts): where these passes are in the progress."""
        batch = self.rows.rows
        active, positions = list(range(batch)), np.repeat(first_positions()[:, None], batch, axis=1)
        reached = 0.0  # the share of the samples' progress reported so far
        first = True
        while active:
            reached = max(reached, 1 - len(active) / batch)
            self.passes.span = ((share[0] + reached) / share[1], (share[0] + (1 + reached) / 2) / share[1])
            values = self._evaluate(active, positions)
            reached = (1 + reached) / 2
            for j, i in enumerate(active):
                self.samples[i].add(positions[:, j], values[:, j])
            if first and self.probe is not None:
                self._measure_rounding(active, positions, values)
            first = False
            active, positions = self._next(active)
        return self._level()

    def _evaluate(self, active: list[int], positions: np.ndarray) -> np.ndarray:
        """One pass of the samples `active` at `positions` [n, b]: each token's integrand [n, b, tokens]; the
        gradients are kept (per_dimension) to be weighted once the panels are final."""
        members = torch.as_tensor(active, device=self.diff.device)
        alphas = torch.as_tensor(positions / GRID, dtype=self.dtype, device=self.diff.device)
        kept, values = [], []
        for _, grads in self.passes.chunks(self.rows.select(members), alphas):
            values.append(self._integrand(grads, members))
            if self.per_dimension:
                kept.append(grads)
        if self.per_dimension:
            self.evaluated.append((members, positions, torch.cat(kept)))
        return torch.cat(values).double().cpu().numpy()

    def _integrand(self, grads: Tensor, members: Tensor) -> Tensor:
        """Each token's projection of the gradients [steps, b x numel]: sum_h (x - baseline)_h dF/dx_h."""
        hidden = self.diff.shape[-1]
        return (grads.view(grads.shape[0], len(members), -1, hidden).to(self.dtype) * self.diff[members]).sum(-1)

    def _measure_rounding(self, active: list[int], positions: np.ndarray, values: np.ndarray) -> None:
        """The first pass's PROBE_POINTS points of largest integrand, again in full precision: each sample's
        measured rounding; those it would keep from the tolerance move to full precision."""
        assert self.probe is not None
        rank = np.argsort(-np.abs(values).sum(2), axis=0, kind="stable")[:PROBE_POINTS]  # [probes, b]
        chosen = np.take_along_axis(positions, rank, axis=0)
        members = torch.as_tensor(active, device=self.diff.device)
        alphas = torch.as_tensor(chosen / GRID, dtype=self.dtype, device=self.diff.device)
        chunks = self.probe.chunks(self.rows.select(members), alphas)
        full = torch.cat([self._integrand(g, members) for _, g in chunks]).double().cpu().numpy()  # [probes, b, t]
        for j, i in enumerate(active):
            low = np.take_along_axis(values[:, j], rank[:, j : j + 1], axis=0)
            self.rounding[i] = max(self.rounding[i], probe_rounding(low, full[:, j]))
            if rounding_too_large(self.samples[i], self.ends[i], self.limits.tolerance, self.rounding[i]):
                self.escalate[i] = ESCALATED_BY_PROBE

    def _next(self, active: list[int]) -> tuple[list[int], np.ndarray]:
        """The samples that go on and their next positions [NEW_POINTS, b]."""
        going, later = [], []
        for i in active:
            now = standing(self.samples[i], self.ends[i], self.limits.tolerance, self.rounding[i])
            self.error[i] = now.relative_error
            if now.within or self.escalate[i]:
                continue
            points = self.samples[i].points + NEW_POINTS
            cap = self.limits.cap
            if cap is not None and points > cap:
                self.escalate[i] = ESCALATED_AT_CAP
            elif points <= self.limits.max_steps:
                going.append(i)
                later.append(self.samples[i].split(now.panel_errors))
        return going, np.stack(later, axis=1) if later else np.zeros((NEW_POINTS, 0), dtype=np.int64)

    def _level(self) -> Level:
        device = self.diff.device
        steps = torch.as_tensor([s.points for s in self.samples], dtype=torch.long, device=device)
        error = torch.as_tensor(self.error, dtype=self.dtype, device=device)
        escalate = torch.as_tensor(self.escalate, dtype=torch.int8, device=device)
        if not self.per_dimension:
            scores = np.stack([sample.estimate().scores for sample in self.samples])
            return Level(torch.as_tensor(scores, dtype=self.dtype, device=device), steps, error, escalate)
        return Level(self._weighted(), steps, error, escalate)

    def _weighted(self) -> Tensor:
        """[b, numel]: every pass's gradients with their points' weights in the final panels."""
        device = self.diff.device
        total = torch.zeros(len(self.samples), self.diff[0].numel(), dtype=self.dtype, device=device)
        for members, where, grads in self.evaluated:
            weights = [self.samples[i].weights() for i in members.tolist()]
            table = np.array([[w[int(p)] for w, p in zip(weights, row)] for row in where])  # [n, b]
            w = torch.as_tensor(table, dtype=self.dtype, device=device)
            total[members] += torch.einsum("nb,nbk->bk", w, grads.view(*w.shape, -1).to(self.dtype))
        return total
