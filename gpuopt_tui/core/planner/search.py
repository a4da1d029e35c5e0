"""Choosing a micro-batch, gradient accumulation and samples per anchor under a memory budget.

Every function takes a peak model: a callable from a TrainSetup to the process's peak bytes on the GPU (the
closed-form estimate, or a line fitted to probes), so the same search serves both tiers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner.estimate import Overheads, estimate
from gpuopt_tui.core.planner.model_spec import ModelSpec
from gpuopt_tui.core.planner.train_setup import MAX_BATCH, TrainSetup

PeakModel = Callable[[TrainSetup], int]
ACCUMULATION_MODES = ("exact", "approx")
# The share of the budget a search on the closed form keeps back for the estimate's own error, so that its
# recommendation fits by construction. Against H200 measurements of recommendation-sized BERT-base batches
# (benchmarks/results/memory_planner_H200.md) the estimate's worst under-estimate is 1.7% (LoRA: allocator
# fragmentation it does not model), and its 768 MiB context differs from other GPUs' by a few hundred MiB (2% of
# a 16 GB card); 5% covers both, with room for the architectures measured less.
CLOSED_FORM_HEADROOM = 0.05


@dataclass(frozen=True)
class Budget:
    gpu_total: int  # bytes of GPU memory
    margin: float  # plan for at most this share of it

    @property
    def limit(self) -> int:
        return int(self.gpu_total * self.margin)

    def search_limit(self, headroom: float = 0.0) -> int:
        """What a search may plan for when `headroom` of the budget is kept back for the peak model's error."""
        return int(self.limit * (1 - headroom))


def closed_form(spec: ModelSpec, overheads: Overheads | None = None) -> PeakModel:
    return lambda setup: estimate(spec, setup, overheads).total


def largest_batch(peak: PeakModel, setup: TrainSetup, limit: int, upper: int = MAX_BATCH) -> int:
    """The largest micro-batch whose peak stays within `limit` at the setup's accumulation (0 if one does not
    fit); peak grows with b."""
    if peak(setup.with_batch(1)) > limit:
        return 0
    return _largest(lambda b: peak(setup.with_batch(b)) <= limit, 1, upper)


def _largest(fits: Callable[[int], bool], lo: int, upper: int) -> int:
    """The largest b in [lo, upper] with fits(b), given fits(lo) and fits falling from true to false once."""
    hi = lo + 1
    while hi <= upper and fits(hi):
        lo, hi = hi, hi + 2 * (hi - lo)
    hi = min(hi, upper + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi) (or hi is past the upper bound)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def accumulate_for(micro: int, target: int, n_gpus: int = 1) -> int:
    """The accumulation a micro-batch gets for an effective batch of `target`: the nearest whole number of steps
    (halves round up), at least 1. Integer arithmetic: floor(target / (micro x n) + 1/2)."""
    step = micro * n_gpus
    return max(1, (2 * target + step) // (2 * step))


def largest_batch_for(peak: PeakModel, setup: TrainSetup, limit: int, target: int, upper: int = MAX_BATCH) -> int:
    """The largest micro-batch whose peak stays within `limit` at the accumulation it gets for `target`
    (`accumulate_for`), 0 if none. The peak may depend on the accumulation only through whether gradients are kept
    between micro-batches (accumulation above 1), so two bisections cover every micro-batch, whatever the target:
    those that get accumulation 1, tried first, and the smaller ones, which accumulate."""
    n = setup.n_gpus
    single = (2 * target) // (3 * n) + 1  # the smallest micro-batch with accumulation 1: target / (b n) < 3/2

    def fits(b: int) -> bool:
        return peak(setup.with_batch(b, accumulate_for(b, target, n))) <= limit

    if single <= upper and fits(single):
        return _largest(fits, single, upper)
    below = min(upper, single - 1)
    return _largest(fits, 1, below) if below >= 1 and fits(1) else 0


@dataclass(frozen=True)
class Accumulation:
    micro_batch: int
    accumulate: int
    effective: int
    target: int

    @property
    def deviation(self) -> float:
        """Effective batch relative to the target: 0.0 when exact, +0.05 when 5% larger."""
        return self.effective / self.target - 1 if self.target else 0.0


def accumulation(
    b_max: int,
    target: int,
    n_gpus: int = 1,
    mode: str = "exact",
    fits: Callable[[int, int], bool] = lambda micro, accumulate: True,
) -> Accumulation:
    """Micro-batch and accumulate_grad_batches for an effective batch of `target` over `n_gpus`, where `b_max` is
    the largest micro-batch that fits at the accumulation it gets (`largest_batch_for`).

    exact: the largest divisor of target / n_gpus that fits at its accumulation (`fits(micro, accumulate)`), so
    that the effective batch is the target; approx: the largest micro-batch that fits, and the accumulation
    closest to the target (deviation shown).
    """
    if mode not in ACCUMULATION_MODES:
        raise UserError(f'accumulation mode "{mode}": expected exact or approx')
    if b_max < 1:
        raise UserError("not even a micro-batch of 1 fits in the memory budget")
    if target < 1:
        raise UserError(f"target effective batch {target}: expected a positive integer")
    if mode == "exact":
        if target % n_gpus:
            raise UserError(
                f"an exact effective batch of {target} over {n_gpus} GPUs is impossible (not divisible); "
                "use approx mode or another target"
            )
        per_gpu = target // n_gpus
        # the largest divisor first: at most b_max remainders, whatever the target
        divisors = (d for d in range(min(b_max, per_gpu), 0, -1) if per_gpu % d == 0)
        micro = next((d for d in divisors if fits(d, per_gpu // d)), 0)
        if micro == 0:
            raise UserError(f"no micro-batch dividing {per_gpu} fits with the accumulation it needs; use approx mode")
        return Accumulation(micro, per_gpu // micro, target, target)
    micro = min(b_max, -(-target // n_gpus))
    accumulate = accumulate_for(micro, target, n_gpus)
    return Accumulation(micro, accumulate, micro * accumulate * n_gpus, target)


@dataclass(frozen=True)
class Candidate:
    """One configuration with its memory, side by side with others."""

    label: str
    micro_batch: int
    accumulate: int
    effective_batch: int
    deviation: float  # effective batch relative to the target
    peak: int  # bytes on the GPU, context included
    utilisation: float  # peak / GPU memory
    fits: bool  # peak within what the search plans for (margin x GPU memory, less the headroom kept back)


def candidate(label: str, peak: PeakModel, setup: TrainSetup, budget: Budget, target: int, limit: int) -> Candidate:
    """One configuration evaluated once, at its own micro-batch and accumulation; it fits when its peak is within
    `limit`, the share of the budget the search plans for."""
    bytes_ = peak(setup)
    effective = setup.effective_batch
    return Candidate(
        label=label,
        micro_batch=setup.micro_batch,
        accumulate=setup.accumulate,
        effective_batch=effective,
        deviation=effective / target - 1 if target else 0.0,
        peak=bytes_,
        utilisation=bytes_ / budget.gpu_total,
        fits=bytes_ <= limit,
    )


def candidates(
    peak: PeakModel, setup: TrainSetup, budget: Budget, target: int, b_max: int, limit: int, mode: str = "exact"
) -> tuple[Candidate, ...]:
    """Configurations worth comparing, each at the accumulation it gets for `target`: the exact target, the closest
    to it, the largest micro-batch (`b_max`, from `largest_batch_for` at the same `limit`), the largest power of
    two that fits, and half the largest (headroom)."""
    n = setup.n_gpus

    def at(micro: int, acc: int | None = None) -> TrainSetup:
        return setup.with_batch(micro, accumulate_for(micro, target, n) if acc is None else acc)

    def fits(micro: int, acc: int) -> bool:
        return peak(setup.with_batch(micro, acc)) <= limit

    options: list[tuple[str, TrainSetup]] = []
    if target % n == 0:
        try:
            exact = accumulation(b_max, target, n, "exact", fits)
            options.append(("exact effective batch", at(exact.micro_batch, exact.accumulate)))
        except UserError:
            if mode == "exact":
                raise
    approx = accumulation(b_max, target, n, "approx")
    options.append(("closest to the target", at(approx.micro_batch, approx.accumulate)))
    options.append(("largest micro-batch", at(b_max)))
    pow2 = 1 << (b_max.bit_length() - 1)
    while pow2 > 1 and peak(at(pow2)) > limit:
        pow2 //= 2
    options.append(("power of two", at(pow2)))
    options.append(("half the largest (headroom)", at(max(1, b_max // 2))))
    seen: set[tuple[int, int]] = set()
    out = []
    for label, s in options:
        if (s.micro_batch, s.accumulate) not in seen:
            seen.add((s.micro_batch, s.accumulate))
            out.append(candidate(label, peak, s, budget, target, limit))
    return tuple(out)


@dataclass(frozen=True)
class Stage:
    """A curriculum stage: a name (usually its file) and its samples per anchor."""

    name: str
    n_positives: int
    n_negatives: int


@dataclass(frozen=True)
class StagePlan:
    stage: Stage
    b_max: int  # largest micro-batch for this stage alone
    peak: int  # at the recommended micro-batch
    utilisation: float
    max_positives: int  # the most samples per anchor that fit at the recommended micro-batch, same ratio
    max_negatives: int


def max_samples(peak: PeakModel, setup: TrainSetup, limit: int, upper: int = 4096) -> tuple[int, int]:
    """The largest (n_positives, n_negatives) keeping the setup's ratio that fits at its micro-batch."""
    pos, neg = setup.n_positives, setup.n_negatives
    total = pos + neg
    if total == 0:
        return 0, 0

    def split(t: int) -> TrainSetup:
        p = min(t, max(1 if pos else 0, round(t * pos / total)))
        return dataclasses.replace(setup, n_positives=p, n_negatives=t - p)

    best = 0
    lo, hi = 1, upper
    while lo <= hi:
        mid = (lo + hi) // 2
        if peak(split(mid)) <= limit:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    if best == 0:
        return 0, 0
    chosen = split(best)
    return chosen.n_positives, chosen.n_negatives


@dataclass(frozen=True)
class Recommendation:
    """The search's answer: a chosen configuration, alternatives, and one plan per curriculum stage."""

    budget: Budget
    target: int
    mode: str
    b_max: int  # largest micro-batch that fits every stage, at the accumulation it gets for the target
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    current: Candidate | None
    stages: tuple[StagePlan, ...]
    tier: str
    headroom: float = 0.0  # share of the budget the search kept back for the peak model's error
    b_max_accumulate: int = 1  # the accumulation b_max was evaluated at
    # the next larger exact micro-batch when its peak is over what the search planned for but within the budget
    # itself: inside the share kept back, for the user to measure rather than for the planner to risk
    within_reserve: Candidate | None = None

    @property
    def limit(self) -> int:
        """What the search planned for, and what every row's `fits` is judged against."""
        return self.budget.search_limit(self.headroom)


def recommend(
    peak: PeakModel,
    setup: TrainSetup,
    budget: Budget,
    target: int = 0,
    mode: str = "exact",
    stages: Sequence[Stage] = (),
    tier: str = "closed-form estimate",
    headroom: float = 0.0,
) -> Recommendation:
    """Search micro-batch and accumulation under the budget less `headroom`; `target` 0 keeps the setup's
    effective batch.

    With stages, the micro-batch must fit the most demanding one; each stage also gets its own largest batch
    and the most samples per anchor it could take at the chosen batch.
    """
    target = target or setup.effective_batch
    room = budget.search_limit(headroom)
    stage_setups = [dataclasses.replace(setup, n_positives=s.n_positives, n_negatives=s.n_negatives) for s in stages]
    setups = stage_setups or [setup]
    limits = [largest_batch_for(peak, s, room, target) for s in setups]
    b_max = min(limits)
    binding = setups[limits.index(b_max)]  # the most demanding stage sets the micro-batch
    if b_max < 1:
        need = peak(binding.with_batch(1))
        kept = f" less {headroom:.0%} kept for the estimate's error" if headroom else ""
        raise UserError(
            f"a micro-batch of 1 needs {need / 1024**3:.2f} GiB, more than {budget.margin:.0%} of "
            f"{budget.gpu_total / 1024**3:.1f} GiB{kept}; try gradient checkpointing, LoRA, a frozen encoder, mixed "
            "precision or a shorter sequence"
        )
    acc = accumulation(
        b_max, target, setup.n_gpus, mode, lambda micro, accumulate: peak(binding.with_batch(micro, accumulate)) <= room
    )
    chosen_setup = binding.with_batch(acc.micro_batch, acc.accumulate)
    chosen = candidate(f"recommended ({mode})", peak, chosen_setup, budget, target, room)
    plans = tuple(
        StagePlan(
            stage=stage,
            b_max=limit,
            peak=(p := peak(s.with_batch(acc.micro_batch, acc.accumulate))),
            utilisation=p / budget.gpu_total,
            max_positives=(m := max_samples(peak, s.with_batch(acc.micro_batch, acc.accumulate), room))[0],
            max_negatives=m[1],
        )
        for stage, s, limit in zip(stages, stage_setups, limits)
    )
    return Recommendation(
        budget=budget,
        target=target,
        mode=mode,
        b_max=b_max,
        b_max_accumulate=accumulate_for(b_max, target, setup.n_gpus),
        chosen=chosen,
        candidates=candidates(peak, binding, budget, target, b_max, room, mode),
        current=candidate("current", peak, binding, budget, target, room),
        stages=plans,
        tier=tier,
        headroom=headroom,
        within_reserve=_within_reserve(peak, binding, budget, target, acc, mode) if headroom else None,
    )


def _within_reserve(
    peak: PeakModel, setup: TrainSetup, budget: Budget, target: int, chosen: Accumulation, mode: str
) -> Candidate | None:
    """The next divisor of the effective batch above the chosen micro-batch, when its peak fits the budget only
    by using the share the search kept back (`Recommendation.within_reserve`); None otherwise."""
    if mode != "exact" or target % setup.n_gpus:
        return None
    per_gpu = target // setup.n_gpus
    # no divisor beyond the largest micro-batch within the whole budget can fit it: at most that many remainders,
    # whatever the target (as in `accumulation`)
    upper = min(per_gpu, largest_batch_for(peak, setup, budget.limit, target))
    bigger = next((d for d in range(chosen.micro_batch + 1, upper + 1) if per_gpu % d == 0), None)
    if bigger is None:
        return None
    found = candidate("next divisor", peak, setup.with_batch(bigger, per_gpu // bigger), budget, target, budget.limit)
    return found if found.fits else None
