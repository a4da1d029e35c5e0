"""The measured tier: probes of real training steps on the GPU, each in a fresh process, and a line fit.

A probe is `python -m gpuopt_tui.jobs.memprobe` with a JSON request on stdin; it prints one JSON result line.
Running each probe in its own process means an out-of-memory error cannot poison the next probe (or the UI),
and the CUDA context is measured fresh every time.

Each probe runs the user's loop (`TrainSetup.loop`: the HF Trainer's, Lightning's or a plain one) for
`WARMUP_STEPS` + `MEASURED_STEPS` steps. The headroom a measured recommendation keeps back is the drift the
probes saw (how far the peak rose after warm-up), and a confirming probe must fit with that drift on top.

Plan: probe the closed-form guess and half of it (halving on out-of-memory), fit peak reserved against
the sequences per micro-batch, compute b_max from the budget, re-probe when that is far beyond the probes, then
confirm b_max with one more probe, shrinking x0.9 while it runs out of memory, the allocator had to retry, or
the peak exceeds the budget.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner.fit import LineFit, ProbeResult, fit_line, max_batch, shrink
from gpuopt_tui.core.planner.search import Budget, PeakModel, Recommendation
from gpuopt_tui.core.planner.train_setup import TrainSetup

PROBE_MODULE = "gpuopt_tui.jobs.memprobe"
# The allocator setting used by every probe; training runs should use the same one for the plan to hold.
ALLOC_CONF = "expandable_segments:True"
MAX_PROBES = 8
# Each probe runs the loop for warm-up steps (the first creates the optimizer state) and measured steps; the peak
# counts all of them, as a real run's does, and the measured steps' rise above the warm-up's is the drift
WARMUP_STEPS = 3
MEASURED_STEPS = 5
FAR = 1.5  # re-probe when b_max is this many times the largest probed batch

Probe = Callable[[Mapping[str, Any]], ProbeResult]


def probe_request(
    config: Mapping[str, Any],
    task: str,
    setup: TrainSetup,
    device: str = "cuda",
    steps: int = MEASURED_STEPS,
    warmup: int = WARMUP_STEPS,
) -> dict[str, Any]:
    """The JSON request for one probe: the model's config, the task and the training setup (its `loop` included)."""
    fields = asdict(setup)
    fields["lora_targets"] = list(setup.lora_targets)
    return {"config": dict(config), "task": task, "device": device, "steps": steps, "warmup": warmup, **fields}


def probe_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    return env


def run_probe(request: Mapping[str, Any], timeout: float = 600.0, python: str = sys.executable) -> ProbeResult:
    """Run one probe in a fresh Python process and return what it measured."""
    batch, accumulate = int(request["micro_batch"]), int(request.get("accumulate", 1))
    sequences = batch * (1 + int(request.get("n_positives", 0)) + int(request.get("n_negatives", 0)))
    try:
        done = subprocess.run(
            [python, "-m", PROBE_MODULE],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=probe_env(),
            check=False,
        )
    except subprocess.TimeoutExpired:
        return ProbeResult(batch, sequences, accumulate, error=f"the probe took longer than {timeout:.0f} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        failed = f"the probe exited with code {done.returncode}: " + " | ".join(tail)
        return ProbeResult(batch, sequences, accumulate, error=failed)
    return dataclasses.replace(ProbeResult.from_dict(json.loads(lines[-1])), accumulate=accumulate)


def fits_budget(result: ProbeResult, limit: int) -> bool:
    """A probe that ran without running out of memory, without allocator retries and within the limit, with room
    for its peak to rise again as much as it did across its measured steps."""
    return result.ok and result.num_alloc_retries == 0 and result.footprint + result.drift <= limit


@dataclass(frozen=True)
class MeasuredPlan:
    probes: tuple[ProbeResult, ...]
    fit: LineFit | None  # None when only a micro-batch of 1 fits
    context: int  # the largest context any probe saw
    sequences_per_example: int
    b_max: int  # from the fit
    micro_batch: int  # confirmed by a probe
    confirmed: ProbeResult
    limit: int  # the budget the probes were judged against
    tier: str = "measured"

    @property
    def drift(self) -> int:
        """The largest rise of a probe's peak across its measured steps (bytes)."""
        return max((r.drift for r in self.probes if r.ok), default=0)

    @property
    def headroom(self) -> float:
        """The share of the budget a search keeps back: the measured drift, as a run's peak may rise that much
        again (none when no probe's peak rose after its warm-up)."""
        return min(0.5, self.drift / self.limit) if self.limit else 0.0

    @property
    def ceiling(self) -> int | None:
        """The most sequences the line may be trusted for: once a probe did not fit the budget, the largest
        probe below it that did (None when every probe fitted)."""
        refused = min((r.sequences for r in self.probes if not fits_budget(r, self.limit)), default=None)
        if refused is None:
            return None
        return max(
            (r.sequences for r in self.probes if fits_budget(r, self.limit) and r.sequences < refused), default=0
        )

    def peak_model(self) -> PeakModel:
        """Peak bytes predicted by the fit (context included), for the search. Beyond the `ceiling` a batch counts
        as over the budget whatever the line says: when the confirmation had to shrink, a search recommends no
        more than the confirmed batch. Valid for the probed setup's sequence length, precision and model; the
        micro-batch and samples per anchor may vary."""
        fit, confirmed, over, ceiling = self.fit, self.confirmed, self.limit + 1, self.ceiling

        probed = {r.sequences: r.footprint for r in self.probes if r.ok}

        def peak(setup: TrainSetup) -> int:
            n = setup.sequences
            if n in probed:  # a probe's own figure rather than the line's
                predicted = probed[n]
            elif fit is None:
                predicted = confirmed.footprint if n <= confirmed.sequences else over
            else:
                predicted = int(fit.predict(n) + self.context)
            return max(predicted, over) if ceiling is not None and n > ceiling else predicted

        return peak

    def probed(self, micro_batch: int) -> bool:
        """Whether a probe ran at this micro-batch (of the probed setup)."""
        return any(r.micro_batch == micro_batch for r in self.probes)

    def with_probe(
        self, result: ProbeResult, budget: Budget, log: Callable[[str], None], noun: str = "probe"
    ) -> MeasuredPlan:
        """The plan with one more probe (logged), whose figure `peak_model` takes at its batch; UserError when it
        failed."""
        log(_describe(result, budget, noun))
        if result.error:
            raise UserError(f"the {noun} at micro-batch {result.micro_batch} failed: {result.error}")
        return dataclasses.replace(self, probes=(*self.probes, result))


def measure(
    request_for: Callable[[int], Mapping[str, Any]],
    sequences_per_example: int,
    budget: Budget,
    start: int,
    probe: Probe = run_probe,
    log: Callable[[str], None] = lambda message: None,
    max_probes: int = MAX_PROBES,
    noun: str = "probe",
) -> MeasuredPlan:
    """Find the largest micro-batch by probing; `start` is the closed-form guess, `request_for(b)` a request.
    `noun` names a probe in the log and messages (the traced tier's probes are traces)."""
    results: list[ProbeResult] = []

    def run(batch: int) -> ProbeResult:
        for earlier in results:
            if earlier.micro_batch == batch:
                return earlier
        if len(results) >= max_probes:
            raise UserError(f"no confirmed micro-batch after {max_probes} {noun}s; see the {noun} log")
        result = probe(request_for(batch))
        results.append(result)
        log(_describe(result, budget, noun))
        if result.error:
            raise UserError(f"the {noun} at micro-batch {batch} failed: {result.error}")
        return result

    def first_fit(batch: int) -> tuple[int, ProbeResult]:
        result = run(batch)
        while result.oom:  # the guess was far off: halve until a probe runs, the fit finds the rest
            if batch == 1:
                raise UserError(f"a micro-batch of 1 runs out of GPU memory in the {noun}")
            batch = max(1, batch // 2)
            result = run(batch)
        return batch, result

    hi, r_hi = first_fit(max(2, start))
    spe = sequences_per_example
    fit: LineFit | None = None
    if hi == 1:
        b_max = 1
    else:
        lo, r_lo = first_fit(max(1, hi // 2))
        if not fits_budget(r_lo, budget.limit) and lo > 1:  # over the budget already: bracket from one
            hi, r_hi, lo, r_lo = lo, r_lo, 1, run(1)
        if not fits_budget(r_lo, budget.limit):  # a micro-batch of one, here
            checkpointing = bool(request_for(1).get("gradient_checkpointing"))
            raise UserError(_hopeless(r_lo, r_hi, budget, noun, checkpointing))
        fit = fit_line([(lo * spe, r_lo.max_reserved), (hi * spe, r_hi.max_reserved)])
        b_max = max_batch(fit, budget.limit, _context(results), spe)
        if b_max > FAR * hi:
            far, r_far = first_fit(b_max)
            if far > hi:
                fit = fit_line([(hi * spe, r_hi.max_reserved), (far * spe, r_far.max_reserved)])
                b_max = max_batch(fit, budget.limit, _context(results), spe)
    if b_max < 1:
        raise UserError(f"the {noun}s show that not even a micro-batch of 1 fits in the budget")
    batch = b_max
    while True:
        result = run(batch)
        if fits_budget(result, budget.limit):
            break
        if batch == 1:
            raise UserError(f"a micro-batch of 1 does not fit in the budget ({noun}d)")
        batch = shrink(batch)
    return MeasuredPlan(
        probes=tuple(results),
        fit=fit,
        context=_context(results),
        sequences_per_example=spe,
        b_max=b_max,
        micro_batch=batch,
        confirmed=result,
        limit=budget.limit,
    )


def confirm_choice(
    plan: MeasuredPlan,
    search: Callable[[MeasuredPlan], Recommendation],
    probe_at: Callable[[int], ProbeResult],
    budget: Budget,
    log: Callable[[str], None],
    noun: str = "probe",
    rounds: int = 3,
) -> tuple[Recommendation, MeasuredPlan]:
    """`search(plan)`'s recommendation with its micro-batch probed: when the search chose one no probe ran at (a
    divisor of the effective batch below the largest that fits), `probe_at` it and search again with that probe's
    figure in place of the line's (`peak_model`), which a refuted choice leaves for a smaller one; up to `rounds`
    searches. Returns the last search's recommendation and the plan with the added probes."""
    for _ in range(rounds):
        rec = search(plan)
        micro = rec.chosen.micro_batch
        if plan.probed(micro):
            break
        log(f"micro-batch {micro} chosen (dividing the effective batch {rec.target}): {noun}d to confirm it")
        plan = plan.with_probe(probe_at(micro), budget, log, noun)
    return rec, plan


def measure_setup(
    config: Mapping[str, Any], task: str, setup: TrainSetup, device: str, probe: Probe = run_probe
) -> ProbeResult:
    """One probe of `setup` as it is (what `plan --show --profile` reports); UserError when it fails."""
    result = probe(probe_request(config, task, setup, device))
    if result.error:
        raise UserError(f"the probe at micro-batch {setup.micro_batch} failed: {result.error}")
    return result


def _hopeless(one: ProbeResult, more: ProbeResult, budget: Budget, noun: str, checkpointing: bool) -> str:
    """Why no micro-batch fits: a micro-batch of one is over the budget (`more`: a larger one's result). The line
    through the two, taken to no batch at all, is what weights, gradients and optimizer state take: when that alone
    is over the budget, nothing about activations (sequence length, checkpointing) can help."""
    gib = 1024**3
    slope = (more.footprint - one.footprint) / max(1, more.sequences - one.sequences)
    states = one.footprint - max(0.0, slope) * one.sequences
    if states > budget.limit:
        why = (
            f"; weights, gradients and optimizer state alone take about {states / gib:.1f} GiB with the context "
            f"(the {noun}s' line at no batch), so no change to the activations can fit it: train fewer parameters "
            "(LoRA), use a lighter optimizer state, or a larger GPU"
        )
    else:
        checkpoint = "" if checkpointing else "gradient checkpointing, "
        why = f": shorter sequences, {checkpoint}fewer trained parameters (LoRA) or a larger GPU"
    return (
        f"not even a micro-batch of {one.micro_batch} fits: its {noun} peaks at {one.max_reserved / gib:.2f} GiB "
        f"reserved + {one.context / gib:.2f} GiB context, over the budget's {budget.limit / gib:.2f} GiB{why}"
    )


def _context(results: list[ProbeResult]) -> int:
    return max((r.context for r in results if r.ok), default=0)


def _describe(r: ProbeResult, budget: Budget, noun: str = "probe") -> str:
    at = f"{noun} {r.label}"
    if r.error:
        return f"{at}: failed: {r.error}"
    if r.oom:
        return f"{at}: out of memory"
    gib = 1024**3
    retries = f", {r.num_alloc_retries} allocator retries" if r.num_alloc_retries else ""
    drift = f", rose {r.drift / gib:.2f} GiB after warm-up" if r.drift else ""
    return (
        f"{at}: peak reserved {r.max_reserved / gib:.2f} GiB + context {r.context / gib:.2f} "
        f"GiB = {r.footprint / budget.gpu_total:.0%} of the GPU{retries}{drift} ({r.seconds:.1f} s)"
    )
