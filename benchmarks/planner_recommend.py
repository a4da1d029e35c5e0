"""planner_traced.py --recommend: the traced tier's recommendation run for real, in the HF Trainer.

For each case (its model config and training setup) and each budget (--budget-gib, a card of that many GiB as
`plan --gpu-memory` takes it, and with --card the card here as the planner detects it through NVML), the traced
tier recommends a micro-batch and accumulation for the effective batch (--effective-batch) as `gpuopt-tui plan
--trace --auto` does (`session.prepare` on the command's flags, `session.trace_probes`, `session.recommend_traced`),
and one more trace gives its figures at exactly that micro-batch and accumulation. The recommendation then trains
--steps optimizer steps in the HF Trainer in a fresh process (`trainer_loop.py`; a card smaller than this one is
emulated by capping torch's allocator at its size less the CUDA context). Verdict (`recommend_verdict.passes`): no
out-of-memory error, no allocator retry, peak (max_memory_reserved + the memory outside torch) within the budget
(margin x card) and at least 80% of it, unless the next larger divisor of the effective batch would not fit (by a
line through this run and the small one: then none can reach 80%, and the row says so).

The same Trainer run at a small micro-batch (--small-batch, accumulation 2 so that gradients live across
micro-batches as they do in any accumulating run) gives the trace's error there: the traced figures at that batch
beside the measured ones. On the CPU (--quick) there are no memory figures: the runs show that the whole path works
and that the Trainer trains at the recommended batch; nothing is measured.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import importlib.metadata
import json
import multiprocessing
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from recommend_verdict import LOW_SHARE, budget_share, passes, pretend_card

from gpuopt_tui.commands import plan as plan_command
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner import gpu as gpu_memory
from gpuopt_tui.core.planner import session
from gpuopt_tui.core.planner.measure import probe_env, probe_request
from gpuopt_tui.core.planner.traced import TRACED_HEADROOM
from gpuopt_tui.core.planner.train_setup import GiB, MiB, TrainSetup

ROOT = Path(__file__).resolve().parents[1]
LOOP_SCRIPT = Path(__file__).with_name("trainer_loop.py")
SMALL_ACCUMULATE = 2
QUICK_CASES = ("phi2-lora", "gemma-2b-full-ckpt", "bert-base-cls")
QUICK_SPARE = 24 * MiB  # --quick: the pretend card's room beyond the fixed overheads
RUN_TIMEOUT = 300.0


def planner_inputs(
    model_dir: Path, task: str, setup: TrainSetup, target: int, gib: float | None, gpu: gpu_memory.GpuMemory | None
) -> session.PlanInputs:
    """The plan `gpuopt-tui plan --model DIR ... --trace --auto` prepares: the case's setup as command-line flags,
    the budget as --gpu-memory GIB or the detected card (`gpu`)."""
    argv = [
        *("--model", str(model_dir), "--task", task, "--precision", setup.precision),
        *("--optimizer", setup.optimizer, "--trainable", setup.trainable, "--loop", setup.loop),
        *("--lora-rank", str(setup.lora_rank), "--lora-targets", ",".join(setup.lora_targets)),
        "--checkpointing" if setup.gradient_checkpointing else "--no-checkpointing",
        *("--seq-len", str(setup.seq_len), "--batch", str(setup.micro_batch)),
        *("--accumulate", str(setup.accumulate), "--effective-batch", str(target)),
        *(("--gpu-memory", repr(gib)) if gib is not None else ()),
        "--trace",
        "--auto",
    ]
    parser = argparse.ArgumentParser()
    plan_command.configure(parser)
    args = parser.parse_args(argv)
    profile = plan_command.build_profile(args)
    return session.prepare(profile, gpu=gpu, origins=plan_command.origins(args, profile))


def traced_at(inputs: session.PlanInputs, micro: int, accumulate: int) -> dict[str, Any]:
    """The traced tier's figures of the step at `micro` x `accumulate` (as `plan --show --trace` prints them)."""
    at = dataclasses.replace(inputs, setup=inputs.setup.with_batch(micro, accumulate))
    est = session.trace_current(at)
    return {
        "allocated": est.allocated,
        "reserved": est.reserved,
        "total": est.total,
        "phase": est.phase,
        "seconds": round(est.seconds, 1),
    }


def trainer_run(
    config: dict[str, Any], task: str, setup: TrainSetup, device: str, steps: int, card_total: int | None
) -> dict[str, Any]:
    """`setup` trained `steps` optimizer steps by the HF Trainer in a fresh process (`trainer_loop.py`)."""
    request = {**probe_request(config, task, setup, device, steps=steps, warmup=0), "card_total": card_total}
    env = probe_env()
    if device.startswith("cuda"):  # one GPU: the Trainer would spread a batch over every GPU it sees
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, str(LOOP_SCRIPT)],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the Trainer run took longer than {RUN_TIMEOUT:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("result: ")]
    if not lines:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-4:])
        return {"error": f"the Trainer run exited with code {done.returncode}: {tail}"}
    return {**json.loads(lines[-1][len("result: ") :]), "wall_seconds": round(time.perf_counter() - started, 1)}


def footprint(run: dict[str, Any]) -> int | None:
    """Peak reserved + the memory outside torch, of a run that did not run out of memory (None otherwise)."""
    if run.get("oom") or "max_reserved" not in run:
        return None
    return int(run["max_reserved"]) + int(run["context"])


def _next_divisor(target: int, micro: int) -> int | None:
    return next((d for d in range(micro + 1, target + 1) if target % d == 0), None)


def reachable(entry: dict[str, Any], small: dict[str, Any], target: int) -> tuple[bool, str]:
    """Whether a micro-batch the exact search may choose could have reached `LOW_SHARE` of the budget, and why
    (by a line through the small run and the recommended run, in sequences)."""
    micro, peak, limit = entry["micro_batch"], footprint(entry["run"]), entry["limit"]
    if peak is None or peak >= LOW_SHARE * limit:  # out of memory fails whatever a divisor could do
        return True, ""
    larger = _next_divisor(target, micro)
    if larger is None:
        return False, f"the whole effective batch ({target}) is one micro-batch: no divisor can use more"
    low = footprint(small.get("run", {}))
    if low is None or micro == small["micro_batch"]:
        return True, "no line through two runs to judge the next divisor"
    slope = (peak - low) / (micro - small["micro_batch"])
    need = peak + slope * (larger - micro)
    verdict = "it would fit: the search left room" if need <= limit else "over the budget"
    return (
        need <= limit,
        f"next divisor {larger}: ~{need / GiB:.1f} GiB by the runs' line, {need / limit:.0%} ({verdict})",
    )


def judge(entry: dict[str, Any], small: dict[str, Any], target: int) -> None:
    run = entry["run"]
    if "error" in run:
        entry["verdict"] = "failed: " + run["error"]
        return
    if "max_reserved" not in run:
        steps = run.get("optimizer_steps", 0)
        entry["verdict"] = f"not measured (CPU): the Trainer made {steps} optimizer steps at this batch"
        return
    peak = footprint(run)
    share = budget_share(peak, entry["limit"])
    able, note = reachable(entry, small, target)
    entry.update(footprint=peak, share=share, note=note)
    entry["ok"] = passes(bool(run["oom"]), int(run["num_alloc_retries"]), share, able)
    entry["verdict"] = "ok" if entry["ok"] else "NO"
    _errors(entry, peak)


def _errors(entry: dict[str, Any], peak: int | None) -> None:
    """The traced figures against the run's (allocated against allocated, reserved against reserved, the planner's
    total with its context against reserved + the memory outside torch)."""
    run, traced = entry["run"], entry.get("traced") or {}
    pairs = {"allocated": run.get("max_allocated"), "reserved": run.get("max_reserved"), "total": peak}
    entry["errors"] = {
        k: round(traced[k] / v - 1, 4) for k, v in pairs.items() if v and not run.get("oom") and k in traced
    }
    if peak and entry.get("predicted"):
        entry["errors"]["predicted"] = round(entry["predicted"] / peak - 1, 4)


def plan_case(
    case: Any, budgets: Sequence[tuple[str, float | None, gpu_memory.GpuMemory | None]], args: argparse.Namespace
) -> dict[str, Any]:
    """One case's plans, no GPU work: the recommendation under each budget, the traced figures there and at the
    small micro-batch. The Trainer runs them afterwards (`run_planned`)."""
    config = case.config().to_dict()
    row: dict[str, Any] = {"case": case.name, "model_type": config["model_type"], "task": case.task}
    row["setup"] = dataclasses.asdict(case.setup)
    target = args.effective_batch or case.setup.effective_batch
    row.update(
        effective_batch=target, budgets=[], small={"micro_batch": args.small_batch, "accumulate": SMALL_ACCUMULATE}
    )
    say = _say(case.name)
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(config))
        inputs = None
        for label, gib, gpu in budgets:
            entry: dict[str, Any] = {"budget": label, "smaller_card": gpu is None and not args.quick}
            row["budgets"].append(entry)
            try:
                inputs = planner_inputs(Path(model_dir), case.task, case.setup, target, gib, gpu)
                entry.update(gpu_total=inputs.budget.gpu_total, limit=inputs.budget.limit, card=inputs.gpu.total)
                started = time.perf_counter()
                plan = session.trace_probes(inputs, lambda line: say(f"  {line}"))
                rec, plan = session.recommend_traced(inputs, plan, lambda line: say(f"  {line}"))
                entry["traced"] = traced_at(inputs, rec.chosen.micro_batch, rec.chosen.accumulate)
            except UserError as e:
                entry["run"] = {"error": f"planner: {e}"}
                say(f"{label}: planner: {e}")
                continue
            chosen = rec.chosen
            entry.update(
                micro_batch=chosen.micro_batch,
                accumulate=chosen.accumulate,
                b_max=rec.b_max,
                predicted=chosen.peak,
                headroom=rec.headroom,
                traces=len(plan.probes),
                plan_seconds=round(time.perf_counter() - started, 1),
            )
            say(f"{label}: recommended {chosen.micro_batch} x {chosen.accumulate}")
        if inputs is not None:
            try:
                row["small"]["traced"] = traced_at(inputs, args.small_batch, SMALL_ACCUMULATE)
            except UserError as e:  # the Trainer still runs it: what the trace could not give, the row says
                row["small"]["traced_error"] = str(e)
    return row


def run_planned(case: Any, row: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The Trainer runs of `plan_case`'s row: each recommendation (a card smaller than this one emulated by a cap),
    then the small micro-batch on the card without a cap; each judged."""
    config = case.config().to_dict()
    device = "cpu" if args.quick else "cuda:0"
    for entry in row["budgets"]:
        if "micro_batch" not in entry:
            continue
        _say(case.name)(f"{entry['budget']}: the Trainer runs {entry['micro_batch']} x {entry['accumulate']}")
        setup = case.setup.with_batch(entry["micro_batch"], entry["accumulate"])
        cap = entry["card"] if entry["smaller_card"] else None
        entry["run"] = trainer_run(config, case.task, setup, device, args.steps, cap)
    small = row["small"]
    setup = case.setup.with_batch(small["micro_batch"], small["accumulate"])
    small["run"] = trainer_run(config, case.task, setup, device, args.steps, None)
    _errors(small, footprint(small["run"]))
    for entry in row["budgets"]:
        if "micro_batch" in entry:
            judge(entry, small, row["effective_batch"])
        _say(case.name)(_line(entry))
    return row


def plan_named(
    name: str, budgets: Sequence[tuple[str, float | None, gpu_memory.GpuMemory | None]], args: argparse.Namespace
) -> dict[str, Any]:
    """`plan_case` of the case called `name`, in a worker process of --plan-jobs (cases hold lambdas: they travel
    by name), on its share of the CPU threads."""
    import torch
    from planner_traced import CASES, tiny

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.plan_jobs))
    case = next(c for c in (map(tiny, CASES) if args.quick else CASES) if c.name == name)
    return plan_case(case, budgets, args)


def _say(name: str) -> Callable[[str], None]:
    return lambda line: print(f"[{name}] {line}", flush=True)


def _gib(x: float | None) -> str:
    return "—" if x is None else f"{x / GiB:.2f}"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:+.1f}%"


def _line(entry: dict[str, Any]) -> str:
    if "micro_batch" not in entry:
        return f"{entry['budget']}: {entry['run'].get('error', '?')}"
    run = entry["run"]
    measured = (
        f"peak {_gib(entry.get('footprint'))} GiB = {entry['share']:.0%} of the budget, "
        f"{run['num_alloc_retries']} retries, oom {run['oom']}"
        if "share" in entry and entry["share"] is not None
        else ("out of memory" if run.get("oom") else "")
    )
    return (
        f"{entry['budget']}: {entry['micro_batch']} x {entry['accumulate']} predicted {_gib(entry['predicted'])} GiB;"
        f" {measured} -> {entry.get('verdict', '?')} {entry.get('note', '')}"
    ).rstrip()


def budgets_here(args: argparse.Namespace) -> list[tuple[str, float | None, gpu_memory.GpuMemory | None]]:
    """(label, --gpu-memory GiB, detected card) of each budget to plan for."""
    if args.quick:
        card = pretend_card(QUICK_SPARE, 0.85, TRACED_HEADROOM) / GiB
        return [(f"pretend card {card:.3f} GiB (--quick)", card, None)]
    found = [(f"{gib:g} GiB card", gib, None) for gib in args.budget_gib]
    if args.card:
        card = gpu_memory.detect(0)
        if card is None:
            raise SystemExit("--card: no GPU 0 found through NVML")
        found.append((card.label, None, card))
    return found


def _versions() -> str:
    found = []
    for name in ("torch", "transformers", "peft", "accelerate"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# The traced planner's recommendations run in the HF Trainer",
        "",
        f"- date: {meta['date']}; card: {meta['card']}; {meta['versions']}",
        f"- command: `{meta['command']}`",
        f"- {meta['steps']} optimizer steps of transformers.Trainer per run (trainer_loop.py: peft LoRA, the Trainer's"
        " checkpointing, autocast and default AdamW, logging and saving off); peak = max_memory_reserved + memory"
        " outside torch (context, kernels); budget = margin x card; ok = no out-of-memory, no allocator retry, peak"
        f" within the budget and >= {LOW_SHARE:.0%} of it unless the next divisor of the effective batch would not"
        " fit (line through the run and the small run)",
        "- traced error = traced / measured - 1: allocated vs max_memory_allocated, reserved vs max_memory_reserved;"
        " predicted = the search's figure (line through its traces, context included) vs the peak",
        *([f"- {meta['note']}"] if meta.get("note") else []),
        *(
            [f"- every case planned first, {meta['plan_jobs']} at a time: the plan seconds are under that load"]
            if meta.get("plan_jobs", 1) > 1
            else []
        ),
        "",
        "| case | budget (limit GiB) | effective | recommended (b_max) | predicted GiB | peak GiB | of budget | OOM"
        " | retries | ok | traced alloc / res error | predicted error | s (plan / run) | note |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---|",
    ]
    for row in rows:
        for e in row["budgets"]:
            lines.append(_budget_row(row, e))
    lines += [
        "",
        f"At a small micro-batch (accumulation {SMALL_ACCUMULATE}), on the card without a cap:",
        "",
        "| case | micro-batch | measured alloc / res GiB | traced alloc / res GiB | error alloc / res | s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        s = row.get("small") or {}
        run, traced, err = s.get("run", {}), s.get("traced", {}), s.get("errors", {})
        measured = f"{_gib(run.get('max_allocated'))} / {_gib(run.get('max_reserved'))}"
        if "error" in run:
            measured = "failed: " + run["error"][:120]
        traced_text = f"{_gib(traced.get('allocated'))} / {_gib(traced.get('reserved'))}"
        if "traced_error" in s:
            traced_text = "failed: " + s["traced_error"][:120]
        lines.append(
            f"| {row['case']} | {s.get('micro_batch', '—')} | {measured} | {traced_text} | "
            f"{_pct(err.get('allocated'))} / {_pct(err.get('reserved'))} | {run.get('wall_seconds', '—')} |"
        )
    if meta.get("skipped"):
        lines += ["", f"Not started (time budget): {', '.join(meta['skipped'])}"]
    return "\n".join(lines) + "\n"


def _budget_row(row: dict[str, Any], e: dict[str, Any]) -> str:
    head = f"| {row['case']} | {e['budget']} ({_gib(e.get('limit'))}) | {row['effective_batch']} |"
    if "micro_batch" not in e:
        return head + f" {e['run'].get('error', '?')[:160]} ||||||||||"
    run, err = e["run"], e.get("errors", {})
    share = e.get("share")
    verdict = e.get("verdict", "")
    return (
        head + f" {e['micro_batch']} x {e['accumulate']} ({e['b_max']}) | {_gib(e['predicted'])} | "
        f"{_gib(e.get('footprint'))} | {'—' if share is None else format(share, '.0%')} | "
        f"{'yes' if run.get('oom') else 'no' if 'oom' in run else '—'} | {run.get('num_alloc_retries', '—')} | "
        f"{verdict[:100]} | {_pct(err.get('allocated'))} / {_pct(err.get('reserved'))} | {_pct(err.get('predicted'))} | "
        f"{e.get('plan_seconds', '—')} / {run.get('wall_seconds', '—')} | {e.get('note', '')} |"
    )


def plan_all(
    cases: Sequence[Any],
    budgets: Sequence[tuple[str, float | None, gpu_memory.GpuMemory | None]],
    args: argparse.Namespace,
) -> dict[str, dict[str, Any] | None]:
    """With --plan-jobs N > 1, every case's plan first, N at a time in fresh processes (the traces are CPU work;
    their processes end before any Trainer run, so that no other process holds GPU memory while one measures);
    with 1, nothing here: each case is planned just before its runs."""
    if args.plan_jobs <= 1:
        return {}
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.plan_jobs, mp_context=context) as pool:
        futures = {c.name: pool.submit(plan_named, c.name, budgets, args) for c in cases}
        planned = {name: _planned(future) for name, future in futures.items()}
    print(f"planned {len(planned)} cases in {time.perf_counter() - started:.0f} s, {args.plan_jobs} at a time")
    return planned


def _planned(future: concurrent.futures.Future[dict[str, Any]]) -> dict[str, Any] | None:
    """A worker's plan, or None where its process failed (the case is then planned again in this process, just
    before its runs; a planner error is a row of its own, see `plan_case`)."""
    try:
        return future.result()
    except Exception as e:  # one case's failure must not end the others'
        print(f"a planning process failed: {type(e).__name__}: {e}", flush=True)
        return None


def recommend_all(cases: Sequence[Any], args: argparse.Namespace) -> int:
    """Run every case under every budget; JSON after each case, the markdown table at the end."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if args.quick and not args.cases:
        cases = [c for c in cases if c.name in QUICK_CASES]
    budgets = budgets_here(args)
    default_dir = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out = Path(args.out) if args.out else default_dir / "planner_recommend.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    card = gpu_memory.detect(0)
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "card": "no GPU (CPU, --quick)" if args.quick or card is None else card.label,
        "versions": _versions(),
        "command": shlex.join(["python", *sys.argv]),
        "steps": args.steps,
        "plan_jobs": args.plan_jobs,
        "budgets": [label for label, _, _ in budgets],
        "note": "--quick on the CPU: tiny configs, a pretend card; nothing was measured" if args.quick else "",
    }
    started = time.perf_counter()
    planned = plan_all(cases, budgets, args)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for case in cases:
        if time.perf_counter() - started > args.budget:
            skipped.append(case.name)
            continue
        print(f"{case.name} ...", flush=True)
        case_started = time.perf_counter()
        row = planned.get(case.name) or plan_case(case, budgets, args)
        rows.append(run_planned(case, row, args))
        rows[-1]["seconds"] = round(time.perf_counter() - case_started, 1)
        print(f"{case.name}: {rows[-1]['seconds']:.0f} s", flush=True)
        out.write_text(json.dumps({**meta, "rows": rows, "skipped": skipped}, indent=1))  # a killed run keeps these
    meta["skipped"] = skipped
    out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    text = markdown(meta, rows)
    out.with_suffix(".md").write_text(text)
    print(text)
    print(f"{len(rows)} cases in {time.perf_counter() - started:.0f} s; skipped: {', '.join(skipped) or 'none'}")
    print(f"results: {out} and {out.with_suffix('.md')}")
    return 0
