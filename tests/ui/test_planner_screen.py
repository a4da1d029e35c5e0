"""The planner screen on real YAML configs in temporary directories: both tiers labelled, the breakdown adding up,
candidates and stages, the diff previewed in a dialog, writing with a backup (or refusing), undo, and measuring
(no GPU here: refused; with a stand-in GPU: a background run, then its saved plan on the Measured tab)."""

from __future__ import annotations

import io
import json
import re
import shutil
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from model_configs import BERT_BASE
from rich.console import Console, RenderableType
from textual.pilot import Pilot
from textual.widgets import DataTable

import gpuopt_tui.app as app_module
from gpuopt_tui.app import GpuOptApp, make_app
from gpuopt_tui.core.atomic import atomic_write_text
from gpuopt_tui.core.format import human_bytes
from gpuopt_tui.core.planner import apply, session, yamledit
from gpuopt_tui.core.planner import gpu as gpu_memory
from gpuopt_tui.core.planner.fit import ProbeResult
from gpuopt_tui.core.planner.measure import measure
from gpuopt_tui.core.planner.report import candidate_rows
from gpuopt_tui.core.planner.yamledit import FilePatch
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.profiles.plan import PlanProfile
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.lifecycle import create_run
from gpuopt_tui.jobs import planjob
from gpuopt_tui.jobs.context import JobContext
from gpuopt_tui.ui.screens.planner import EstimateRead, PlannerScreen
from gpuopt_tui.ui.widgets.diff_dialog import DiffDialog
from gpuopt_tui.ui.widgets.planner_view import PlanView
from gpuopt_tui.ui.widgets.tab_switch import TabSwitch

from .conftest import notifications, screen_text, wait_for, widget_text

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "yaml"
GIB = 1024**3
MIB = 1024**2


@pytest.fixture
def work(tmp_path: Path, user_profiles: Path) -> dict[str, Path]:
    """A model config, a Lightning training config with two curriculum stage files, and a plan profile for them
    saved as the user's demo-plan (so the screen opens it)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(BERT_BASE))
    config = tmp_path / "train.yaml"
    shutil.copy(CORPUS / "lightning.yaml", config)
    stages = [tmp_path / name for name in ("01_stage.yaml", "02_stage.yaml")]
    for stage in stages:
        shutil.copy(CORPUS / "hydra" / "curriculum" / stage.name, stage)
    profile = user_profiles / "demo-plan.toml"
    profile.write_text(
        f"""# a plan for the embedder
kind = "plan"
name = "demo-plan"

[model]
adapter = "hf"
path = "{model}"

[plan]
config = "{config}"
stages = ["{stages[0]}", "{stages[1]}"]
trainable = "lora"
gradient_checkpointing = true
gpu_memory_gb = 24.0
""",
        encoding="utf-8",
    )
    return {"config": config, "profile": profile, "backup": config.with_name(config.name + ".backup.1"), "model": model}


def wide_text(renderables: Sequence[RenderableType]) -> str:
    """Rendered on a console wide enough that no path folds."""
    console = Console(width=400, record=True, file=io.StringIO())
    for r in renderables:
        console.print(r)
    return console.export_text()


def one_space(text: str) -> str:
    """Runs of three or more spaces (table padding) as two."""
    return re.sub(r" {3,}", "  ", text)


def plan_profile(path: Path) -> PlanProfile:
    profile = load_profile(path)
    assert isinstance(profile, PlanProfile)
    return profile


def expected_patches(profile_path: Path) -> list[FilePatch]:
    """What writing the closed-form recommendation changes, computed without the screen."""
    inputs = session.prepare(plan_profile(profile_path))
    rec = session.recommend_closed_form(inputs)
    return [p for p in session.planned_patches(inputs, rec) if p.changes]


def planner(app: GpuOptApp) -> PlannerScreen:
    screen = app.screen
    assert isinstance(screen, PlannerScreen)
    return screen


async def estimated(pilot: Pilot[Any]) -> PlanView:
    """The closed-form view once its plan is shown."""
    view = planner(pilot.app).query_one("#plan-closed", PlanView)
    await wait_for(pilot, lambda: view.plan is not None)
    await pilot.pause()
    return view


async def preview(pilot: Pilot[Any]) -> DiffDialog:
    await pilot.press("ctrl+o")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, DiffDialog))
    dialog = pilot.app.screen
    assert isinstance(dialog, DiffDialog)
    return dialog


async def test_estimate_is_labelled_adds_up_shows_candidates_and_stages_and_follows_the_form(
    work: dict[str, Path],
) -> None:
    inputs = session.prepare(plan_profile(work["profile"]))
    est = session.estimate_current(inputs)
    rec = session.recommend_closed_form(inputs)
    assert sum(c.bytes for c in est.components if c.in_peak) == est.total
    app = make_app(screen="planner")
    async with app.run_test(size=(120, 150)) as pilot:
        view = await estimated(pilot)
        text = screen_text(app)
        lines = text.splitlines()
        assert "Closed-form estimate" in text and "Measured" in text  # the tabs
        assert view.plan is not None and view.plan.current is not None
        assert view.plan.head.plain == f"closed-form estimate of {inputs.model.label}, peak at {est.phase}"
        assert "closed-form estimate of" in text
        # the breakdown: every component with its size and whether it is at the peak; those at the peak are the bar
        assert view.plan.current.used == est.total
        assert f"current setup: {human_bytes(est.total)} of 24.0 GiB" in text
        for c in est.components:
            row = next(line for line in lines if f"■ {c.label} " in line)
            assert human_bytes(c.bytes) in row
            assert ("yes" in row.split(human_bytes(c.bytes))[1]) == c.in_peak
        assert any("total on the GPU" in line and human_bytes(est.total) in line for line in lines)
        setup = view.plan.details[1].plain
        assert setup.startswith("setup bf16-mixed, adamw, trains lora (r=8, query,value), checkpointing on, seq 128")
        # the candidates side by side, the cursor on the recommended one
        c = rec.chosen
        assert f"> recommended (exact): micro-batch {c.micro_batch} x accumulate {c.accumulate}" in text
        assert rec.headroom == 0.05 and "closed-form estimate; 5% of the budget kept back for its error" in text
        table = view.query_one(DataTable)
        rows = candidate_rows(rec)
        assert table.row_count == len(rows)
        for i, (candidate, chosen) in enumerate(rows):
            cells = [str(cell) for cell in table.get_row_at(i)]
            assert cells[1:4] == [str(candidate.micro_batch), str(candidate.accumulate), str(candidate.effective_batch)]
            assert cells[5] == human_bytes(candidate.peak)
            assert cells[0].startswith(">") == chosen
        assert view.selected is not None
        assert (view.selected.micro_batch, view.selected.accumulate) == (c.micro_batch, c.accumulate)
        # one plan per curriculum stage
        assert "curriculum stages" in text
        for stage in rec.stages:
            row = next(line for line in lines if Path(stage.stage.name).name in line)
            assert f" {stage.stage.n_positives} " in row and f"{stage.max_positives} + {stage.max_negatives}" in row
        # every value with its source: the config's line, the profile's, and what the config's values override
        assert "read as Lightning + Hydra" in text
        values = wide_text(view.plan.details)
        assert f"sequence length  128  {work['config']}:17" in one_space(values)
        assert f"model  {work['model']}/config.json  profile demo-plan" in one_space(values)
        # an edit of the form is estimated again; a value the config sets still wins over the form's (the profile's)
        first = view.plan
        planner(app).form.edit_key("plan.seq_len").value = "64"
        planner(app).form.edit_key("plan.optimizer").value = "sgd"
        await wait_for(pilot, lambda: view.plan is not first and "sgd" in view.plan.details[1].plain)
        assert view.plan is not None
        assert "setup bf16-mixed, sgd" in view.plan.details[1].plain and "seq 128," in view.plan.details[1].plain
        assert "64 (profile demo-plan)" in wide_text(view.plan.details)


async def test_preview_cancel_refusals_apply_and_undo(work: dict[str, Path]) -> None:
    config, backup = work["config"], work["backup"]
    original = config.read_bytes()
    (patch,) = expected_patches(work["profile"])
    app = make_app(screen="planner")
    async with app.run_test(size=(120, 40)) as pilot:
        await estimated(pilot)
        await pilot.press("ctrl+z")
        await wait_for(pilot, lambda: any("nothing to undo" in n for n in notifications(app)))

        # the preview is exactly the patch's diff; cancel leaves the file as it was
        dialog = await preview(pilot)
        assert dialog.diff == patch.diff
        assert widget_text(app, "#diff-text").splitlines() == patch.diff.splitlines()
        assert "Apply (y)" in screen_text(app)
        await pilot.press("n")
        await wait_for(pilot, lambda: not isinstance(app.screen, DiffDialog))
        await app.workers.wait_for_complete()
        assert config.read_bytes() == original and not backup.exists()

        # a file edited after the preview is refused and left as edited
        await preview(pilot)
        edited = original + b"# tuned by hand\n"
        config.write_bytes(edited)
        await pilot.press("y")
        await wait_for(pilot, lambda: any("changed since the preview" in n for n in notifications(app)))
        assert any("nothing was written, preview again" in n for n in notifications(app))
        assert config.read_bytes() == edited and not backup.exists()
        config.write_bytes(original)

        # a read-only file is refused
        await preview(pilot)
        config.chmod(0o444)
        await pilot.press("y")
        await wait_for(pilot, lambda: any("the file is read-only" in n for n in notifications(app)))
        assert config.read_bytes() == original and not backup.exists()
        config.chmod(0o644)

        # confirmed: only the values change, and the original is kept as the backup
        await preview(pilot)
        await pilot.press("y")
        await wait_for(pilot, lambda: any("wrote train.yaml" in n for n in notifications(app)))
        assert backup.read_bytes() == original
        written = config.read_bytes()
        assert written.decode() == patch.new_text
        old, new = original.decode().splitlines(), patch.new_text.splitlines()
        assert len(old) == len(new)
        changed = [i + 1 for i, (a, b) in enumerate(zip(old, new)) if a != b]
        assert changed == sorted(change.line for change in patch.changes)
        for n in changed:
            a, b = old[n - 1], new[n - 1]
            assert a.split(":")[0] == b.split(":")[0] and a.partition("#")[2] == b.partition("#")[2]
        data = yamledit.load(config)
        values = {change.key: change.new for change in patch.changes}
        assert data["data_loader"]["batch_size"] == values["data_loader.batch_size"]

        # undo shows its own diff; keep changes nothing, restore puts the original back byte for byte
        await pilot.press("ctrl+z")
        await wait_for(pilot, lambda: isinstance(app.screen, DiffDialog))
        assert isinstance(app.screen, DiffDialog)
        assert app.screen.diff == "".join(r.diff for r in apply.undo_preview([config]))
        assert "Restore (y)" in screen_text(app)
        await pilot.press("n")
        await wait_for(pilot, lambda: not isinstance(app.screen, DiffDialog))
        assert config.read_bytes() == written

        # a file edited after the undo preview is refused and left as edited, its backup kept
        await pilot.press("ctrl+z")
        await wait_for(pilot, lambda: isinstance(app.screen, DiffDialog))
        config.write_bytes(written + b"# tuned by hand\n")
        await pilot.press("y")
        await wait_for(pilot, lambda: any("nothing was restored, undo again" in n for n in notifications(app)))
        assert config.read_bytes() == written + b"# tuned by hand\n" and backup.read_bytes() == original

        # an edit made before the preview is shown first, and the question says it is lost
        await pilot.press("ctrl+z")
        await wait_for(pilot, lambda: isinstance(app.screen, DiffDialog))
        assert isinstance(app.screen, DiffDialog)
        assert app.screen.diff.index("+# tuned by hand") < app.screen.diff.index("-# tuned by hand")
        assert "changed after the planner wrote it" in " ".join(widget_text(app, ".dialog-text").split())
        await pilot.press("n")
        await wait_for(pilot, lambda: not isinstance(app.screen, DiffDialog))
        config.write_bytes(written)

        await pilot.press("ctrl+z")
        await wait_for(pilot, lambda: isinstance(app.screen, DiffDialog))
        assert "changed after the planner wrote it" not in " ".join(widget_text(app, ".dialog-text").split())
        await pilot.press("y")
        await wait_for(pilot, lambda: any("restored train.yaml" in n for n in notifications(app)))
    assert config.read_bytes() == original
    assert not backup.exists()


async def test_measuring_needs_a_gpu_and_runs_in_the_background(
    work: dict[str, Path], runs_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_memory, "detect", lambda index=0, binding=None: None)
    monkeypatch.setattr(app_module, "start_run", lambda profile, source=None: create_run(profile, source))
    app = make_app(screen="planner")
    async with app.run_test(size=(120, 40)) as pilot:
        await estimated(pilot)
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: any("No GPU 0 found here" in n for n in notifications(app)))
        await pilot.pause()
        assert planner(app).query_one("#plan-tabs", TabSwitch).active == "plan-measured"
        message = widget_text(app, "#plan-measured .plan-head")
        assert "measuring needs a GPU, so no run was started" in message
        assert not runs_root.exists() or not any(runs_root.iterdir())

        monkeypatch.setattr(gpu_memory, "detect", lambda index=0, binding=None: stand_in_gpu(24 * GIB))
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: runs_root.exists() and any(runs_root.iterdir()))
        (run_dir,) = runs_root.iterdir()
        frozen = plan_profile(run_dir / "profile.toml")
        assert frozen.plan.measure is True
        assert frozen.plan.config == str(work["config"])
        await wait_for(pilot, lambda: f"Measuring on GPU 0: run {run_dir.name}" in screen_text(app))


def stand_in_gpu(total: int) -> gpu_memory.GpuMemory:
    return gpu_memory.GpuMemory(total=total, label="Stand-in GPU (GPU 0, NVML)")


class LinearGpu:
    """Probes of a GPU whose peak reserved memory grows by a fixed amount per sequence."""

    def __init__(self, total: int) -> None:
        self.total = total

    def __call__(self, request: Mapping[str, Any]) -> ProbeResult:
        batch = int(request["micro_batch"])
        sequences = batch * (1 + int(request["n_positives"]) + int(request["n_negatives"]))
        reserved = GIB + sequences * 24 * MIB
        context = 500 * MIB
        if reserved + context > self.total:
            return ProbeResult(batch, sequences, oom=True, gpu_total=self.total)
        return ProbeResult(batch, sequences, max_reserved=reserved, context=context, gpu_total=self.total)


def finished_measured_run(profile_path: Path, runs_root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A plan run with measure = true, done by the plan engine against the stand-in GPU."""
    total = 24 * GIB
    monkeypatch.setattr(gpu_memory, "detect", lambda index=0, binding=None: stand_in_gpu(total))
    monkeypatch.setattr(session, "measure", partial(measure, probe=LinearGpu(total)))
    profile = plan_profile(profile_path)
    profile.plan.measure = True
    run_dir = create_run(profile, source=profile_path, root=runs_root)
    events = EventWriter(run_dir / "events.jsonl")
    events.emit("started", pid=0, attempt=1)
    summary = planjob.run_job(profile, JobContext(run_dir, events, runs_root / "cache"))
    events.emit("finished", summary=summary)
    events.close()
    atomic_write_text(run_dir / "pid.json", '{"pid": 0, "attempt": 1}')
    return run_dir


async def test_a_measured_run_shows_on_the_measured_tab_and_can_be_written(
    work: dict[str, Path], runs_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = finished_measured_run(work["profile"], runs_root, monkeypatch)
    saved = json.loads((run_dir / "results" / "plan.json").read_text())
    chosen = saved["recommendation"]["chosen"]
    assert saved["recommendation"]["tier"] == "measured" and saved["recommendation"]["headroom"] == 0.0  # no drift
    closed = session.recommend_closed_form(session.prepare(plan_profile(work["profile"]))).chosen
    assert (chosen["micro_batch"], chosen["accumulate"]) != (closed.micro_batch, closed.accumulate)
    confirmed = saved["measured"]["confirmed_micro_batch"]
    app = make_app(screen="planner")
    async with app.run_test(size=(120, 60)) as pilot:
        await estimated(pilot)
        view = planner(app).query_one("#plan-measured", PlanView)
        await wait_for(pilot, lambda: view.plan is not None)
        planner(app).query_one("#plan-tabs", TabSwitch).active = "plan-measured"
        await pilot.pause()
        text = screen_text(app)
        assert "measured on GPU 0 of" in text and run_dir.name in text
        assert f"micro-batch {chosen['micro_batch']} x accumulate {chosen['accumulate']}" in text
        assert "measured: nothing kept back" in text
        probes = next(line for line in text.splitlines() if "probes b=" in line)
        assert f"b={saved['measured']['probes'][0]['micro_batch']} " in probes
        assert f"b={confirmed} {human_bytes(GIB + confirmed * 57 * 24 * MIB + 500 * MIB)} confirmed" in text
        # the measured recommendation is what Preview writes from this tab, not the closed form's
        dialog = await preview(pilot)
        assert f"micro-batch {chosen['micro_batch']} x accumulate {chosen['accumulate']}" in widget_text(
            app, ".dialog-text"
        )
        assert "measured" in widget_text(app, ".dialog-text")
        assert f"+  batch_size: {chosen['micro_batch']} " in dialog.diff


TINY_PHI = {  # a family the closed form does not cover
    "model_type": "phi",
    "architectures": ["PhiForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
}


async def test_trace_shows_a_family_the_closed_form_refuses(work: dict[str, Path]) -> None:
    (work["model"] / "config.json").write_text(json.dumps(TINY_PHI))
    config = work["config"].read_text().replace("[query, value]", "[q_proj, v_proj]")  # Phi's attention linears
    work["config"].write_text(config)
    app = make_app(screen="planner")
    async with app.run_test(size=(120, 150)) as pilot:
        closed = planner(app).query_one("#plan-closed", PlanView)
        await wait_for(pilot, lambda: "phi" in widget_text(app, "#plan-closed .plan-head"))
        assert closed.plan is None
        assert "Trace on the planner screen" in widget_text(app, "#plan-closed .plan-head")
        await pilot.press("ctrl+y")
        assert planner(app).query_one("#plan-tabs", TabSwitch).active == "plan-traced"
        assert "Tracing one training step on fake tensors" in widget_text(app, "#plan-traced .plan-head")
        await wait_for(pilot, lambda: "Tracing" not in widget_text(app, "#plan-traced .plan-head"), timeout=300)
        text = " ".join(screen_text(app).split())
        assert "traced on fake tensors (no GPU): PhiForCausalLM" in text, text
        assert "closed form no estimate: " in text and 'model_type "phi"' in text
        assert "model.layers.*" in text and "Activations" in text and "CUDA context" in text  # by module


async def test_an_estimate_that_arrives_after_the_views_are_gone_is_dropped(work: dict[str, Path]) -> None:
    """The app can close while an estimate runs (its worker thread replies after the screen's widgets are removed):
    the reply is dropped, not an error of the closing app."""
    app = make_app(screen="planner")
    async with app.run_test(size=(120, 40)) as pilot:
        await estimated(pilot)
        screen = planner(app)
        await screen.query_one("#plan-tabs").remove()
        late = EstimateRead(screen._seq + 1)
        late.value = None  # never read: nothing is left to show it
        screen.post_message(late)
        await pilot.pause()
        assert app.screen is screen and screen._shown == late.key
