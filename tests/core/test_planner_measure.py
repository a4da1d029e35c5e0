"""The measured tier without a GPU: the line fit, b_max, the x0.9 shrink, the probe protocol and the probing
strategy against simulated GPUs (linear, curved, and with allocator retries near the limit)."""

from __future__ import annotations

import dataclasses
import json
import math
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner.fit import LineFit, ProbeResult, fit_line, max_batch, shrink
from gpuopt_tui.core.planner.layouts import LAYOUTS
from gpuopt_tui.core.planner.measure import (
    ALLOC_CONF,
    MeasuredPlan,
    confirm_choice,
    fits_budget,
    measure,
    probe_request,
    run_probe,
)
from gpuopt_tui.core.planner.search import Budget, Recommendation, recommend
from gpuopt_tui.core.planner.traced import difference, run_trace
from gpuopt_tui.core.planner.train_setup import LOOPS, TrainSetup

GIB = 1024**3
MIB = 1024**2


def test_fit_recovers_a_line_and_b_max_follows_the_formula() -> None:
    fit = fit_line([(16, 3 * GIB + 16 * 50 * MIB), (64, 3 * GIB + 64 * 50 * MIB)])
    assert fit.intercept == pytest.approx(3 * GIB) and fit.slope == pytest.approx(50 * MIB)
    limit, context = int(0.85 * 24 * GIB), 500 * MIB
    assert max_batch(fit, limit, context) == math.floor((limit - context - 3 * GIB) / (50 * MIB))
    assert max_batch(fit, limit, context, sequences_per_example=4) == math.floor(
        (limit - context - 3 * GIB) / (4 * 50 * MIB)
    )
    assert max_batch(fit, 2 * GIB, context) == 0


def test_fit_needs_two_batches_and_a_growing_peak() -> None:
    with pytest.raises(UserError, match="two different batch sizes"):
        fit_line([(8, GIB), (8, 2 * GIB)])
    with pytest.raises(UserError, match="did not grow"):
        fit_line([(8, 2 * GIB), (16, 2 * GIB)])


def test_shrink_is_x09_and_always_smaller() -> None:
    assert [shrink(b) for b in (100, 10, 5, 2, 1)] == [90, 9, 4, 1, 1]


class SimulatedGpu:
    """A probe that answers like a GPU whose peak reserved memory is `peak(sequences)`."""

    def __init__(self, total: int, peak: Any, context: int = 600 * MIB, retry_above: float = 1.0) -> None:
        self.total, self.peak, self.context, self.retry_above = total, peak, context, retry_above
        self.calls: list[int] = []

    def __call__(self, request: Mapping[str, Any]) -> ProbeResult:
        b = int(request["micro_batch"])
        sequences = b * (1 + request["n_positives"] + request["n_negatives"])
        self.calls.append(b)
        reserved = int(self.peak(sequences))
        if reserved + self.context > self.total:
            return ProbeResult(b, sequences, oom=True)
        retries = 1 if reserved + self.context > self.retry_above * self.total else 0
        return ProbeResult(b, sequences, max_reserved=reserved, context=self.context, num_alloc_retries=retries)


def _request(setup: TrainSetup):
    return lambda b: probe_request({"model_type": "bert"}, "classification", setup.with_batch(b))


def test_measure_finds_b_max_of_a_linear_gpu_in_few_probes() -> None:
    gpu = SimulatedGpu(80 * GIB, lambda s: 2 * GIB + s * 120 * MIB)
    budget = Budget(gpu.total, 0.85)
    plan = measure(_request(TrainSetup()), 1, budget, start=100, probe=gpu)
    expected = math.floor((budget.limit - gpu.context - 2 * GIB) / (120 * MIB))
    assert plan.b_max == expected and plan.micro_batch == expected
    assert gpu.calls == [100, 50, expected]  # large, medium, then far beyond them: refit and confirmed
    assert plan.confirmed.footprint <= budget.limit
    assert plan.peak_model()(TrainSetup(micro_batch=expected)) == pytest.approx(
        2 * GIB + expected * 120 * MIB + gpu.context, rel=1e-6
    )


def test_measure_shrinks_after_out_of_memory_and_when_the_guess_is_far_off() -> None:
    gpu = SimulatedGpu(24 * GIB, lambda s: GIB + s * 300 * MIB)
    plan = measure(_request(TrainSetup()), 1, Budget(gpu.total, 0.85), start=400, probe=gpu)
    expected = math.floor((0.85 * 24 * GIB - gpu.context - GIB) / (300 * MIB))
    assert gpu.calls == [400, 200, 100, 50, 25, expected]  # out of memory three times, halving
    assert plan.micro_batch == expected
    gpu = SimulatedGpu(80 * GIB, lambda s: GIB + s * 10 * MIB)
    plan = measure(_request(TrainSetup()), 1, Budget(gpu.total, 0.85), start=8, probe=gpu)
    expected = math.floor((0.85 * 80 * GIB - gpu.context - GIB) / (10 * MIB))
    assert gpu.calls == [8, 4, expected] and plan.micro_batch == expected


def test_confirmation_shrinks_on_curvature_and_allocator_retries() -> None:
    curved = SimulatedGpu(40 * GIB, lambda s: GIB + s * 100 * MIB + s * s * 0.4 * MIB, retry_above=0.8)
    budget = Budget(curved.total, 0.85)
    plan = measure(_request(TrainSetup(n_positives=1)), 2, budget, start=30, probe=curved)
    assert plan.confirmed.ok and plan.confirmed.num_alloc_retries == 0
    assert plan.confirmed.footprint <= 0.8 * curved.total
    assert plan.micro_batch < plan.b_max
    assert curved.calls[-2] > curved.calls[-1] == plan.micro_batch


def test_a_measured_recommendation_stays_at_the_confirmed_batch_after_a_shrink() -> None:
    """The line promises more than the GPU gives near the limit; the batch a probe refused caps the search."""
    curved = SimulatedGpu(40 * GIB, lambda s: GIB + s * 100 * MIB + s * s * 0.4 * MIB, retry_above=0.8)
    budget = Budget(curved.total, 0.85)
    setup = TrainSetup(micro_batch=4, n_positives=1)
    plan = measure(_request(setup), 2, budget, start=30, probe=curved)
    assert plan.micro_batch < plan.b_max
    rec = recommend(plan.peak_model(), setup, budget, target=8 * plan.micro_batch, tier="measured")
    assert rec.b_max == plan.micro_batch
    linear = SimulatedGpu(80 * GIB, lambda s: 2 * GIB + s * 120 * MIB)
    plan = measure(_request(TrainSetup()), 1, budget, start=100, probe=linear)
    assert plan.ceiling is None
    assert recommend(plan.peak_model(), TrainSetup(), budget, tier="measured").b_max == plan.micro_batch


def test_the_chosen_micro_batch_is_probed_and_its_figure_replaces_the_line_s() -> None:
    """A peak that grows ever slower with the batch (as a mixture-of-experts model's traces did): the line through
    the bracketing probes is under the curve between them, so the recommended divisor of the effective batch gets
    a probe of its own, and the recommendation states that probe's figure."""
    peak = lambda s: 2 * GIB + 3 * GIB * math.sqrt(s)  # noqa: E731
    gpu = SimulatedGpu(80 * GIB, peak)
    budget = Budget(gpu.total, 0.85)
    setup = TrainSetup(micro_batch=4)
    plan = measure(_request(setup), 1, budget, start=4, probe=gpu)
    assert plan.micro_batch > 64 and not plan.probed(64)

    def search(p: MeasuredPlan) -> Recommendation:
        return recommend(p.peak_model(), setup, budget, target=64, tier="measured")

    line = search(plan).chosen
    assert line.micro_batch == 64 and line.peak < peak(64) + gpu.context  # the line's figure, under the curve's
    lines: list[str] = []
    rec, confirmed = confirm_choice(plan, search, lambda b: gpu(_request(setup)(b)), budget, lines.append)
    assert gpu.calls[-1] == 64 and confirmed.probed(64) and len(confirmed.probes) == len(plan.probes) + 1
    assert rec.chosen.micro_batch == 64 and rec.chosen.peak == peak(64) + gpu.context
    assert lines[0] == "micro-batch 64 chosen (dividing the effective batch 64): probed to confirm it"
    calls = len(gpu.calls)
    assert confirm_choice(confirmed, search, lambda b: gpu(_request(setup)(b)), budget, lines.append)[1] is confirmed
    assert len(gpu.calls) == calls  # a probed choice is not probed again


def test_probe_failures_and_hopeless_budgets_are_user_errors() -> None:
    def broken(request: Mapping[str, Any]) -> ProbeResult:
        return ProbeResult(request["micro_batch"], request["micro_batch"], error="ValueError: bad config")

    with pytest.raises(UserError, match="probe at micro-batch 8 failed: ValueError: bad config"):
        measure(_request(TrainSetup()), 1, Budget(GIB, 0.85), start=8, probe=broken)
    tiny = SimulatedGpu(GIB, lambda s: 2 * GIB)
    with pytest.raises(UserError, match="micro-batch of 1 runs out of GPU memory"):
        measure(_request(TrainSetup()), 1, Budget(GIB, 0.85), start=4, probe=tiny)


def test_a_setup_whose_optimizer_state_alone_is_over_the_budget_is_refused_with_the_reason() -> None:
    """Full fine-tuning of a 2.5B model with AdamW under a 34 GiB budget (Gemma-2B with checkpointing on an H200):
    the traces do not grow with the batch, and the smallest is over the budget already."""
    flat = SimulatedGpu(140 * GIB, lambda s: 46 * GIB - s * 4 * MIB)
    budget = Budget(40 * GIB, 0.85)
    with pytest.raises(UserError, match=r"not even a micro-batch of 1 fits: its trace peaks at 4\d\.\d\d GiB.*LoRA"):
        measure(_request(TrainSetup()), 1, budget, start=4, probe=flat, noun="trace")
    assert flat.calls == [4, 2, 1]
    # as traced on the H200: a little more with the batch, yet the model states alone are over the budget
    rising = SimulatedGpu(140 * GIB, lambda s: 47 * GIB + s * 600 * MIB)
    with pytest.raises(
        UserError, match=r"optimizer state alone take about 4\d\.\d GiB with the context .* no change to the activ"
    ):
        measure(_request(TrainSetup(gradient_checkpointing=True)), 1, budget, start=4, probe=rising, noun="trace")
    growing = SimulatedGpu(140 * GIB, lambda s: 28 * GIB + s * 8 * GIB)
    with pytest.raises(UserError, match="over the budget's 34.00 GiB: shorter sequences, gradient checkpointing, few"):
        measure(_request(TrainSetup()), 1, budget, start=4, probe=growing, noun="trace")
    with pytest.raises(UserError, match="over the budget's 34.00 GiB: shorter sequences, fewer trained parameters"):
        measure(_request(TrainSetup(gradient_checkpointing=True)), 1, budget, start=4, probe=growing, noun="trace")


def _fake_python(tmp_path: Path, body: str) -> str:
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_run_probe_speaks_json_over_a_subprocess(tmp_path: Path) -> None:
    result = {"micro_batch": 4, "sequences": 12, "max_reserved": 123, "context": 7, "oom": False, "extra": 1}
    python = _fake_python(
        tmp_path,
        f'cat > "{tmp_path}/request.json"\necho "$PYTORCH_CUDA_ALLOC_CONF" > "{tmp_path}/env"\n'
        f"echo 'log line'\necho '{json.dumps(result)}'\n",
    )
    request = probe_request({"model_type": "bert"}, "classification", TrainSetup(micro_batch=4, n_positives=2))
    got = run_probe(request, python=python)
    assert (got.micro_batch, got.sequences, got.max_reserved, got.footprint) == (4, 12, 123, 130)
    assert json.loads((tmp_path / "request.json").read_text()) == request
    assert (tmp_path / "env").read_text().strip() == ALLOC_CONF


def test_run_probe_reports_a_crash_with_its_stderr(tmp_path: Path) -> None:
    python = _fake_python(tmp_path, "echo 'Traceback: boom' >&2\nexit 3\n")
    got = run_probe(probe_request({"model_type": "bert"}, "classification", TrainSetup()), python=python)
    assert not got.ok and "code 3" in got.error and "boom" in got.error


def test_line_fit_is_a_plain_value() -> None:
    fit = LineFit(1.0, 2.0, ((1, 3),))
    assert fit.predict(10) == 21.0


def test_drift_sets_the_headroom_and_the_confirmation_needs_room_for_it() -> None:
    budget = Budget(24 * GIB, 0.85)

    def drifting(request: Mapping[str, Any]) -> ProbeResult:
        b = int(request["micro_batch"])
        return ProbeResult(b, b, max_reserved=GIB + b * 50 * MIB, context=500 * MIB, drift=200 * MIB)

    plan = measure(lambda b: probe_request({}, "causal_lm", TrainSetup(micro_batch=b)), 1, budget, 64, drifting)
    assert plan.headroom == pytest.approx(200 * MIB / budget.limit)
    assert plan.confirmed.footprint + 200 * MIB <= budget.limit
    steady = ProbeResult(8, 8, max_reserved=budget.limit - 600 * MIB, context=500 * MIB)
    assert fits_budget(steady, budget.limit)
    assert not fits_budget(dataclasses.replace(steady, drift=200 * MIB), budget.limit)


def test_each_framework_has_a_loop_and_requests_carry_it() -> None:
    loops = {layout.name: layout.loop for layout in LAYOUTS}
    assert {k: loops[k] for k in ("hf_trainer", "axolotl", "llama_factory", "torchtune", "lightning")} == {
        "hf_trainer": "hf",
        "axolotl": "hf",
        "llama_factory": "hf",
        "torchtune": "plain",
        "lightning": "lightning",
    }
    assert all(loop is None or loop in LOOPS for loop in loops.values())
    request = probe_request({}, "causal_lm", TrainSetup(loop="hf"))
    assert (request["loop"], request["warmup"], request["steps"]) == ("hf", 3, 5)
    with pytest.raises(UserError, match='loop "trainer"'):
        TrainSetup(loop="trainer").check()


def test_a_trace_runs_with_torchscript_off(tmp_path: Path) -> None:
    """Model code compiled by TorchScript cannot run on fake tensors (DeBERTa-v2 in transformers 5.17): the trace's
    process runs it as plain Python."""
    python = _fake_python(tmp_path, 'cat > /dev/null\necho "{\\"jit\\": \\"$PYTORCH_JIT\\"}"\n')
    assert run_trace({"config": {"model_type": "deberta-v2"}}, python=python) == {"jit": "0"}


def test_the_closed_form_s_difference_is_flagged_only_when_large_in_share_and_in_bytes() -> None:
    """A tiny model's tiers differ by a large share that is the closed form's fixed allocator figure: no flag."""
    assert difference(int(1.1 * GIB), 837 * MIB) == "+34.6%"
    assert difference(12 * GIB, 10 * GIB) == "+20.0% (large)"
    assert difference(int(10.5 * GIB), 10 * GIB) == "+5.0%"
