"""The follow view of `run`, `resume` and `attach`: the stage a run is in, with a count only where it has one."""

from __future__ import annotations

import io
import re

from rich.console import Console
from rich.progress import Progress

from gpuopt_tui.commands.follow import new_progress, show_progress

COUNT = re.compile(r"\d+/[\d?]")


def rendered(progress: Progress) -> str:
    out = Console(file=io.StringIO(), width=150, record=True)
    out.print(progress.make_tasks_table(progress.tasks))
    return out.export_text()


def test_each_stage_is_shown_with_its_count_where_it_has_one() -> None:
    progress, task = new_progress("20250101-120000-attribution-0001")
    assert "20250101-120000-attribution-0001" in rendered(progress) and "starting…" in rendered(progress)

    show_progress(progress, task, {"type": "progress", "stage": "loading the model"}, "run")
    text = rendered(progress)
    assert "loading the model" in text and not COUNT.search(text)

    counted = {"type": "progress", "stage": "attribution", "done": 3, "total": 8, "unit": "samples", "rate": 1.5}
    show_progress(progress, task, counted, "run")
    text = rendered(progress)
    assert "attribution" in text and "3/8" in text and "1.5 samples/s" in text

    show_progress(progress, task, {"type": "progress", "stage": "writing results"}, "run")
    text = rendered(progress)  # the earlier total is not shown against a stage without a count
    assert "writing results" in text and not COUNT.search(text)

    show_progress(progress, task, {"type": "progress", "stage": "probes", "done": 0, "total": 31, "epoch": 4}, "run")
    assert "probes, epoch 4" in rendered(progress) and "0/31" in rendered(progress)


def test_a_progress_without_a_stage_shows_the_run() -> None:
    progress, task = new_progress("run-7")
    show_progress(progress, task, {"type": "progress", "done": 1, "total": 2}, "run-7")
    assert "run-7" in rendered(progress) and "1/2" in rendered(progress)
