"""Profiles: validation messages, overrides, lookup and comment-preserving saves."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuopt_tui.core.errors import ProfileError, UserError
from gpuopt_tui.core.kinds import KINDS
from gpuopt_tui.core.paths import shipped_profiles_dir
from gpuopt_tui.core.profiles.attribution import AttributionProfile
from gpuopt_tui.core.profiles.io import (
    apply_overrides,
    find_profile,
    list_profiles,
    load_profile,
    parse_toml,
    profile_from_data,
    profile_to_toml,
    save_profile,
)
from gpuopt_tui.core.profiles.schema import describe, to_plain


def write(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", sorted(shipped_profiles_dir().glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_profile_is_valid(path: Path) -> None:
    profile = load_profile(path)
    assert profile.kind in KINDS
    assert profile.name == path.stem
    assert profile.description


def test_each_kind_has_a_demo_profile() -> None:
    kinds = {e.kind for e in list_profiles() if e.name.startswith("demo-")}
    assert kinds == set(KINDS)


def test_defaults_fill_missing_keys(tmp_path: Path) -> None:
    profile = load_profile(write(tmp_path, 'kind = "attribution"\n[attribution]\nn_steps = 7\n'))
    assert isinstance(profile, AttributionProfile)
    assert profile.attribution.n_steps == 7
    assert profile.attribution.method == "gausslegendre"
    assert profile.name == "p"


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ('kind = "attribution"\n[attribution]\nn_stepz = 3\n', "attribution.n_stepz", "did you mean 'n_steps'"),
        (
            'kind = "attribution"\n[attribution]\nn_steps = "many"\n',
            "attribution.n_steps",
            'expected an integer or "auto", got "many"',
        ),
        (
            'kind = "attribution"\n[attribution]\nn_steps = 0\n',
            "attribution.n_steps",
            'expected an integer >= 1 or "auto", got 0',
        ),
        ('kind = "attribution"\n[attribution]\nmethod = "simpson"\n', "attribution.method", "expected one of"),
        ('kind = "attribution"\n[attribution]\nuse_amp = 1\n', "attribution.use_amp", "expected true or false"),
        ('kind = "attribution"\nattribution = 3\n', "attribution", "expected a table"),
        ('kind = "attributon"\n', "kind", "did you mean 'attribution'"),
        ("name = 'x'\n", "kind", "missing"),
        (
            'kind = "tracin"\n[tracin]\ncheckpoints = [{ path = "a", lr = -1.0 }]\n',
            "tracin.checkpoints[0].lr",
            ">= 0.0",
        ),
        ('kind = "attribution"\n[model]\nadapter = "hf"\n', "model.path", "local model directory"),
        (
            'kind = "tracin"\n[tracin]\nprojection_basis = "pca"\n',
            "tracin.projection_basis",
            "needs method = factored with projection_in or out",
        ),
    ],
)
def test_bad_values_name_file_key_and_expectation(tmp_path: Path, text: str, key: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert err.value.key == key
    assert expected in str(err.value)
    assert str(path) in str(err.value)


def test_malformed_toml_names_line(tmp_path: Path) -> None:
    path = write(tmp_path, 'kind = "attribution"\n[attribution\nn_steps = 3\n')
    with pytest.raises(ProfileError, match=r"not valid TOML.*line 2"):
        load_profile(path)


def test_overrides_full_and_short_keys(tmp_path: Path) -> None:
    path = write(tmp_path, 'kind = "attribution"\n')
    profile = load_profile(path, ["attribution.n_steps=100", "method=riemann_left", "run.device=cpu"])
    assert profile.attribution.n_steps == 100
    assert profile.attribution.method == "riemann_left"
    assert profile.run.device == "cpu"


def test_override_of_a_text_key_keeps_the_text_as_typed(tmp_path: Path) -> None:
    path = write(tmp_path, 'kind = "attribution"\n')
    profile = load_profile(path, ["attribution.target=1", "run.devices=0,2", "model.path=007"])
    assert profile.attribution.target == "1"
    assert profile.run.devices == "0,2"
    assert profile.model.path == "007"  # not the number 7


def test_override_errors(tmp_path: Path) -> None:
    data = parse_toml('kind = "attribution"\n', "x")
    with pytest.raises(UserError, match="expected key=value"):
        apply_overrides(data, ["n_steps"])
    with pytest.raises(ProfileError, match="no such key"):
        apply_overrides(data, ["nonsense=1"])
    with pytest.raises(ProfileError, match="ambiguous"):
        apply_overrides(data, ["path=x"])  # model.path and data.path
    with pytest.raises(ProfileError, match="expected an integer"):
        load_profile(write(tmp_path, 'kind = "attribution"\n'), ["n_steps=1.5"])


def test_save_keeps_comments_and_changes_only_values(tmp_path: Path) -> None:
    text = (
        "# my experiment\n"
        'kind = "attribution"  # the kind\n'
        "\n[attribution]\n"
        "# fewer steps for a quick look\n"
        "n_steps = 20\n"
        'method = "riemann_middle"\n'
    )
    path = write(tmp_path, text)
    profile = load_profile(path)
    profile.attribution.n_steps = 40
    save_profile(profile, path)
    saved = path.read_text()
    assert "# my experiment" in saved and "# fewer steps for a quick look" in saved
    assert "n_steps = 40" in saved and 'method = "riemann_middle"' in saved
    assert to_plain(load_profile(path)) == to_plain(profile)


@pytest.mark.parametrize(
    "name", ["demo-attribution", "demo-attribution-lm", "demo-tracin", "demo-tracin-lm", "demo-ablation", "demo-plan"]
)
def test_saving_a_shipped_profile_writes_no_defaults(tmp_path: Path, name: str) -> None:
    """A copy saved unchanged is the file as it was; a changed value is added, a count as a number."""
    shipped = (shipped_profiles_dir() / f"{name}.toml").read_text()
    path = write(tmp_path, shipped)
    profile = load_profile(path)
    save_profile(profile, path)
    assert path.read_text() == shipped
    if hasattr(profile.run, "devices"):
        profile.run.devices = "2"
        save_profile(profile, path)
        assert "devices = 2\n" in path.read_text()
        assert to_plain(load_profile(path)) == to_plain(profile)


def test_a_count_in_the_file_keeps_its_type(tmp_path: Path) -> None:
    for text in (
        'kind = "tracin"\nname = "p"\n[run]\ndevices = "2"\nnodes = 1\n',
        'kind = "tracin"\nname = "p"\n[run]\ndevices = 2\n',
    ):
        path = write(tmp_path, text)
        save_profile(load_profile(path), path)
        assert path.read_text() == text


def test_frozen_toml_round_trips() -> None:
    for cls in (k.profile for k in KINDS.values()):
        profile = profile_from_data({"kind": cls.kind}, "x.toml")
        again = profile_from_data(parse_toml(profile_to_toml(profile), "frozen"), "frozen")
        assert to_plain(again) == to_plain(profile)


def test_describe_lists_leaf_keys_with_help() -> None:
    infos = {f.key: f for f in describe(AttributionProfile)}
    assert infos["attribution.n_steps"].type_name == "int"
    assert infos["attribution.alpha_batch_size"].auto
    assert infos["attribution.method"].choices
    assert all(f.help for f in infos.values())


def test_find_profile_by_name_and_errors(tmp_path: Path) -> None:
    assert find_profile("demo-attribution").name == "demo-attribution.toml"
    with pytest.raises(UserError, match="did you mean|one of"):
        find_profile("demo-atribution")
    with pytest.raises(UserError, match="no such profile file"):
        find_profile(str(tmp_path / "missing.toml"))


def test_user_profile_shadows_shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUOPT_TUI_HOME", str(tmp_path))
    user_dir = tmp_path / "config" / "profiles"
    user_dir.mkdir(parents=True)
    (user_dir / "demo-attribution.toml").write_text('kind = "attribution"\ndescription = "mine"\n')
    (user_dir / "broken.toml").write_text("kind = \n")
    entries = {e.name: e for e in list_profiles()}
    assert entries["demo-attribution"].description == "mine" and not entries["demo-attribution"].shipped
    assert entries["broken"].error and "not valid TOML" in entries["broken"].error
    assert find_profile("demo-attribution").parent == user_dir
