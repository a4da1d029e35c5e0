"""Generated YAML configs fed to `gpuopt-tui plan --show` and `plan --apply --yes` through the CLI's entry function:
realistic configs mutated (YAML syntax characters, tabs, deleted and repeated lines, anchors and aliases, huge
scalars, a BOM, other encodings) and raw bytes. Every run ends in success or in a one-line error naming the file,
never a traceback or an internal error, with a non-zero exit on errors; the file stays byte-identical and no
other file appears unless an apply succeeded, which leaves the original bytes in its backup."""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuopt_tui.cli import main
from gpuopt_tui.core.planner import yamledit

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "yaml"
BASES = [CORPUS / name for name in ("lightning.yaml", "flow.yaml", "quoted.yaml", "anchors.yaml")]
SYNTAX = ":-[]{}&*!|>#'\"%@`,?\t\n \\"
ALIASES = "bomb: &x [1, 2, 3]\nmore: &y [*x, *x, *x, *x]\nmost: [*y, *y, *y, *y]\nmerged: {<<: {batch_size: 8}}\n"
TRAINER = "trainer: {accumulate_grad_batches: 16}\n"  # with batch_size 4: the plan writes 64 x 1
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# one mutation of the text: (kind, position as a share of the length, text or count)
mutation = st.one_of(
    st.tuples(st.just("insert"), st.floats(0, 1), st.text(alphabet=SYNTAX + "abz019", min_size=1, max_size=6)),
    st.tuples(st.just("delete"), st.floats(0, 1), st.integers(1, 40)),
    st.tuples(st.just("repeat line"), st.floats(0, 1), st.integers(1, 3)),
    st.tuples(st.just("tab"), st.floats(0, 1), st.just("")),
    st.tuples(st.just("append"), st.just(1.0), st.sampled_from([ALIASES, "huge: " + "x" * 300_000 + "\n"])),
)


def mutate(text: str, mutations: list[tuple[str, float, object]]) -> str:
    for kind, where, arg in mutations:
        at = int(where * len(text))
        if kind == "insert":
            text = text[:at] + str(arg) + text[at:]
        elif kind == "delete":
            text = text[:at] + text[at + int(str(arg)) :]
        elif kind == "repeat line":
            lines = text.splitlines(keepends=True) or [""]
            i = min(at * len(lines) // max(len(text), 1), len(lines) - 1)
            text = "".join(lines[: i + 1] + [lines[i]] * int(str(arg)) + lines[i + 1 :])
        elif kind == "tab":
            text = text[:at] + "\t" + text[at + 1 :]
        else:
            text += ("" if text.endswith("\n") else "\n") + str(arg)
    return text


@st.composite
def configs(draw: st.DrawFn) -> bytes:
    """The bytes of a mutated realistic config."""
    text = mutate(draw(st.sampled_from(BASES)).read_text(), draw(st.lists(mutation, max_size=4)))
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8-sig", "utf-16", "latin-1"]))
    return text.encode(encoding, errors="replace")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    config = {"model_type": "bert", "architectures": ["BertModel"], "vocab_size": 1000, "hidden_size": 64}
    config |= {"num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128}
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    return path


def plan(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *args])
    return code, out.getvalue(), err.getvalue()


def check(model: Path, data: bytes, action: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "train config.yaml"
        config.write_bytes(data)
        flags = ["--show"] if action == "show" else ["--apply", "--yes"]
        code, out, err = plan("--config", str(config), "--model", str(model), "--gpu-memory", "24", *flags)
        assert "Traceback" not in out + err and "internal error" not in err, err
        assert code in (0, 1), err
        others = sorted(p.name for p in Path(tmp).iterdir() if p != config)
        if code == 1:
            message = err.removeprefix("gpuopt-tui: error: ")
            assert err.startswith("gpuopt-tui: error: ") and config.name in message, err
        else:
            assert not err.strip(), err
        if code == 0 and others:  # a successful apply: the original is in the backup, the result reads back
            assert action == "apply" and others == ["train config.yaml.backup.1"]
            assert (Path(tmp) / others[0]).read_bytes() == data
            assert isinstance(yamledit.load(config), dict)
        else:
            assert config.read_bytes() == data and not others


@FUZZ
@given(data=configs(), action=st.sampled_from(["show", "apply"]))
def test_mutated_configs(model: Path, data: bytes, action: str) -> None:
    check(model, data, action)


@settings(max_examples=15, deadline=None)
@given(data=st.binary(max_size=400), action=st.sampled_from(["show", "apply"]))
def test_raw_bytes(model: Path, data: bytes, action: str) -> None:
    check(model, data, action)


@pytest.mark.parametrize(
    "text",
    [
        "\ufeffdata_loader:\n  batch_size: 4\n",  # a BOM
        "data_loader:\n\tbatch_size: 4\n",  # a tab for indentation
        "data_loader: {batch_size: 4}\n" + "x: " + "[" * 3000 + "]" * 3000 + "\n",  # nested too deeply
        "data_loader:\n  batch_size: &b 4\n  eval_batch_size: *b\n" + TRAINER,  # an alias of the edited value
        "base: &b {batch_size: 4}\ndata_loader: *b\n" + TRAINER,  # the edited value inside an aliased mapping
        "data_loader:\n  batch_size: 4\n" + "k: " + "é" * 200_000 + "\n",  # a huge scalar
        "\x00\x01data_loader: 4\n",  # control characters
        "",  # empty
    ],
    ids=["bom", "tab", "deep", "scalar-alias", "mapping-alias", "huge", "control", "empty"],
)
@pytest.mark.parametrize("action", ["show", "apply"])
def test_known_hard_cases(model: Path, text: str, action: str) -> None:
    check(model, text.encode("utf-8"), action)
