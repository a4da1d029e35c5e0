"""Overhead of the GPU screen beside other monitors, on the same host, interval and terminal size.

Each monitor runs alone in a pseudo-terminal of a fixed size. Measured per monitor:
- start-up to first frame: from launch until the GPU's name appears in the terminal output;
- steady CPU: utime + stime from /proc/PID/stat over the measurement window, as % of one core;
- bytes written to the terminal per second over the window (what an SSH session carries);
- peak RSS (VmHWM);
- with --rows, the bytes sent to each screen row (benchmarks/terminal_rows.py), to see which part of a
  monitor's screen costs what.
In-process: NVML calls and time per refresh of gpuopt-tui's NVML source (with and without the PCIe call).

Usage on a GPU machine (nvitop installed for the side-by-side row):
    python benchmarks/gpu_panel_bench.py --duration 60 --out benchmarks/results/gpu_panel_h100.md
Quick check anywhere (replays the synthetic trace, 5 s windows):
    python benchmarks/gpu_panel_bench.py --quick
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import os
import platform
import pty
import select
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from terminal_rows import RowBytes, row_bytes  # beside this script, which Python puts first on the path

REPO = Path(__file__).resolve().parents[1]
SYNTHETIC = REPO / "tests" / "fixtures" / "traces" / "synthetic_3gpu.jsonl"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Measurement:
    tool: str
    command: str
    startup_s: float | None = None
    cpu_percent: float | None = None
    bytes_per_s: float | None = None
    peak_rss_mib: float | None = None
    window_s: float = 0.0
    error: str = ""
    rows: list[RowBytes] = field(default_factory=list)


class Terminal:
    """A pty of fixed size whose output is drained (and counted) by a thread."""

    def __init__(self, columns: int, rows: int, marker: str) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.marker = marker.encode()
        self.bytes = 0
        self.output = bytearray()  # everything written, for the per-row breakdown
        self.marker_at: float | None = None
        self._tail = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if not ready:
                continue
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                return
            self.bytes += len(chunk)
            self.output += chunk
            if self.marker_at is None:
                window = self._tail + chunk
                if self.marker in window:
                    self.marker_at = time.monotonic()
                self._tail = window[-len(self.marker) :]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        for fd in (self.master, self.slave):
            os.close(fd)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime, all threads


def peak_rss_mib(pid: int) -> float | None:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def measure(tool: str, command: list[str], args: argparse.Namespace, marker: str) -> Measurement:
    result = Measurement(tool, shlex.join(command))
    term = Terminal(args.columns, args.rows, marker)
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(args.columns), "LINES": str(args.rows)}
    started = time.monotonic()
    proc = subprocess.Popen(
        command, stdin=term.slave, stdout=term.slave, stderr=term.slave, env=env, start_new_session=True
    )
    try:
        deadline = started + args.startup_timeout
        while term.marker_at is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        if term.marker_at is None:
            result.error = f"'{marker}' never appeared (exit code {proc.poll()})"
            return result
        result.startup_s = term.marker_at - started
        time.sleep(args.warmup)
        cpu0, bytes0, t0 = cpu_seconds(proc.pid), term.bytes, time.monotonic()
        start = len(term.output)
        time.sleep(args.duration)
        cpu1, bytes1, t1 = cpu_seconds(proc.pid), term.bytes, time.monotonic()
        output = bytes(term.output)
        result.rows = row_bytes(output[:start], output[start:], args.columns, args.rows)
        result.window_s = t1 - t0
        result.cpu_percent = 100 * (cpu1 - cpu0) / (t1 - t0)
        result.bytes_per_s = (bytes1 - bytes0) / (t1 - t0)
        result.peak_rss_mib = peak_rss_mib(proc.pid)
        if proc.poll() is not None:
            result.error = f"exited during the window (code {proc.returncode})"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        term.close()
    return result


def monitors(args: argparse.Namespace) -> dict[str, list[str]]:
    """The command of each requested monitor that is installed here."""
    interval = f"{args.interval:g}"
    ours = shlex.split(args.gpuopt_cmd) if args.gpuopt_cmd else [sys.executable, "-m", "gpuopt_tui", "gpu"]
    ours += ["--interval", interval] + (["--replay", str(args.replay)] if args.replay else [])
    candidates: dict[str, list[str] | None] = {
        "gpuopt-tui": ours,
        "nvitop": ["nvitop", "-m", "full", "--interval", interval]
        if shutil.which("nvitop")
        else ([sys.executable, "-m", "nvitop", "-m", "full", "--interval", interval] if _has("nvitop") else None),
        "nvtop": ["nvtop", "-d", str(max(1, round(args.interval * 10)))] if shutil.which("nvtop") else None,
        "gpustat": ["gpustat", "-i", interval] if shutil.which("gpustat") else None,
        "nvidia-smi": ["nvidia-smi", "-l", str(max(1, round(args.interval)))] if shutil.which("nvidia-smi") else None,
    }
    chosen = {}
    for name in args.tools.split(","):
        command = candidates.get(name)
        if command is None:
            print(f"skip {name}: not installed here", file=sys.stderr)
        else:
            chosen[name] = command
    return chosen


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def nvml_cost(polls: int) -> tuple[list[str], str | None]:
    """NVML calls and wall time per refresh of gpuopt-tui's source, without and with the (slow) PCIe read;
    also the first GPU's name, the frame marker."""
    sys.path.insert(0, str(REPO))
    from gpuopt_tui.core.telemetry import NvmlSource

    rows = []
    for label, pcie in (("refresh without PCIe", None), ("refresh with one GPU's PCIe read", 0.0)):
        source = NvmlSource(pcie_interval=pcie)  # interval 0: every poll reads one GPU's PCIe counters
        failure = source.start()
        if failure:
            return [f"NVML not measured: {failure}"], None
        first = source.poll()
        calls, millis = [], []
        for _ in range(polls):
            source.poll()
            calls.append(source.last_calls)
            millis.append(source.last_seconds * 1e3)
        millis.sort()
        p95 = millis[int(0.95 * (len(millis) - 1))]
        rows.append(
            f"| {label} | {len(first.gpus)} | {statistics.mean(calls):.1f} | {statistics.median(millis):.3f} | {p95:.3f} |"
        )
        facts = (
            f"Driver {source.nvml.driver_version}, nvidia-ml-py {source.nvml.binding_version}; "
            f"{len(first.processes)} GPU processes; {polls} polls each."
        )
        source.close()
    header = ["| poll | GPUs | NVML calls | median ms | p95 ms |", "|---|---:|---:|---:|---:|"]
    name = first.gpus[0].name if first.gpus else None
    return [facts, "", *header, *rows], name


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "?",
    )
    versions = []
    for module in ("textual", "nvitop"):
        if _has(module):
            from importlib.metadata import version

            versions.append(f"{module} {version(module)}")
    return f"{platform.node()}, {cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, " + ", ".join(
        versions
    )


def report(args: argparse.Namespace, results: list[Measurement], nvml_lines: list[str], card: str) -> str:
    out = [
        "# GPU monitor overhead",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M')} on {machine()}.",
        f"Card: {card}. Interval {args.interval:g} s, pty {args.columns}x{args.rows}, "
        f"{args.warmup:g} s warm-up then a {args.duration:g} s window per monitor, one monitor at a time.",
        "",
        "| monitor | start-up to first frame (s) | steady CPU (% of one core) | terminal bytes/s | peak RSS (MiB) | note |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in results:

        def f(value: float | None, fmt: str) -> str:
            return "n/a" if value is None else format(value, fmt)

        out.append(
            f"| {r.tool} | {f(r.startup_s, '.2f')} | {f(r.cpu_percent, '.2f')} | {f(r.bytes_per_s, '.0f')} | "
            f"{f(r.peak_rss_mib, '.0f')} | {r.error} |"
        )
    out += ["", "Commands:", ""] + [f"- {r.tool}: `{r.command}`" for r in results]
    if args.rows:
        out += ["", "## Terminal bytes per screen row", ""]
        for r in results:
            out += [f"{r.tool} (bytes/s; SGR = colour and attribute sequences; the row as it ends):", ""]
            out += ["| row | bytes/s | of which SGR | row text |", "|---:|---:|---:|---|"]
            out += [
                f"| {b.row} | {b.total / r.window_s:.1f} | {b.styles / r.window_s:.1f} | `{b.text}` |"
                for b in r.rows
                if b.total and r.window_s
            ]
            out.append("")
    out += ["", "## NVML cost per refresh (gpuopt-tui's source, in-process)", "", *nvml_lines, ""]
    return "\n".join(out)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        f.write(text)
    os.replace(f.name, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="measurement window per monitor (s)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds after the first frame before measuring")
    parser.add_argument("--interval", type=float, default=1.0, help="refresh interval given to every monitor (s)")
    parser.add_argument("--size", default="100x30", help="pty size COLUMNSxROWS")
    parser.add_argument(
        "--tools", default="gpuopt-tui,nvitop", help="comma list: gpuopt-tui,nvitop,nvtop,gpustat,nvidia-smi"
    )
    parser.add_argument("--gpuopt-cmd", help="command for gpuopt-tui's GPU screen (default: python -m gpuopt_tui gpu)")
    parser.add_argument("--replay", type=Path, help="make gpuopt-tui replay this trace instead of NVML")
    parser.add_argument("--marker", help="text whose appearance counts as the first frame (default: the GPU name)")
    parser.add_argument("--startup-timeout", type=float, default=30.0)
    parser.add_argument("--nvml-polls", type=int, default=200, help="polls timed in-process for the NVML cost")
    parser.add_argument("--quick", action="store_true", help="5 s windows; replay the synthetic trace if no NVML")
    parser.add_argument("--rows", action="store_true", help="also report the bytes sent to each screen row")
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    args = parser.parse_args()
    args.columns, args.rows = (int(v) for v in args.size.lower().split("x"))
    if args.quick:
        args.duration, args.warmup, args.nvml_polls = 5.0, 1.0, 20

    nvml_lines, name = nvml_cost(args.nvml_polls)
    if name is None and args.replay is None:
        if not args.quick:
            print("no NVML here: run on a GPU machine, or pass --quick / --replay TRACE", file=sys.stderr)
            return 1
        args.replay = SYNTHETIC
    if args.replay is not None:
        from gpuopt_tui.core.telemetry import read_trace

        name = read_trace(args.replay).snapshots[0].gpus[0].name
        args.tools = "gpuopt-tui"  # other monitors cannot replay a trace
    marker = args.marker or (name or "GPU").removeprefix("NVIDIA ").split()[0]
    card = name or "?"
    if args.replay is not None:
        card += f" (replayed from {args.replay.name}, not live)"

    results = []
    for tool, command in monitors(args).items():
        print(f"measuring {tool}: {shlex.join(command)}", file=sys.stderr)
        results.append(measure(tool, command, args, marker))
        print(f"  {results[-1]}", file=sys.stderr)
    text = report(args, results, nvml_lines, card)
    print(text)
    if args.out:
        write_atomic(args.out, text + "\n")
    return 0 if all(not r.error for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
