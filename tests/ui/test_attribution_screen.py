"""The attribution screen's results on a frozen run of the real engine (tests/fixtures/runs/attribution: the demo
classifier, 12 samples, with a check on 2): the sample list and the selected sample's heatmap against
attributions.jsonl, search, the check action (its run's frozen profile), the check view against check.json,
copying a path, a run still going, and a snapshot at 120x40. On a frozen causal LM run per completion token
(tests/fixtures/runs/attribution-lm): choosing the completion token with `,` and `.`, and a snapshot."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from textual.content import Content
from textual.pilot import Pilot
from textual.widgets import DataTable, Input, OptionList, Static

from gpuopt_tui.app import make_app
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.results.attribution import SampleIndex, write_samples
from gpuopt_tui.core.runs import lifecycle as runs_module
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.status import RunWatcher
from gpuopt_tui.ui.screens.attribution import CHECK_SAMPLES, AttributionScreen
from gpuopt_tui.ui.screens.help import HelpScreen
from gpuopt_tui.ui.widgets.app_footer import AppFooter
from gpuopt_tui.ui.widgets.attribution_view import AttributionRunResults
from gpuopt_tui.ui.widgets.token_heatmap import NEGATIVE, POSITIVE, UNCOLOURED_BELOW, word_pieces

from .conftest import frozen_run, frozen_source, make_run, settle, wait_for, widget_text

STRONGEST = {POSITIVE[-1][0], NEGATIVE[-1][0]}
FROZEN = frozen_source("attribution")


@pytest.fixture
def finished_run(runs_root: Path) -> Path:
    return frozen_run("attribution", runs_root)


def jsonl_records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "results" / "attributions.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


N_SAMPLES = len(jsonl_records(FROZEN))


async def open_results(pilot: Pilot[Any], rows: int = N_SAMPLES) -> AttributionRunResults:
    results = pilot.app.screen.query_one(AttributionRunResults)
    await wait_for(pilot, lambda: results.query_one("#sample-table", DataTable).row_count == rows)
    await pilot.pause()
    return results


def text_of(results: AttributionRunResults, selector: str) -> str:
    return str(results.query_one(selector, Static).content)


def shaded_tokens(content: Content) -> list[tuple[str, str]]:
    """(text, background colour) of every shaded stretch of a heatmap."""
    found = []
    for span in content.spans:
        style = str(span.style)
        if " on " in style:
            found.append((content.plain[span.start : span.end], style.split(" on ")[1]))
    return found


def shade_level(colour: str) -> int:
    ramp = [bg for bg, _ in POSITIVE] if colour in {bg for bg, _ in POSITIVE} else [bg for bg, _ in NEGATIVE]
    return ramp.index(colour)


def check_heatmap(results: AttributionRunResults, words: list[str], scores: list[float]) -> None:
    """The heatmap shows `words` with those of `scores` at or above the threshold shaded, by sign and by size."""
    heatmap = results.query_one("#heatmap", Static).content
    assert isinstance(heatmap, Content)
    assert heatmap.plain == " ".join(words)
    top = max(abs(s) for s in scores)
    expected = [(t, s) for t, s in zip(words, scores) if s != 0 and abs(s) / top >= UNCOLOURED_BELOW]
    shaded = shaded_tokens(heatmap)
    assert [t for t, _ in shaded] == [t for t, _ in expected]
    for (_, colour), (_, score) in zip(shaded, expected):
        assert colour in {bg for bg, _ in (POSITIVE if score > 0 else NEGATIVE)}
    levels = [(abs(s), shade_level(c)) for (_, c), (_, s) in zip(shaded, expected)]
    assert all(la <= lb for (sa, la) in levels for (sb, lb) in levels if sa < sb)
    assert any(c in STRONGEST for _, c in shaded)  # the largest |score| gets the strongest shade


async def test_selecting_a_sample_shows_its_tokens_shaded_by_score(finished_run: Path) -> None:
    records = jsonl_records(finished_run)
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        results = await open_results(pilot)
        table = results.query_one("#sample-table", DataTable)
        assert [table.get_row_at(i)[0].plain for i in range(table.row_count)] == [str(i) for i in range(N_SAMPLES)]
        await pilot.press("ctrl+o")  # the results on the whole screen, the sample table focused
        assert app.focused is table
        for row, keys in ((5, ["down"] * 5), (2, ["up"] * 3)):
            await pilot.press(*keys)
            await pilot.pause()
            assert table.cursor_row == row
            record = records[row]
            assert text_of(results, "#sample-heading").startswith(
                f"sample {row} · predicted {record['prediction']} (p {record['probability']:.3f})"
            )
            # every token at or above the threshold is shaded, by the sign of its score, more for a larger |score|
            check_heatmap(results, record["tokens"], record["scores"])
            # the sample's top tokens, from the line's `top`
            top_table = results.query_one("#sample-top", DataTable)
            assert [top_table.get_row_at(i)[1].plain for i in range(top_table.row_count)] == [
                t[1] for t in record["top"]
            ]


async def test_searching_filters_the_list(finished_run: Path) -> None:
    records = jsonl_records(finished_run)
    word = records[0]["top"][0][1]
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        results = await open_results(pilot)
        await pilot.press("ctrl+o", "slash")
        assert isinstance(app.focused, Input)
        await pilot.press(*f"top:{word}")
        expected = [str(r["index"]) for r in records if word in [t[1] for t in r["top"]]]
        assert len(expected) < N_SAMPLES
        table = results.query_one("#sample-table", DataTable)
        status = f"{len(expected)} of {N_SAMPLES} samples"
        await wait_for(pilot, lambda: text_of(results, "#sample-status").startswith(status))
        assert [table.get_row_at(i)[0].plain for i in range(table.row_count)] == expected
        await pilot.press(*" pred:x")
        await wait_for(pilot, lambda: '"pred:x": expected' in text_of(results, "#sample-status"))


async def test_the_check_and_delta_views_show_their_files(finished_run: Path) -> None:
    check = json.loads((finished_run / "results" / "check.json").read_text())
    deltas = json.loads((finished_run / "results" / "summary.json").read_text())["deltas"]
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        results = await open_results(pilot)
        results.show_tab("tab-check")
        await pilot.pause()
        text = text_of(results, "#check-text")
        assert f"Optimized vs original on the first {check['n_samples']} samples" in text
        assert f"optimized: samples × steps batched, {check['precision_optimized']}" in text
        assert "original: one sample and one step at a time, fp32" in text
        assert f"max relative difference     {check['max_rel_diff']:.3g}" in text
        assert f"median relative difference  {check['median_rel_diff']:.3g}" in text
        results.show_tab("tab-deltas")
        await pilot.pause()
        text = text_of(results, "#delta-text")
        rel = f"relative  median {deltas['median_rel']:.3g} · p95 {deltas['p95_rel']:.3g} · max {deltas['max_rel']:.3g}"
        assert rel in text
        assert f"absolute  median {deltas['median_abs']:.3g} · p95 {deltas['p95_abs']:.3g}" in text
        assert deltas["warning"]  # 8 steps leave this demo unconverged: the engine warns and suggests more
        assert f"⚠ {deltas['warning']}" in text and f"n_steps = {deltas['suggested_n_steps']}" in text


async def test_the_check_action_starts_a_small_run_with_check_samples(
    finished_run: Path, runs_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launched: list[Path] = []
    monkeypatch.setattr(runs_module, "launch", lambda run_dir, *_: launched.append(run_dir) or 0)  # no engine process
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        results = await open_results(pilot)
        screen = app.screen
        assert isinstance(screen, AttributionScreen)
        form_steps = screen.form.values()["attribution"]["n_steps"]
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: len(launched) == 1)
        profile = load_profile(launched[0] / "profile.toml")
        assert profile.attribution.check_samples == CHECK_SAMPLES  # type: ignore[attr-defined]
        assert profile.attribution.n_samples == CHECK_SAMPLES  # type: ignore[attr-defined]
        assert profile.attribution.n_steps == form_steps  # type: ignore[attr-defined]
        assert profile.name == "demo-attribution check"
        assert results.active_tab == "tab-check"
        # the check run shows in the Check tab; the run in view stays, with its results
        check_id = launched[0].name
        await wait_for(pilot, lambda: f"Check run {check_id}" in str(results.query_one("#check-text", Static).content))
        assert screen.latest is not None and screen.latest.dir == finished_run
        assert results.has_results


async def test_copying_an_export_path(finished_run: Path) -> None:
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        results = await open_results(pilot)
        await pilot.press("ctrl+o")
        results.show_tab("tab-files")
        options = results.query_one("#export-files", OptionList)
        options.focus()
        await pilot.pause()
        assert [options.get_option_at_index(i).id for i in range(options.option_count)] == [
            str(finished_run),
            *(str(finished_run / "results" / name) for name in ("attributions.jsonl", "attributions.safetensors")),
            *(str(finished_run / "results" / name) for name in ("summary.json", "check.json")),
        ]
        await pilot.press("down", "c")
        assert app.clipboard == str(finished_run / "results" / "attributions.jsonl")
        await pilot.press("down", "enter")
        assert app.clipboard == str(finished_run / "results" / "attributions.safetensors")


async def test_a_running_run_shows_the_results_it_has_written(
    live_run: tuple[Path, Any],
) -> None:
    run_dir, _ = live_run
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        results = app.screen.query_one(AttributionRunResults)
        await wait_for(pilot, lambda: "once the run has written its results" in text_of(results, "#results-text"))
        assert not results.has_results
        events = EventWriter(run_dir / "events.jsonl")
        for name in ("attributions.jsonl", "summary.json"):  # as the engine writes them before its check
            shutil.copy(FROZEN / "results" / name, run_dir / "results" / name)
            events.emit("artifact", path=f"results/{name}", description=name)
        events.close()
        await open_results(pilot)
        assert results.has_results
        assert "still running: results so far" in text_of(results, "#results-text")


def test_the_run_watcher_counts_artifact_events(runs_root: Path) -> None:
    """What the results view follows to read a run's files again: the number of `artifact` events so far (read
    incrementally) and the newest one's path."""
    run_dir = make_run(
        runs_root,
        ("started", {"pid": 0, "attempt": 1}),
        ("artifact", {"path": "results/attributions.jsonl", "description": "per-sample"}),
        ("progress", {"done": 1, "total": 2}),
    )
    watcher = RunWatcher(runs_root)
    info = watcher.info(run_dir)
    assert (info.artifacts, info.last_artifact) == (1, "results/attributions.jsonl")
    events = EventWriter(run_dir / "events.jsonl")
    events.emit("artifact", path="results/summary.json", description="summary")
    events.close()
    info = watcher.info(run_dir)
    assert (info.artifacts, info.last_artifact) == (2, "results/summary.json")
    assert watcher.info(run_dir).artifacts == 2  # nothing new: nothing counted twice


def test_word_pieces_are_joined_into_words() -> None:
    def joined(tokens: tuple[str, ...]) -> str:
        return "".join((" " if space else "") + text for text, space in word_pieces(tokens))

    assert joined(("[CLS]", "play", "##ing", "cards", "[SEP]")) == "[CLS] playing cards [SEP]"
    assert joined(("<s>", "Ġplay", "ing", "Ġcards", "</s>")) == "<s> playing cards </s>"
    assert joined(("▁play", "ing", "▁cards")) == "playing cards"


def test_snapshot_with_a_finished_run(finished_run: Path, snap_compare: Any) -> None:
    async def loaded(pilot: Pilot[Any]) -> None:
        results = await open_results(pilot)
        results.query_one("#sample-table", DataTable).move_cursor(row=2)  # a sample other than the first
        await settle(pilot)

    assert snap_compare(make_app(screen="attribution"), terminal_size=(120, 40), run_before=loaded)


# --- a causal LM run per completion token ---------------------------------------------------------------------------
LM_FROZEN = frozen_source("attribution-lm")


def footer_keys(app: Any) -> list[tuple[str, str]]:
    return [(k.display, k.description) for k in app.screen.query_one(AppFooter).keys]


def top_rows(results: AttributionRunResults) -> list[list[str]]:
    table = results.query_one("#sample-top", DataTable)
    return [[cell.plain for cell in table.get_row_at(i)] for i in range(table.row_count)]


def expected_top(top: list[list[Any]]) -> list[list[str]]:
    return [[str(rank), token, str(position), f"{score:+.4g}"] for rank, (position, token, score) in enumerate(top, 1)]


@pytest.mark.parametrize("indexed", [False, True], ids=["jsonl-read-whole", "index-file"])
async def test_keys_choose_the_completion_token_the_heatmap_explains(
    runs_root: Path, monkeypatch: pytest.MonkeyPatch, indexed: bool
) -> None:
    """The frozen run has no index file (an earlier version's run); written again with one, the same is shown and
    the jsonl is not read whole."""
    run_dir = frozen_run("attribution-lm", runs_root)
    reads: list[int] = []
    read = SampleIndex.read
    monkeypatch.setattr(SampleIndex, "read", lambda index, entry: reads.append(entry.index) or read(index, entry))
    records = jsonl_records(LM_FROZEN)
    if indexed:
        write_samples(run_dir / "results" / "attributions.jsonl", records)
        monkeypatch.setattr(SampleIndex, "scan", None)  # reading the jsonl whole would fail
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        results = await open_results(pilot, len(records))
        await pilot.press("ctrl+o")  # the sample table focused
        table = results.query_one("#sample-table", DataTable)
        rows = [[cell.plain for cell in table.get_row_at(i)] for i in range(table.row_count)]
        assert rows == [
            [str(r["index"]), f"{r['logprob']:.3g}", f"{r['relative_delta']:.2g}", r["top"][0][1], r["completion"]]
            for r in records
        ]
        record = records[0]
        tokens, count = record["completion_tokens"], len(record["completion_tokens"])
        assert (",", "Prev token") in footer_keys(app) and (".", "Next token") in footer_keys(app)
        heading = text_of(results, "#sample-heading")
        assert heading.startswith(f"sample 0 · completion {record['completion']!r} · log p {record['logprob']:.3g}")
        assert "shown: the whole completion" in heading
        check_heatmap(results, record["tokens"], record["scores"])
        assert top_rows(results) == expected_top(record["top"])
        # "." walks through the completion's tokens: each shows its row of the matrix, its top tokens and its delta,
        # from the sample already read (a key reads no file)
        read_before = list(reads)
        for t in range(count):
            await pilot.press("full_stop")
            heading = text_of(results, "#sample-heading")
            logprob = f"{record['token_logprobs'][t]:.3g}"
            assert f"shown: completion token {t + 1} of {count} {tokens[t]!r} · log p {logprob}" in heading
            delta = f"delta {record['token_deltas'][t]:.3g} = {record['token_relative_deltas'][t]:.3g} ×"
            assert delta in heading
            check_heatmap(results, record["tokens"], record["matrix"][t])
            assert top_rows(results) == expected_top(record["token_top"][t])
        await pilot.press("full_stop")  # past the last token: it stays
        assert f"shown: completion token {count} of {count}" in text_of(results, "#sample-heading")
        assert reads == read_before
        # another sample keeps the choice; "," goes back to the whole completion
        await pilot.press("down")
        await pilot.pause()
        other = records[1]
        last = len(other["completion_tokens"]) - 1
        assert text_of(results, "#sample-heading").startswith("sample 1 ")
        check_heatmap(results, other["tokens"], other["matrix"][min(count - 1, last)])
        await pilot.press(*["comma"] * (count + 1))
        assert "shown: the whole completion" in text_of(results, "#sample-heading")
        check_heatmap(results, other["tokens"], other["scores"])
        assert top_rows(results) == expected_top(other["top"])


async def test_the_token_keys_are_in_the_help_and_only_where_there_are_rows(finished_run: Path) -> None:
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        await open_results(pilot)
        await pilot.press("ctrl+o")
        assert footer_keys(app) and not {k for k in footer_keys(app) if k[1] in ("Prev token", "Next token")}
        await pilot.press("escape")
        await app.push_screen(HelpScreen())
        await pilot.pause()
        help_text = " ".join(widget_text(app, ".help-keys").split())
        where = "Causal LM run per completion token (its Samples tab, wherever the focus is in its results):"
        assert f", {where} explain the previous completion token (first: the whole completion)" in help_text
        assert f". {where} explain the next completion token" in help_text
        results_group = "A run's results (enter on a run; the keys of its kind's results, listed above, work there too)"
        assert results_group in help_text


def test_snapshot_of_a_causal_lm_sample_per_completion_token(runs_root: Path, snap_compare: Any) -> None:
    frozen_run("attribution-lm", runs_root)

    async def loaded(pilot: Pilot[Any]) -> None:
        await open_results(pilot, len(jsonl_records(LM_FROZEN)))
        await pilot.press("ctrl+o", "full_stop")  # the completion's first token
        await settle(pilot)

    assert snap_compare(make_app(screen="attribution"), terminal_size=(120, 40), run_before=loaded)
