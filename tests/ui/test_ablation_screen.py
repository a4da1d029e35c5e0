"""The ablation screen's results on a frozen probing run (tests/fixtures/runs/ablation: the engine on a small
synthetic set, and the feature cache it filled): the table equals results.json, the plot has a series per
representation, the feature cache is cleared only after confirmation, and a running run's probes show up as
its events arrive (and are not read while the screen is hidden)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.command import CommandPalette
from textual.pilot import Pilot

from gpuopt_tui.app import make_app
from gpuopt_tui.core.atomic import atomic_write_text
from gpuopt_tui.core.caches.features import FeatureCache, group_entries
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.results.ablation import ReportedProbe, ReportedProbes, best_of, sort_rows
from gpuopt_tui.core.runs import lifecycle as runs
from gpuopt_tui.core.runs.events import TERMINAL_TYPES, EventWriter
from gpuopt_tui.ui.widgets.ablation_view import (
    BRAILLE_BLANK,
    DOT_BITS,
    SERIES_STYLES,
    AccuracyPlot,
    BrailleCanvas,
    CachePanel,
    ProbeTable,
    layer_span,
    x_labels,
    y_range,
    y_ticks,
)
from gpuopt_tui.ui.widgets.confirm import ConfirmDialog
from gpuopt_tui.ui.widgets.probing_results import ProbingResults

from .conftest import (
    FROZEN_RUNS,
    frozen_run,
    frozen_source,
    palette_highlight,
    screen_text,
    settle,
    wait_for,
    widget_text,
)

FROZEN = frozen_source("ablation")
PROFILE = load_profile(FROZEN / "profile.toml")
REPRESENTATIONS = list(PROFILE.ablation.representations)  # type: ignore[attr-defined]
LAYERS = PROFILE.ablation.synthetic_layers  # type: ignore[attr-defined]
SPLIT_CELLS = {"test acc": "test", "val acc": "val", "train acc": "train"}


@pytest.fixture
def probing_run(runs_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The frozen run and the feature cache it filled, copied into this test's runs and cache folders."""
    shutil.copytree(FROZEN_RUNS / "ablation" / "cache", tmp_path / "cache")
    monkeypatch.setenv("GPUOPT_TUI_CACHE_DIR", str(tmp_path / "cache"))
    return frozen_run("ablation", runs_root)


def raw_rows(run_dir: Path) -> list[dict[str, Any]]:
    return json.loads((run_dir / "results" / "results.json").read_text())["rows"]


def table_cells(table: ProbeTable) -> list[dict[str, str]]:
    header = [str(column.key.value) for column in table.ordered_columns]
    return [dict(zip(header, (c.plain for c in table.get_row_at(i)))) for i in range(table.row_count)]


def mean_std(row: dict[str, Any], split: str) -> str:
    return f"{row[f'{split}_acc_mean']:.3f} ± {row[f'{split}_acc_std']:.3f}"


def best_layers(rows: list[dict[str, Any]], split: str) -> dict[str, str]:
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        held = best.get(row["representation"])
        if held is None or row[f"{split}_acc_mean"] > held[f"{split}_acc_mean"]:
            best[row["representation"]] = row
    return {name: row["layer"] for name, row in best.items()}


async def open_results(pilot: Pilot[Any], rows: int) -> ProbingResults:
    results = pilot.app.screen.query_one(ProbingResults)
    await wait_for(pilot, lambda: results.query_one(ProbeTable).row_count == rows)
    return results


async def test_the_table_equals_results_json_marks_the_best_layers_and_sorts(probing_run: Path) -> None:
    rows = raw_rows(probing_run)
    app = make_app(screen="ablation")
    async with app.run_test(size=(120, 40)) as pilot:
        results = await open_results(pilot, len(rows))
        table = results.query_one(ProbeTable)
        shown = table_cells(table)
        assert len(shown) == len(rows) == 3 * LAYERS + 1
        starred = {}
        groups: dict[float, int] = {}  # probes trained in one batch share their time: shown on the first only
        for row in rows:
            groups[row["probe_time_s"]] = groups.get(row["probe_time_s"], 0) + 1
        for cells, row in zip(shown, rows):  # results.json order: representation, then layer
            layer = cells["layer"].removesuffix(" ★")
            assert (cells["representation"], layer) == (row["representation"], row["layer"])
            for column, split in SPLIT_CELLS.items():
                assert cells[column] == mean_std(row, split)
            assert cells["dim"] == str(row["feature_dim"])
            assert cells["features"] == f"{row['feature_time_s']:.2f}s"
            group, size = row["probe_time_s"], groups.pop(row["probe_time_s"], None)
            assert cells["probes"] == ("" if size is None else f"{group:.2f}s" + (f" ×{size}" if size > 1 else ""))
            assert cells["cached"] == ("yes" if row["cached"] else "")
            if cells["layer"].endswith(" ★"):
                starred[row["representation"]] = layer
        assert starred == best_layers(rows, "val")  # selected on validation, whatever split is shown
        head = widget_text(app, "#ablation-head")
        assert head == "19 probes × 3 seeds · 400 samples, 2 classes · chance 0.500 · cpu fp32 · cache 0/18 hits"

        await pilot.press("ctrl+o", "s")  # zoomed in, the view tabs focused; the val split
        await wait_for(pilot, lambda: results.split == "val")
        starred = {c["representation"]: c["layer"][:-2] for c in table_cells(table) if c["layer"].endswith(" ★")}
        assert starred == best_layers(rows, "val")

        await pilot.press("o")  # sort by the next column: test accuracy, best first
        tests = [float(c["test acc"].split(" ± ")[0]) for c in table_cells(table)]
        assert tests == sorted((round(r["test_acc_mean"], 3) for r in rows), reverse=True)
        assert table.columns["test acc"].label.plain == "test acc ▼"

        await pilot.pause()
        layer_header = (table.region.x + table.ordered_columns[0].get_render_width(table) + 1, table.region.y)
        await pilot.click(offset=layer_header)
        assert table.sort_column == "layer" and not table.descending
        order = [(c["layer"].removesuffix(" ★"), c["representation"]) for c in table_cells(table)]
        per_layer = [(f"layer.{i}", name) for i in range(LAYERS) for name in REPRESENTATIONS[:3]]
        assert order == [*per_layer, ("all", "spectrum_stats_all_layers")]
        await pilot.click(offset=layer_header)  # again: the other way
        assert table.descending
        assert [(c["layer"].removesuffix(" ★"), c["representation"]) for c in table_cells(table)] == order[::-1]


@pytest.mark.parametrize("width", [100, 120, 160])
async def test_no_accuracy_is_ever_cut_in_the_split_layout(probing_run: Path, width: int) -> None:
    """Beside the form, the table shows the charted split's accuracy whole (names give way, with an ellipsis);
    a column the table's edge cuts is blank with an ellipsis, and scrolling sideways never shows part of one."""
    rows = raw_rows(probing_run)
    app = make_app(screen="ablation")
    async with app.run_test(size=(width, 40)) as pilot:
        results = await open_results(pilot, len(rows))
        await settle(pilot)
        table = results.query_one(ProbeTable)
        expected = {mean_std(row, "test") for row in rows}

        def shown() -> list[str]:
            return re.findall(r"\d\.\d+ ± [\d.]*(?=\s|…|▏|$)", screen_text(app))

        # every test accuracy shown, whole, once the table has its width (a busy machine may draw it a frame later)
        await wait_for(pilot, lambda: expected <= set(shown()))
        for scroll in range(0, 60, 7):
            table.scroll_to(x=scroll, animate=False)
            await settle(pilot)
            cut = shown()
            assert all(value in expected or re.fullmatch(r"\d\.\d{3} ± \d\.\d{3}", value) for value in cut), cut


async def test_the_plot_has_one_series_per_representation(probing_run: Path) -> None:
    rows = raw_rows(probing_run)
    app = make_app(screen="ablation")
    async with app.run_test(size=(120, 40)) as pilot:
        results = await open_results(pilot, len(rows))
        await pilot.press("ctrl+o", "v")
        plot = results.query_one(AccuracyPlot)
        await wait_for(pilot, lambda: plot.display and plot.size.height > 20)
        data = plot.data
        assert data is not None and data.split == "test" and data.chance == pytest.approx(0.5, abs=0.05)
        per_layer = [r for r in rows if r["layer_index"] is not None]
        assert list(data.series) == REPRESENTATIONS[:3]
        for name, points in data.series.items():
            expected = [
                (r["layer_index"], r["test_acc_mean"], r["test_acc_std"])
                for r in per_layer
                if r["representation"] == name
            ]
            assert points == expected
        whole = [r for r in rows if r["layer_index"] is None]
        assert data.whole == {whole[0]["representation"]: (whole[0]["test_acc_mean"], whole[0]["test_acc_std"])}

        drawn = plot.draw(plot.size.width, plot.size.height)
        canvas = [line for line in drawn.split() if line.plain[5:6] in ("┤", "│")]  # the rows right of the y axis
        assert len(canvas) > 20
        for i, name in enumerate(data.series):
            color, marker = SERIES_STYLES[i]
            assert any(str(span.style) == color for line in canvas for span in line.spans), name  # its own colour
            assert any(marker in line.plain for line in canvas), name  # its marker on its points
            assert f"{marker} {name}" in drawn.plain  # named in the legend
        _, last_marker = SERIES_STYLES[len(data.series) - 1]
        assert sum(line.plain.count(last_marker) for line in canvas) == LAYERS  # drawn last: no point hidden
        assert "chance 0.500" in drawn.plain and "spectrum_stats_all_layers (all layers)" in drawn.plain

        await pilot.press("s")
        await wait_for(pilot, lambda: plot.data is not None and plot.data.split == "val")
        assert plot.data.series["svd_topk"][0][1] == per_layer[0]["val_acc_mean"]


async def test_clearing_the_cache_empties_it_after_confirmation_and_not_before(probing_run: Path) -> None:
    cache = FeatureCache()
    assert len(cache.entries()) == 3 * LAYERS
    app = make_app(screen="ablation")
    async with app.run_test(size=(120, 40)) as pilot:
        results = await open_results(pilot, len(raw_rows(probing_run)))
        await pilot.press("ctrl+p")  # the command palette asks first, too
        await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette))
        await pilot.press(*"clear the feature")
        await wait_for(pilot, lambda: palette_highlight(app) == "Clear the feature cache")
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        assert len(cache.entries()) == 3 * LAYERS
        await pilot.press("n")
        await wait_for(pilot, lambda: not isinstance(app.screen, ConfirmDialog))
        await settle(pilot)
        assert len(cache.entries()) == 3 * LAYERS and cache.size_bytes() > 0

        panel = results.query_one(CachePanel)  # the palette opened the cache view
        assert results.view == "cache" and panel.listing is not None and panel.listing.entries == 3 * LAYERS
        await pilot.press("ctrl+o")
        await settle(pilot)
        text = screen_text(app)
        assert f"{3 * LAYERS} entries" in text
        for name in REPRESENTATIONS[:3]:
            assert name in text
        assert text.count(f"layer.0 … layer.{LAYERS - 1} ({LAYERS})") == 3

        await pilot.press("c")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        assert len(cache.entries()) == 3 * LAYERS  # asked, not done
        await pilot.press("y")
        await wait_for(pilot, lambda: panel.listing is not None and panel.listing.entries == 0)
        assert cache.entries() == [] and cache.size_bytes() == 0
        assert "The feature cache is empty" in screen_text(app)


@pytest.fixture
def running_run(runs_root: Path) -> Iterator[Path]:
    """An ablation run directory whose recorded process is alive (a `sleep` stands in for the engine, so that
    the test decides when events arrive)."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    run_dir = runs.create_run(load_profile(FROZEN / "profile.toml"), root=runs_root)
    atomic_write_text(run_dir / "pid.json", json.dumps({"pid": proc.pid, "attempt": 1}))
    writer = EventWriter(run_dir / "events.jsonl")
    writer.emit("started", pid=proc.pid, attempt=1, kind="ablation")
    writer.close()
    yield run_dir
    proc.send_signal(signal.SIGKILL)
    proc.wait()


async def test_probes_show_up_as_a_running_runs_events_arrive(running_run: Path) -> None:
    """The frozen run's events, replayed into a running run's events file a part at a time."""
    lines = (FROZEN / "events.jsonl").read_text().splitlines()
    replay = [line for line in lines if json.loads(line)["type"] not in ("started", *TERMINAL_TYPES)]
    probe_at = [i for i, line in enumerate(replay) if '"probe_test_acc"' in line]
    assert len(probe_at) == 3 * LAYERS + 1

    written = 0

    def append(upto: int) -> None:
        nonlocal written
        with (running_run / "events.jsonl").open("a") as f:
            f.writelines(line + "\n" for line in replay[written:upto])
        written = upto

    app = make_app(screen="ablation")
    async with app.run_test(size=(120, 40)) as pilot:
        results = pilot.app.screen.query_one(ProbingResults)
        await wait_for(pilot, lambda: results.info is not None and results.info.active)
        assert widget_text(app, "#ablation-head") == "live · 0 probes finished"
        await wait_for(pilot, lambda: bool(results.query(ProbeTable)))  # mounted once a run is shown
        table = results.query_one(ProbeTable)

        append(probe_at[4] + 1)  # features and the first five probes
        await wait_for(pilot, lambda: table.row_count == 5)
        head = widget_text(app, "#ablation-head")
        assert head == f"live · 5 of {3 * LAYERS + 1} probes finished · features {3 * LAYERS} (0 from the cache)"
        shown = {(c["representation"], c["layer"].removesuffix(" ★")): c for c in table_cells(table)}
        for event in (json.loads(replay[i]) for i in probe_at[:5]):
            cells = shown[event["representation"], event["layer"]]
            assert cells["test acc"] == f"{event['value']:.3f} ± {event['std']:.3f}"
            assert cells["val acc"] == f"{event['val']:.3f} ± {event['val_std']:.3f}"  # the layer is selected on it
            assert cells["features"] == cells["probes"] == ""  # known only when the run ends
        plot = results.query_one(AccuracyPlot)  # every representation has its place (and colour) from the start
        assert plot.data is not None and list(plot.data.series) == REPRESENTATIONS[:3]
        assert sum(len(points) for points in plot.data.series.values()) == 5

        live = results._timer
        assert live is not None and live._active.is_set()  # following the run's events
        app.action_show("dashboard")  # hidden: its events are not read
        await wait_for(pilot, lambda: not live._active.is_set())  # its next tick saw it hidden and stopped
        await settle(pilot)  # a read already in flight lands
        append(probe_at[9] + 1)
        await settle(pilot)
        assert not live._active.is_set() and table.row_count == 5
        app.action_show("ablation")
        await wait_for(pilot, lambda: table.row_count == 10)

        append(len(replay))
        await wait_for(pilot, lambda: table.row_count == 3 * LAYERS + 1)
        assert plot.data is not None and {name: len(p) for name, p in plot.data.series.items()} == {
            name: LAYERS for name in REPRESENTATIONS[:3]
        }


def test_snapshot_of_the_zoomed_plot(probing_run: Path, snap_compare: Any) -> None:
    async def zoom_to_the_plot(pilot: Pilot[Any]) -> None:
        results = await open_results(pilot, 3 * LAYERS + 1)
        await pilot.press("ctrl+o", "v")
        plot = results.query_one(AccuracyPlot)
        await wait_for(pilot, lambda: plot.display and plot.size.height > 20)
        await settle(pilot)

    assert snap_compare(make_app(screen="ablation"), terminal_size=(120, 40), run_before=zoom_to_the_plot)


# -- the pieces, on inputs whose answers are known ----------------------------------------------------------------


def dots(canvas: BrailleCanvas) -> set[tuple[int, int]]:
    """Every dot set on the canvas, read back from its braille characters."""
    found = set()
    for row in range(canvas.height):
        for col in range(canvas.width):
            char, _ = canvas.cell(col, row)
            bits = ord(char) - BRAILLE_BLANK if char != " " else 0
            for dy, pair in enumerate(DOT_BITS):
                for dx, bit in enumerate(pair):
                    if bits & bit:
                        found.add((2 * col + dx, 4 * row + dy))
    return found


def test_canvas_lines_set_exactly_the_dots_between_their_ends() -> None:
    canvas = BrailleCanvas(5, 2)
    canvas.line(0, 0, 9, 0, "red")  # the top dot row, end to end
    canvas.line(0, 7, 7, 0, "blue")  # a diagonal, one dot per column and row
    assert dots(canvas) == {(x, 0) for x in range(10)} | {(x, 7 - x) for x in range(8)}
    assert canvas.cell(0, 0)[1] == "red" and canvas.cell(0, 1)[1] == "blue"  # the last line drawn in a cell
    assert canvas.cell(4, 1) == (" ", None)
    canvas.mark(9, 7, "●", "green")
    assert canvas.cell(4, 1) == ("●", "green")


def test_axis_range_ticks_and_labels() -> None:
    assert y_range([0.5, 0.93]) == (0.4, 1.0)
    assert y_range([0.97, 0.99]) == (0.8, 1.0)  # at least 0.2 apart, inside [0, 1]
    assert y_range([0.0, 0.05]) == (0.0, 0.2)
    assert y_ticks(0.4, 1.0, 30) == [0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0]
    assert y_ticks(0.4, 1.0, 8) == [0.4, 0.6, 0.8, 1.0]
    assert x_labels([(0, "0"), (5, "5"), (10, "10")], 12) == "0    5    10"
    assert x_labels([(0, "0"), (1, "1"), (2, "2"), (9, "11")], 11) == "0 2      11"  # "1" would touch "0"


def test_sorting_puts_rows_without_a_value_last() -> None:
    rows = [
        ReportedProbe("b", "layer.2", 2, 0.7, 0.0),
        ReportedProbe("a", "layer.1", 1, 0.9, 0.0),
        ReportedProbe("b", "layer.1", 1, 0.8, 0.0),
        ReportedProbe("a", "all", None, 0.95, 0.0),
    ]
    keys = lambda ordered: [(r.representation, r.layer) for r in ordered]  # noqa: E731
    assert keys(sort_rows(rows)) == [("b", "layer.1"), ("b", "layer.2"), ("a", "layer.1"), ("a", "all")]
    assert keys(sort_rows(rows, "test acc", descending=True))[0] == ("a", "all")
    assert keys(sort_rows(rows, "layer")) == [("b", "layer.1"), ("a", "layer.1"), ("b", "layer.2"), ("a", "all")]
    assert keys(sort_rows(rows, "val acc", descending=True)) == keys(sort_rows(rows))  # none known yet
    assert best_of(rows) == {}  # no validation accuracy reported: nothing is selected on test
    rows[0] = ReportedProbe("b", "layer.2", 2, 0.7, 0.0, (0.8, 0.01))
    rows[2] = ReportedProbe("b", "layer.1", 1, 0.8, 0.0, (0.75, 0.01))
    assert {k: r.layer for k, r in best_of(rows).items()} == {"b": "layer.2"}  # best val, not best test


def test_reported_probes_fold_events_and_skip_malformed_ones() -> None:
    probes = ReportedProbes()
    good = {"type": "metric", "name": "probe_test_acc", "value": 0.75, "std": 0.05}
    assert not probes.add([{"type": "log", "message": "x"}, {"type": "metric", "name": "probe_test_acc"}])
    assert probes.add([{**good, "representation": "svd_topk", "layer": "layer.3", "layer_index": 3}])
    assert not probes.add([{**good, "representation": "svd_topk", "layer": "layer.4", "layer_index": "4"}])
    assert probes.add([{"type": "progress", "unit": "probes", "done": 1, "total": 7}])
    assert probes.add([{"type": "metric", "name": "feature_seconds", "value": 0.5, "representation": "svd_topk",
                        "layer": "layer.3", "cached": True}])  # fmt: skip
    assert probes.rows == [ReportedProbe("svd_topk", "layer.3", 3, 0.75, 0.05)]
    assert probes.add([{**good, "val": 0.7, "val_std": 0.02, "representation": "svd_topk", "layer": "layer.3"}])
    assert probes.rows[0].accuracy("val") == (0.7, 0.02)
    assert (probes.total, probes.features, probes.features_cached, probes.feature_seconds) == (7, 1, 1, 0.5)


def test_cache_entries_group_by_representation_and_source(tmp_path: Path) -> None:
    import numpy as np

    cache = FeatureCache(tmp_path)
    for i, layer in enumerate(["layer.10", "layer.2", "layer.1"]):
        cache.store(
            f"k{i}", np.zeros((4, 2), np.float32), {"representation": "svd_topk", "layer": layer, "source": "s"}
        )
    cache.store("k9", np.zeros((4, 3), np.float32), {"representation": "mean_pool", "layer": "layer.1", "source": "s"})
    (tmp_path / "broken.npy").write_bytes(b"x")
    groups = {g.representation: g for g in group_entries(cache.entries())}
    assert groups["svd_topk"].layers == ("layer.1", "layer.2", "layer.10") and groups["svd_topk"].entries == 3
    assert groups["mean_pool"].layers == ("layer.1",)
    assert not groups[""].ok and groups[""].entries == 1
    assert layer_span(groups["svd_topk"].layers) == "layer.1 … layer.10 (3)"
