"""Profiles from damaged or unusual files and `--set` values: each refused with a message that names its
source (the file, or the `--set` that gave the value), or accepted where it is fine (a UTF-8 BOM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuopt_tui.cli import main
from gpuopt_tui.core.errors import ProfileError
from gpuopt_tui.core.kinds import KINDS
from gpuopt_tui.core.profiles.io import list_profiles, load_profile
from gpuopt_tui.core.profiles.schema import describe

FLOAT_KEYS = [(kind, f.key) for kind, k in KINDS.items() for f in describe(k.profile) if f.type_name == "float"]


@pytest.mark.parametrize(("kind", "key"), FLOAT_KEYS, ids=[f"{k}:{key}" for k, key in FLOAT_KEYS])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_key_refuses_nan_and_infinity(tmp_path: Path, kind: str, key: str, value: str) -> None:
    section, _, leaf = key.rpartition(".")
    body = f"[{section}]\n{leaf} = {value}\n" if section else f"{leaf} = {value}\n"
    path = tmp_path / "p.toml"
    path.write_text(f'kind = "{kind}"\n{body}')
    with pytest.raises(
        ProfileError, match=f"key '{key}': expected a finite number( or \"auto\")?, got {value}"
    ) as error:
        load_profile(path)
    assert error.value.source == str(path)
    path.write_text(f'kind = "{kind}"\n')
    with pytest.raises(ProfileError, match=f"key '{key}': expected a finite number") as error:
        load_profile(path, [f"{key}={value}"])
    assert error.value.source == f"--set {key}={value}"


def test_a_bad_set_value_blames_the_set_not_the_file(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('kind = "attribution"\n[attribution]\nn_steps = 0\n')
    with pytest.raises(ProfileError) as error:
        load_profile(path, ["n_steps=7", "attribution.memory_fraction=2"])
    assert str(error.value).startswith("--set attribution.memory_fraction=2: key 'attribution.memory_fraction': ")
    with pytest.raises(ProfileError) as error:  # the file's own mistake is still the file's
        load_profile(path, ["memory_fraction=0.5"])
    assert str(error.value).startswith(f"{path}: key 'attribution.n_steps': ")
    with pytest.raises(ProfileError, match=r"^--set nonsense=1: key 'nonsense': no such key"):
        load_profile(path, ["nonsense=1"])
    with pytest.raises(ProfileError, match=r"no such key; did you mean attribution\.n_steps"):  # typed without section
        load_profile(path, ["n_step=64"])
    with pytest.raises(ProfileError, match=r"^--set run\.device=tpu: key 'run\.device': expected auto, cpu"):
        load_profile(path, ["n_steps=5", "run.device=tpu"])


def test_a_set_below_a_value_that_is_not_a_table_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('kind = "attribution"\nattribution = 5\n')
    with pytest.raises(ProfileError, match=r"key 'attribution': expected a table \(for --set n_steps=3\)"):
        load_profile(path, ["n_steps=3"])


def test_a_profile_with_a_utf8_bom_loads(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_bytes(b'\xef\xbb\xbfkind = "attribution"\n[attribution]\nn_steps = 7\n')
    assert load_profile(path).attribution.n_steps == 7


def test_validate_names_a_missing_model_or_data_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.toml"
    path.write_text('kind = "attribution"\n[model]\nadapter = "hf"\npath = "no-such-model"\n')
    assert main(["profiles", "--validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"invalid {path}: key 'model.path': {tmp_path / 'no-such-model'}: no such file or directory")
    (tmp_path / "no-such-model").mkdir()
    (tmp_path / "no-such-model" / "config.json").write_text("{}")
    assert main(["profiles", "--validate", str(path)]) == 0
    assert capsys.readouterr().out == f"ok {path} (attribution)\n"
    path.write_text('kind = "attribution"\n[data]\nsource = "csv"\npath = "gone.csv"\n')
    assert main(["profiles", "--validate", str(path)]) == 1
    assert "key 'data.path'" in capsys.readouterr().out


@pytest.mark.parametrize(
    "text",
    ['kind = "attribution"\n"[bold]" = 1\n', 'kind = "attribution"\nname = "\\u001b[31m[/]"\n[x]\n', "kind = [\n"],
)
def test_validate_prints_file_contents_as_plain_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    path = tmp_path / "p.toml"
    path.write_text(text)
    assert main(["profiles", "--validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"invalid {path}: ") and "\x1b" not in out


def test_listing_shows_broken_profiles_and_their_reason_as_plain_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GPUOPT_TUI_HOME", str(tmp_path))
    user_dir = tmp_path / "config" / "profiles"
    user_dir.mkdir(parents=True)
    (user_dir / "typo.toml").write_text('kind = "atribution"\n')
    (user_dir / "markup.toml").write_text('kind = "attribution"\ndescription = "[/] \\u001b[2J"\n')
    entries = {e.name: e for e in list_profiles()}
    assert "unknown run kind 'atribution' (did you mean 'attribution'?)" in entries["typo"].error
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    assert "unknown run kind" in out and "[/] ?[2J" in out and "\x1b" not in out
