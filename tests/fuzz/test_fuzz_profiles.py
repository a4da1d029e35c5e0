"""Profiles, damaged at random, fed to `gpuopt-tui profiles --validate` and `profiles --show --set ...` (the
path `run --set` takes before a run starts): ok, or a message naming the file or the `--set`, never a
traceback; the profile file is never written."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from gpuopt_tui.core.kinds import KINDS
from gpuopt_tui.core.paths import shipped_profiles_dir
from gpuopt_tui.core.profiles.schema import describe
from gpuopt_tui.core.runs.layout import RunDir

from .inputs import FUZZ, TOKENS, Result, check_result, damaged, run_cli, unchanged

SHIPPED = sorted(shipped_profiles_dir().glob("*.toml"))
KEYS = sorted({f.key for k in KINDS.values() for f in describe(k.profile)})
VALUES = st.sampled_from([t.decode(errors="replace") for t in TOKENS]) | st.text(max_size=12) | st.just("\x1b[2J")


@FUZZ
@given(data=st.data())
def test_damaged_profiles_validate(scratch: Path, data: st.DataObject) -> None:
    good = data.draw(st.sampled_from(SHIPPED)).read_bytes()
    path = RunDir(scratch).profile
    path.write_bytes(data.draw(damaged(good)))
    unchanged(path, lambda: check_result(run_cli("profiles", "--validate", str(path)), path))


@FUZZ
@given(data=st.data())
def test_any_set_on_a_profile(scratch: Path, data: st.DataObject) -> None:
    source = data.draw(st.sampled_from(SHIPPED))
    path = RunDir(scratch).profile
    path.write_bytes(source.read_bytes())
    keys = st.sampled_from(KEYS) | st.sampled_from(KEYS).map(lambda k: k.rsplit(".", 1)[-1]) | st.text(max_size=10)
    items = data.draw(st.lists(st.tuples(keys, VALUES).map("=".join), min_size=1, max_size=3))
    argv = ["profiles", "--show", str(path), *(f"--set={item}" for item in items)]

    def show() -> None:
        result = run_cli(*argv)
        check_set_result(result, path, items)

    unchanged(path, show)


def check_set_result(result: Result, path: Path, items: list[str]) -> None:
    """A --show either prints the profile or names the culprit: the file, or one of the --set items."""
    text = result.out + result.err
    assert "Traceback" not in text and "internal error" not in text, text
    assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text, text
    assert result.code in (0, 1), result
    if result.code:
        culprits = [str(path), *(f"--set {item.strip()}" for item in items), "--set "]
        assert any(c in result.err for c in culprits), result.err
