"""Training configs of the common frameworks read without --key, every value printed with its source; precedence
(command line > config > profile > default); models found in the Hugging Face cache, or the plan stops."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from model_configs import BERT_BASE_CLASSIFIER

from gpuopt_tui.cli import main
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner import session, trainconfig
from gpuopt_tui.core.planner.gpu import GpuMemory
from gpuopt_tui.core.profiles.plan import PlanProfile
from gpuopt_tui.core.profiles.schema import build

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
GIB = 1024**3
QWEN2_05B = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}
# per config: the layout detected, and (value label, value, line of the config it is read from)
EXPECTED = {
    "hf_trainer.yaml": (
        "HF Trainer (TrainingArguments)",
        [
            ("model", "bert-base-uncased", 4),
            ("micro-batch", "16", 9),
            ("accumulation", "4", 11),
            ("sequence length", "256", 12),
            ("precision", "bf16-mixed", 18),
            ("checkpointing", "on", 19),
        ],
    ),
    "axolotl.yaml": (
        "axolotl",
        [
            ("model", "Qwen/Qwen2-0.5B", 2),
            ("micro-batch", "2", 30),
            ("accumulation", "4", 29),
            ("sequence length", "1024", 17),
            ("precision", "bf16-mixed", 36),
            ("trains", "lora", 21),
            ("LoRA rank", "16", 22),
            ("LoRA targets", "q_proj,v_proj", 25),
            ("checkpointing", "on", 38),
        ],
    ),
    "llama_factory.yaml": (
        "LLaMA-Factory",
        [
            ("model", "Qwen/Qwen2-0.5B", 2),
            ("micro-batch", "1", 27),
            ("accumulation", "8", 28),
            ("sequence length", "2048", 15),
            ("precision", "bf16-mixed", 33),
            ("trains", "lora", 8),
            ("LoRA rank", "8", 9),
            ("LoRA targets", "all-linear", 10),
        ],
    ),
    "torchtune.yaml": (
        "torchtune",
        [
            ("model", "models/Qwen2-0.5B", 25),
            ("micro-batch", "4", 37),
            ("accumulation", "8", 51),
            ("sequence length", "1024", 21),
            ("precision", "bf16-mixed", 56),
            ("trains", "lora", 13),
            ("LoRA rank", "32", 13),
            ("LoRA targets", "q_proj,v_proj", 11),
            ("checkpointing", "on", 57),
        ],
    ),
    "curriculum.yaml": (
        "curriculum",
        [
            ("model", "bert-base-uncased", 3),
            ("micro-batch", "8", 12),
            ("accumulation", "2", 13),
            ("sequence length", "512", 17),
            ("precision", "bf16-mixed", 18),
            ("positives per anchor", "4", 8),
            ("negatives per anchor", "12", 9),
        ],
    ),
}


def _snapshot(cache: Path, repo: str, config: dict[str, object]) -> Path:
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0123abcd")
    return snapshot


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The configs in the working directory, BERT-base and Qwen2-0.5B configs in a Hugging Face cache (HF_HUB_CACHE)
    and a local Qwen2 download next to the torchtune config."""
    cache = tmp_path / "hub"
    _snapshot(cache, "bert-base-uncased", BERT_BASE_CLASSIFIER)
    _snapshot(cache, "Qwen/Qwen2-0.5B", QWEN2_05B)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    work = tmp_path / "work"
    shutil.copytree(CONFIGS, work)
    (work / "models" / "Qwen2-0.5B").mkdir(parents=True)
    (work / "models" / "Qwen2-0.5B" / "config.json").write_text(json.dumps(QWEN2_05B))
    monkeypatch.chdir(work)
    monkeypatch.setenv("COLUMNS", "200")  # the values table on one line per value
    return work


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def rows(out: str) -> dict[str, list[str]]:
    """The values table's rows by label: [value, source, ...] (the table is printed 80 columns wide)."""
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        if len(cells) >= 3:
            found.setdefault(cells[0], cells[1:])
    return found


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_framework_is_read_without_keys_with_every_source_printed(
    name: str, work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    layout, expected = EXPECTED[name]
    code, out, err = plan(capsys, "--config", name, "--gpu-memory", "80", "--show")
    assert code == 0, err
    assert f"config {name}, read as {layout}" in out
    table = rows(out)
    for label, value, line in expected:
        assert table[label][0].startswith(value), (label, table[label])
        assert table[label][1] == f"{name}:{line}", (label, table[label])


BATCH_KEYS = {  # the key each config sets its micro-batch with
    "hf_trainer.yaml": "per_device_train_batch_size",
    "axolotl.yaml": "micro_batch_size",
    "llama_factory.yaml": "per_device_train_batch_size",
    "torchtune.yaml": "batch_size",
    "curriculum.yaml": "batch_size",
}


@pytest.mark.parametrize("value", ["1000000000", "1" + "0" * 30])
@pytest.mark.parametrize("name", sorted(BATCH_KEYS))
def test_a_micro_batch_no_gpu_could_hold_is_refused_naming_its_key(
    name: str, value: str, work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = BATCH_KEYS[name]
    text = re.sub(rf"^(\s*{key}:) *\d+", rf"\g<1> {value}", (work / name).read_text(), count=1, flags=re.M)
    (work / "huge.yaml").write_text(text)
    code, _, err = plan(capsys, "--config", "huge.yaml", "--gpu-memory", "80", "--auto")
    assert code == 1
    assert "huge.yaml:" in err and f"{key}' = {value}, expected at most 1,048,576" in err


def test_a_framework_default_is_named_and_a_missing_memory_value_warns(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (work / "hf_trainer.yaml").read_text()
    (work / "hf.yaml").write_text(text.replace("max_seq_length: 256\n", "").replace("bf16: true\n", ""))
    code, out, err = plan(capsys, "--config", "hf.yaml", "--gpu-memory", "80", "--show")
    assert code == 0, err
    table = rows(out)
    assert table["precision"][:2] == [
        "fp32",
        "HF Trainer (TrainingArguments) default",
    ]  # TrainingArguments' own default
    assert table["sequence length"][:2] == ["128", "default"]
    assert "warning sequence length is set nowhere (command line, config or profile): planning for the default 128" in (
        " ".join(out.split())
    )
    assert "warning precision" not in out


def test_command_line_beats_config_beats_profile(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (work / "p.toml").write_text(
        'kind = "plan"\nname = "p"\n[model]\nadapter = "demo"\n[plan]\nseq_len = 32\nmicro_batch = 64\n'
        'precision = "fp32"\ngpu_memory_gb = 24.0\n'
    )
    code, out, err = plan(capsys, "--from", "p.toml", "--config", "hf_trainer.yaml", "--show", "--batch", "4")
    assert code == 0, err
    table = rows(out)
    assert table["sequence length"][:3] == ["256", "hf_trainer.yaml:12", "32 (profile p)"]  # config > profile
    assert table["micro-batch"][:3] == ["4", "--batch", "16 (hf_trainer.yaml:9)"]  # command line > config
    assert table["model"][1] == "hf_trainer.yaml:4"  # the config's model, not the profile's demo model
    # without the config the profile's values hold, named as the profile's
    code, out, err = plan(capsys, "--from", "p.toml", "--show")
    assert code == 0, err
    table = rows(out)
    assert table["sequence length"][:2] == ["32", "profile p"] and table["precision"][:2] == ["fp32", "profile p"]
    assert "warning planning the demo classifier model (profile p): the config names no model" in " ".join(out.split())


def test_saved_runs_and_the_screen_resolve_the_same_way(work: Path) -> None:
    """Without a command line (the planner screen, a plan run) the config still wins over the profile."""
    profile = build(PlanProfile, {"name": "demo-plan", "plan": {"config": "curriculum.yaml", "seq_len": 32}}, "test")
    inputs = session.prepare(profile, gpu=GpuMemory(24 * GIB, "test card"))
    seq = next(v for v in inputs.values if v.role == "seq_len")
    assert (seq.value, seq.source, seq.overridden) == (512, "curriculum.yaml:17", ("32 (profile demo-plan)",))
    assert inputs.setup.seq_len == 512 and inputs.spec.hidden == 768  # bert-base-uncased from the cache
    assert inputs.setup.sequences_per_example == 17


def test_a_model_named_but_not_here_stops_the_plan(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (work / "hf_trainer.yaml").read_text().replace("bert-base-uncased", "org/not-downloaded")
    (work / "hf.yaml").write_text(text)
    code, out, err = plan(capsys, "--config", "hf.yaml", "--gpu-memory", "24", "--auto")
    assert code != 0 and out == ""
    message = " ".join(err.split())
    assert "hf.yaml:4: model_name_or_path: the config names the model 'org/not-downloaded'" in message
    assert "models--org--not-downloaded" in message and "never downloads" in message and "--model DIR" in message
    # --model (the command line) wins over the config's name
    model = work / "bert"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(BERT_BASE_CLASSIFIER))
    code, out, err = plan(capsys, "--config", "hf.yaml", "--model", str(model), "--gpu-memory", "24", "--show")
    assert code == 0, err
    assert rows(out)["model"][1:3] == ["--model", "org/not-downloaded (hf.yaml:4)"]


def test_a_task_guessed_from_a_config_without_architectures_is_a_warning(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = work / "bert"
    model.mkdir()
    named = ["--config", "hf_trainer.yaml", "--model", str(model), "--gpu-memory", "24", "--show"]
    (model / "config.json").write_text(json.dumps(BERT_BASE_CLASSIFIER))  # BertForSequenceClassification
    code, out, err = plan(capsys, *named)
    assert code == 0, err
    assert "names no architecture" not in out
    (model / "config.json").write_text(
        json.dumps({k: v for k, v in BERT_BASE_CLASSIFIER.items() if k != "architectures"})
    )
    code, out, err = plan(capsys, *named)
    assert code == 0, err
    assert "warning the model's config.json names no architecture: planning for classification" in " ".join(out.split())
    code, out, err = plan(capsys, *named, "--set", "plan.task=masked_lm")
    assert code == 0, err
    assert "names no architecture" not in out and "bert masked_lm" in out


def test_accumulation_is_looked_for_under_train_and_keys_still_override(work: Path) -> None:
    config = trainconfig.read(work / "curriculum.yaml")
    assert config.require("accumulate").file_key == "train.gradient_accumulation_steps"
    with pytest.raises(UserError, match=r"curriculum.yaml:4: 'model.pooling' = 'mean', expected a positive integer"):
        trainconfig.read(work / "curriculum.yaml", {"seq_len": "model.pooling"}).typed("seq_len")
