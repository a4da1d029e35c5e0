"""The results of a TracIn run: each test example with its proponents and opponents, the self-influence ranking
of the training examples, their dataset-level ranking (mean and max influence over the test set; runs made before
it have no such tab), the run's summary and its result files.

Everything shown comes from the run's files (core.results.tracin), read in thread workers a page at a time, so
a ranking of millions of training examples opens as fast as a small one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from rich.text import Text
from textual import on, work
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.content import Content
from textual.widget import Widget
from textual.widgets import DataTable, Static, TabbedContent, TabPane

from gpuopt_tui.core.format import human_bytes
from gpuopt_tui.core.results.tracin import (
    FILE_ROLES,
    DatasetRanked,
    InfluenceRecord,
    Neighbour,
    PagedRecords,
    RankedExample,
    TracInResults,
    load_results,
)
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.status import RunInfo
from gpuopt_tui.ui.loading import Loaded, reply
from gpuopt_tui.ui.widgets.run_results import RunResults, tabbed
from gpuopt_tui.ui.widgets.tracin_summary import status_content, summary_content

PAGE = 200  # rows read at a time
FIRST_PAGE = 60  # rows read before a run is shown: a screenful and more (every row added is measured at once)
LOAD_MARGIN = 20  # the next page is read when the cursor comes this close to the last row read
TEXT_CELL = 100  # characters of a text in a table cell; the line under the table shows all of it

T = TypeVar("T")


def cut(text: str, width: int = TEXT_CELL) -> str:
    text = " ".join(text.split())  # one line in a cell
    return text if len(text) <= width else text[: width - 1] + "…"


def label_text(label: int | None) -> str:
    return "-" if label is None else str(label)


def prediction_text(record: InfluenceRecord, name: Callable[[int | None], str]) -> str:
    """The predicted class and its probability at the last checkpoint ("-" for runs that saved none)."""
    if record.prediction is None:
        return "-"
    return name(record.prediction) + ("" if record.probability is None else f" ({record.probability:.2f})")


def is_lm(records: Sequence[InfluenceRecord | Neighbour | RankedExample | DatasetRanked]) -> bool:
    """Whether the examples are a causal LM's (prompt and completion) rather than a classifier's (text and label)."""
    return any(r.completion is not None for r in records)


def example_columns(lm: bool) -> tuple[str, str]:
    """The names of an example's two columns: what it is trained to give, and its input."""
    return ("completion", "prompt") if lm else ("label", "text")


def example_cells(
    text: str, completion: str | None, label: int | None, name: Callable[[int | None], str] = label_text
) -> tuple[str, str]:
    """An example's two cells: its completion (a causal LM's) or label, and its prompt or text."""
    target = cut(completion, TEXT_CELL // 2) if completion is not None else name(label)
    return target, cut(text)


def example_detail(text: str, completion: str | None, label: int | None) -> str:
    """An example in full, for the line under a table."""
    if completion is not None:
        return f"prompt {text} · completion {completion}"
    return f"label {label_text(label)} · {text}"


def neighbours_title(side: str, neighbours: Sequence[Neighbour]) -> str:
    """The title over a test example's proponents or opponents: TracIn's sign says whether a training example
    lowered (positive) or raised (negative) its loss; where every listed one has the other sign, none did."""
    if side == "proponents":
        if neighbours and all(n.score <= 0 for n in neighbours):
            return "Highest scores (no training example lowered its loss: every score is 0 or below)"
        return "Proponents (training that lowered its loss)"
    if neighbours and all(n.score >= 0 for n in neighbours):
        return "Lowest scores (no training example raised its loss: every score is 0 or above)"
    return "Opponents (training that raised its loss)"


def score_text(score: float) -> str:
    return f"{score:+.4e}"


def _optional_score(score: float | None) -> str:
    return "-" if score is None else score_text(score)


def cells(*values: str) -> tuple[Text, ...]:
    """Table cells as plain text: a string cell would be read as markup, and texts may hold brackets."""
    return tuple(Text(v) for v in values)


def fill(table: DataTable[Text], columns: Sequence[str], rows: Sequence[Sequence[Text]]) -> None:
    """Replace a table's columns and rows. Each column gets the width of its widest cell here: a table left to
    measure new rows itself keeps any drawing made before it measured them, cut to the old widths."""
    table.clear(columns=True)
    for i, name in enumerate(columns):
        table.add_column(name, width=max([len(name), *(row[i].cell_len for row in rows)]))
    table.add_rows(rows)


class PageRead(Loaded):
    """A page of a table's records; `key`: the table's generation it was read for."""


class PagedTable(DataTable[Text], Generic[T]):
    """A table over PagedRecords: the first page comes with `attach`, the next is read (in a thread) when the
    cursor nears the last row read."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self.records: list[T] = []
        self.total = 0
        self._source: PagedRecords[T] | None = None
        self._row: Callable[[T], Sequence[Text]] = lambda record: ()
        self._columns: tuple[str, ...] = ()
        self._generation = 0  # bumped on attach: pages read for an earlier source are dropped
        self._reading = False

    def attach(
        self,
        columns: Sequence[str],
        source: PagedRecords[T] | None,
        total: int,
        first: list[T],
        row: Callable[[T], Sequence[Text]],
    ) -> None:
        self._generation += 1
        self._source, self.total, self._row, self._columns = source, total, row, tuple(columns)
        self.records = []
        self._reading = True  # clearing the table scrolls it: no read from there while it is refilled
        fill(self, self._columns, [])
        self._append(first)
        self._reading = False

    def record(self, row: int) -> T | None:
        return self.records[row] if 0 <= row < len(self.records) else None

    @property
    def current(self) -> T | None:
        return self.record(self.cursor_row) if self.row_count else None

    def _append(self, records: list[T]) -> None:
        rows = [self._row(r) for r in records]
        widths = [column.width for column in self.ordered_columns]
        self.records.extend(records)
        if any(cell.cell_len > width for row in rows for cell, width in zip(row, widths)):
            cursor = self.cursor_row  # a wider cell: lay the table out again (rare: widths only grow)
            fill(self, self._columns, [self._row(r) for r in self.records])
            self.move_cursor(row=cursor)
        else:
            self.add_rows(rows)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table is self:
            self._read_more_near(event.cursor_row)

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        self._read_more_near(int(new_value) + self.scrollable_content_region.height)  # the mouse wheel, too

    def _read_more_near(self, row: int) -> None:
        if row >= len(self.records) - LOAD_MARGIN and len(self.records) < self.total and not self._reading:
            self._reading = True
            self._read_page(self._source, len(self.records), self._generation)

    @work(thread=True, exclusive=True, group="page", exit_on_error=False)
    def _read_page(self, source: PagedRecords[T] | None, start: int, generation: int) -> None:
        reply(self, PageRead, generation, lambda: source.page(start, PAGE) if source is not None else [])

    @on(PageRead)
    def _page_read(self, message: PageRead) -> None:
        if message.key != self._generation:
            return
        self._reading = False
        if message.failed:
            self.total = len(self.records)  # stop asking for a file that cannot be read
            self.app.notify(message.reason, title="TracIn results", severity="error", timeout=10)
        self._append(message.value or [])


class FileTable(DataTable[Text]):
    """The run's result files; `copy_highlighted` copies the highlighted file's full path (`c`, bound by the view
    around it)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self.paths: list[Path] = []

    def show_files(self, files: list[tuple[Path, int]]) -> None:
        self.paths = [path for path, _ in files]
        rows = [cells(path.name, human_bytes(size), FILE_ROLES.get(path.name, "")) for path, size in files]
        fill(self, ("file", "size", "holds"), rows)

    def copy_highlighted(self) -> None:
        if not 0 <= self.cursor_row < len(self.paths):
            return
        path = str(self.paths[self.cursor_row])
        self.app.copy_to_clipboard(path)
        self.app.notify(path, title="Path copied")


@dataclass
class TracInFiles:
    """A run's results with the first rows of each row file (read in a worker thread)."""

    results: TracInResults
    n_tests: int
    tests: list[InfluenceRecord]
    n_ranked: int
    ranked: list[RankedExample]
    files: list[tuple[Path, int]]
    n_dataset: int = 0
    dataset: list[DatasetRanked] = field(default_factory=list)


def read_results(results_dir: Path) -> TracInFiles:
    """Open a run's result files and read the first rows of each row file (UserError for unreadable ones)."""
    results = load_results(results_dir)
    influence, ranking, dataset = results.influence, results.self_influence, results.dataset_ranking
    return TracInFiles(
        results=results,
        n_tests=0 if influence is None else len(influence),
        tests=[] if influence is None else influence.page(0, FIRST_PAGE),
        n_ranked=0 if ranking is None else len(ranking),
        ranked=[] if ranking is None else ranking.page(0, FIRST_PAGE),
        files=results.files(),
        n_dataset=0 if dataset is None else len(dataset),
        dataset=[] if dataset is None else dataset.page(0, FIRST_PAGE),
    )


class TracInResultsRead(Loaded):
    """A TracIn run's results; `key`: the read's token."""


class TracInResultsView(RunResults):
    """A run's summary line, then tabs: test examples, self-influence, dataset ranking, summary, files.
    Maximizable."""

    ALLOW_MAXIMIZE = True
    # `c` is the view's, not the file table's: it works wherever the focus is in the view (a results screen opens
    # with the view focused, not its file table), on the Files tab that shows what it copies.
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding(
            "c",
            "copy_path",
            "Copy path",
            id="tracin.copy",
            tooltip="On the Files tab, wherever the focus is in the results: copy the highlighted file's full path",
        ),
    ]
    DEFAULT_CSS = """
    TracInResultsView {
        #tracin-tabs { height: 1fr; min-height: 10; }
        TabPane { padding: 0; }
        DataTable { height: 1fr; min-height: 3; }
        .tracin-note { height: auto; max-height: 3; color: $text-muted; }
        .tracin-title { height: 1; text-style: bold; }
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._token = 0  # bumped for each read: results of an earlier read are dropped
        self.loaded: TracInFiles | None = None

    @classmethod
    def read_finished(cls, info: RunInfo) -> TracInFiles:
        return read_results(RunDir(info.dir).results)

    @classmethod
    def views_for(cls, value: Any) -> bool:
        return isinstance(value, TracInFiles) and not value.results.empty

    def compose_views(self) -> list[Widget]:
        return [
            tabbed(
                TabPane(
                    "Test examples",
                    PagedTable[InfluenceRecord](id="tracin-tests"),
                    Static("", id="tracin-test-detail", classes="tracin-note", markup=False),
                    Static(neighbours_title("proponents", ()), id="tracin-proponents-title", classes="tracin-title"),
                    DataTable[Text](id="tracin-proponents", cursor_type="row"),
                    Static(neighbours_title("opponents", ()), id="tracin-opponents-title", classes="tracin-title"),
                    DataTable[Text](id="tracin-opponents", cursor_type="row"),
                    id="tracin-tests-tab",
                ),
                TabPane(
                    "Self-influence",
                    Static("", id="tracin-self-note", classes="tracin-note", markup=False),
                    PagedTable[RankedExample](id="tracin-self"),
                    Static("", id="tracin-self-detail", classes="tracin-note", markup=False),
                    id="tracin-self-tab",
                ),
                TabPane(
                    "Dataset ranking",
                    Static("", id="tracin-dataset-note", classes="tracin-note", markup=False),
                    PagedTable[DatasetRanked](id="tracin-dataset"),
                    Static("", id="tracin-dataset-detail", classes="tracin-note", markup=False),
                    id="tracin-dataset-tab",
                ),
                TabPane(
                    "Summary", VerticalScroll(Static("", id="tracin-summary", markup=False)), id="tracin-summary-tab"
                ),
                TabPane(
                    "Files",
                    Static("", id="tracin-folder", classes="tracin-note", markup=False),
                    FileTable(id="tracin-files"),
                    id="tracin-files-tab",
                ),
                id="tracin-tabs",
            )
        ]

    # -- reading ------------------------------------------------------------------------------------------------

    def run_changed(self, info: RunInfo | None) -> None:
        """The run's state moved on: read its results again (in a thread)."""
        super().run_changed(info)
        self._token += 1
        if info is None:
            self._show(None)
            return
        if (preread := self.take_preread(info, TracInResultsRead, self._token)) is not None:
            self._results_read(preread)
        else:
            self._read(self._token, RunDir(info.dir).results)

    def describe(self, info: RunInfo | None) -> Content:
        if info is None:
            return Content("")
        if info.status in ("failed", "crashed"):
            return super().describe(info)
        return Content("Reading the results…")

    @work(thread=True, exclusive=True, group="tracin-read", exit_on_error=False)
    def _read(self, token: int, folder: Path) -> None:
        reply(self, TracInResultsRead, token, lambda: read_results(folder))

    @on(TracInResultsRead)
    def _results_read(self, message: TracInResultsRead) -> None:
        if message.key != self._token:
            return
        text = self.query_one("#results-text", Static)
        if message.reason:
            text.update(Content.from_markup("[$error]$error[/]", error=message.reason))
            self._show(None)
            return
        loaded = message.value
        if loaded is None or loaded.results.empty:
            if self.showing_log:
                return  # a failed run: the base shows the end of its log
            text.update("No result files yet: they are written when the run finishes.")
            self._show(None)
            return
        text.update(status_content(loaded.results.summary))
        self._show(loaded)

    # -- showing ------------------------------------------------------------------------------------------------

    def _show(self, loaded: TracInFiles | None) -> None:
        self.loaded = loaded
        if loaded is None:
            if self.views_ready:
                self.query_one("#tracin-tabs").display = False
            return
        self.with_views(lambda: self._fill(loaded))

    def _fill(self, loaded: TracInFiles) -> None:
        if loaded is not self.loaded:
            return  # a newer read came meanwhile: it is drawn by its own call
        self.query_one("#tracin-tabs").display = True
        tests = self.query_one("#tracin-tests", PagedTable)
        results = loaded.results
        name = results.summary.label_name if results.summary else label_text

        if is_lm(loaded.tests):
            columns = ("test", "loss", *example_columns(lm=True))

            def test_row(record: InfluenceRecord) -> tuple[Text, ...]:
                loss = "-" if record.completion_loss is None else f"{record.completion_loss:.4g}"
                return cells(str(record.index), loss, *example_cells(record.text, record.completion, record.label))
        else:
            columns = ("test", "label", "predicted", "text")

            def test_row(record: InfluenceRecord) -> tuple[Text, ...]:
                return cells(str(record.index), name(record.label), prediction_text(record, name), cut(record.text))

        tests.attach(columns, results.influence, loaded.n_tests, loaded.tests, test_row)
        self._show_test(tests.current)
        self._show_ranking(loaded)
        self._show_dataset(loaded)
        summary = self.query_one("#tracin-summary", Static)
        summary.update(summary_content(results.summary) if results.summary else "No summary.json in this run.")
        self.query_one("#tracin-folder", Static).update(f"Folder: {results.results_dir}")
        self.query_one("#tracin-files", FileTable).show_files(loaded.files)

    def _show_test(self, record: InfluenceRecord | None) -> None:
        if record is not None:
            detail = f"test {record.index} · {example_detail(record.text, record.completion, record.label)}"
        elif self.loaded is not None and self.loaded.results.influence is None:
            detail = "No influence.jsonl in this run."
        else:
            detail = ""
        self.query_one("#tracin-test-detail", Static).update(detail)
        for side, neighbours in (
            ("proponents", record.proponents if record else ()),
            ("opponents", record.opponents if record else ()),
        ):
            self.query_one(f"#tracin-{side}-title", Static).update(neighbours_title(side, neighbours))
            self._fill_neighbours(self.query_one(f"#tracin-{side}", DataTable), neighbours)

    @staticmethod
    def _fill_neighbours(table: DataTable[Text], neighbours: Sequence[Neighbour]) -> None:
        rows = [
            cells(score_text(n.score), str(n.index), *example_cells(n.text, n.completion, n.label)) for n in neighbours
        ]
        fill(table, ("score", "train", *example_columns(is_lm(neighbours))), rows)

    def _show_ranking(self, loaded: TracInFiles) -> None:
        marked = any(r.flipped is not None for r in loaded.ranked)
        note = self.query_one("#tracin-self-note", Static)
        ranking, lm = loaded.results.self_influence, is_lm(loaded.ranked)
        if ranking is None:
            note.update("No self_influence.jsonl or .csv in this run.")
        else:
            odd = "examples whose completion the model finds wrong or unusual" if lm else "mislabeled examples"
            note.update(
                f"{loaded.n_ranked:,} training examples, highest self-influence first: {odd} tend to rank high."
                + (" 'flipped': the data marks this label as flipped on purpose." if marked else "")
            )
        target, text = example_columns(lm)
        columns = ("rank", "score", "train", target, *(("flipped",) if marked else ()), text)

        def row(r: RankedExample) -> tuple[Text, ...]:
            flag = ("flipped" if r.flipped else "",) if marked else ()
            target, text = example_cells(r.text, r.completion, r.label)
            return cells(str(r.rank), f"{r.score:.4e}", str(r.index), target, *flag, text)

        table = self.query_one("#tracin-self", PagedTable)
        table.attach(columns, ranking, loaded.n_ranked, loaded.ranked, row)
        self._show_ranked(table.current)

    def _show_ranked(self, record: RankedExample | None) -> None:
        text = (
            f"train {record.index} · {example_detail(record.text, record.completion, record.label)}" if record else ""
        )
        self.query_one("#tracin-self-detail", Static).update(text)

    def _show_dataset(self, loaded: TracInFiles) -> None:
        tabs = self.query_one("#tracin-tabs", TabbedContent)
        ranking = loaded.results.dataset_ranking
        if ranking is None:  # a run made before the ranking was written
            tabs.hide_tab("tracin-dataset-tab")
            return
        tabs.show_tab("tracin-dataset-tab")
        self.query_one("#tracin-dataset-note", Static).update(
            f"{loaded.n_dataset:,} training examples, highest mean influence over the test set first (max: over any "
            "one test example): keep a top slice for the test set's task; gpuopt-tui select exports the top k or p%."
        )

        def row(r: DatasetRanked) -> tuple[Text, ...]:
            example = example_cells(r.text, r.completion, r.label)
            return cells(str(r.rank), _optional_score(r.mean), _optional_score(r.max), str(r.index), *example)

        columns = ("rank", "mean", "max", "train", *example_columns(is_lm(loaded.dataset)))
        table = self.query_one("#tracin-dataset", PagedTable)
        table.attach(columns, ranking, loaded.n_dataset, loaded.dataset, row)
        self._show_dataset_row(table.current)

    def _show_dataset_row(self, record: DatasetRanked | None) -> None:
        if record is None:
            text = ""
        else:
            example = example_detail(record.text, record.completion, record.label)
            text = f"train {record.index} · {record.n_queries} test examples · {example}"
        self.query_one("#tracin-dataset-detail", Static).update(text)

    @on(DataTable.RowHighlighted, "#tracin-dataset")
    def _dataset_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_dataset_row(self.query_one("#tracin-dataset", PagedTable).record(event.cursor_row))

    @on(DataTable.RowHighlighted, "#tracin-tests")
    def _test_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_test(self.query_one("#tracin-tests", PagedTable).record(event.cursor_row))

    @on(DataTable.RowHighlighted, "#tracin-self")
    def _ranked_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_ranked(self.query_one("#tracin-self", PagedTable).record(event.cursor_row))

    # -- keys -------------------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "copy_path":
            tabs = self.query_one("#tracin-tabs", TabbedContent) if self.views_ready else None
            return tabs is not None and tabs.display and tabs.active == "tracin-files-tab"
        return True

    def action_copy_path(self) -> None:
        self.query_one("#tracin-files", FileTable).copy_highlighted()

    @on(TabbedContent.TabActivated, "#tracin-tabs")
    def _tab_changed(self) -> None:
        self.refresh_bindings()

    def focus_first(self) -> None:
        """Focus the table of the tab shown (after the view is maximized)."""
        if not self.views_ready:
            return
        tabs = self.query_one("#tracin-tabs", TabbedContent)
        if tabs.display and tabs.active_pane is not None:
            tables = tabs.active_pane.query(DataTable)
            if tables:
                tables.first().focus()
