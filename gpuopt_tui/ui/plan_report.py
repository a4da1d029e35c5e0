"""A memory plan as tables and a bar of GPU memory: Rich renderables shared by `gpuopt-tui plan` and the planner
screen (no torch, no Textual: the CLI draws them without the app). What they show comes from core.planner.report
and the planner's results; this module gives it styles and colours."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from gpuopt_tui.core.format import human_bytes
from gpuopt_tui.core.planner.estimate import Estimate
from gpuopt_tui.core.planner.fit import ProbeResult
from gpuopt_tui.core.planner.measure import fits_budget
from gpuopt_tui.core.planner.report import Segment, bar_cells, candidate_rows, header_facts, layout_fact
from gpuopt_tui.core.planner.resolve import Resolved
from gpuopt_tui.core.planner.search import Candidate, Recommendation, StagePlan
from gpuopt_tui.core.planner.traced import TracedEstimate, difference

if TYPE_CHECKING:
    from gpuopt_tui.core.planner.session import PlanInputs

# one colour per component of the estimate, shared by the breakdown table and the bar
COMPONENT_COLOURS = {
    "weights": "blue",
    "gradients": "magenta",
    "optimizer": "yellow",
    "master": "dark_orange",
    "buckets": "cyan",
    "cast_cache": "bright_blue",
    "activations": "green",
    "recompute": "bright_green",
    "logits": "bright_magenta",
    "working": "bright_cyan",
    "optimizer_temp": "khaki1",
    "batch": "white",
    "workspaces": "grey62",
    "allocator": "grey42",
    "context": "red",
}
CANDIDATE_COLUMNS = ("", "micro", "accum", "effective", "deviation", "peak", "of GPU", "fits", "configuration")
SWATCH = "■"
FILLED = "█"
FREE = "░"
MARGIN_MARK = "┃"


def _table(title: str | None = None) -> Table:
    return Table(title=title, box=None, header_style="bold", title_justify="left", pad_edge=False)


def _labelled(label: str, text: str) -> Text:
    return Text.assemble((label + " ", "bold"), text)


def header_lines(inputs: PlanInputs) -> list[Text]:
    """What is planned: the model, the training setup and the memory budget, a line each."""
    return [_labelled(label, text) for label, text in header_facts(inputs)]


def layout_line(inputs: PlanInputs) -> Text | None:
    """Which framework's layout the training config was read as."""
    fact = layout_fact(inputs)
    return _labelled(*fact) if fact else None


VALUES_TITLE = "values and where each comes from (command line > config > profile > default)"


def values_table(values: Sequence[Resolved], title: str | None = VALUES_TITLE) -> Table:
    """Every value the plan depends on, its source (`file:line`, the flag, the profile, a default) and the
    lower-ranked values it overrode; a value only the planner's default sets is yellow."""
    table = _table(title)
    table.add_column("value")
    table.add_column("is", overflow="fold")
    table.add_column("from", overflow="fold")
    table.add_column("overrides", style="dim", overflow="fold")
    for r in values:
        style = "yellow" if r.origin == "default" else ""
        table.add_row(r.label, Text(r.text, style=style), Text(r.source, style=style), "; ".join(r.overridden))
    return table


def warning_lines(warnings: Sequence[str]) -> list[Text]:
    return [Text.assemble(("warning ", "bold yellow"), w) for w in warnings]


def breakdown_table(est: Estimate | TracedEstimate, notes: bool = True, title: str | None = None) -> Table:
    """One row per component (a coloured swatch, its size, whether it is part of the peak), then the totals."""
    table = _table(title)
    table.add_column("component")
    table.add_column("size", justify="right")
    table.add_column("at peak", justify="center")
    if notes:
        table.add_column("how", style="dim")
    for c in est.components:
        label = Text.assemble((SWATCH + " ", COMPONENT_COLOURS.get(c.key, "default")), c.label)
        table.add_row(label, human_bytes(c.bytes), "yes" if c.in_peak else "", *([c.note] if notes else []))
    table.add_section()
    table.add_row(
        Text("peak reserved by torch", style="bold"),
        human_bytes(est.reserved),
        "",
        *(["what torch.cuda.max_memory_reserved() shows"] if notes else []),
    )
    table.add_row(
        Text("total on the GPU", style="bold"),
        human_bytes(est.total),
        "",
        *(["with the CUDA context (what nvidia-smi shows)"] if notes else []),
    )
    return table


def tiers_table(traced: TracedEstimate, closed: Estimate) -> Table:
    """The traced tier beside the closed form, with the closed form's difference from the trace."""
    table = _table("tiers side by side (the difference: closed form against the trace)")
    for column in ("tier", "peak allocated", "peak reserved", "total on the GPU", "peak at", "difference"):
        table.add_column(column, justify="left" if column in ("tier", "peak at") else "right")
    for est in (traced, closed):
        diff = difference(closed.total, traced.total) if est is closed else ""
        table.add_row(
            est.tier,
            human_bytes(est.allocated),
            human_bytes(est.reserved),
            human_bytes(est.total),
            est.phase,
            Text(diff, style="yellow" if "large" in diff else ""),
        )
    return table


def modules_table(traced: TracedEstimate, title: str | None = None) -> Table:
    """Activations alive at the traced peak, by module (the layers of a stack folded into one row)."""
    table = _table(title)
    table.add_column("module")
    table.add_column("at the peak", justify="right")
    for name, nbytes in traced.modules:
        table.add_row(name, human_bytes(nbytes))
    return table


def utilisation_text(c: Candidate) -> Text:
    colour = "green" if c.fits and c.utilisation >= 0.6 else ("yellow" if c.fits else "red")
    return Text(f"{c.utilisation:.0%}", style=colour, justify="right")


def candidate_cells(c: Candidate, chosen: bool) -> tuple[Text, ...]:
    """The cells of one candidate, in the order of CANDIDATE_COLUMNS: the figures first, the name last (the
    chosen one marked)."""
    return (
        Text(">" if chosen else "", style="bold"),
        Text(str(c.micro_batch), justify="right"),
        Text(str(c.accumulate), justify="right"),
        Text(str(c.effective_batch), justify="right"),
        Text(f"{c.deviation:+.1%}" if c.deviation else "exact", justify="right"),
        Text(human_bytes(c.peak), justify="right"),
        utilisation_text(c),
        Text("yes", justify="right") if c.fits else Text("no", style="red", justify="right"),
        Text(c.label, style="bold" if chosen else ""),
    )


def candidates_table(rec: Recommendation, title: str | None = None) -> Table:
    table = _table(title)
    for column in CANDIDATE_COLUMNS:
        if column == "configuration":
            table.add_column(column, ratio=1)  # the name takes what the figures leave, wrapped if it must
        else:
            table.add_column(column, justify="left" if not column else "right", no_wrap=True, min_width=1)
    for c, chosen in candidate_rows(rec):
        table.add_row(*candidate_cells(c, chosen))
    return table


def recommendation_text(rec: Recommendation) -> Text:
    """The chosen configuration, then where its figures come from (`tier_text`)."""
    c = rec.chosen
    return Text.assemble(
        f"> recommended ({rec.mode}): micro-batch {c.micro_batch} x accumulate {c.accumulate} = {c.effective_batch}, "
        f"{human_bytes(c.peak)} total on the GPU ({c.utilisation:.0%}); largest micro-batch that fits: {rec.b_max} "
        f"(at accumulation {rec.b_max_accumulate})\n",
        tier_text(rec),
    )


def tier_text(rec: Recommendation) -> Text:
    """The tier of a recommendation and the share of the budget its search kept back for the tier's error."""
    limit = human_bytes(rec.budget.limit)
    if not rec.headroom:
        return Text.assemble((rec.tier, "bold"), f": nothing kept back, the whole {limit} budget planned for")
    why = "a long run's drift above the probes" if rec.tier == "measured" else "its error"
    text = Text.assemble(
        (rec.tier, "bold"),
        f"; {rec.headroom:.0%} of the budget kept back for {why}: "
        f"planned for {human_bytes(rec.budget.search_limit(rec.headroom))} of {limit}",
    )
    if (c := rec.within_reserve) is not None:
        how = "a longer run than the probes'" if rec.tier == "measured" else "a run on the GPU (plan --profile)"
        text.append(
            f"\nmicro-batch {c.micro_batch} x accumulate {c.accumulate} would take {human_bytes(c.peak)} "
            f"({c.peak / rec.budget.limit:.0%} of the budget): only inside what was kept back; {how} tells whether "
            "it holds"
        )
    return text


def probes_text(probes: Sequence[ProbeResult], limit: int, confirmed: int) -> Text:
    """A measured plan's probes in the order they ran: each micro-batch with its footprint on the GPU (context
    included), those that did not fit `limit` marked, and the `confirmed` micro-batch."""
    parts: list[Text] = []
    for r in probes:
        if not r.ok:
            parts.append(Text(f"{r.label} {'out of memory' if r.oom else 'failed'}", style="red"))
            continue
        retries = f", {r.num_alloc_retries} allocator retries" if r.num_alloc_retries else ""
        over = " over the budget" if r.footprint > limit else ""
        part = Text(f"{r.label} {human_bytes(r.footprint)}{over}{retries}")
        if not fits_budget(r, limit):
            part.stylize("yellow")
        elif r.micro_batch == confirmed:
            part.append(" confirmed", style="bold")
        parts.append(part)
    return Text.assemble(("probes ", "bold"), Text(" · ").join(parts))


STAGES_TITLE = (
    "curriculum stages: each one's largest micro-batch, and at the chosen micro-batch its peak and the most "
    "samples per anchor (positives + negatives) that fit"
)


def stages_table(stages: Sequence[StagePlan], title: str | None = None, file_names: bool = False) -> Table:
    """Per curriculum stage: its samples per anchor, its own largest micro-batch, and what the chosen micro-batch
    costs and allows. `file_names` shows stage files by name instead of their full path (which may fold)."""
    table = _table(title)
    table.add_column("stage", overflow="fold", no_wrap=file_names)
    for column in ("n_pos", "n_neg", "max batch", "peak at chosen", "max samples"):
        table.add_column(column, justify="right", no_wrap=True)
    for p in stages:
        table.add_row(
            Path(p.stage.name).name if file_names else p.stage.name,
            str(p.stage.n_positives),
            str(p.stage.n_negatives),
            str(p.b_max),
            f"{human_bytes(p.peak)} {p.utilisation:.0%}",
            f"{p.max_positives} + {p.max_negatives}",
        )
    return table


class MemoryBar:
    """GPU memory as one line of coloured segments over the card's size, the budget's margin marked, and a caption
    with the figures. Drawn at whatever width it is given."""

    def __init__(self, segments: Iterable[Segment], gpu_total: int, margin: float, label: str = "") -> None:
        self.segments = tuple(s for s in segments if s.bytes > 0)
        self.gpu_total = gpu_total
        self.margin = margin
        self.label = label  # starts the caption

    @property
    def used(self) -> int:
        return sum(s.bytes for s in self.segments)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = max(10, options.max_width)
        mark = min(width - 1, int(self.margin * width))
        bar = Text()
        for i, colour in enumerate(bar_cells(self.segments, self.gpu_total, width)):
            if i == mark:
                bar.append(MARGIN_MARK, style=f"bold white on {colour}" if colour else "bold yellow")
            else:
                bar.append(FILLED if colour else FREE, style=colour or "grey30")
        yield bar
        used, limit = self.used, int(self.gpu_total * self.margin)
        verdict = Text(" · over the budget", style="bold red") if used > limit else Text("")
        yield Text.assemble(
            (f"{self.label}: " if self.label else "", "bold"),
            f"{human_bytes(used)} of {human_bytes(self.gpu_total)} ({used / self.gpu_total:.0%}) · ",
            (MARGIN_MARK, "bold yellow"),
            f" margin {self.margin:.0%} = {human_bytes(limit)}",
            verdict,
        )


def breakdown_bar(est: Estimate | TracedEstimate, gpu_total: int, margin: float, label: str = "") -> MemoryBar:
    """The components at the peak, in the colours of the breakdown table (they add up to the total)."""
    return MemoryBar(
        (Segment(c.bytes, COMPONENT_COLOURS.get(c.key, "white")) for c in est.components if c.in_peak),
        gpu_total,
        margin,
        label,
    )


def candidate_bar(c: Candidate, gpu_total: int, margin: float, label: str = "") -> MemoryBar:
    return MemoryBar([Segment(c.peak, "green" if c.fits else "red")], gpu_total, margin, label)
