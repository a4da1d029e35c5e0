"""Minimal-diff YAML edits over a corpus of realistic configs: only the intended values' bytes change."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner import apply, backups, trainconfig, yamledit
from gpuopt_tui.core.planner.yamledit import ValueEdit

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "yaml"


def _copy(tmp_path: Path, name: str) -> Path:
    target = tmp_path / Path(name).name
    shutil.copy(CORPUS / name, target)
    return target


def _assert_only_values_changed(old: str, new: str, expected: dict[int, tuple[str, str]]) -> None:
    """Every line is byte-identical except the 1-based lines in `expected`, where exactly the old value's text
    became the new value's text (the rest of the line, comments included, is the same)."""
    old_lines, new_lines = old.splitlines(keepends=True), new.splitlines(keepends=True)
    assert len(old_lines) == len(new_lines)
    changed = {i + 1 for i, (a, b) in enumerate(zip(old_lines, new_lines)) if a != b}
    assert changed == set(expected)
    for line, (before, after) in expected.items():
        a, b = old_lines[line - 1], new_lines[line - 1]
        start = a.index(before)
        assert b == a[:start] + after + a[start + len(before) :], (a, b)


CASES = [
    (
        "lightning.yaml",
        [
            ValueEdit("data_loader.batch_size", 64),
            ValueEdit("training.trainer.accumulate_grad_batches", 1),
            ValueEdit("data.n_positives", 32),
        ],
        {
            "data_loader.batch_size": ("4", "64"),
            "training.trainer.accumulate_grad_batches": ("16", "1"),
            "data.n_positives": ("16", "32"),
        },
    ),
    (
        "lightning.yaml",
        [ValueEdit("training.trainer.precision", "16-mixed"), ValueEdit("model.gradient_checkpointing", False)],
        {
            "training.trainer.precision": ('"bf16-mixed"', '"16-mixed"'),
            "model.gradient_checkpointing": ("true", "false"),
        },
    ),
    (
        "anchors.yaml",
        [ValueEdit("trainer.accumulate_grad_batches", 4), ValueEdit("eval_loader.batch_size", 64)],
        {"trainer.accumulate_grad_batches": ("2", "4"), "eval_loader.batch_size": ("*bs", "64")},
    ),
    (
        "flow.yaml",
        [ValueEdit("data_loader.batch_size", 8), ValueEdit("data_loader.num_workers", 16)],
        {"data_loader.batch_size": ("batch_size: 16, num_workers: 2", "batch_size: 8, num_workers: 16")},
    ),
    (
        "flow.yaml",
        [ValueEdit("trainer.accumulate_grad_batches", 12), ValueEdit("trainer.precision", "32-true")],
        {"trainer.accumulate_grad_batches": ("4, precision: bf16-mixed", "12, precision: 32-true")},
    ),
    (
        "quoted.yaml",
        [ValueEdit("data_loader.batch_size", 48), ValueEdit("trainer.accumulate_grad_batches", 6)],
        {"data_loader.batch_size": ('"24"', '"48"'), "trainer.accumulate_grad_batches": ("3", "6")},
    ),
    (
        "quoted.yaml",
        [ValueEdit("trainer.precision", "bf16-mixed"), ValueEdit("data_loader.name", "a'b")],
        {"trainer.precision": ("'16-mixed'", "'bf16-mixed'"), "data_loader.name": ("'it''s'", "'a''b'")},
    ),
]


@pytest.mark.parametrize(("name", "edits", "texts"), CASES)
def test_edit_changes_only_the_values(tmp_path: Path, name: str, edits: list[ValueEdit], texts: dict) -> None:
    path = _copy(tmp_path, name)
    original = path.read_bytes()
    patch = yamledit.preview(path, edits)
    assert path.read_bytes() == original  # a preview writes nothing
    by_key = {c.key: c.line for c in patch.changes}
    expected = {by_key[key]: pair for key, pair in texts.items()}
    # keys whose value shares a line with another edited key are covered by that line's expectation
    assert set(by_key.values()) == set(expected)
    _assert_only_values_changed(patch.old_text, patch.new_text, expected)
    old_data, new_data = yamledit.load(path), yamledit.parse(patch.new_text, path)
    for edit in edits:
        got = yamledit.lookup(new_data, edit.key, path)
        was_string = isinstance(yamledit.lookup(old_data, edit.key, path), str)
        want = str(edit.value) if was_string else edit.value  # a quoted string stays a string
        assert got == want and type(want) in type(got).__mro__

    (written,) = apply.apply([patch])
    assert path.read_bytes() == patch.new_text.encode()
    assert written.backup == path.with_name(path.name + ".backup.1")
    assert written.backup.read_bytes() == original
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    apply.undo(apply.undo_preview([path]))
    assert path.read_bytes() == original
    assert not written.backup.exists()


def test_diff_names_the_file_and_shows_only_the_value_lines(tmp_path: Path) -> None:
    path = _copy(tmp_path, "lightning.yaml")
    diff = yamledit.preview(path, [ValueEdit("data_loader.batch_size", 12)]).diff
    assert f"--- {path}" in diff
    changed = [line for line in diff.splitlines() if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert changed == ["-  batch_size: 4       # micro-batch per GPU", "+  batch_size: 12       # micro-batch per GPU"]


def test_interpolations_are_never_rewritten(tmp_path: Path) -> None:
    path = _copy(tmp_path, "interpolation.yaml")
    original = path.read_bytes()
    for key in ("data_loader.batch_size", "trainer.accumulate_grad_batches"):
        with pytest.raises(UserError) as e:
            yamledit.preview(path, [ValueEdit(key, 16)])
        assert str(path) in str(e.value) and key in str(e.value) and "interpolation" in str(e.value)
    assert path.read_bytes() == original


def test_anchor_shared_by_aliases_is_refused(tmp_path: Path) -> None:
    path = _copy(tmp_path, "anchors.yaml")
    with pytest.raises(UserError, match=r"would change .*eval_loader\.batch_size"):
        yamledit.preview(path, [ValueEdit("defaults.batch_size", 64)])
    with pytest.raises(UserError, match="merge key"):
        yamledit.preview(path, [ValueEdit("train_loader.batch_size", 64)])


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = _copy(tmp_path, "malformed.yaml")
    original = path.read_bytes()
    with pytest.raises(UserError, match=r"malformed\.yaml: not valid YAML at line \d+"):
        yamledit.preview(path, [ValueEdit("data_loader.batch_size", 8)])
    assert path.read_bytes() == original


def test_missing_key_and_non_scalar_are_refused(tmp_path: Path) -> None:
    path = _copy(tmp_path, "lightning.yaml")
    original = path.read_bytes()
    with pytest.raises(UserError, match=r"no key 'data_loader\.micro_batch'.*there: batch_size"):
        yamledit.preview(path, [ValueEdit("data_loader.micro_batch", 8)])
    with pytest.raises(UserError, match="not a single value"):
        yamledit.preview(path, [ValueEdit("training.optimizer", 8)])
    with pytest.raises(UserError, match="'seed' is not a mapping"):
        yamledit.preview(path, [ValueEdit("seed.value", 8)])
    assert path.read_bytes() == original


def test_read_only_file_is_left_byte_identical(tmp_path: Path) -> None:
    path = _copy(tmp_path, "lightning.yaml")
    original = path.read_bytes()
    patch = yamledit.preview(path, [ValueEdit("data_loader.batch_size", 64)])
    os.chmod(path, 0o444)
    try:
        with pytest.raises(UserError, match="read-only"):
            apply.apply([patch])
    finally:
        os.chmod(path, 0o644)
    assert path.read_bytes() == original
    assert not backups.backups(path)


def test_file_changed_after_preview_is_not_written(tmp_path: Path) -> None:
    path = _copy(tmp_path, "lightning.yaml")
    patch = yamledit.preview(path, [ValueEdit("data_loader.batch_size", 64)])
    edited = path.read_bytes().replace(b"seed: 42", b"seed: 43")
    path.write_bytes(edited)
    with pytest.raises(UserError, match="changed since the preview"):
        apply.apply([patch])
    assert path.read_bytes() == edited
    assert not backups.backups(path)


def test_no_file_is_written_when_one_of_several_fails_its_check(tmp_path: Path) -> None:
    first, second = _copy(tmp_path, "lightning.yaml"), _copy(tmp_path, "flow.yaml")
    originals = first.read_bytes(), second.read_bytes()
    patches = [
        yamledit.preview(first, [ValueEdit("data_loader.batch_size", 64)]),
        yamledit.preview(second, [ValueEdit("data_loader.batch_size", 4)]),
    ]
    second.write_bytes(originals[1] + b"# touched\n")
    with pytest.raises(UserError, match="flow.yaml: the file changed"):
        apply.apply(patches)
    assert first.read_bytes() == originals[0]


def test_crlf_bom_tags_and_values_on_their_own_line(tmp_path: Path) -> None:
    path = tmp_path / "windows.yaml"
    text = (
        "\ufeff# saved on Windows\r\ntrainer:\r\n  accumulate_grad_batches: !!int 4  # tagged\r\n"
        '  batch_size:\r\n    # on its own line\r\n    32\r\n  note: "a # not a comment"\r\n'
    )
    path.write_bytes(text.encode("utf-8"))
    patch = yamledit.preview(
        path, [ValueEdit("trainer.accumulate_grad_batches", 8), ValueEdit("trainer.batch_size", 16)]
    )
    expected = text.replace("!!int 4 ", "!!int 8 ").replace("    32\r\n", "    16\r\n")
    assert patch.new_text == expected
    apply.apply([patch])
    assert path.read_bytes() == expected.encode("utf-8")


def test_an_empty_value_is_refused_not_confused_with_the_next_key(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("loader:\n  batch_size:\n  workers: 3\n")
    with pytest.raises(UserError, match="'loader.batch_size': it has no value"):
        yamledit.preview(path, [ValueEdit("loader.batch_size", 8)])


def test_strings_that_would_change_type_are_quoted(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("name: run-1\nflag: yes-please\n")
    patch = yamledit.preview(path, [ValueEdit("name", "true"), ValueEdit("flag", "a: b")])
    assert patch.new_text == 'name: "true"\nflag: "a: b"\n'


def test_undo_without_backup_is_refused(tmp_path: Path) -> None:
    path = _copy(tmp_path, "flow.yaml")
    with pytest.raises(UserError, match="no backups .* nothing to undo"):
        apply.undo_preview([path])


def test_composed_config_edits_the_file_whose_value_wins(tmp_path: Path) -> None:
    root = tmp_path / "conf"
    shutil.copytree(CORPUS / "hydra", root)
    before = {p: p.read_bytes() for p in root.rglob("*.yaml")}
    config = trainconfig.read(root / "config.yaml", overrides=["experiment=big"])
    patches = trainconfig.preview_edits(config.edits({"batch_size": 24, "accumulate": 4}))
    assert sorted(p.path.relative_to(root).as_posix() for p in patches) == [
        "data_loader/large.yaml",
        "experiment/big.yaml",
    ]
    apply.apply(patches)
    changed = {p.relative_to(root).as_posix() for p in root.rglob("*.yaml") if p.read_bytes() != before[p]}
    assert changed == {"data_loader/large.yaml", "experiment/big.yaml"}
    assert (root / "data_loader" / "large.yaml").read_text() == "batch_size: 24\nnum_workers: 8\n"
    again = trainconfig.read(root / "config.yaml", overrides=["experiment=big"])
    assert again.require("batch_size").value == 24
    assert again.require("accumulate").value == 4


def test_a_merge_key_inside_its_own_anchor_is_a_clear_error() -> None:
    """ruamel.yaml raises AttributeError on it (found by tests/core/test_planner_fuzz.py): the file and the cause."""
    text = "defaults: &defaults\n  batch_size: 32\n  <<: *defaults\n"
    with pytest.raises(UserError, match=r"train\.yaml: YAML the reader cannot build .*merge key"):
        yamledit.parse(text, "train.yaml")
