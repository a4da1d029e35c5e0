"""The results of an attribution run, in tabs: samples (a searchable list and the selected sample's token
heatmap with its top tokens), the overall top tokens, convergence deltas, the optimized-vs-original check
and the exported files.

Everything shown comes from the run's result files, read in a thread worker (core.results.attribution); a
sample's tokens are read from disk when it is selected. A run that is still going shows what it has written
(read again when its events report a new result file).
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.content import Content
from textual.widget import Widget
from textual.widgets import Button, DataTable, Input, OptionList, Static, TabbedContent, TabPane
from textual.widgets.option_list import Option
from textual.worker import get_current_worker

from gpuopt_tui.core.format import human_bytes
from gpuopt_tui.core.results.attribution import MAX_LINE_BYTES, RunFiles, load_run_files
from gpuopt_tui.core.results.attribution_query import QUERY_HELP
from gpuopt_tui.core.results.attribution_summary import AttributionSummary, CheckResult, load_check
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.status import RunInfo
from gpuopt_tui.ui.loading import Loaded, reply
from gpuopt_tui.ui.widgets.attribution_text import check_report, delta_report, figure, percent
from gpuopt_tui.ui.widgets.run_results import Preread, RunResults, tabbed, wait_or_read
from gpuopt_tui.ui.widgets.run_text import activity_text
from gpuopt_tui.ui.widgets.sample_browser import SampleBrowser, right
from gpuopt_tui.ui.widgets.token_heatmap import shade

TOP_COLUMNS = ("#", "token", "share", "mean", "mean |a|", "count")
SAMPLES_WHERE = "On the Samples tab, wherever the focus is in the results: "
TOKEN_KEYS_WHERE = "Causal LM run per completion token (its Samples tab, wherever the focus is in its results): "
SAMPLE_ACTIONS = ("search", "cycle_sort", "page", "completion_token")  # bound here, done by the sample browser


class RunFilesRead(Loaded):
    """The files of an attribution run (RunFiles); `key`: its id."""


class CheckRunRead(Loaded):
    """What the run's check run found (a CheckResult, or why there is none); `key`: the check run's id."""


class AttributionRunResults(RunResults):
    """Results of the latest attribution run (see the module docstring)."""

    can_focus = False  # its tables, search field and tabs take the focus
    DEFAULT_CSS = """
    AttributionRunResults {
        overflow-y: hidden;
        #results-text { height: auto; }
        #attribution-tabs { height: 1fr; display: none; }
        #attribution-tabs > ContentSwitcher { height: 1fr; }
        TabPane { height: 1fr; padding: 0; }
        #overall-top { height: auto; }
        #top-note, #files-note { color: $text-muted; }
        #files-note { margin-bottom: 1; }
        #check-run { margin-top: 1; width: auto; }
        #export-files { height: 1fr; }
    }
    AttributionRunResults.-has-results #attribution-tabs { display: block; }
    """
    # The sample browser's keys are the view's, not the browser's: they work wherever the focus is in the view (a
    # results screen opens with its tab bar focused), on the Samples tab that shows what they act on.
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("c", "copy_path", "Copy path", id="attribution.copy", tooltip="Copy the highlighted path"),
        Binding(
            "slash",
            "search",
            "Search",
            id="attribution.search",
            tooltip=f"{SAMPLES_WHERE}search the samples ({QUERY_HELP})",
        ),
        Binding(
            "s",
            "cycle_sort",
            "Sort",
            id="attribution.sort",
            tooltip=f"{SAMPLES_WHERE}sort the samples: dataset order, largest delta, least sure",
        ),
        Binding(
            "left_square_bracket",
            "page(-1)",
            "Prev page",
            key_display="[",
            id="attribution.prev_page",
            tooltip=f"{SAMPLES_WHERE}previous page of the sample list",
        ),
        Binding(
            "right_square_bracket",
            "page(1)",
            "Next page",
            key_display="]",
            id="attribution.next_page",
            tooltip=f"{SAMPLES_WHERE}next page of the sample list",
        ),
        Binding(
            "comma",
            "completion_token(-1)",
            "Prev token",
            key_display=",",
            id="attribution.prev_token",
            tooltip=f"{TOKEN_KEYS_WHERE}explain the previous completion token (first: the whole completion)",
        ),
        Binding(
            "full_stop",
            "completion_token(1)",
            "Next token",
            key_display=".",
            id="attribution.next_token",
            tooltip=f"{TOKEN_KEYS_WHERE}explain the next completion token",
        ),
    ]

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._info: RunInfo | None = None
        self._files: RunFiles | None = None
        self._loading = False  # result files of the shown run are being read
        self._read_artifacts: int | None = None  # the run's artifact count when its files were last read
        self._check_run: RunInfo | None = None  # a check run started beside the run shown (see show_check_run)
        self._check_run_result: CheckResult | str | None = None  # its check.json, or why it cannot be read

    @classmethod
    def read_finished(cls, info: RunInfo) -> RunFiles | None:
        return load_run_files(info.dir)

    @classmethod
    def views_for(cls, value: Any) -> bool:
        return isinstance(value, RunFiles) and value.has_results

    def compose(self) -> ComposeResult:
        if self.views_composed:  # likely results (a screen made ahead is made for runs that have them)
            self.add_class("-has-results")  # before mounting: adding it later restyles every widget inside
        yield from super().compose()

    def compose_views(self) -> list[Widget]:
        table = DataTable[Text](id="overall-top", cursor_type="none", show_cursor=False)
        table.add_columns(*TOP_COLUMNS)
        table.can_focus = False  # read-only, shown whole: the pane around it scrolls
        return [
            tabbed(
                TabPane("Samples", SampleBrowser(id="samples"), id="tab-samples"),
                TabPane("Top tokens", VerticalScroll(Static("", id="top-note", markup=False), table), id="tab-top"),
                TabPane("Deltas", VerticalScroll(Static("", id="delta-text", markup=False)), id="tab-deltas"),
                TabPane(
                    "Check",
                    VerticalScroll(
                        Static("", id="check-text", markup=False), Button("Run a check", id="check-run", compact=True)
                    ),
                    id="tab-check",
                ),
                TabPane(
                    "Files",
                    Static("", id="files-note", markup=False),
                    OptionList(id="export-files", compact=True),
                    id="tab-files",
                ),
                id="attribution-tabs",
            )
        ]

    # -- which run, and reading its files -----------------------------------------------------------------------

    def run_changed(self, info: RunInfo | None) -> None:
        if info is None or self._info is None or info.id != self._info.id:
            self._files, self._read_artifacts, self._loading = None, None, False
            if self._info is not None:  # another run's results were shown (the first run's may come composed)
                self.set_class(False, "-has-results")
        self._info = info
        # read the files when the run reports a new one, and once when it ends (not when only its status moves on)
        artifacts = info.artifacts if info is not None else 0
        reload = info is not None and (
            artifacts > (self._read_artifacts or 0) or (self._read_artifacts is None and not info.active)
        )
        self._loading = self._loading or reload
        super().run_changed(info)  # the header, and the log of a failed run
        if info is not None and reload:
            self._read_artifacts = artifacts
            if (preread := self.take_preread(info, RunFilesRead, info.id)) is not None:
                self._files_read(preread)
            else:
                self._load(info.id, info.dir, self.take_pending())
        elif self._files is not None:
            self._show_check(self._files.check)  # what it says depends on whether the run goes on

    @work(thread=True, exclusive=True, group="attribution-results", exit_on_error=False)
    def _load(self, run_id: str, run_dir: Path, pending: Future[Preread | None] | None = None) -> None:
        """Read the run's files, or wait for the read of them still going when the view was shown (`pending`): a
        large run's samples take a while to index, and a second read beside it would only slow both down."""
        worker = get_current_worker()

        def cancelled() -> bool:
            return worker.is_cancelled

        read = partial(load_run_files, run_dir, cancelled)
        reply(self, RunFilesRead, run_id, lambda: wait_or_read(pending, read, cancelled))

    def describe(self, info: RunInfo | None) -> Content:
        if info is None:
            return Content("")
        files = self._files if self._files is not None and self._files.run_dir == info.dir else None
        if files is not None and files.has_results:
            return self._overview(info, files)
        if info.status in ("failed", "crashed"):
            return super().describe(info)
        if self._loading:
            return Content("Reading the results…")
        if info.active:
            return Content("The sample list, heatmaps and tables appear here once the run has written its results.")
        if info.status == "cancelled":
            done, total = info.progress.get("done", 0), info.progress.get("total", "?")
            return Content(
                f"Cancelled after {done} of {total} samples. The finished batches are kept: "
                f"`gpuopt-tui resume {info.id}` goes on from them and writes the results."
            )
        return Content(f"This run wrote no attribution results in {info.dir / 'results'}.")

    def _overview(self, info: RunInfo, files: RunFiles) -> Content:
        summary, samples = files.summary, files.samples
        parts: list[Content] = []
        if summary is not None:
            line = f"{summary.n_samples} samples · {summary.data} · {summary.model}"
            parts.append(Content.from_markup("[b]$line[/]", line=line))
        if info.active:
            parts.append(Content.from_markup("[$text-muted]still running: results so far[/]"))
        if samples is not None and samples.corrupt:
            message = f"{samples.corrupt} unreadable line(s) of {samples.path.name} were skipped"
            parts.append(Content.from_markup("[$warning]$message[/]", message=message))
        if samples is not None and samples.too_long:
            message = (
                f"{samples.too_long} sample(s) of {samples.path.name} over {human_bytes(MAX_LINE_BYTES)} a line were "
                "left out: see the file itself"
            )
            parts.append(Content.from_markup("[$warning]$message[/]", message=message))
        parts.extend(Content.from_markup("[$error]$error[/]", error=error) for error in files.errors)
        return Content("\n").join(parts)

    @on(RunFilesRead)
    def _files_read(self, message: RunFilesRead) -> None:
        if message.value is not None:
            self._loaded(message.key, message.value)

    def _loaded(self, run_id: str, files: RunFiles) -> None:
        if self._info is None or run_id != self._info.id:
            return  # read for a run that is no longer shown (or a read cut short for a newer one)
        same_run = self._files is not None
        self._files = files
        self._loading = False
        self.query_one("#results-text", Static).update(self.describe(self._info))
        self.set_class(files.has_results, "-has-results")
        if files.has_results or self.views_ready:
            self.with_views(lambda: self._show_files_read(files, same_run))
        self.refresh_bindings()

    def _show_files_read(self, files: RunFiles, same_run: bool) -> None:
        if files is not self._files:
            return  # a newer read came meanwhile: it is drawn by its own call
        self.query_one(SampleBrowser).show_index(files.samples, same_run)
        self._show_top(files.summary)
        self._show_deltas(files.summary)
        self._show_check(files.check)
        self._show_files(files)
        self.refresh_bindings()

    def show_check_run(self, info: RunInfo | None) -> None:
        """Show the check run started from the kind screen in the Check tab, beside (not instead of) the run
        shown; its check.json is read once it finished."""
        before = self._check_run
        if before is not None and info is not None and (before.id, before.status) == (info.id, info.status):
            self._check_run = info  # only its progress moved on
        else:
            self._check_run, self._check_run_result = info, None
            if info is not None and info.status == "finished":
                self._read_check(info.id, RunDir(info.dir).results)
        self._show_check(self._files.check if self._files is not None else None)

    @work(thread=True, exclusive=True, group="check-run", exit_on_error=False)
    def _read_check(self, run_id: str, results_dir: Path) -> None:
        def read() -> CheckResult | str:
            check = load_check(results_dir)
            return f"the check run wrote no {results_dir / 'check.json'}" if check is None else check

        reply(self, CheckRunRead, run_id, read)

    @on(CheckRunRead)
    def _check_read(self, message: CheckRunRead) -> None:
        if self._check_run is not None and message.key == self._check_run.id:
            self._check_run_result = message.reason or message.value
            self._show_check(self._files.check if self._files is not None else None)

    def _check_run_report(self, run: RunInfo) -> Content:
        lead = Content.from_markup(
            "[b]Check run $id[/] ($name): $status $progress",
            id=run.id,
            name=run.name,
            status=run.status,
            progress=activity_text(run),  # the check's stage and rate while it goes on
        )
        result = self._check_run_result
        if run.active:
            body = Content("Its figures appear here when it finishes; the run above stays in view.")
        elif run.status != "finished":
            body = Content.styled(run.message or f"it is {run.status}", "$error")
        elif isinstance(result, CheckResult):
            body = check_report(result)
        elif isinstance(result, str):
            body = Content.styled(result, "$error")
        else:
            body = Content("Reading its check.json…")
        return Content("\n").join([lead, body])

    # -- the other tabs -----------------------------------------------------------------------------------------

    def _show_top(self, summary: AttributionSummary | None) -> None:
        table = self.query_one("#overall-top", DataTable)
        table.clear()
        note = self.query_one("#top-note", Static)
        if summary is None:
            note.update("summary.json is not written yet.")
            return
        least = summary.settings.get("min_token_count")
        fewer = f"; tokens seen fewer than {least} times are left out" if least else ""
        note.update(f"Top {len(summary.top_k)} tokens over {summary.n_samples} samples, by {summary.ranking}{fewer}.")
        largest = max((t.mean_share for t in summary.top_k), default=0.0)
        for rank, t in enumerate(summary.top_k, 1):
            table.add_row(
                right(str(rank)),
                Text(t.token, style=shade(math.copysign(t.mean_share, t.mean), largest) or ""),
                right(percent(t.mean_share)),
                right(f"{t.mean:+.3g}"),
                right(figure(t.mean_abs)),
                right(str(t.count)),
            )

    def _show_deltas(self, summary: AttributionSummary | None) -> None:
        self.query_one("#delta-text", Static).update(delta_report(summary))

    def _show_check(self, check: CheckResult | None) -> None:
        if not self.views_ready:
            return  # drawn with the rest of the views when they are mounted
        info, files = self._info, self._files
        text = self.query_one("#check-text", Static)
        button = self.query_one("#check-run", Button)
        button.label = "Run the check again" if check else "Run a check"
        check_run = self._check_run
        button.display = not self.in_browser and not (info is not None and info.active)
        if check_run is not None:
            button.display = button.display and not check_run.active
            text.update(self._check_run_report(check_run))
        elif check is not None:
            text.update(check_report(check))
        elif info is not None and info.active and files is not None and files.check_samples:
            text.update(
                f"This run compares the two paths on its first {files.check_samples} samples after the "
                "attribution; the figures appear here when that is done."
            )
        else:
            how = "The Attribution screen's ctrl+t" if self.in_browser else "ctrl+t (or the button)"
            text.update(
                f"This run has no check of the optimized path against the original. {how} runs the profile in the "
                "form on a few samples with check_samples set: both paths attribute them and the relative "
                "difference of their token scores shows " + ("there." if self.in_browser else "here.")
            )

    def _show_files(self, files: RunFiles) -> None:
        note = self.query_one("#files-note", Static)
        note.update(f"Run directory {files.run_dir}\nenter or c copies the highlighted path.")
        options = self.query_one("#export-files", OptionList)
        highlighted = options.highlighted
        options.clear_options()
        options.add_option(Option(Content.from_markup("[b]run directory[/]"), id=str(files.run_dir)))
        for f in files.exports:
            prompt = Content.from_markup(
                "[b]$name[/]  $size\n[$text-muted]$description[/]",
                name=f.name,
                size=human_bytes(f.size),
                description=f.description,
            )
            options.add_option(Option(prompt, id=str(f.path)))
        options.highlighted = highlighted if highlighted is not None and highlighted < options.option_count else 0

    # -- actions ------------------------------------------------------------------------------------------------

    @property
    def has_results(self) -> bool:
        return self.has_class("-has-results")

    def focus_first(self) -> None:
        """Focus the sample table, or the tabs when another tab is shown."""
        if not self.views_ready:
            return
        if self.active_tab == "tab-samples":
            self.query_one(SampleBrowser).focus_table()
        else:
            self.query_one("#attribution-tabs Tabs").focus()

    @property
    def active_tab(self) -> str:
        """The tab shown ("" before the tabs are mounted)."""
        return self.query_one("#attribution-tabs", TabbedContent).active if self.views_ready else ""

    def show_tab(self, tab: str) -> None:
        if self.views_ready:  # else there are no results to show a tab of
            self.query_one("#attribution-tabs", TabbedContent).active = tab

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "copy_path":
            return self.has_results and self.active_tab == "tab-files"
        if action in SAMPLE_ACTIONS:
            if not self.has_results or self.active_tab != "tab-samples" or isinstance(self.screen.focused, Input):
                return False  # they would act on nothing shown, or the search field types them
            browser = self.query_one(SampleBrowser)
            if action == "page":
                return browser.has_pages
            if action == "completion_token":
                return browser.has_completion_tokens
        return True

    def action_search(self) -> None:
        self.query_one(SampleBrowser).focus_search()

    def action_cycle_sort(self) -> None:
        self.query_one(SampleBrowser).cycle_sort()

    def action_page(self, step: int) -> None:
        self.query_one(SampleBrowser).step_page(step)

    def action_completion_token(self, step: int) -> None:
        self.query_one(SampleBrowser).step_completion_token(step)

    def action_copy_path(self) -> None:
        options = self.query_one("#export-files", OptionList)
        if options.highlighted is not None:
            self._copy(options.get_option_at_index(options.highlighted).id)

    @on(OptionList.OptionSelected, "#export-files")
    def _selected_file(self, event: OptionList.OptionSelected) -> None:
        self._copy(event.option.id)

    def _copy(self, path: str | None) -> None:
        if path:
            self.app.copy_to_clipboard(path)
            self.app.notify(path, title="Path copied to the clipboard", markup=False)

    @on(TabbedContent.TabActivated)
    def _tab_changed(self) -> None:
        self.refresh_bindings()
