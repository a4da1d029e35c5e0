"""The samples of an attribution run: a searchable, sortable list a page at a time, and the selected sample's
token heatmap and top tokens, read from its line of attributions.jsonl when it is selected.

A causal LM sample of a per_target_token run also holds each completion token's row of its [completion, prompt]
matrix: `step_completion_token` chooses what the heatmap, the top tokens and the delta explain, the whole completion
(the first choice) or one of its tokens, from the sample already read. The choice stays while other samples are
opened (cut to their number of tokens).

The keys (`/` search, `s` sort, `[` and `]` pages, `,` and `.` completion tokens) are bound by the results view around
the browser, not here: they work wherever the focus is in the view (a results screen opens with its tab bar
focused)."""

from __future__ import annotations

from collections import OrderedDict

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.timer import Timer
from textual.widgets import DataTable, Input, Static

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.results.attribution import Sample, SampleEntry, SampleIndex, page, page_count
from gpuopt_tui.core.results.attribution_query import QUERY_HELP, SORTS, SampleQuery, select
from gpuopt_tui.ui.widgets.attribution_text import sample_heading
from gpuopt_tui.ui.widgets.token_heatmap import heatmap, legend, shade

PAGE_SIZE = 100  # rows in the sample table at a time: each row added costs about 0.3 ms of CPU as the view opens
CACHED_SAMPLES = 64  # samples kept parsed, so moving the cursor back and forth reads nothing again
SEARCH_DELAY_S = 0.25  # the search runs once the typing pauses this long
SEARCH_PLACEHOLDER = "/ search: words top:TOKEN pred:N label:N wrong"
# a causal LM's samples have no classes: its search offers what applies to them
COMPLETION_SEARCH_PLACEHOLDER = "/ search: words top:TOKEN abovetol fullprecision"
SAMPLE_COLUMNS = ("#", "pred", "tgt", "label", "p", "rel Δ", "top token")
COMPLETION_COLUMNS = ("#", "log p", "rel Δ", "top token", "completion")  # a causal LM's samples
TOP_COLUMNS = ("#", "token", "at", "score")


def right(text: str, style: str = "") -> Text:
    return Text(text, style=style, justify="right")


class SampleBrowser(Vertical):
    """`show_index(index)` lists its samples; the search, the order and the selected sample are kept when the
    same run's file is shown again."""

    DEFAULT_CSS = """
    SampleBrowser {
        #sample-status { height: 1; text-wrap: nowrap; text-overflow: ellipsis; color: $text-muted; }
        #sample-table { height: 45%; min-height: 3; }
        #sample-detail { height: 1fr; }
        #sample-heading { text-style: bold; }
        #heatmap { margin: 1 0; }
        #sample-top { height: auto; }
        #heatmap-legend { color: $text-muted; }
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._index: SampleIndex | None = None
        self._query = SampleQuery()
        self._sort = "index"
        self._rows: list[SampleEntry] = []  # samples that match the search, in the chosen order
        self._page = 0
        self._page_rows: list[SampleEntry] = []
        self._cache: OrderedDict[int, Sample] = OrderedDict()  # by line offset
        self._selected: int | None = None  # index of the sample shown in the heatmap
        self._sample: Sample | None = None  # that sample, read
        self._token: int | None = None  # the completion token it is explained for (None: the whole completion)
        self._search_timer: Timer | None = None
        self._columns: tuple[str, ...] = ()  # the sample table's columns (set when mounted)

    def compose(self) -> ComposeResult:
        yield Input(
            placeholder=SEARCH_PLACEHOLDER,
            id="sample-search",
            compact=True,
            tooltip=f"Search the samples: {QUERY_HELP}",
        )
        yield Static("", id="sample-status", markup=False)
        yield DataTable(id="sample-table", cursor_type="row", zebra_stripes=True)
        with VerticalScroll(id="sample-detail"):
            yield Static("", id="sample-heading", markup=False)
            yield Static("", id="heatmap", markup=False)
            yield Static("", id="heatmap-legend", markup=False)
            yield DataTable(id="sample-top", cursor_type="none", show_cursor=False)

    def on_mount(self) -> None:
        self.query_one("#sample-table", DataTable).add_columns(*SAMPLE_COLUMNS)
        self._columns = SAMPLE_COLUMNS
        top = self.query_one("#sample-top", DataTable)
        top.add_columns(*TOP_COLUMNS)
        top.can_focus = False  # read-only, shown whole: the pane around it scrolls

    def show_index(self, index: SampleIndex | None, same_run: bool) -> None:
        """List the samples of `index` (None: attributions.jsonl is not there yet)."""
        self._index = index
        self._cache.clear()
        if not same_run:
            self._selected, self._page, self._token = None, 0, None
        self._show_rows()

    def focus_table(self) -> None:
        self.query_one("#sample-table", DataTable).focus()

    # -- the list -----------------------------------------------------------------------------------------------

    def _show_rows(self) -> None:
        self._rows = select(self._index.entries, self._query, self._sort) if self._index else []
        self._page = min(self._page, page_count(self._rows, PAGE_SIZE) - 1)
        self._fill_table()

    def _fill_table(self) -> None:
        table = self.query_one("#sample-table", DataTable)
        entries = self._index.entries if self._index is not None else ()
        completions = bool(entries) and entries[0].completion is not None  # a causal LM's run
        columns = COMPLETION_COLUMNS if completions else SAMPLE_COLUMNS
        table.clear(columns=columns != self._columns)
        if columns != self._columns:
            table.add_columns(*columns)
            self._columns = columns
            search = self.query_one("#sample-search", Input)
            search.placeholder = COMPLETION_SEARCH_PLACEHOLDER if completions else SEARCH_PLACEHOLDER
        self._page_rows = list(page(self._rows, self._page, PAGE_SIZE))
        if completions:
            table.add_rows(self._completion_cells(e) for e in self._page_rows)
        else:
            error = self.app.get_css_variables().get("error", "red")
            table.add_rows(self._cells(e, error) for e in self._page_rows)
        self._update_status()
        keep = next((i for i, e in enumerate(self._page_rows) if e.index == self._selected), 0)
        if self._page_rows:
            table.move_cursor(row=keep)
            self._open(self._page_rows[keep])
        else:
            self._open(None)
        self.screen.refresh_bindings()

    @staticmethod
    def _cells(e: SampleEntry, error: str) -> tuple[Text, ...]:
        return (
            right(str(e.index)),
            right(str(e.prediction), f"bold {error}" if e.wrong else ""),  # the label says otherwise
            right(str(e.target)),
            right("" if e.label is None else str(e.label)),
            right(f"{e.probability:.2f}"),
            right(f"{e.relative_delta:.2g}"),
            Text(e.top_token),
        )

    @staticmethod
    def _completion_cells(e: SampleEntry) -> tuple[Text, ...]:
        return (
            right(str(e.index)),
            right("" if e.logprob is None else f"{e.logprob:.3g}"),
            right(f"{e.relative_delta:.2g}"),
            Text(e.top_token),
            Text(e.completion or ""),
        )

    def _update_status(self, error: str = "") -> None:
        status = self.query_one("#sample-status", Static)
        if error:
            status.update(Content.from_markup("[$error]$error[/]", error=error))
            return
        if self._index is None:
            status.update("attributions.jsonl is not written yet")
            return
        parts = [f"{len(self._rows)} of {len(self._index)} samples", SORTS[self._sort][0]]
        pages = page_count(self._rows, PAGE_SIZE)
        if pages > 1:
            parts.append(f"page {self._page + 1}/{pages}")
        status.update(" · ".join(parts))

    @on(Input.Changed, "#sample-search")
    def _typed(self) -> None:
        # searching 40k samples takes a tenth of a second: wait for a pause in the typing
        if self._search_timer is not None:
            self._search_timer.stop()
        self._search_timer = self.set_timer(SEARCH_DELAY_S, self._search, name="attribution search")

    def _search(self) -> None:
        self._search_timer = None
        try:
            self._query = SampleQuery.parse(self.query_one("#sample-search", Input).value)
        except UserError as e:
            self._update_status(str(e))
            return
        self._page = 0
        self._show_rows()

    @on(Input.Submitted, "#sample-search")
    def _search_done(self) -> None:
        if self._search_timer is not None:
            self._search_timer.stop()
            self._search()
        self.focus_table()

    # -- the selected sample ------------------------------------------------------------------------------------

    @on(DataTable.RowHighlighted, "#sample-table")
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        if 0 <= event.cursor_row < len(self._page_rows):
            self._open(self._page_rows[event.cursor_row])

    def _read(self, index: SampleIndex, entry: SampleEntry) -> Sample:
        sample = self._cache.get(entry.offset)
        if sample is None:
            sample = index.read(entry)
            self._cache[entry.offset] = sample
            while len(self._cache) > CACHED_SAMPLES:
                self._cache.popitem(last=False)
        self._cache.move_to_end(entry.offset)
        return sample

    def _open(self, entry: SampleEntry | None) -> None:
        """Show one sample's heatmap and top tokens."""
        had_tokens = self.has_completion_tokens
        self._sample = None
        self._selected = entry.index if entry else None
        if entry is not None and self._index is not None:
            try:
                self._sample = self._read(self._index, entry)
            except UserError as e:
                self._show_sample(Content.from_markup("[$error]$error[/]", error=str(e)))
            else:
                self._show_sample()
        else:
            self._show_sample(Content("no sample matches the search" if self._index else ""))
        if self.has_completion_tokens != had_tokens:
            self.screen.refresh_bindings()

    @property
    def has_completion_tokens(self) -> bool:
        """Whether the open sample has per-token rows to choose from (a causal LM run per completion token)."""
        return self._sample is not None and bool(self._sample.completion_tokens)

    def _show_sample(self, why: Content | None = None) -> None:
        """The open sample as its chosen completion token explains it, or `why` there is none to show."""
        heading = self.query_one("#sample-heading", Static)
        top = self.query_one("#sample-top", DataTable)
        top.clear()
        for selector in ("#heatmap", "#heatmap-legend"):
            self.query_one(selector, Static).update("")
        whole = self._sample
        if whole is None:
            heading.update(why or "")
            return
        count = len(whole.completion_tokens)
        self._token = None if self._token is None or not count else min(self._token, count - 1)
        sample = whole.explaining(self._token)
        heading.update(sample_heading(whole, self._token))
        self.query_one("#heatmap", Static).update(heatmap(sample))
        self.query_one("#heatmap-legend", Static).update(legend(sample.max_abs))
        max_abs = sample.max_abs
        for rank, item in enumerate(sample.top, 1):
            where = ":".join(str(p) for p in item.position)
            style = shade(item.score, max_abs) or ""
            top.add_row(right(str(rank)), Text(item.token, style=style), right(where), right(f"{item.score:+.4g}"))

    # -- what the keys do (the results view around binds them: they work wherever its focus is) ----------------

    @property
    def has_pages(self) -> bool:
        """Whether the samples that match the search take more than one page."""
        return page_count(self._rows, PAGE_SIZE) > 1

    def step_completion_token(self, step: int) -> None:
        """Explain the next (`step` 1) or previous (-1) choice of [whole completion, token 1, token 2, ...]."""
        if self._sample is None or not self._sample.completion_tokens:
            return
        choice = 0 if self._token is None else self._token + 1  # 0: the whole completion
        choice = max(0, min(len(self._sample.completion_tokens), choice + step))
        self._token = None if choice == 0 else choice - 1
        self._show_sample()

    def focus_search(self) -> None:
        self.query_one("#sample-search", Input).focus()

    def cycle_sort(self) -> None:
        order = list(SORTS)
        self._sort = order[(order.index(self._sort) + 1) % len(order)]
        self._page = 0
        self._show_rows()

    def step_page(self, step: int) -> None:
        self._page = max(0, min(page_count(self._rows, PAGE_SIZE) - 1, self._page + step))
        self._selected = None
        self._fill_table()
