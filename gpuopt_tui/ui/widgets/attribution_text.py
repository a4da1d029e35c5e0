"""The words and figures of the attribution results: a sample's heading, the convergence-delta report and the
optimized-vs-original check report."""

from __future__ import annotations

from typing import Any

from textual.content import Content

from gpuopt_tui.core.results.attribution import Sample
from gpuopt_tui.core.results.attribution_summary import AttributionSummary, Audit, CheckResult, StepStats

CHECK_TOLERANCE = 1e-2  # relative difference within which the optimized path counts as agreeing


def figure(value: float) -> str:
    return f"{value:.3g}"


def percent(value: float) -> str:
    return f"{value * 100:.3g}%"


def sample_heading(sample: Sample, token: int | None = None) -> Content:
    """The heading of `sample` as its completion token `token` explains it (None: the whole completion, or a
    sample of another model)."""
    if sample.completion_tokens:
        shown = completion_token_line(sample, token)
    else:
        shown = Content(sample.rows_note) if sample.rows_note else None
    return _heading(sample.explaining(token), shown)


def completion_token_line(sample: Sample, token: int | None) -> Content:
    """Which completion token the heatmap explains, with the keys that choose another."""
    count = len(sample.completion_tokens)
    keys = f"(, . choose: the whole completion or one of its {count} tokens)"
    if token is None:
        return Content(f"shown: the whole completion {keys}")
    row = sample.completion_tokens[token]
    return Content(f"shown: completion token {token + 1} of {count} {row.token!r} · log p {figure(row.logprob)} {keys}")


def _heading(sample: Sample, shown: Content | None) -> Content:
    """The sample's first line, `shown` (what its scores explain, where it says), then its delta and warnings."""
    e = sample.entry
    what = "candidate " if sample.two_tower else ""
    label = "" if e.label is None else f" · label {e.label}"
    explained = "" if e.target == e.prediction else f" · explained {what}{e.target}"
    close = (
        f"\n⚠ its two largest outputs differ by {figure(e.margin or 0.0)}, within the error of the steps' precision: "
        "the steps may rank them the other way"
        if e.low_margin
        else ""
    )
    steps = "" if e.steps is None else f" · {e.steps} steps" + (" in full precision" if e.full_precision else "")
    above = (
        f"\n⚠ above the tolerance: its relative delta or its error estimate ({figure(e.error_estimate or 0.0)}) "
        "exceeds it"
        if e.within_tolerance is False
        else ""
    )
    if e.completion is not None:  # a causal LM: the prompt's tokens explain log p(completion | prompt)
        logprob = figure(e.logprob or 0.0)
        first = f"sample {e.index} · completion {e.completion!r} · log p {logprob} (p {e.probability:.3g})"
    else:
        first = f"sample {e.index} · predicted {what}{e.prediction} (p {e.probability:.3f}){label}{explained}"
    rest = f"delta {figure(e.delta)} = {figure(e.relative_delta)} × |F(x) − F(baseline)|{steps}{above}{close}"
    return Content("\n").join([Content(first), *([shown] if shown is not None else []), Content(rest)])


def delta_report(summary: AttributionSummary | None) -> Content:
    if summary is None:
        return Content("summary.json is not written yet.")
    d, s = summary.deltas, summary.settings
    lines = [
        Content.from_markup("[b]Convergence delta[/]"),
        Content(
            f"sum of a sample's attributions − (F(x) − F(baseline)), over {summary.n_samples} samples; "
            "relative: divided by |F(x) − F(baseline)|"
        ),
        Content(f"  relative  median {figure(d.median_rel)} · p95 {figure(d.p95_rel)} · max {figure(d.max_rel)}"),
        Content(f"  absolute  median {figure(d.median_abs)} · p95 {figure(d.p95_abs)}"),
    ]
    if d.warning:
        warning = d.warning
        if d.suggested_n_steps and str(d.suggested_n_steps) not in warning:
            warning += f"; suggested n_steps: {d.suggested_n_steps}"
        lines.append(Content.from_markup("[$warning]⚠ $warning[/]", warning=warning))
    else:
        lines.append(
            Content(
                f"  median and p95 of the relative delta are within the warning threshold ({figure(d.threshold_rel)})"
            )
        )
    if summary.low_margin is not None and summary.low_margin.count:
        m = summary.low_margin
        close = (
            f"{m.count} samples have their two largest outputs (fp32) within {figure(m.relative_error)} × the "
            f"largest |output| of each other, the error of {m.precision}: the steps may rank them the other way "
            "(search: lowmargin)"
        )
        lines.append(Content.from_markup("[$warning]⚠ $close[/]", close=close))
    if summary.steps is not None and summary.steps.mode == "auto":
        lines += step_report(summary.steps)
    if summary.audit is not None:
        lines += audit_report(summary.audit)
    lines += [Content(""), Content.from_markup("[b]Settings[/]"), Content("  " + settings_line(s))]
    rate, seconds = summary.timing.get("samples_per_s"), summary.timing.get("compute_seconds")
    if isinstance(rate, (int, float)) and isinstance(seconds, (int, float)):
        lines.append(Content(f"  speed {rate:,.1f} samples/s ({seconds:.3g} s of attribution)"))
    return Content("\n").join(lines)


BARS = " ▁▂▃▄▅▆▇█"


def step_histogram(histogram: tuple[tuple[int, int], ...]) -> str:
    """ "9 ▇ 612 · 17 █ 840 · 33 ▂ 95": samples per step count, with a bar scaled to the largest."""
    most = max((count for _, count in histogram), default=0)
    return " · ".join(
        f"{steps} {BARS[max(1, round(count / most * (len(BARS) - 1)))]} {count}" for steps, count in histogram
    )


def step_report(steps: StepStats) -> list[Content]:
    """The steps of an "auto" run: their distribution over the samples, the total and the samples at the cap."""
    lines = [
        Content(""),
        Content.from_markup("[b]Steps per sample[/] (n_steps = auto, tolerance $tol)", tol=f"{steps.tolerance:g}"),
        Content(f"  {step_histogram(steps.histogram)}"),
        Content(f"  mean {steps.mean:.3g} · {steps.total:,} sample-steps in all · cap {steps.max_steps}"),
    ]
    if steps.full_precision:
        lines.append(Content(f"  {steps.full_precision}"))
    if steps.warning:
        lines.append(Content.from_markup("[$warning]⚠ $warning[/]", warning=steps.warning))
    return lines


def audit_report(audit: Audit) -> list[Content]:
    """The run's audit: each audited sample's error against the strict reference, and the verdict."""
    samples = " · ".join(f"#{s.index} {s.error:.1e}" + (" ⚠" if s.within is False else "") for s in audit.samples)
    lines = [
        Content(""),
        Content.from_markup("[b]Audit[/] ($how; $seconds s)", how=audit.reference, seconds=f"{audit.seconds:.3g}"),
        Content(f"  {samples}"),
    ]
    if audit.tolerance is None:
        lines.append(Content(f"  max error {audit.max_error:.1e} (fixed steps: no tolerance to hold them to)"))
    elif audit.silent_misses:
        warning = (
            f"{audit.silent_misses} of {len(audit.samples)} audited samples were reported within the tolerance "
            f"{audit.tolerance:g} but are above it: lower attribution.tolerance or run the steps in full precision "
            "(use_amp = false)"
        )
        lines.append(Content.from_markup("[$warning]⚠ $warning[/]", warning=warning))
    elif audit.above:
        lines.append(
            Content(
                f"  {audit.above} of {len(audit.samples)} audited samples are above the tolerance {audit.tolerance:g}, "
                "as the run flags them too; none it reported within is above it"
            )
        )
    else:
        lines.append(Content(f"  every audited sample is within the tolerance {audit.tolerance:g}"))
    return lines


def settings_line(settings: dict[str, Any]) -> str:
    path = "batched" if settings.get("optimized") else "one sample and one step at a time"
    keys = ("n_steps", "method", "precision", "baseline", "target", "device")
    return " · ".join([*(f"{k} {settings[k]}" for k in keys if k in settings), path])


def path_names(check: CheckResult) -> tuple[str, str]:
    weights = f"{check.precision_optimized} weights" if check.cast_weights_optimized else check.precision_optimized
    return (
        f"optimized: samples × steps batched, {weights}",
        f"original: one sample and one step at a time, {check.precision_original}",
    )


def check_report(check: CheckResult) -> Content:
    optimized, original = path_names(check)
    agrees = check.max_rel_diff <= CHECK_TOLERANCE
    verdict = (
        f"within {CHECK_TOLERANCE:g}: the optimized path agrees with the original"
        if agrees
        else f"above {CHECK_TOLERANCE:g}: the optimized scores differ; try use_amp = false or amp_mode = autocast"
    )
    speed = f" ({check.speedup:.3g}× faster)" if check.speedup else ""
    lines = [
        Content.from_markup("[b]Optimized vs original[/] on the first $n samples", n=str(check.n_samples)),
        Content(f"  {optimized}"),
        Content(f"  {original}"),
        Content(f"  max relative difference     {check.max_rel_diff:.3g}"),
        Content(f"  median relative difference  {check.median_rel_diff:.3g}"),
        Content("  (per sample: max |optimized − original| / max |original| over its token scores)"),
        Content.from_markup(f"  [{'$success' if agrees else '$warning'}]$verdict[/]", verdict=verdict),
        Content(f"  time: optimized {check.seconds_optimized:.3g} s, original {check.seconds_original:.3g} s{speed}"),
    ]
    return Content("\n").join(lines)
