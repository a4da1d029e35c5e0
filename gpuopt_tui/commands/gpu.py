"""`gpuopt-tui gpu`: the GPU monitor, one-shot queries, CSV logging, and recording/replaying traces."""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.telemetry import display
from gpuopt_tui.core.telemetry.backend import (
    CachedRunLookup,
    NvmlSource,
    ReplaySource,
    TelemetrySource,
    open_source,
)
from gpuopt_tui.core.telemetry.fields import CSV_COLUMNS, REPORT_CELLS, csv_row
from gpuopt_tui.core.telemetry.history import MIN_INTERVAL_S
from gpuopt_tui.core.telemetry.replay import Redactor, TraceWriter, replay
from gpuopt_tui.core.telemetry.snapshot import Snapshot

NAME = "gpu"
HELP = "GPU telemetry: live monitor, one-shot query (--once), CSV log (--log), trace record/replay"


def configure(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="print one sample of every GPU and its processes, then exit")
    mode.add_argument(
        "--log",
        type=Path,
        metavar="FILE.csv",
        help="append one CSV row per GPU every --interval seconds (like nvidia-smi --query-gpu ... -l); Ctrl-C stops",
    )
    mode.add_argument(
        "--record", type=Path, metavar="FILE", help="record live NVML samples to a JSONL trace (for --replay)"
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument(
        "--json",
        action="store_true",
        help="with --once: print the sample as JSON (N/A and NaN as null); when there is none (no GPU, an unreadable "
        'trace) print {"error": "..."} instead and exit 1',
    )
    output.add_argument(
        "--csv", action="store_true", help="with --once: print CSV rows (the --log columns; NaN as an empty field)"
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="S",
        help=f"seconds between samples (default 1, minimum {MIN_INTERVAL_S})",
    )
    parser.add_argument("--duration", type=float, metavar="S", help="with --log/--record: stop after S seconds")
    parser.add_argument("--replay", type=Path, metavar="TRACE", help="read samples from a recorded trace, not NVML")
    parser.add_argument(
        "--speed",
        type=float,
        metavar="X",
        help="replay speed (1 = as recorded); default: real time in the monitor, as fast as possible headless",
    )
    parser.add_argument(
        "--pcie-interval",
        type=float,
        default=5.0,
        metavar="S",
        help="refresh PCIe throughput (a slow, blocking NVML call) at most every S seconds; 0 turns it off",
    )
    parser.add_argument(
        "--redact",
        action="store_true",
        help="with --record: replace user names, home directories and the host name, to share the trace",
    )
    parser.add_argument("--readonly", action="store_true", help="monitor: never signal processes")


def _validate(args: argparse.Namespace) -> None:
    for option in ("interval", "duration", "speed", "pcie_interval"):
        value = getattr(args, option)
        if value is not None and not math.isfinite(value):
            raise UserError(f"--{option.replace('_', '-')} must be a finite number (got {value:g})")
    if args.interval < MIN_INTERVAL_S:
        raise UserError(f"--interval must be at least {MIN_INTERVAL_S} s (got {args.interval:g})")
    if (args.json or args.csv) and not args.once:
        raise UserError("--json and --csv go with --once (for a continuous log use --log FILE.csv)")
    if args.duration is not None and args.duration <= 0:
        raise UserError(f"--duration must be positive (got {args.duration:g})")
    if args.duration is not None and not (args.log or args.record):
        raise UserError("--duration goes with --log or --record")
    if args.speed is not None and args.speed <= 0:
        raise UserError(f"--speed must be positive (got {args.speed:g})")
    if args.record and args.replay:
        raise UserError("--record takes live NVML samples; it cannot be combined with --replay")
    if args.redact and not args.record:
        raise UserError("--redact goes with --record")
    if args.pcie_interval < 0:
        raise UserError(f"--pcie-interval must be 0 (off) or positive (got {args.pcie_interval:g})")


def _active_runs() -> dict[int, str]:
    from gpuopt_tui.core.runs.lifecycle import active_run_pids
    from gpuopt_tui.core.runs.status import RunWatcher

    return active_run_pids(RunWatcher().refresh())


def _source(args: argparse.Namespace, headless: bool) -> TelemetrySource:
    default_speed = None if headless else 1.0
    return open_source(
        args.replay,
        speed=args.speed if args.speed is not None else default_speed,
        run_lookup=CachedRunLookup(_active_runs),
        pcie_interval=args.pcie_interval or None,
    )


def run(args: argparse.Namespace) -> int:
    _validate(args)
    if not (args.once or args.log or args.record):
        return _monitor(args)
    if args.once and args.json:
        return _once_json(args)
    source = _source(args, headless=True)
    try:
        if args.once:
            return _once(source, args)
        if args.log:
            return _log(source, args)
        return _record(source, args)
    finally:
        source.close()


def _no_gpu_message(source: TelemetrySource, snapshot: Snapshot) -> str:
    message = snapshot.message or "no GPU to show"
    return f"{source.label}: {message}" if isinstance(source, ReplaySource) else message


def _no_gpu(source: TelemetrySource, snapshot: Snapshot) -> int:
    print(f"gpuopt-tui gpu: {_no_gpu_message(source, snapshot)}", file=sys.stderr)
    return 1


def _notes(snapshot: Snapshot) -> None:
    for note in snapshot.notes:
        print(f"gpuopt-tui gpu: note: {note}", file=sys.stderr)


# --- --once -----------------------------------------------------------------------------------------------


def _once_json(args: argparse.Namespace) -> int:
    """One sample as JSON; a script reading stdout gets a JSON object in every case: {"error": ...} and exit
    status 1 when there is no sample (no GPU, an unreadable trace)."""
    try:
        source = _source(args, headless=True)
        try:
            snapshot = source.poll()
        finally:
            source.close()
    except UserError as error:
        print(json.dumps({"error": str(error)}, indent=2))
        return 1
    data = finite_or_none(snapshot.to_dict())
    if not snapshot.has_gpus:
        data.pop("message", None)
        data["error"] = _no_gpu_message(source, snapshot)
    print(json.dumps(data, indent=2, allow_nan=False))
    if not snapshot.has_gpus:
        return 1
    _notes(snapshot)
    return 0


def finite_or_none(value: Any) -> Any:
    """`value` with every NaN or infinity (at any depth) as None, so that the JSON is valid."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_none(v) for v in value]
    return value


def _once(source: TelemetrySource, args: argparse.Namespace) -> int:
    snapshot = source.poll()
    if not snapshot.has_gpus:
        return _no_gpu(source, snapshot)
    if args.csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        writer.writerows(csv_row(snapshot.time, gpu) for gpu in snapshot.gpus)
    else:
        print(text_report(snapshot))
    _notes(snapshot)
    return 0


def _table(header: list[str], rows: list[list[str]], left: int, free_last: bool = False) -> list[str]:
    """Columns separated by two spaces; the first `left` columns left-aligned, the rest right-aligned;
    `free_last`: the last column as is (command lines can be long)."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = []
    for row in (header, *rows):
        cells = [
            cell.ljust(width) if i < left else cell.rjust(width) for i, (cell, width) in enumerate(zip(row, widths))
        ]
        if free_last:
            cells[-1] = row[-1]
        lines.append("  ".join(cells).rstrip())
    return lines


def text_report(snapshot: Snapshot) -> str:
    """A plain table of GPUs then processes, for a terminal or a log."""
    gpu_rows = []
    for g in snapshot.gpus:
        name = display.short_name(g.name)
        if g.lost:
            gpu_rows.append([str(g.index), name, "GPU LOST: reset it or reboot", *[""] * (len(REPORT_CELLS) - 1)])
        else:
            gpu_rows.append([str(g.index), name, *(cell.text(g) for cell in REPORT_CELLS)])
    header = ["GPU", "NAME", *(cell.title for cell in REPORT_CELLS)]
    lines = [*_table(header, gpu_rows, left=3), ""]
    if not snapshot.processes:
        return "\n".join([*lines, "no GPU processes"])
    process_rows = [
        [
            str(p.pid),
            str(p.gpu_index),
            p.user or "?",
            p.run_id or "-",
            display.NA if p.gpu_memory is None else f"{p.gpu_memory / 2**20:.0f} MiB",
            p.command or "?",
        ]
        for p in snapshot.processes
    ]
    process_lines = _table(["PID", "GPU", "USER", "RUN", "GPU MEM", "COMMAND"], process_rows, left=4, free_last=True)
    return "\n".join(lines + process_lines)


# --- --log and --record: a sample every interval --------------------------------------------------------------


def ticks(
    interval: float,
    duration: float | None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[int]:
    """Yield at start + k * interval (k = 0, 1, ...) while that is before `duration`; a tick missed because the
    work took longer is skipped, not bunched."""
    start = clock()
    k = 0
    while True:
        yield k
        k = max(k + 1, int((clock() - start) / interval) + 1)
        if duration is not None and k * interval >= duration:
            return
        sleep(max(0.0, start + k * interval - clock()))


def _samples(source: TelemetrySource, args: argparse.Namespace) -> Iterator[Snapshot]:
    """Live: a poll per tick. Replay: the recorded samples, as fast as possible unless --speed."""
    if isinstance(source, ReplaySource):
        start = source.trace.snapshots[0].time
        for snapshot in replay(source.trace, speed=args.speed):
            if args.duration is not None and snapshot.time - start >= args.duration:
                return
            yield snapshot
        return
    for _ in ticks(args.interval, args.duration):
        yield source.poll()


def _open_log(path: Path) -> TextIO:
    """Append to an existing log with our header; refuse to append to any other file."""
    header = ",".join(CSV_COLUMNS)
    try:
        if path.exists() and path.stat().st_size > 0:
            with path.open(encoding="utf-8") as f:
                first = f.readline().rstrip("\r\n")
            if first != header:
                raise UserError(f"{path}: exists and is not a gpuopt-tui GPU log; choose another file name")
            return path.open("a", encoding="utf-8", newline="")
        out = path.open("w", encoding="utf-8", newline="")
    except OSError as error:
        raise UserError(f"{path}: cannot write the log ({error.strerror or error})") from None
    out.write(header + "\n")
    return out


def _log(source: TelemetrySource, args: argparse.Namespace) -> int:
    samples = _samples(source, args)
    first = next(samples)
    if not first.has_gpus:
        return _no_gpu(source, first)
    _notes(first)
    rows = 0
    with _open_log(args.log) as out:
        writer = csv.writer(out, lineterminator="\n")
        try:
            for snapshot in itertools.chain([first], samples):
                writer.writerows(csv_row(snapshot.time, gpu) for gpu in snapshot.gpus)
                out.flush()
                rows += len(snapshot.gpus)
        except KeyboardInterrupt:
            pass
    print(f"gpuopt-tui gpu: wrote {rows} rows to {args.log}", file=sys.stderr)
    return 0


def _record(source: TelemetrySource, args: argparse.Namespace) -> int:
    samples = _samples(source, args)
    first = next(samples)
    if not first.has_gpus:
        return _no_gpu(source, first)
    _notes(first)
    header: dict[str, Any] = {"interval": args.interval, "created": round(first.time, 3)}
    if isinstance(source, NvmlSource):
        header.update(source.describe())
    redact = Redactor() if args.redact else None
    if redact is not None:
        header.update(host="redacted", redacted=True)
    with TraceWriter(args.record, header) as trace:
        try:
            for snapshot in itertools.chain([first], samples):
                trace.write(redact(snapshot) if redact else snapshot)
        except KeyboardInterrupt:
            pass
    print(f"gpuopt-tui gpu: recorded {trace.count} samples to {args.record}", file=sys.stderr)
    return 0


# --- the monitor ----------------------------------------------------------------------------------------------


def _monitor(args: argparse.Namespace) -> int:
    from gpuopt_tui.ui.gpu_monitor import GpuMonitorApp

    app = GpuMonitorApp(_source(args, headless=False), interval=args.interval, readonly=args.readonly)
    app.run(mouse=not getattr(args, "no_mouse", False))
    return app.return_code or 0
