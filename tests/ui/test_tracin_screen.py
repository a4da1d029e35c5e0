"""The TracIn screen's results, on a frozen run of the real engine (tests/fixtures/runs/tracin: the demo profile on
6 test and 500 training examples; the UI test process never loads torch): test examples with their proponents
and opponents, the self-influence ranking read a page at a time, the files with their copy key (also at once in a
run's results opened from the Runs screen), and a run that has not written results yet; a run over all layers with
projected gradients, the gradient cache and the check against exact TracIn (made by the CLI, its numbers read from
its own files); the profile form's mode, projection and cache fields."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.text import Text
from textual.pilot import Pilot
from textual.widgets import DataTable, TabbedContent

from gpuopt_tui.app import make_app
from gpuopt_tui.core.atomic import atomic_write_text, write_csv
from gpuopt_tui.core.profiles.io import find_profile, load_profile
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.lifecycle import create_run
from gpuopt_tui.ui.widgets.app_footer import AppFooter
from gpuopt_tui.ui.widgets.choice_field import ChoiceField
from gpuopt_tui.ui.widgets.tracin_view import FIRST_PAGE, PAGE, score_text

from .conftest import (
    flat_text,
    frozen_run,
    frozen_source,
    open_from_runs,
    screen_text,
    settle,
    wait_for,
    widget_text,
)


def cli_run(home: Path, *settings: str, profile: str = "demo-tracin") -> Path:
    """A finished TracIn run of a shipped demo profile on the CPU with these `--set` values, made by `gpuopt-tui
    run` with `home` as its data directory."""
    env = dict(os.environ, GPUOPT_TUI_HOME=str(home), GPUOPT_TUI_RUNS_DIR=str(home / "runs"), OMP_NUM_THREADS="1")
    command = ["run", profile, "--set", "run.device=cpu", *(f"--set={value}" for value in settings)]
    done = subprocess.run(
        [sys.executable, "-m", "gpuopt_tui", *command], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (run_dir,) = (home / "runs").iterdir()
    return run_dir


@pytest.fixture(scope="module")
def factored_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """All layers, gradients projected to 8 x 8 per layer, the training-gradient cache on, and the check against
    exact all-parameter TracIn on 40 training examples."""
    factored = ["layers=all", "method=factored", "projection_in=8", "projection_out=8", "train_cache=true"]
    sizes = [f"n_test={N_TEST}", "n_train=120", "agreement_train=40"]
    return cli_run(tmp_path_factory.mktemp("tracin-factored-home"), *(f"tracin.{s}" for s in factored + sizes))


@pytest.fixture
def run_dir(runs_root: Path) -> Path:
    return frozen_run("tracin", runs_root)


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


FROZEN = frozen_source("tracin")
N_TEST = len(jsonl(FROZEN / "results" / "influence.jsonl"))
N_TRAIN = len(jsonl(FROZEN / "results" / "self_influence.jsonl"))  # more than two pages of the ranking


def rows(table: DataTable[Text]) -> list[list[str]]:
    return [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]


def table(pilot: Pilot[Any], selector: str) -> DataTable[Text]:
    return pilot.app.screen.query_one(selector, DataTable)


async def open_results(pilot: Pilot[Any]) -> None:
    """Wait for the latest run's results, then show them on the whole screen."""
    await wait_for(pilot, lambda: table(pilot, "#tracin-tests").row_count == N_TEST)
    await pilot.press("ctrl+o")
    await pilot.pause()


async def show_tab(pilot: Pilot[Any], pane: str) -> None:
    pilot.app.screen.query_one("#tracin-tabs", TabbedContent).active = pane
    await pilot.pause()


def neighbour_rows(record: dict[str, Any], side: str) -> list[list[str]]:
    return [[score_text(n["score"]), str(n["index"]), str(n["label"]), n["text"]] for n in record[side]]


async def test_selecting_a_test_example_shows_its_proponents_and_opponents(run_dir: Path) -> None:
    records = jsonl(run_dir / "results" / "influence.jsonl")
    app = make_app(screen="tracin")
    async with app.run_test(size=(120, 40)) as pilot:
        await open_results(pilot)
        tests = table(pilot, "#tracin-tests")
        assert app.focused is tests
        names = json.loads((run_dir / "results" / "summary.json").read_text())["label_names"]
        assert names  # the demo names its classes

        def predicted(r: dict[str, Any]) -> str:
            return f"{names[r['prediction']]} ({r['probability']:.2f})"

        assert rows(tests) == [[str(r["index"]), names[r["label"]], predicted(r), r["text"]] for r in records]
        for i in (0, 2, 3):
            tests.move_cursor(row=i)
            await pilot.pause()
            assert rows(table(pilot, "#tracin-proponents")) == neighbour_rows(records[i], "proponents")
            assert rows(table(pilot, "#tracin-opponents")) == neighbour_rows(records[i], "opponents")
            assert records[i]["text"] in widget_text(app, "#tracin-test-detail")
        await pilot.press("up")  # as a user would: the keys move the selection
        await pilot.pause()
        assert rows(table(pilot, "#tracin-proponents")) == neighbour_rows(records[2], "proponents")
        assert neighbour_rows(records[2], "proponents") != neighbour_rows(records[3], "proponents")
        text = screen_text(app)
        assert records[2]["proponents"][0]["text"] in text and records[2]["opponents"][0]["text"] in text


async def test_self_influence_tab_lists_training_examples_in_rank_order(run_dir: Path) -> None:
    ranked = jsonl(run_dir / "results" / "self_influence.jsonl")
    expected = [
        [str(r["rank"]), f"{r['self_influence']:.4e}", str(r["index"]), str(r["label"]), "flipped" * r["flipped"]]
        for r in ranked
    ]
    app = make_app(screen="tracin")
    async with app.run_test(size=(120, 40)) as pilot:
        await open_results(pilot)
        await show_tab(pilot, "tracin-self-tab")
        ranking = table(pilot, "#tracin-self")
        assert [str(c.label) for c in ranking.columns.values()] == [
            "rank",
            "score",
            "train",
            "label",
            "flipped",
            "text",
        ]
        assert len(ranked) == N_TRAIN > 2 * PAGE and ranking.row_count == FIRST_PAGE  # the first rows only at first
        assert [row[:5] for row in rows(ranking)] == expected[:FIRST_PAGE]
        assert f"{len(ranked)} training examples" in widget_text(app, "#tracin-self-note")
        ranking.focus()
        while ranking.row_count < len(ranked):  # going down reads the following pages
            count = ranking.row_count
            await pilot.press("ctrl+end")
            await wait_for(pilot, lambda count=count: ranking.row_count > count)
        assert [row[:5] for row in rows(ranking)] == expected
        await pilot.press("ctrl+end")
        await pilot.pause()
        assert ranked[-1]["text"] in widget_text(app, "#tracin-self-detail")


async def test_files_tab_copies_a_path(run_dir: Path) -> None:
    app = make_app(screen="tracin")
    async with app.run_test(size=(120, 40)) as pilot:
        await open_results(pilot)
        await show_tab(pilot, "tracin-files-tab")
        files = table(pilot, "#tracin-files")
        names = [row[0] for row in rows(files)]
        assert names[:3] == ["influence.jsonl", "self_influence.jsonl", "self_influence.csv"]
        assert set(names) == {p.name for p in (run_dir / "results").iterdir()}
        files.focus()
        await pilot.press("down", "c")
        assert app.clipboard == str(run_dir / "results" / "self_influence.jsonl")
        await pilot.press("escape")  # back from the whole screen
        await pilot.pause()
        assert app.screen.maximized is None


async def test_c_copies_a_path_at_once_in_a_run_opened_from_the_runs_screen(run_dir: Path) -> None:
    """c copies the highlighted file's path wherever the focus is in the results (a results screen opens with the
    view focused, not its file table), on the Files tab only (the footer offers it there alone); right and left
    switch the tabs."""
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_from_runs(pilot, app, run_dir.name)
        await wait_for(pilot, lambda: screen.view.query_one("#tracin-files", DataTable).row_count > 0)
        await settle(pilot)
        tabs = screen.view.query_one("#tracin-tabs", TabbedContent)
        focused = app.focused
        assert focused is screen.view and tabs.active == "tracin-tests-tab"  # as the screen opens
        assert "Copy path" not in footer_keys(app)
        await pilot.press("c")
        assert not app.clipboard
        while tabs.active != "tracin-files-tab":
            await pilot.press("right")
            await pilot.pause()
        assert "Copy path" in footer_keys(app) and app.focused is focused
        await pilot.press("c")
        assert app.clipboard == str(run_dir / "results" / "influence.jsonl")  # the first file, highlighted
        await pilot.press("left")
        await wait_for(pilot, lambda: tabs.active != "tracin-files-tab")
        await pilot.pause()
        assert "Copy path" not in footer_keys(app)


def footer_keys(app: Any) -> set[str]:
    """The descriptions of the keys the footer shows."""
    return {k.description for k in app.screen.query_one(AppFooter).keys}


async def test_results_fit_80x24_on_the_whole_screen(run_dir: Path) -> None:
    app = make_app(screen="tracin")
    async with app.run_test(size=(80, 24)) as pilot:
        await open_results(pilot)
        assert table(pilot, "#tracin-tests").region.height >= 4
        assert table(pilot, "#tracin-proponents").region.height >= 3
        assert table(pilot, "#tracin-opponents").region.height >= 3
        assert "flipped AUC" in flat_text(app)


@pytest.fixture
def running_tracin(runs_root: Path) -> Iterator[Path]:
    """A TracIn run whose process is alive (a `sleep` stands in for the job) and has written no results."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    path = find_profile("demo-tracin")
    run_dir = create_run(load_profile(path), source=path, root=runs_root)
    writer = EventWriter(run_dir / "events.jsonl")
    writer.emit("started", pid=proc.pid, attempt=1)
    writer.close()
    atomic_write_text(run_dir / "pid.json", f'{{"pid": {proc.pid}, "attempt": 1}}')
    yield run_dir
    proc.kill()
    proc.wait()


async def test_a_run_without_results_yet_says_so(running_tracin: Path) -> None:
    app = make_app(screen="tracin")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: "No result files yet" in widget_text(app, "#results-text"))
        assert not any(tabs.display for tabs in app.screen.query("#tracin-tabs"))


async def test_a_run_in_progress_shows_the_files_it_has(running_tracin: Path) -> None:
    (running_tracin / "results").mkdir(exist_ok=True)
    shutil.copy(FROZEN / "results" / "influence.jsonl", running_tracin / "results")
    app = make_app(screen="tracin")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: table(pilot, "#tracin-tests").row_count == N_TEST)
        assert "No summary.json yet" in widget_text(app, "#results-text")
        assert widget_text(app, "#tracin-self-note") == "No self_influence.jsonl or .csv in this run."
        assert table(pilot, "#tracin-self").row_count == 0


def test_results_snapshot(run_dir: Path, snap_compare: Any) -> None:
    async def second_example(pilot: Pilot[Any]) -> None:
        await open_results(pilot)
        await pilot.press("down")
        await settle(pilot)

    assert snap_compare(make_app(screen="tracin"), terminal_size=(120, 40), run_before=second_example)


async def test_summary_says_the_projection_the_cache_and_the_agreement_with_exact_tracin(
    factored_run: Path, runs_root: Path
) -> None:
    shutil.copytree(factored_run, runs_root / factored_run.name)
    summary = json.loads((factored_run / "results" / "summary.json").read_text())
    agreement, cache = summary["agreement"], summary["train_cache"]
    app = make_app(screen="tracin")
    async with app.run_test(size=(120, 40)) as pilot:
        await open_results(pilot)
        status = widget_text(app, "#results-text")
        assert "factored (all-layer hooks), each layer's gradient projected to 8 × 8" in status
        assert f"Spearman vs exact {agreement['spearman']:.3f}" in status
        await show_tab(pilot, "tracin-summary-tab")
        text = " ".join(widget_text(app, "#tracin-summary").split())
        assert f"8 × 8 (output × input) (seed {summary['projection']['seed']})" in text
        assert f"{summary['gradient_size']:,} numbers per gradient" in text
        assert (
            f"Cache training gradients: {cache['read']} blocks read from the cache, {cache['computed']} computed"
            in text
        )
        assert (
            f"Agreement Spearman {agreement['spearman']:.4f}, top-10 overlap {agreement['top_k_overlap']:.0%} "
            f"against {agreement['reference']} on the first 40 training × {N_TEST} test examples" in text
        )
        assert ("Left out" in text) == bool(summary["excluded_parameters"])


async def test_dataset_ranking_tab_lists_the_ranking_the_run_wrote(factored_run: Path, runs_root: Path) -> None:
    shutil.copytree(factored_run, runs_root / factored_run.name)
    ranked = jsonl(factored_run / "results" / "dataset_ranking.jsonl")
    names = json.loads((factored_run / "results" / "summary.json").read_text())["label_names"]
    assert len(ranked) == 120 and [r["rank"] for r in ranked] == list(range(1, 121))
    expected = [
        [str(r["rank"]), score_text(r["mean_influence"]), score_text(r["max_influence"]), str(r["index"])]
        for r in ranked
    ]
    app = make_app(screen="tracin")
    async with app.run_test(size=(120, 40)) as pilot:
        await open_results(pilot)
        await show_tab(pilot, "tracin-dataset-tab")
        ranking = table(pilot, "#tracin-dataset")
        assert [str(c.label) for c in ranking.columns.values()] == ["rank", "mean", "max", "train", "label", "text"]
        assert [row[:4] for row in rows(ranking)] == expected[:FIRST_PAGE]
        assert rows(ranking)[0][4] == str(ranked[0]["label"]) and names  # the label's number, as in the file
        assert "120 training examples, highest mean influence over the test set first" in widget_text(
            app, "#tracin-dataset-note"
        )
        ranking.focus()
        await pilot.press("down")
        await pilot.pause()
        detail = widget_text(app, "#tracin-dataset-detail")
        assert f"train {ranked[1]['index']} · {N_TEST} test examples" in detail and ranked[1]["text"] in detail


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo causal LM's TracIn profile (prompt and completion rows, completion-only loss) on 8 test x 200
    training rows."""
    home = tmp_path_factory.mktemp("tracin-lm-home")
    return cli_run(home, "tracin.n_test=8", "tracin.n_train=200", profile="demo-tracin-lm")


async def test_a_language_model_run_shows_prompts_completions_and_losses(lm_run: Path, runs_root: Path) -> None:
    """Every tab of a causal LM's run shows an example as its completion and prompt (no label), and each test
    example its completion loss."""
    shutil.copytree(lm_run, runs_root / lm_run.name)
    results = lm_run / "results"
    records, ranked = jsonl(results / "influence.jsonl"), jsonl(results / "self_influence.jsonl")
    dataset = jsonl(results / "dataset_ranking.jsonl")
    assert all(r["completion"] and r["label"] is None for r in records)
    app = make_app(screen="tracin")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: table(pilot, "#tracin-tests").row_count == len(records))
        await pilot.press("ctrl+o")
        await pilot.pause()
        tests = table(pilot, "#tracin-tests")
        assert [str(c.label) for c in tests.columns.values()] == ["test", "loss", "completion", "prompt"]
        assert rows(tests) == [
            [str(r["index"]), f"{r['completion_loss']:.4g}", r["completion"], r["text"]] for r in records
        ]
        first = records[0]
        assert widget_text(app, "#tracin-test-detail") == (
            f"test {first['index']} · prompt {first['text']} · completion {first['completion']}"
        )
        proponents = table(pilot, "#tracin-proponents")
        assert [str(c.label) for c in proponents.columns.values()] == ["score", "train", "completion", "prompt"]
        assert rows(proponents) == [
            [score_text(n["score"]), str(n["index"]), n["completion"], n["text"]] for n in first["proponents"]
        ]
        all_positive = all(n["score"] >= 0 for n in first["opponents"])  # the file's signs say which title
        assert widget_text(app, "#tracin-opponents-title").startswith("Lowest scores" if all_positive else "Opponents")
        await show_tab(pilot, "tracin-self-tab")
        ranking = table(pilot, "#tracin-self")
        assert [str(c.label) for c in ranking.columns.values()] == ["rank", "score", "train", "completion", "prompt"]
        assert "examples whose completion the model finds wrong or unusual tend to rank high" in widget_text(
            app, "#tracin-self-note"
        )
        assert rows(ranking)[0][2:] == [str(ranked[0]["index"]), ranked[0]["completion"], ranked[0]["text"]]
        await show_tab(pilot, "tracin-dataset-tab")
        assert rows(table(pilot, "#tracin-dataset"))[0][3:] == [
            str(dataset[0]["index"]),
            dataset[0]["completion"],
            dataset[0]["text"],
        ]
        assert widget_text(app, "#tracin-dataset-detail") == (
            f"train {dataset[0]['index']} · {dataset[0]['n_queries']} test examples · prompt {dataset[0]['text']} · "
            f"completion {dataset[0]['completion']}"
        )


async def test_a_dataset_ranking_in_the_csv_only_shows_unscored_examples(run_dir: Path) -> None:
    """A causal LM's rows (as the job writes them: no label, a completion; one example no test example was scored
    against) in the CSV only."""
    rows_written = [
        {"rank": 1, "index": 4, "mean_influence": 0.25, "max_influence": 1.5, "n_queries": 2,
         "text": "the cat sat on", "completion": "the mat"},
        {"rank": 2, "index": 0, "mean_influence": None, "max_influence": None, "n_queries": 0,
         "text": "a dog", "completion": "ran, fast"},
    ]  # fmt: skip
    write_csv(run_dir / "results" / "dataset_ranking.csv", rows_written)
    app = make_app(screen="tracin")
    async with app.run_test(size=(120, 40)) as pilot:
        await open_results(pilot)
        await show_tab(pilot, "tracin-dataset-tab")
        assert rows(table(pilot, "#tracin-dataset")) == [
            ["1", score_text(0.25), score_text(1.5), "4", "the mat", "the cat sat on"],
            ["2", "-", "-", "0", "ran, fast", "a dog"],
        ]


async def test_a_run_without_a_dataset_ranking_hides_its_tab(run_dir: Path) -> None:
    assert not (run_dir / "results" / "dataset_ranking.jsonl").exists()
    app = make_app(screen="tracin")
    async with app.run_test(size=(120, 40)) as pilot:
        await open_results(pilot)
        tabs = app.screen.query_one("#tracin-tabs", TabbedContent)
        assert tabs.get_tab("tracin-dataset-tab").display is False
        assert "Dataset ranking" not in screen_text(app)


async def test_profile_form_offers_the_mode_projection_sizes_and_cache() -> None:
    app = make_app(screen="tracin")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        screen = app.screen
        path = find_profile("tracin-all-projected")
        screen.query_one("#profile-picker", ChoiceField).value = str(path)
        await wait_for(pilot, lambda: screen.path == path)
        profile = load_profile(path)
        form = screen.form
        assert form.edit_key("tracin.layers").value == profile.tracin.layers == "all"
        method = form.edit_key("tracin.method")
        assert isinstance(method, ChoiceField) and method.value == "factored"
        assert {value for _, value in method.options} >= {"closed_form", "vmap", "factored"}
        assert form.edit_key("tracin.train_cache").value is True
        for key, expected in [("projection_in", "32"), ("projection_out", "32"), ("agreement_train", "0")]:
            field = form.edit_key(f"tracin.{key}")
            assert field.value == expected
            await pilot.pause()
            help_line = widget_text(app, ".form-help")
            assert f"tracin.{key}" in help_line and len(help_line) > 60  # the schema's help, shown
        form.edit_key("tracin.method").value = "closed_form"  # sizes of another method
        await pilot.pause()
        form.edit_key("tracin.projection_in")
        await pilot.pause()
        assert "apply to method = factored only" in screen.form.errors["tracin.projection_in"]


def test_the_summary_says_how_long_fitting_the_projection_took_apart_from_the_rate() -> None:
    from gpuopt_tui.core.results.tracin_summary import parse_summary
    from gpuopt_tui.ui.widgets.tracin_summary import summary_content

    frozen = Path(__file__).parents[1] / "fixtures" / "browse_runs" / "20261126-161121-tracin-1451" / "results"
    raw = json.loads((frozen / "summary.json").read_text())
    timing = {**raw["timing"], "compute_seconds": 9.0, "projection_fit_seconds": 2.5}
    text = summary_content(parse_summary({**raw, "timing": timing})).plain
    assert "(9 s computing, 2.5 s of it fitting the projection, left out of the rate)" in text
    assert "of it fitting" not in summary_content(parse_summary(raw)).plain
