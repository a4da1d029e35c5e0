"""A memory plan's report as data: the lines that say what is planned, the candidates a table lists, and how a bar
of GPU memory divides its cells. ui/plan_report.py draws them with Rich for `gpuopt-tui plan` and the planner
screen; nothing here knows about styles."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuopt_tui.core.format import human_bytes
from gpuopt_tui.core.planner.search import Candidate, Recommendation

if TYPE_CHECKING:
    from gpuopt_tui.core.planner.session import PlanInputs


def header_facts(inputs: PlanInputs) -> list[tuple[str, str]]:
    """What is planned, as (label, text): the model, the training setup and the memory budget."""
    spec, s = inputs.spec, inputs.setup
    lora = f" (r={s.lora_rank}, {','.join(s.lora_targets)})" if s.trainable == "lora" else ""
    samples = f", {s.n_positives}+{s.n_negatives} samples per anchor" if s.sequences_per_example > 1 else ""
    if spec is not None:
        shape = f"{spec.layers} layers, hidden {spec.hidden}, {spec.params / 1e6:.1f}M parameters"
        model = f"{inputs.model.label}: {spec.model_type} {spec.task}, {shape}"
    else:
        family = inputs.model.config.get("model_type")
        model = f"{inputs.model.label}: {family} {inputs.task} (a family the closed form does not cover: traced tier)"
    setup = (
        f"{s.precision}, {s.optimizer}, trains {s.trainable}{lora}, checkpointing "
        f"{'on' if s.gradient_checkpointing else 'off'}, seq {s.seq_len}, micro-batch {s.micro_batch} x "
        f"accumulate {s.accumulate} x {s.n_gpus} GPU(s) = {s.effective_batch}{samples}"
    )
    budget = (
        f"{inputs.budget.margin:.0%} of {human_bytes(inputs.gpu.total)} ({inputs.gpu.label}) = "
        f"{human_bytes(inputs.budget.limit)}"
    )
    return [("model", model), ("setup", setup), ("budget", budget)]


def layout_fact(inputs: PlanInputs) -> tuple[str, str] | None:
    """Which framework's layout the training config was read as, as (label, text); None without a config."""
    if inputs.config is None:
        return None
    return ("config", f"{inputs.config.path}, read as {inputs.layout}")


def candidate_rows(rec: Recommendation) -> list[tuple[Candidate, bool]]:
    """The current setup, the candidates and the chosen configuration (once), each with whether it is chosen."""
    key = (rec.chosen.micro_batch, rec.chosen.accumulate)
    same = [c for c in rec.candidates if (c.micro_batch, c.accumulate) == key]
    chosen = same[0] if same else rec.chosen
    rows = [c for c in (rec.current, *rec.candidates, *([] if same else [rec.chosen])) if c is not None]
    return [(c, c is chosen) for c in rows]


@dataclass(frozen=True)
class Segment:
    """A stretch of a memory bar: its bytes and the name of its colour."""

    bytes: int
    colour: str


def bar_cells(segments: Iterable[Segment], gpu_total: int, width: int) -> list[str]:
    """The colour of each of `width` cells of a bar over `gpu_total` bytes ("" for free memory); a segment ends at
    its rounded boundary."""
    colours = [""] * width
    start = 0
    total = 0
    for s in segments:
        total += s.bytes
        end = min(width, round(total / gpu_total * width))
        colours[start:end] = [s.colour] * (end - start)
        start = max(start, end)
    return colours
