"""A TracIn run through the CLI with tracin.optimizer_state = "adam" on a saved tiny Llama-shaped decoder and three
LoRA checkpoints of a real AdamW run, each directory holding the adapter and optimizer.pt as the Trainer writes
them: the CLI, the log, summary.json and the results view name the preconditioning with its settings, and the
agreement check compares with exact Adam-preconditioned gradients. The profile refuses adam with method = factored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lm_cases import save_tiny_decoder, tiny_decoder, tiny_tokenizer
from test_tracin_adam import BETAS, EPS, LRS, train_with_adamw, trainer_groups
from test_tracin_causal_lm_job import lm_profile
from test_tracin_lora_job import cli, run_dir

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.io import profile_from_data
from gpuopt_tui.core.results.tracin_summary import read_summary
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow
SAID = "Adam-preconditioned training gradients (optimizer.pt of each checkpoint): β1 0.8, β2 0.95, ε 0.0001, step 2 / 4 / 6"


def lora_checkpoints(folder: Path) -> list[Path]:
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(tiny_decoder("llama"), config).eval()
    trainer = CausalLMAdapter("llama", model, tiny_tokenizer(), torch.device("cpu"))

    def save(checkpoint: Path) -> Path:
        model.save_pretrained(checkpoint)
        return checkpoint

    return train_with_adamw(trainer, folder, trainer_groups(model, "single"), save)[0]


@pytest.fixture(scope="module")
def adam_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    home = tmp_path_factory.mktemp("adam-run")
    model = save_tiny_decoder("llama", home / "model")
    folders = lora_checkpoints(home / "trainer")
    tracin = 'optimizer_state = "adam"\ntop_k = 2\nagreement_train = 4\n'
    profile = lm_profile(home, model, list(zip(folders, LRS)), tracin)
    done = cli(home, "run", str(profile))
    return home, done.stdout + done.stderr


def test_the_cli_log_summary_and_view_name_the_preconditioning(adam_run: tuple[Path, str]) -> None:
    home, output = adam_run
    assert f"training_gradients: {SAID}" in output
    run = RunDir(run_dir(home))
    log = run.log.read_text()
    assert "training gradients: Adam-preconditioned training gradients (optimizer.pt of each checkpoint)" in log
    assert f"training gradients: {SAID}" in log
    summary_file = run.results / "summary.json"
    summary = json.loads(summary_file.read_text())
    state = summary["optimizer_state"]
    assert state["kind"] == "adam" and "Γ(g) = m̂/(√v̂+ε)" in state["formula"]
    assert [(c["beta1"], c["beta2"], c["eps"], c["step"]) for c in state["checkpoints"]] == [
        (*BETAS, EPS, s) for s in (2, 4, 6)
    ]
    assert all(c["file"].endswith("optimizer.pt") for c in state["checkpoints"])
    assert summary["settings"]["optimizer_state"] == "adam"
    parsed = read_summary(summary_file)
    assert parsed.optimizer_state is not None and parsed.optimizer_state.text == SAID
    assert "Adam-preconditioned" in parsed.mode


def test_the_results_view_names_the_preconditioning(adam_run: tuple[Path, str]) -> None:
    # imported here: the GPU machine runs tests/jobs without the UI's packages
    view = pytest.importorskip("gpuopt_tui.ui.widgets.tracin_summary", exc_type=ImportError)
    home, _ = adam_run
    summary_file = RunDir(run_dir(home)).results / "summary.json"
    formula = json.loads(summary_file.read_text())["optimizer_state"]["formula"]
    shown = view.summary_content(read_summary(summary_file)).plain
    assert f"Training    {SAID}" in shown and formula in shown


def test_the_agreement_check_compares_with_exact_adam_gradients(adam_run: tuple[Path, str]) -> None:
    home, _ = adam_run
    summary = json.loads((RunDir(run_dir(home)).results / "summary.json").read_text())
    agreement = summary["agreement"]
    assert "Adam-preconditioned" in agreement["reference"] and "PEFT adapter" in agreement["reference"]
    assert agreement["spearman"] == pytest.approx(1.0) and agreement["top_k_overlap"] == 1.0


def test_the_profile_refuses_adam_with_the_factored_method() -> None:
    data = {
        "kind": "tracin",
        "model": {"adapter": "demo"},
        "tracin": {"method": "factored", "optimizer_state": "adam"},
    }
    with pytest.raises(UserError, match=r"optimizer_state.*method = factored cannot.*closed_form or vmap"):
        profile_from_data(data, "adam.toml")
    data["tracin"]["method"] = "vmap"
    assert profile_from_data(data, "adam.toml").tracin.optimizer_state == "adam"
    with pytest.raises(UserError, match=r"optimizer_state.*adam"):
        profile_from_data({**data, "tracin": {"optimizer_state": "sgd"}}, "adam.toml")
