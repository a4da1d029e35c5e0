"""History: a time window per GPU, in columns for plots; fed by the replayed trace."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

from gpuopt_tui.core.telemetry import GpuSample, History, ReplaySource, Snapshot

SYNTHETIC = Path(__file__).parents[1] / "fixtures" / "traces" / "synthetic_3gpu.jsonl"


def snap(t: float, util: int | None, used: int = 4, lost: bool = False) -> Snapshot:
    gpu = GpuSample(index=0, memory_used=used, memory_total=8, util_sm=util, lost=lost)
    return Snapshot(time=t, gpus=(gpu,))


def test_points_older_than_the_window_are_dropped() -> None:
    history = History(window_s=10)
    for t in range(25):
        history.add(snap(float(t), util=t))
    values = history.values(0, "util")
    assert [t for t, _ in values] == [float(t) for t in range(14, 25)]
    assert history.values(0, "memory")[0][1] == 50.0


def test_a_snapshot_not_newer_than_the_last_is_ignored() -> None:
    history = History(window_s=10)
    assert history.add(snap(5.0, util=1))
    assert not history.add(snap(5.0, util=2))
    assert not history.add(snap(4.0, util=3))
    assert history.values(0, "util") == [(5.0, 1.0)]


def test_columns_hold_the_peak_of_complete_columns_and_none_where_nothing_was_sampled() -> None:
    history = History(window_s=10)
    for t, util in [(1.0, 10), (1.5, 80), (2.2, 30), (9.9, 5), (10.0, 7)]:
        history.add(snap(t, util))
    # 5 columns of 2 s; [10, 12) is in progress, so the complete ones are [0,2) [2,4) [4,6) [6,8) [8,10)
    assert history.columns(0, "util", 5) == [80.0, 30.0, None, None, 5.0]
    assert history.columns(0, "util", 0) == []
    assert history.columns(7, "util", 3) == [None, None, None]  # a GPU never seen


def test_a_column_once_shown_never_changes_and_the_plot_moves_a_column_at_a_time() -> None:
    history = History(window_s=10)
    shown = []
    for quarter in range(4, 160):  # polls every 0.25 s from t=1 to t=39.75
        history.add(snap(quarter / 4, util=quarter % 97))
        shown.append(history.columns(0, "util", 5))
    changes = [(a, b) for a, b in pairwise(shown) if a != b]
    assert len(changes) == 19  # once per completed 2 s column: at t=2, 4, ..., 38
    assert all(a[1:] == b[:-1] for a, b in changes)  # moved one column left, the new one on the right
    assert shown[-1][0] is not None  # the oldest column still has its points (history keeps twice the window)


def test_a_sweep_keeps_columns_in_place_and_changes_two_positions_a_column() -> None:
    history = History(window_s=10)
    shown = []
    for quarter in range(4, 160):
        history.add(snap(quarter / 4, util=quarter % 97))
        shown.append(history.sweep(0, "util", 5))
    changes = [(a, b) for a, b in pairwise(shown) if a != b]
    assert len(changes) == 19  # once per completed 2 s column
    columns = history.columns(0, "util", 5)  # t=39.75: complete columns [28,30) .. [36,38), timeline 14..18
    assert shown[-1] == [columns[1], columns[2], columns[3], columns[4], None]  # 19 -> position 4: now, blank
    for a, b in changes[5:]:  # a full window on: the new column and the blank "now" move one position right
        assert sum(x != y for x, y in zip(a, b)) <= 2 and b.count(None) == 1


def test_a_lost_gpu_and_na_values_leave_gaps() -> None:
    history = History(window_s=4)
    history.add(snap(0.5, util=50))
    history.add(snap(1.5, util=None))
    history.add(snap(2.5, util=60, lost=True))
    history.add(snap(3.5, util=70))
    history.add(snap(4.0, util=0))
    assert history.last_time == 4.0
    assert history.columns(0, "util", 4) == [50.0, None, None, 70.0]
    assert history.columns(0, "memory", 4) == [50.0, 50.0, None, 50.0]


def test_empty_history_and_bad_arguments() -> None:
    history = History()
    assert history.columns(0, "memory", 3) == [None, None, None]
    with pytest.raises(ValueError):
        history.values(0, "power")
    with pytest.raises(ValueError):
        history.columns(0, "power", 3)
    with pytest.raises(ValueError):
        History(window_s=0)


def test_history_from_a_replayed_trace() -> None:
    source = ReplaySource(SYNTHETIC, speed=None, loop=False)
    history = History(window_s=60)
    frames = source.trace.snapshots
    for _ in frames:
        history.add(source.poll())
    assert history.indices() == [0, 1, 2]
    memory0 = [v for _, v in history.values(0, "memory")]
    assert memory0 == sorted(memory0) and memory0[0] == pytest.approx(2.5) and memory0[-1] == pytest.approx(75.0)
    lost_from = next(i for i, f in enumerate(frames) if f.gpus[2].lost)
    util2 = [v for _, v in history.values(2, "util")]
    assert all(v is None for v in util2[lost_from:]) and all(v == 55.0 for v in util2[:lost_from])
    assert all(v == pytest.approx(0.625) for _, v in history.values(1, "memory"))  # 0.5 of 80 GiB
