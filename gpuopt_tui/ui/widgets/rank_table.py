"""The ranks of a run over several processes, a row each: where it runs, its own progress and how it ended."""

from __future__ import annotations

from typing import Any

from rich.text import Text

from gpuopt_tui.core.runs.status import RunInfo, Worker
from gpuopt_tui.ui.widgets.keyed_table import KeyedTable
from gpuopt_tui.ui.widgets.run_text import RANK_STATE_COLOR, first_line, rank_state, rate_text

COLUMNS = ("rank", "state", "host", "device", "pid", "progress", "rate", "message")
MESSAGE_WIDTH = 60  # a failed rank's message, cut to this (the run's message says it in full)


class RankTable(KeyedTable):
    """Shown only for a run with ranks; `show(info)` follows the run (None hides the table)."""

    DEFAULT_CSS = """
    RankTable { height: auto; max-height: 9; overflow-x: hidden; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(COLUMNS, id=id, cursor_type="none")
        self.display = False

    def show(self, info: RunInfo | None) -> None:
        ranks = info.rank_progress if info is not None else {}
        self.display = bool(ranks)
        if info is None or not ranks:
            self.set_rows({})
            return
        colors = self.app.get_css_variables()
        workers = {w.rank: w for w in info.workers}
        self.set_rows({str(r): rank_cells(info, r, p, workers.get(r), colors) for r, p in ranks.items()})


def rank_cells(
    info: RunInfo, rank: int, report: dict[str, Any], worker: Worker | None, colors: dict[str, str]
) -> tuple[Text, ...]:
    state = rank_state(info, report)
    style = colors.get(RANK_STATE_COLOR.get(state, "$warning").lstrip("$"), "")
    message = str(report.get("message") or "") if state == "failed" else ""  # a cancel's message says nothing new
    return (
        Text(str(rank), justify="right"),
        Text(state, style=style),
        Text(worker.host if worker else "?"),
        Text(worker.device if worker else "?"),
        Text(str(worker.pid) if worker and worker.pid else "-", justify="right"),
        Text(_progress(info, report)),
        Text(rate_text(report) if "done" in report else ""),
        Text(first_line(message, MESSAGE_WIDTH), style=style),
    )


def _progress(info: RunInfo, report: dict[str, Any]) -> str:
    """`done/total (pct)` of the rank's own share, with its stage where it differs from the run's (a stage
    without a count: the stage alone, where it differs)."""
    done, total = report.get("done"), report.get("total")
    stage = report.get("stage")
    elsewhere = f" {stage}" if stage and stage != info.progress.get("stage") else ""
    if not isinstance(done, (int, float)) or not isinstance(total, (int, float)):
        return elsewhere.lstrip()
    pct = f" ({min(1.0, done / total):.0%})" if total > 0 else ""
    return f"{done}/{total}{pct}{elsewhere}"
