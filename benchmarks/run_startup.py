"""From `gpuopt-tui run` to the first computed batch, stage by stage.

Each round launches a real run through the CLI (`gpuopt-tui --runs-dir FRESH run PROFILE --detach`), follows its
events.jsonl until its first batch is computed, then cancels it (start-up is what is measured; the rest of the run
is not waited for). The stages come from the run's `startup` events (core/runs/startup.py): seconds from the CLI's
process start. A tree from before those events existed (`--source OLD NEW` compares two trees, round by round)
has only its progress events: their stages are timed from one stage's first event to the next, from the moment
the CLI was spawned, up to the first progress event of the main count; that event may come up to 0.25 s (the
progress throttle) after its batch.

The launched commands run with bytecode caching on (PYTHONDONTWRITEBYTECODE removed), as an installed package's
modules are; a first, uncounted round per profile compiles them and builds the demo models if needed.

    python benchmarks/run_startup.py --out benchmarks/results/run_startup_cpu.md
    python benchmarks/run_startup.py --model-size 30m --device cuda --out benchmarks/results/run_startup_H100.md

`--warm` starts a warm runner (`gpuopt-tui warm`, waited for until it is ready) before each launch and stops the
one that replaces it after: the start-up of a run handed to a warm runner (core/runs/warm.py). With
`--warm-model`, the runner also reads the profile's local model ahead (`gpuopt-tui warm --model DIR`).

`--model-size 30m` builds a ~30M-parameter RoBERTa-shaped sequence classifier from a transformers config (random
weights, its own WordPiece vocabulary) with 64 texts into a temporary local directory and times an attribution
profile on it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuopt_tui.core.runs import events as core_events  # noqa: E402

DEMOS = [
    "demo-attribution",
    "demo-attribution-two-tower",
    "demo-attribution-lm",
    "demo-tracin",
    "demo-ablation",
    "demo-ablation-lora",
]
POLL_S = 0.02
TIMEOUT_S = 600.0


# --- the 30M-parameter local model ------------------------------------------------------------------------------
def build_30m(folder: Path) -> Path:
    """A RoBERTa-shaped classifier (10 layers, 384 wide, 30,522 tokens: ~30M parameters), its tokenizer and 64
    texts under `folder`; returns the attribution profile that runs on it."""
    import torch
    from transformers import BertTokenizer, RobertaConfig, RobertaForSequenceClassification

    words = _words(30522 - 5)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    config = RobertaConfig(
        vocab_size=len(vocab),
        hidden_size=384,
        num_hidden_layers=10,
        num_attention_heads=6,
        intermediate_size=1536,
        max_position_embeddings=514,
        type_vocab_size=1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        num_labels=2,
    )
    torch.manual_seed(0)
    model = RobertaForSequenceClassification(config)
    model_dir = folder / "roberta-30m"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rng = random.Random(0)
    rows = [
        json.dumps({"text": " ".join(rng.choices(words[:2000], k=rng.randint(20, 60))), "label": i % 2})
        for i in range(64)
    ]
    (folder / "texts.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    profile = folder / "roberta-30m-attribution.toml"
    profile.write_text(
        f"""kind = "attribution"
name = "roberta-30m-attribution"
description = "IG on a ~30M-parameter RoBERTa-shaped classifier (random weights) from a local directory"

[model]
adapter = "hf"
path = {json.dumps(str(model_dir))}

[data]
source = "jsonl"
path = {json.dumps(str(folder / "texts.jsonl"))}
max_length = 128

[attribution]
n_samples = 32
n_steps = 32
batch_size = 8
""",
        encoding="utf-8",
    )
    count = sum(p.numel() for p in model.parameters())
    print(f"built {model_dir}: {count / 1e6:.1f} M parameters", flush=True)
    return profile


def _words(n: int) -> list[str]:
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    syllables = [c + v for c in consonants for v in vowels]
    rng = random.Random(1)
    found: set[str] = set()
    while len(found) < n:
        found.add("".join(rng.choices(syllables, k=rng.randint(2, 4))))
    return sorted(found)


# --- one run ----------------------------------------------------------------------------------------------------
def read_events(path: Path) -> list[dict[str, Any]]:
    """The complete events written so far (a half-written last line waits for the next read)."""
    return core_events.read_events(path)[0]


def progress_stages(events: list[dict[str, Any]], spawned: float) -> tuple[list[tuple[str, float]], bool]:
    """(stage, seconds) from the spawn to the first progress event of the main count (one with done above the
    first count of its stage; the demo's training steps do not count), from progress events alone; and whether
    that event was found."""
    stages: list[tuple[str, float]] = [("(from the spawn to `started`)", 0.0)]
    since, first_done, current = spawned, {}, None
    for event in events:
        if event["type"] == "started":
            stages[0] = (stages[0][0], event["t"] - spawned)
            since = event["t"]
        if event["type"] != "progress":
            continue
        stage = event.get("stage", "")
        if stage != current:
            if current is not None:
                stages.append((current, event["t"] - since))
            else:
                stages.append(("(from `started` to the first stage)", event["t"] - since))
            current, since = stage, event["t"]
        if "done" in event and "training" not in str(event.get("unit", "")):
            first_done.setdefault(stage, event["done"])
            if event["done"] > first_done[stage]:
                stages.append((f"{stage} (to the first progress of its count)", event["t"] - since))
                return stages, True
    return stages, False


def startup_profile(events: list[dict[str, Any]]) -> tuple[list[tuple[str, float]], bool, float | None]:
    """The run's own profile: (stage, seconds), whether it reached the first batch, and the unix time of that."""
    stages = [(e["stage"], e["seconds"]) for e in events if e["type"] == "startup"]
    last = [e for e in events if e["type"] == "startup" and e.get("first_batch")]
    return stages, bool(last), last[0]["t"] if last else None


def one_run(
    profile: str, sets: list[str], env: dict[str, str], source: Path, warm: bool = False, model: str | None = None
) -> dict[str, Any]:
    runs = Path(tempfile.mkdtemp(prefix="startup-runs-"))
    base = [sys.executable, "-m", "gpuopt_tui", "--runs-dir", str(runs)]
    if warm:
        command = [*base, "warm", "--minutes", "10", *(["--model", model] if model else [])]
        ready = subprocess.run(command, env=env, cwd=source, capture_output=True, text=True)
        if ready.returncode != 0:
            raise SystemExit(f"gpuopt-tui warm failed:\n{ready.stderr}")
    load = os.getloadavg()[0]
    spawned = time.time()
    started = subprocess.run(
        [*base, "run", profile, *sets, "--detach"], env=env, cwd=source, capture_output=True, text=True
    )
    if started.returncode != 0:
        raise SystemExit(f"{profile}: gpuopt-tui run failed:\n{started.stderr}")
    run_id = started.stdout.strip().splitlines()[-1]
    events_file = runs / run_id / "events.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        events = read_events(events_file)
        own, reached, at = startup_profile(events)
        coarse, coarse_reached = progress_stages(events, spawned)
        ended = any(e["type"] in ("finished", "failed", "cancelled") for e in events)
        if reached or (not own and coarse_reached) or ended or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    if not ended:
        subprocess.run([*base, "cancel", run_id], env=env, cwd=source, capture_output=True)
        while not any(e["type"] in ("finished", "failed", "cancelled") for e in read_events(events_file)):
            if time.monotonic() > deadline + 60:
                raise SystemExit(f"{profile}: run {runs / run_id} did not end after its cancel")
            time.sleep(0.1)
    failed = [e.get("message", "") for e in read_events(events_file) if e["type"] == "failed"]
    if warm:  # the runner that replaced the one the run took
        subprocess.run([*base, "warm", "--stop"], env=env, cwd=source, capture_output=True)
    shutil.rmtree(runs, ignore_errors=True)
    if failed:
        raise SystemExit(f"{profile}: the run failed: {failed[0]}")
    result: dict[str, Any] = {"profile": profile, "load1": load}
    if own:
        result |= {"stages": own, "reached": reached, "total": sum(s for _, s in own), "kind": "startup events"}
        result["from_spawn"] = at - spawned if at else None
    else:
        total = sum(s for _, s in coarse)
        result |= {"stages": coarse, "reached": coarse_reached, "total": total, "kind": "progress events"}
        result["from_spawn"] = total
    return result


# --- the report -------------------------------------------------------------------------------------------------
def table(rounds: list[dict[str, Any]]) -> list[str]:
    """Median, min and max seconds of each stage over the rounds (stages in the first round's order)."""
    names: list[str] = []
    for r in rounds:
        names.extend(n for n, _ in r["stages"] if n not in names)
    lines = ["| stage | median s | min s | max s |", "|---|---:|---:|---:|"]
    for name in names:
        values = [sum(s for n, s in r["stages"] if n == name) for r in rounds]
        lines.append(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |")
    totals = [r["total"] for r in rounds]
    reached = all(r["reached"] for r in rounds)
    label = "to the first computed batch" if reached else "total (the first batch was not reached in every round)"
    lines.append(f"| **{label}** | **{statistics.median(totals):.2f}** | {min(totals):.2f} | {max(totals):.2f} |")
    spawn = [r["from_spawn"] for r in rounds if r["from_spawn"] is not None]
    if spawn:
        lines.append(
            f"| (the same, from this script's spawn of the command) | {statistics.median(spawn):.2f} | "
            f"{min(spawn):.2f} | {max(spawn):.2f} |"
        )
    return lines


def versions(env: dict[str, str], source: Path) -> str:
    code = (
        "import torch, transformers, safetensors; print(torch.__version__, transformers.__version__, "
        "safetensors.__version__); print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=source, capture_output=True, text=True)
    first, card = out.stdout.splitlines()[:2]
    torch_v, tf_v, st_v = first.split()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=source, capture_output=True, text=True)
    return (
        f"Python {platform.python_version()}, torch {torch_v}, transformers {tf_v}, safetensors {st_v}; {card}; "
        f"gpuopt-tui tree {source} (commit {rev.stdout.strip() or 'not a git checkout'})"
    )


def _warm_model(args: argparse.Namespace, profile: str) -> str | None:
    """The local model directory of a profile file, for --warm-model (None for a shipped demo's name)."""
    if not (args.warm and args.warm_model and profile.endswith(".toml")):
        return None
    import tomllib

    return tomllib.loads(Path(profile).read_text())["model"]["path"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", nargs="*", default=None, help=f"profiles to launch (default: {' '.join(DEMOS)})")
    parser.add_argument("--model-size", choices=["30m"], help="also time a local model of this size (built here)")
    parser.add_argument("--device", default=None, help="--set run.device=... for every run (e.g. cpu, cuda)")
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds per profile (after one uncounted)")
    parser.add_argument(
        "--source",
        type=Path,
        nargs="+",
        default=[ROOT],
        help="the gpuopt-tui trees to run (default: this one); with several, each round runs each tree in turn, so "
        "that they share the machine's load",
    )
    parser.add_argument("--warm", action="store_true", help="a warm runner ready before each launch (see above)")
    parser.add_argument("--warm-model", action="store_true", help="with --warm: it reads the local model ahead")
    parser.add_argument("--machine", default=platform.node(), help="what to call the machine in the report")
    parser.add_argument("--title", default="", help="a heading for this measurement in the report")
    parser.add_argument("--out", type=Path, help="append the report (markdown) to this file")
    args = parser.parse_args()

    sources = [s.resolve() for s in args.source]
    envs = {src: {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} for src in sources}
    for src, env in envs.items():  # the tree first; what was on the path (e.g. packages installed aside) after it
        env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    sets = ["--set", f"run.device={args.device}"] if args.device else []
    profiles = list(args.profiles) if args.profiles is not None else ([] if args.model_size else list(DEMOS))
    model_dir = Path(tempfile.mkdtemp(prefix="startup-model-")) if args.model_size else None
    if model_dir is not None:
        profiles.append(str(build_30m(model_dir)))

    started = datetime.datetime.now(datetime.UTC)
    report = [
        f"## {args.title or 'gpuopt-tui run: start-up to the first computed batch'}",
        "",
        f"- date: {started:%Y-%m-%d %H:%M} UTC; machine: {args.machine}; {os.cpu_count()} CPU cores",
        *(f"- tree {i + 1}: {versions(envs[src], src)}" for i, src in enumerate(sources)),
        f"- command: `{' '.join(shlex.quote(a) for a in sys.argv)}`",
        f"- each profile: 1 uncounted round per tree (bytecode, demo cache), then {args.rounds} counted, the trees "
        "in turn within each round; runs cancelled after their first batch"
        + ("; a warm runner ready before each launch (`gpuopt-tui warm`)" if args.warm else ""),
    ]
    loads: list[float] = []
    for profile in profiles:
        for src in sources:
            print(f"{profile}: warm-up round (tree {src})", flush=True)
            one_run(profile, sets, envs[src], src, args.warm, _warm_model(args, profile))
        rounds: dict[Path, list[dict[str, Any]]] = {src: [] for src in sources}
        for i in range(args.rounds):
            for src in sources:
                result = one_run(profile, sets, envs[src], src, args.warm, _warm_model(args, profile))
                loads.append(result["load1"])
                print(f"{profile}: round {i + 1}, {src}: {result['total']:.2f} s ({result['kind']})", flush=True)
                rounds[src].append(result)
        name = Path(profile).stem if profile.endswith(".toml") else profile
        for i, src in enumerate(sources):
            tree = f"tree {i + 1}, " if len(sources) > 1 else ""
            kind = rounds[src][0]["kind"]
            launch_loads = ", ".join(f"{r['load1']:.2f}" for r in rounds[src])
            heading = f"### {name} ({tree}{kind}; load average 1 min at each launch: {launch_loads})"
            report += ["", heading, "", *table(rounds[src])]
    ended = datetime.datetime.now(datetime.UTC)
    report.insert(
        3,
        f"- load average (1 min) at the launches: min {min(loads):.2f}, median "
        f"{statistics.median(loads):.2f}, max {max(loads):.2f}; finished {ended:%H:%M} UTC",
    )
    if model_dir is not None:
        shutil.rmtree(model_dir, ignore_errors=True)
    text = "\n".join(report) + "\n"
    print(text)
    if args.out:
        with args.out.open("a", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
