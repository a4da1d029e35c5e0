"""Scale-out: the same IG run on one process and over several (torchrun), through the real CLI.

Builds a local BERT-base classifier directory (BertConfig, random weights, a synthetic word-level vocabulary of
30522 entries, saved with save_pretrained) and a JSONL file of N texts that tokenize to --seq tokens, then runs
`gpuopt-tui run` on an attribution profile with the default engine settings, once with `run.devices = 1` and
once with `run.devices = P`. Reported per run: the wall time of the whole command (start-up, model load,
torchrun, merging and writing results included) and the attribution stage (from the first batch to the last
rank's last shard, from the run's summary), samples/s of each, and the scaling efficiency
rate(P) / (P x rate(1)). Both runs' token scores are compared (max relative difference per sample).

    python benchmarks/scaling_bench.py --processes 2 --out benchmarks/results/scaling_h100x2.md   # 2 GPUs
    python benchmarks/scaling_bench.py --quick                                                   # CPU, gloo
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from gpuopt_tui.core.results.attribution import TENSORS_NAME
from gpuopt_tui.core.results.attribution_summary import SUMMARY_NAME
from gpuopt_tui.core.runs.layout import RunDir

ROOT = Path(__file__).resolve().parents[1]


def build_model_dir(path: Path, quick: bool) -> list[str]:
    """A BERT classifier directory and the words of its vocabulary (the texts draw from them)."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    size = 200 if quick else 30522
    words = [f"w{i}" for i in range(size - 5)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    if quick:
        config = BertConfig(
            vocab_size=size,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
        )
    else:
        config = BertConfig(vocab_size=size)  # BERT-base: 12 layers, hidden 768, 12 heads
    config.num_labels = 2
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(path)
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(path)
    return words


def write_data(path: Path, words: list[str], n: int, seq: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            text = " ".join(rng.choice(words) for _ in range(seq - 2))  # + [CLS] and [SEP]
            f.write(json.dumps({"text": text, "label": i % 2}) + "\n")


PROFILE = """kind = "attribution"
name = "scaling"

[run]
device = "{device}"

[model]
adapter = "hf"
path = "{model}"

[data]
source = "jsonl"
path = "{data}"
max_length = {seq}

[attribution]
n_samples = {n}
n_steps = {steps}
check_samples = 0
"""


def run_cli(profile: Path, runs: Path, devices: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "gpuopt_tui", "run", str(profile), "--set", f"run.devices={devices}"]
    env = dict(os.environ, GPUOPT_TUI_RUNS_DIR=str(runs))
    before = set(runs.iterdir()) if runs.exists() else set()
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    (run_dir,) = set(runs.iterdir()) - before
    if done.returncode != 0:
        print(RunDir(run_dir).log.read_text()[-4000:], file=sys.stderr)
        raise SystemExit(f"run with devices={devices} failed: {done.stderr[-2000:]}")
    summary = json.loads((RunDir(run_dir).results / SUMMARY_NAME).read_text())
    timing = summary["timing"]
    n = summary["n_samples"]
    return {
        "processes": devices,
        "run": run_dir.name,
        "dir": run_dir,
        "wall_s": wall,
        "wall_rate": n / wall,
        "stage_s": timing["attempt_seconds"],
        "stage_rate": timing["attempt_samples_per_s"],
        "precision": summary["settings"]["precision"],
        "method": summary["settings"]["method"],
        "cast_weights": summary["settings"]["cast_weights"],
        "command": shlex.join(cmd[1:]),
    }


def max_rel_diff(a_dir: Path, b_dir: Path) -> float:
    a, b = (load_file(str(RunDir(d).results / TENSORS_NAME))["scores"].double() for d in (a_dir, b_dir))
    scale = a.abs().flatten(1).amax(1).clamp_min(1e-30)
    return float(((a - b).abs().flatten(1).amax(1) / scale).max())


def render(meta: dict[str, Any], rows: list[dict[str, Any]], diff: float) -> str:
    one = rows[0]
    lines = [
        "# Scale-out: IG over several processes (torchrun)",
        "",
        f"- date: {meta['date']}",
        f"- card: {meta['card']}",
        f"- versions: Python {meta['python']}, torch {meta['torch']}, transformers {meta['transformers']}",
        f"- command: `{meta['command']}`",
        f"- workload: {meta['workload']}",
        f"- engine settings: the defaults ({one['method']}, {one['precision']}, cast_weights={one['cast_weights']})",
        "",
        "| processes | attribution stage s | samples/s (stage) | efficiency (stage) | whole command s | "
        "samples/s (whole) | efficiency (whole) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p = r["processes"]
        eff_stage = r["stage_rate"] / (p * one["stage_rate"])
        eff_wall = r["wall_rate"] / (p * one["wall_rate"])
        lines.append(
            f"| {p} | {r['stage_s']:.2f} | {r['stage_rate']:.1f} | {eff_stage:.1%} | {r['wall_s']:.2f} | "
            f"{r['wall_rate']:.1f} | {eff_wall:.1%} |"
        )
    lines += [
        "",
        f"Token scores of the {rows[-1]['processes']}-process run against the one-process run: max relative "
        f"difference per sample {diff:.2e}.",
        "",
        "Stage: from the first batch to the last rank's last shard (rank 0 waits for the others), as the run's "
        "summary.json records it. Whole command: `gpuopt-tui run` from start to exit, with Python and torch "
        "imports, model loading, the memory probe of each process, torchrun's start and the merge.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="tiny model, CPU processes over gloo: the plumbing")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.samples, args.steps, args.seq = 64, 8, 32
    device = "cpu" if args.quick or not torch.cuda.is_available() else "auto"
    work = Path(tempfile.mkdtemp(prefix="scaling-"))
    words = build_model_dir(work / "model", args.quick)
    write_data(work / "data.jsonl", words, args.samples, args.seq)
    profile = work / "scaling.toml"
    profile.write_text(
        PROFILE.format(
            device=device,
            model=work / "model",
            data=work / "data.jsonl",
            seq=args.seq,
            n=args.samples,
            steps=args.steps,
        )
    )
    runs = Path(os.environ.get("GPUOPT_TUI_RUNS_DIR") or work / "runs")  # where `gpuopt-tui gpu` looks
    rows = [run_cli(profile, runs, 1), run_cli(profile, runs, args.processes)]
    diff = max_rel_diff(rows[0]["dir"], rows[1]["dir"])
    import transformers

    card = torch.cuda.get_device_name(0) if device != "cpu" else f"CPU ({platform.machine()})"
    if device != "cpu":
        card = f"{torch.cuda.device_count()} x {card}"
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "card": card,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": "python benchmarks/scaling_bench.py " + shlex.join(sys.argv[1:]),
        "workload": f"{'tiny BERT' if args.quick else 'BERT-base'} classifier, {args.samples} samples x "
        f"{args.seq} tokens, {args.steps} steps",
    }
    text = render(meta, rows, diff)
    print(text)
    if args.out:
        args.out.write_text(text)
        serial = [{k: v for k, v in r.items() if k != "dir"} for r in rows]
        args.out.with_suffix(".json").write_text(
            json.dumps({"meta": meta, "rows": serial, "max_rel_diff": diff}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
