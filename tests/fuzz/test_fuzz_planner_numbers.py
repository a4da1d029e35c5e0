"""The values a plan reads from a training config, replaced at random in each framework's layout: huge, negative,
fractional and non-finite numbers, strings, interpolations, lists and mappings at the batch, accumulation,
sequence length, LoRA, precision and samples-per-anchor keys. `plan --auto` answers each within a few seconds with
a plan or a one-line refusal, never a traceback."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from model_configs import BERT_BASE_CLASSIFIER

from .inputs import FUZZ, run_cli

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
SECONDS = 5.0  # per input: a tenth of a second here
# per config: the keys the planner reads from it, as written there
KEYS = {
    "hf_trainer.yaml": ["per_device_train_batch_size", "gradient_accumulation_steps", "max_seq_length", "bf16"],
    "axolotl.yaml": ["micro_batch_size", "gradient_accumulation_steps", "sequence_len", "lora_r", "adapter"],
    "llama_factory.yaml": ["per_device_train_batch_size", "gradient_accumulation_steps", "cutoff_len", "lora_rank"],
    "torchtune.yaml": ["batch_size", "gradient_accumulation_steps", "max_seq_len", "lora_rank"],
    "curriculum.yaml": ["batch_size", "gradient_accumulation_steps", "max_seq_length", "n_positives", "n_negatives"],
}
SCALARS = [
    "0", "-1", "-1000000000", "1000000000", "1" + "0" * 30, "9" * 4000, "-" + "9" * 4000, "9" * 5000, "x" * 5000, "2.5", "-0.0", "1.0e+300", ".nan", ".inf",
    "-.inf", "true", "null", "~", '"16"', "x", "'${data.batch_size}'", "${nowhere}", "[]", "[1, 2]", "{a: 1}",
    "{batch_size: {nested: [1, {deeper: 2}]}}", "0x10", "1_000", "16e0",
]  # fmt: skip
VALUES = st.sampled_from(SCALARS) | st.integers(-(2**80), 2**80).map(str) | st.floats().map(repr)


@pytest.fixture(scope="module")
def model_dir(scratch: Path) -> Path:
    """A BERT-base config, given with --model so that every layout plans without a Hugging Face cache."""
    path = scratch / "bert-base"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(BERT_BASE_CLASSIFIER))
    return path


def with_values(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        line = re.compile(rf"^(\s*{key}:)[^#\n]*", flags=re.M)
        text = line.sub(lambda m, value=value: f"{m.group(1)} {value}  ", text, count=1)
    return text


@FUZZ
@given(data=st.data())
def test_any_value_at_a_planner_key_gets_a_plan_or_a_refusal_in_seconds(
    scratch: Path, model_dir: Path, data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from(sorted(KEYS)))
    keys = data.draw(st.lists(st.sampled_from(KEYS[name]), min_size=1, max_size=3, unique=True))
    values = {key: data.draw(VALUES) for key in keys}
    path = scratch / name
    path.write_text(with_values((CONFIGS / name).read_text(), values))
    start = time.monotonic()
    result = run_cli("plan", "--config", str(path), "--model", str(model_dir), "--gpu-memory", "80", "--auto")
    elapsed = time.monotonic() - start
    text = result.out + result.err
    assert elapsed < SECONDS, (values, elapsed)
    assert "Traceback" not in text and "internal error" not in text, (values, text)
    assert result.code in (0, 1), (values, result)
    if result.code:
        assert result.err.startswith("gpuopt-tui: error: ") and result.err.count("\n") == 1, (values, result.err)
        assert len(result.err) < 1000, (values, result.err)  # a refusal names a value, it does not recite it
    else:
        assert "recommended" in result.out, (values, result.out)
