"""Causal LM rows as chat messages (data.messages_field) on a tiny random Llama with the tests' word-level tokenizer
and its small chat template (lm_cases.CHAT_TEMPLATE): the prompt's and completion's tensors against a hand-written
rendering and against today's prompt + completion path, attribution and TracIn runs (through the CLI too), and the
message of each bad row."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lm_cases import save_tiny_decoder, tiny_decoder, tiny_tokenizer
from test_tracin_lora import save_lora_checkpoints
from test_tracin_support import assert_top_proponents

from gpuopt_tui.core.errors import ProfileError, UserError
from gpuopt_tui.core.profiles.attribution import CompletionDataSection
from gpuopt_tui.core.profiles.common import ModelSection
from gpuopt_tui.core.profiles.io import load_profile, profile_from_data
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.jobs.attribution.job import run_job
from gpuopt_tui.jobs.context import JobContext
from gpuopt_tui.jobs.data import TextDataset, load_dataset
from gpuopt_tui.jobs.models import load_adapter
from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter
from gpuopt_tui.jobs.tracin import select_parameters, tracin_scores
from gpuopt_tui.jobs.tracin.checkpoints import resolve_checkpoints

CPU = torch.device("cpu")


def chat(*turns: tuple[str, str]) -> dict[str, Any]:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


SINGLE = [  # one user turn: today's path with data.chat_template = true gives the same tensors
    ("the cat sat on the", "big red mat"),
    ("a dog", "ran"),
    ("the quick blue river and the sun", "sleeps under the hill"),
]
MULTI = [
    chat(("user", "the cat"), ("assistant", "sat on the mat"), ("user", "and a dog"), ("assistant", "ran")),
    chat(("user", "snow and rain"), ("assistant", "not good")),
    chat(("user", "the moon"), ("assistant", "very"), ("user", "and the sun"), ("assistant", "very happy")),
]
# MULTI[0] as the template writes it, by hand; the completion follows the generation prompt
MULTI_0_TOKENS = ["<|user|>", "the", "cat", "<|assistant|>", "sat", "on", "the", "mat"]
MULTI_0_TOKENS += ["<|user|>", "and", "a", "dog", "<|assistant|>"]


def jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def adapter() -> CausalLMAdapter:
    return CausalLMAdapter("llama", tiny_decoder("llama"), tiny_tokenizer(), CPU)


def read(adapter: CausalLMAdapter, path: Path, **data: Any) -> TextDataset:
    section = CompletionDataSection(source="jsonl", path=str(path), max_length=32, **data)
    return load_dataset(section, adapter)


def test_a_single_user_turn_gives_the_tensors_of_a_prompt_through_the_chat_template(
    adapter: CausalLMAdapter, tmp_path: Path
) -> None:
    plain = jsonl(tmp_path / "plain.jsonl", [{"text": p, "completion": c} for p, c in SINGLE])
    messages = jsonl(tmp_path / "chat.jsonl", [chat(("user", p), ("assistant", c)) for p, c in SINGLE])
    expected = read(adapter, plain, chat_template=True)
    got = read(adapter, messages, messages_field="messages")
    assert expected.tensors.keys() == got.tensors.keys()
    for key, value in expected.tensors.items():
        assert torch.equal(got.tensors[key], value), key
    assert got.meta["completions"] == [c for _, c in SINGLE]
    assert got.texts == [f"user: {p}" for p, _ in SINGLE]


def test_the_prompt_is_the_template_over_all_messages_but_the_last(adapter: CausalLMAdapter, tmp_path: Path) -> None:
    ds = read(adapter, jsonl(tmp_path / "multi.jsonl", MULTI), messages_field="messages")
    ids, mask = ds.tensors["input_ids"][0], ds.tensors["attention_mask"][0].bool()
    assert adapter.tokens(ids[mask].tolist()) == MULTI_0_TOKENS  # no BOS: the template writes no BOS
    rendered = " ".join(MULTI_0_TOKENS)  # the tokenizer splits on spaces: the same tokens from the written text
    assert ids[mask].tolist() == adapter.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    completion = ds.tensors["completion_ids"][0][ds.tensors["completion_mask"][0].bool()]
    assert adapter.tokens(completion.tolist()) == ["ran"]  # no special tokens around the completion
    assert ds.texts[0] == "user: the cat\nassistant: sat on the mat\nuser: and a dog"
    assert ds.meta["completions"] == ["ran", "not good", "very happy"]


def bad_row(adapter: CausalLMAdapter, tmp_path: Path, row: dict[str, Any], **data: Any) -> str:
    """The message of reading a file whose second row is `row`."""
    path = jsonl(tmp_path / "bad.jsonl", [MULTI[1], row])
    with pytest.raises(UserError) as caught:
        read(adapter, path, **({"messages_field": "messages"} | data))
    message = str(caught.value)
    assert message.startswith(f"{path}:2: "), message
    return message


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"text": "the cat"}, 'missing key "messages"'),
        ({"messages": "user: the cat"}, '"messages" must be a non-empty list of .* got a string .*jsonl'),
        ({"messages": {"role": "user", "content": "a"}}, "must be a non-empty list .* got dict"),
        ({"messages": []}, "must be a non-empty list .* got an empty list"),
        ({"messages": [{"role": "user"}, {"role": "assistant", "content": "ran"}]}, r"messages\[0\] must be an object"),
        ({"messages": [["user", "a dog"], {"role": "assistant", "content": "ran"}]}, r"messages\[0\] must be an"),
        ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}, 'string "role" and'),
        (
            chat(("user", "a dog"), ("assistant", "ran"), ("user", "and")),
            "must all end with the assistant.s message .*or "
            'all before it .*this one ends with role "user", .*:1.s with role "assistant"',
        ),
        (chat(("assistant", "ran")), "holds only the assistant's message: the prompt needs one before it"),
        (chat(("user", "a dog"), ("assistant", "")), r'the completion \(the last message in "messages"\) has no'),
    ],
)
def test_a_bad_row_is_named_with_what_was_expected(
    adapter: CausalLMAdapter, tmp_path: Path, row: dict[str, Any], expected: str
) -> None:
    message = bad_row(adapter, tmp_path, row)
    assert re.search(expected, message), message


def test_conversations_that_end_before_the_assistant_are_prompts_without_completions(
    adapter: CausalLMAdapter, tmp_path: Path
) -> None:
    """The whole conversation is the prompt, rendered with the generation prompt: MULTI[0] without its last message
    gives MULTI[0]'s prompt tokens, and there are no completions to read."""
    turns = [chat(*((m["role"], m["content"]) for m in row["messages"][:-1])) for row in MULTI]
    ds = read(adapter, jsonl(tmp_path / "open.jsonl", turns), messages_field="messages")
    ids, mask = ds.tensors["input_ids"][0], ds.tensors["attention_mask"][0].bool()
    assert adapter.tokens(ids[mask].tolist()) == MULTI_0_TOKENS
    assert ds.meta["completions"] is None and ds.tensors["completion_ids"].shape == (len(MULTI), 0)
    assert ds.texts[0] == "user: the cat\nassistant: sat on the mat\nuser: and a dog"


def test_a_template_that_refuses_the_messages_is_named(tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    strict = CausalLMAdapter("strict", tiny_decoder("llama"), tokenizer, CPU)
    message = bad_row(strict, tmp_path, chat(("system", "be kind"), ("user", "a dog"), ("assistant", "ran")))
    assert "the chat template of strict refused the messages: no system role" in message


def test_a_prompt_the_template_renders_empty_is_refused(tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    bare = CausalLMAdapter("bare", tiny_decoder("llama"), tokenizer, CPU)
    message = bad_row(bare, tmp_path, chat(("system", "be kind"), ("assistant", "ran")))
    assert "the prompt has no tokens" in message


def test_a_tokenizer_without_a_chat_template_is_named(tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    plain = CausalLMAdapter("plain", tiny_decoder("llama"), tokenizer, CPU)
    path = jsonl(tmp_path / "chat.jsonl", MULTI)
    with pytest.raises(UserError, match="no chat template") as caught:
        read(plain, path, messages_field="messages")
    assert f'data.messages_field = "messages" ({path})' in str(caught.value)
    assert "the tokenizer of plain" in str(caught.value)


def test_a_csv_file_is_told_to_be_jsonl(adapter: CausalLMAdapter, tmp_path: Path) -> None:
    path = tmp_path / "chat.csv"
    path.write_text('messages\n"[{""role"": ""user"", ""content"": ""a""}]"\n')
    section = CompletionDataSection(source="csv", path=str(path), messages_field="messages")
    with pytest.raises(UserError, match=f"{path}:2: .*got a string .*jsonl"):
        load_dataset(section, adapter)


@pytest.mark.parametrize(("key", "value"), [("text_field", "prompt"), ("target_field", "answer")])
def test_the_profile_refuses_text_or_target_fields_beside_messages(key: str, value: str) -> None:
    data = {"kind": "tracin", "data": {"messages_field": "messages", key: value}}
    with pytest.raises(ProfileError, match=f"data.{key}': not read when data.messages_field is set"):
        profile_from_data(data, "chat.toml")


# --- runs ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("chat_rows")
    save_tiny_decoder("llama", root / "model")
    jsonl(root / "single.jsonl", [chat(("user", p), ("assistant", c)) for p, c in SINGLE])
    jsonl(root / "plain.jsonl", [{"text": p, "completion": c} for p, c in SINGLE])
    jsonl(root / "multi.jsonl", MULTI)
    return root


def attribution_profile(workdir: Path, data: dict[str, Any], **attribution: Any) -> dict[str, Any]:
    settings = {"n_steps": 8, "batch_size": 2, "audit_samples": 0, **attribution}
    return {
        "kind": "attribution",
        "run": {"device": "cpu"},
        "model": {"adapter": "hf", "path": str(workdir / "model")},
        "data": {"source": "jsonl", "max_length": 32, **data},
        "attribution": settings,
    }


def attribute(workdir: Path, name: str, data: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    run_dir = workdir / "runs" / name
    run_dir.mkdir(parents=True)
    ctx = JobContext(run_dir, EventWriter(RunDir(run_dir).events), run_dir / "cache")
    run_job(profile_from_data(attribution_profile(workdir, data), "test.toml"), ctx)
    results = RunDir(run_dir).results
    records = [json.loads(line) for line in (results / "attributions.jsonl").read_text().splitlines()]
    return records, json.loads((results / "summary.json").read_text())


def test_attribution_of_messages_rows_equals_the_chat_template_path(workdir: Path) -> None:
    plain, _ = attribute(workdir, "plain", {"path": str(workdir / "plain.jsonl"), "chat_template": True})
    records, summary = attribute(workdir, "chat", {"path": str(workdir / "single.jsonl"), "messages_field": "messages"})
    assert summary["completions"]["source"].startswith('data.messages_field = "messages": the last (assistant)')
    for record, expected in zip(records, plain, strict=True):
        assert record["text"] == "user: " + expected["text"]
        for key in ("tokens", "scores", "completion", "completion_tokens", "logprob", "delta"):
            assert record[key] == expected[key], key


def test_attribution_generates_the_assistants_turn_of_open_conversations(workdir: Path, tmp_path: Path) -> None:
    """Conversations ending with the user's message, target = "generate": the model's greedy reply is the completion,
    explained as a read one would be; without target = "generate" the run says what is missing."""
    turns = [chat(*((m["role"], m["content"]) for m in row["messages"][:-1])) for row in MULTI]
    data = {"path": str(jsonl(tmp_path / "open.jsonl", turns)), "messages_field": "messages"}
    run_dir = tmp_path / "runs" / "open"
    run_dir.mkdir(parents=True)
    ctx = JobContext(run_dir, EventWriter(RunDir(run_dir).events), run_dir / "cache")
    profile = attribution_profile(workdir, data, target="generate", max_new_tokens=3)
    run_job(profile_from_data(profile, "test.toml"), ctx)
    results = RunDir(run_dir).results
    records = [json.loads(line) for line in (results / "attributions.jsonl").read_text().splitlines()]
    summary = json.loads((results / "summary.json").read_text())
    assert summary["completions"]["source"].startswith("generated")
    assert records[0]["tokens"] == MULTI_0_TOKENS and all(r["generated"] for r in records)
    assert all(1 <= len(r["completion_tokens"]) <= 3 for r in records)
    with pytest.raises(UserError, match='no completions \\(the conversations in "messages" end before the assistant'):
        run_job(profile_from_data(attribution_profile(workdir, data), "test.toml"), ctx)


def write_toml(path: Path, profile: dict[str, Any]) -> Path:
    lines = [f'kind = "{profile["kind"]}"']
    for name, table in profile.items():
        if isinstance(table, dict):
            lines.append(f"[{name}]")
            lines += [f"{key} = {json.dumps(value)}" for key, value in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def cli_run(profile: Path, runs: Path) -> RunDir:
    env = {**os.environ, "GPUOPT_TUI_RUNS_DIR": str(runs), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "gpuopt_tui", "run", str(profile)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    (run_dir,) = runs.iterdir()
    return RunDir(run_dir)


@pytest.mark.slow
def test_a_per_target_token_attribution_of_messages_rows_through_the_cli(workdir: Path, tmp_path: Path) -> None:
    data = {"path": str(workdir / "multi.jsonl"), "messages_field": "messages"}
    profile = write_toml(tmp_path / "chat.toml", attribution_profile(workdir, data, per_target_token=True))
    results = cli_run(profile, tmp_path / "runs").results
    records = [json.loads(line) for line in (results / "attributions.jsonl").read_text().splitlines()]
    summary = json.loads((results / "summary.json").read_text())
    assert summary["completions"]["per_target_token"] and summary["completions"]["source"].startswith("data.messages")
    assert records[0]["text"] == "user: the cat\nassistant: sat on the mat\nuser: and a dog"
    assert records[0]["tokens"] == MULTI_0_TOKENS
    for record, row in zip(records, MULTI, strict=True):
        assert record["completion"] == row["messages"][-1]["content"]
        assert torch.tensor(record["matrix"]).shape == (len(record["completion_tokens"]), len(record["tokens"]))


TRAIN = [
    chat(("user", "the cat sat on the"), ("assistant", "big red mat")),
    chat(("system", "be very happy"), ("user", "a dog"), ("assistant", "ran")),
    chat(("user", "the small blue dog"), ("assistant", "ran"), ("user", "under the"), ("assistant", "rug")),
    chat(("user", "a happy cat"), ("assistant", "sat on the mat")),
    chat(("user", "the red"), ("assistant", "dog ran on the big rug")),
]
TEST = [chat(("user", "the dog sat"), ("assistant", "on the mat")), MULTI[0]]


@pytest.mark.slow
def test_a_tracin_run_on_messages_rows_with_lora_checkpoints_through_the_cli(tmp_path: Path) -> None:
    model = save_tiny_decoder("llama", tmp_path / "model")
    specs = save_lora_checkpoints("llama", tmp_path / "lora", dtype=torch.float32)
    profile = {
        "kind": "tracin",
        "run": {"device": "cpu"},
        "model": {"adapter": "hf", "path": str(model)},
        "data": {"source": "jsonl", "path": str(jsonl(tmp_path / "test.jsonl", TEST)), "messages_field": "messages"},
        "tracin": {"train_path": str(jsonl(tmp_path / "train.jsonl", TRAIN)), "top_k": 2},
    }
    path = write_toml(tmp_path / "chat.toml", profile)
    checkpoints = ", ".join(f'{{ path = "{spec.path}", lr = {spec.lr} }}' for spec in specs)
    path.write_text(path.read_text() + f"checkpoints = [{checkpoints}]\n")
    results = cli_run(path, tmp_path / "runs").results
    records = [json.loads(line) for line in (results / "influence.jsonl").read_text().splitlines()]
    summary = json.loads((results / "summary.json").read_text())
    assert summary["completions"].startswith('data.messages_field = "messages"')
    assert summary["checkpoint_kind"] == "PEFT adapter" and summary["parameter_choice"]["layers"] == "adapter"
    assert [r["text"] for r in records] == [
        "user: the dog sat",
        "user: the cat\nassistant: sat on the mat\nuser: and a dog",
    ]
    assert [r["completion"] for r in records] == ["on the mat", "ran"]
    by_text = {"\n".join(f"{m['role']}: {m['content']}" for m in row["messages"][:-1]): row for row in TRAIN}
    for record in records:
        for neighbour in record["proponents"] + record["opponents"]:
            assert by_text[neighbour["text"]]["messages"][-1]["content"] == neighbour["completion"]

    # the same scores from the engine in this process, on the profile's data read by the same reader
    loaded = load_profile(path)
    adapter = load_adapter(ModelSection(adapter="hf", path=str(model)), CPU, tmp_path / "cache")
    train = load_dataset(loaded.data, adapter, path=loaded.tracin.train_path)
    test = load_dataset(loaded.data, adapter)
    resolved = resolve_checkpoints(loaded.tracin.checkpoints, adapter)
    names = select_parameters(adapter, test.batch([0]), "auto")
    assert names == summary["parameter_tensors"]
    expected = tracin_scores(adapter, resolved, train, test, names)
    assert expected.matrix is not None
    assert_top_proponents(records, expected.matrix)
