"""How the GPU screen names the run a process belongs to."""

from gpuopt_tui.ui.widgets.gpu_view import run_label


def test_a_run_is_named_by_its_kind_and_suffix() -> None:
    assert run_label("20261126-033729-attribution-e52e") == "attribution-e52e"
    assert run_label("20261126-033729-tracin-0a1b") == "tracin-0a1b"


def test_other_names_are_kept_or_cut_with_an_ellipsis() -> None:
    assert run_label("my-run") == "my-run"
    assert run_label("x" * 30) == "x" * 19 + "…"
