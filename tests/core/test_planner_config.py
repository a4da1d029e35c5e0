"""Reading training configs: Hydra-style composition, role keys, interpolations, and a whole planning session."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner import apply, session, trainconfig
from gpuopt_tui.core.planner.compose import compose
from gpuopt_tui.core.planner.gpu import GpuMemory
from gpuopt_tui.core.planner.search import CLOSED_FORM_HEADROOM
from gpuopt_tui.core.profiles.plan import PlanProfile
from gpuopt_tui.core.profiles.schema import build

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "yaml"
GIB = 1024**3
TINY_BERT = {
    "model_type": "bert",
    "architectures": ["BertModel"],
    "vocab_size": 1000,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 128,
}


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    shutil.copytree(CORPUS / "hydra", tmp_path / "conf")
    return tmp_path / "conf"


def _names(root: Path, overrides: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    return [
        (layer.path.relative_to(root).as_posix(), layer.package)
        for layer in compose(root / "config.yaml", overrides).layers
    ]


def test_defaults_lists_expand_in_order_with_self_last(conf: Path) -> None:
    assert _names(conf) == [
        ("data_loader/default.yaml", "data_loader"),
        ("training/lightning.yaml", "training"),
        ("model/bert.yaml", "model"),
        ("config.yaml", ""),
    ]
    # an experiment with `# @package _global_` and `override /data_loader: large`
    assert _names(conf, ("experiment=big",)) == [
        ("data_loader/large.yaml", "data_loader"),
        ("training/lightning.yaml", "training"),
        ("model/bert.yaml", "model"),
        ("experiment/big.yaml", ""),
        ("config.yaml", ""),
    ]


def test_self_first_lets_the_defaults_win(conf: Path) -> None:
    text = (
        (conf / "config.yaml").read_text().replace("  - _self_\n", "").replace("defaults:\n", "defaults:\n  - _self_\n")
    )
    (conf / "config.yaml").write_text(text + "data_loader:\n  batch_size: 99\n")
    config = trainconfig.read(conf / "config.yaml")
    assert config.require("batch_size").value == 8
    assert config.require("batch_size").path == conf / "data_loader" / "default.yaml"
    (conf / "config.yaml").write_text(text.replace("  - _self_\n", "") + "data_loader:\n  batch_size: 99\n")
    assert trainconfig.read(conf / "config.yaml").require("batch_size").value == 99


def test_package_overrides_optional_and_missing_groups(conf: Path) -> None:
    (conf / "config.yaml").write_text(
        "defaults:\n  - data_loader@loader: large\n  - optional extras: none\n  - /training: lightning\n"
    )
    assert _names(conf) == [
        ("data_loader/large.yaml", "loader"),
        ("training/lightning.yaml", "training"),
        ("config.yaml", ""),
    ]
    assert trainconfig.read(conf / "config.yaml", {"batch_size": "loader.batch_size"}).require("batch_size").value == 48
    (conf / "config.yaml").write_text("defaults:\n  - data_loader: huge\n")
    with pytest.raises(UserError, match=r"names data_loader/huge, but .*huge\.yaml does not exist"):
        compose(conf / "config.yaml")
    (conf / "config.yaml").write_text("defaults:\n  - config\n")
    with pytest.raises(UserError, match="includes itself"):
        compose(conf / "config.yaml")


def test_roles_found_with_their_winning_files(conf: Path) -> None:
    config = trainconfig.read(conf / "config.yaml", overrides=["experiment=big"])
    accumulate = config.require("accumulate")
    assert (accumulate.value, accumulate.path.name, accumulate.file_key) == (
        2,
        "big.yaml",
        "training.trainer.accumulate_grad_batches",
    )
    assert config.require("seq_len").value == 64
    assert config.get("n_positives") is None
    with pytest.raises(UserError, match=r"no n_positives found \(looked for data.n_positives.*--key n_positives="):
        config.require("n_positives")


def test_interpolations_are_read_but_never_written(tmp_path: Path) -> None:
    path = tmp_path / "interpolation.yaml"
    shutil.copy(CORPUS / "interpolation.yaml", path)
    config = trainconfig.read(path, {"accumulate": "trainer.accumulate_grad_batches"})
    assert config.require("batch_size").value == 32  # ${base_batch} resolved for reading
    with pytest.raises(UserError, match=r"interpolation.yaml: 'data_loader.batch_size' is an interpolation"):
        trainconfig.preview_edits(config.edits({"batch_size": 64}))
    with pytest.raises(UserError, match="an interpolation the planner cannot resolve"):
        config.typed("accumulate")


def test_key_overrides_are_validated() -> None:
    assert trainconfig.parse_keys(["batch_size=data.train.bs"]) == {"batch_size": "data.train.bs"}
    with pytest.raises(UserError, match='unknown role "bs"'):
        trainconfig.parse_keys(["bs=data.bs"])
    with pytest.raises(UserError, match="expected role=dotted.key"):
        trainconfig.parse_keys(["batch_size"])


def test_lightning_config_sets_the_training_step(tmp_path: Path) -> None:
    path = tmp_path / "lightning.yaml"
    shutil.copy(CORPUS / "lightning.yaml", path)
    config = trainconfig.read(path)
    assert config.layout.name == "lightning" and not config.unread
    values = {role: config.typed(role)[0] for role in trainconfig.ROLES}
    assert values == {
        "model": None,  # model.encoder is not a key the planner reads a model from
        "batch_size": 4,
        "accumulate": 16,
        "seq_len": 128,
        "precision": "bf16-mixed",
        "trainable": "lora",
        "lora_rank": 8,
        "lora_targets": ("query", "value"),
        "gradient_checkpointing": True,
        "devices": 1,
        "zero_stage": None,
        "n_positives": 16,
        "n_negatives": 8,
    }
    assert config.require("accumulate").where == f"{path}:29"


def _profile(**plan: object) -> PlanProfile:
    model = {"adapter": "hf", "path": str(plan.pop("model"))}
    return build(PlanProfile, {"model": model, "plan": plan}, "test")


def test_a_session_from_profile_to_written_config(conf: Path, tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_BERT))
    stages = [str(conf / "curriculum" / "01_stage.yaml"), str(conf / "curriculum" / "02_stage.yaml")]
    profile = _profile(
        model=tmp_path / "model", config=str(conf / "config.yaml"), overrides=["experiment=big"], stages=stages
    )
    inputs = session.prepare(profile, gpu=GpuMemory(4 * GIB, "test card"))
    assert (inputs.setup.micro_batch, inputs.setup.accumulate, inputs.target) == (48, 2, 96)
    assert inputs.spec.task == "embedding" and inputs.budget.limit == int(0.85 * 4 * GIB)
    current = session.estimate_current(inputs)
    assert current.total > 0
    rec = session.recommend_closed_form(inputs)
    assert rec.chosen.effective_batch == 96 and rec.chosen.fits and rec.headroom == CLOSED_FORM_HEADROOM
    assert not session.measurable_here(inputs)  # the budget is for a 4 GiB test card, not a GPU found here
    preferred, measured = session.recommend_preferred(inputs)
    assert measured is None and preferred == rec
    assert [s.stage.n_positives for s in rec.stages] == [32, 16]
    assert rec.stages[0].b_max <= rec.stages[1].b_max and rec.b_max == rec.stages[0].b_max
    patches = session.planned_patches(inputs, rec, tune_samples=True)
    touched = sorted(p.path.relative_to(conf).as_posix() for p in patches)
    assert touched[:2] == ["curriculum/01_stage.yaml", "curriculum/02_stage.yaml"]
    assert "data_loader/large.yaml" in touched
    apply.apply(patches)
    again = trainconfig.read(conf / "config.yaml", overrides=["experiment=big"])
    assert again.require("batch_size").value == rec.chosen.micro_batch
    assert again.require("accumulate").value == rec.chosen.accumulate
    first = trainconfig.read(conf / "curriculum" / "01_stage.yaml")
    assert first.require("n_positives").value == rec.stages[0].max_positives


def test_plugin_models_need_a_config(tmp_path: Path) -> None:
    profile = build(PlanProfile, {"model": {"adapter": "plugin", "factory": "pkg.mod:make"}}, "test")
    with pytest.raises(UserError, match="give --model DIR"):
        session.prepare(profile, gpu=GpuMemory(GIB, "x"))


def test_demo_config_is_read_from_the_demo_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUOPT_TUI_CACHE_DIR", str(tmp_path))
    for version, layers in ((1, 2), (3, 4)):
        model_dir = tmp_path / "demo" / f"classifier-v{version}" / "model"
        model_dir.mkdir(parents=True)
        (model_dir / "config.json").write_text(json.dumps({**TINY_BERT, "num_hidden_layers": layers}))
    assert session.demo_config("classifier")["num_hidden_layers"] == 4  # the newest cache version


def test_planner_core_imports_neither_torch_nor_ruamel() -> None:
    code = (
        "import sys\n"
        "import gpuopt_tui.core.planner.session, gpuopt_tui.core.planner.yamledit, gpuopt_tui.commands.plan\n"
        "heavy = [m for m in ('torch', 'transformers', 'textual', 'ruamel.yaml') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _plan_error(config: Path) -> str:
    """The message a plan of `config` stops with."""
    profile = build(PlanProfile, {"name": "p", "plan": {"config": str(config), "gpu_memory_gb": 24.0}}, "test")
    with pytest.raises(UserError) as e:
        session.prepare(profile)
    return str(e.value)


@pytest.mark.parametrize("kind", ["fifo", "fifo behind a .yaml link", "device", "directory"])
def test_a_config_that_is_not_a_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    """A FIFO would block the read until a writer came, /dev/zero would fill the memory."""
    config = tmp_path / "config.yaml"
    if kind == "directory":
        config.mkdir()
    elif kind == "device":
        config.symlink_to("/dev/zero")
    else:
        os.mkfifo(tmp_path / "pipe")
        if kind == "fifo":
            config = tmp_path / "pipe"
        else:
            config.symlink_to(tmp_path / "pipe")
    assert f"{config}: not a regular file" in _plan_error(config)


def test_a_config_over_the_size_limit_is_refused_naming_its_size(tmp_path: Path) -> None:
    config = tmp_path / "huge.yaml"
    config.write_text("batch_size: 8\n" + "# padding\n" * (1024**2 // 10))
    message = _plan_error(config)
    assert f"{config}: 1.0 MiB, larger than the 1.0 MiB a training config may have" in message


@pytest.mark.parametrize("entry", ["../../outside/victim", "/etc/hostname"])
def test_a_defaults_entry_leading_outside_the_config_tree_is_refused(conf: Path, entry: str) -> None:
    outside = conf.parent / "outside"
    outside.mkdir()
    (outside / "victim.yaml").write_text("batch_size: 8\n")
    text = (conf / "config.yaml").read_text()
    (conf / "config.yaml").write_text(text.replace("defaults:\n", f"defaults:\n  - data_loader: {entry}\n", 1))
    with pytest.raises(UserError, match=r"config\.yaml: the defaults list names data_loader/.*outside the config"):
        compose(conf / "config.yaml")


def test_the_traced_search_traces_each_micro_batch_at_the_accumulation_it_would_get(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a step's second micro-batch on, the gradients of the first are kept: a trace at accumulation 1 misses
    them wherever the recommendation accumulates. Here they are 1 GiB of a synthetic trace: the recommendation's
    figure holds them, and every trace ran at the accumulation its micro-batch gets for the effective batch (2
    standing for more)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_BERT))
    inputs = session.prepare(_profile(model=tmp_path / "model", effective_batch=64), gpu=GpuMemory(40 * GIB, "card"))
    seen: dict[int, int] = {}

    def trace(request: dict, log: object = None) -> dict:
        micro, accumulate = int(request["micro_batch"]), int(request["accumulate"])
        seen[micro] = accumulate
        kept = GIB if accumulate > 1 else 0
        return {"components": {}, "max_allocated": 2 * GIB + kept + micro * GIB // 2, "peak_phase": "backward",
                "peak_step": 2, "params": 1, "trainable_params": 1}  # fmt: skip

    monkeypatch.setattr(session, "run_trace", trace)
    lines: list[str] = []
    plan = session.trace_probes(inputs, lines.append)
    rec, plan = session.recommend_traced(inputs, plan, lines.append)
    assert seen and all(acc == min(2, session.accumulate_for(b, 64)) for b, acc in seen.items())
    said = {int(line.split("b=")[1].split()[0].rstrip(":")): "accumulating" in line for line in lines if "b=" in line}
    assert said == {b: acc > 1 for b, acc in seen.items()}  # each trace's line says whether it accumulated
    assert rec.chosen.accumulate > 1 and seen[rec.chosen.micro_batch] == 2
    at_chosen = 2 * GIB + GIB + rec.chosen.micro_batch * GIB // 2
    assert rec.chosen.peak >= at_chosen
