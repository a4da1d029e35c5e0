"""A run's files in a dialog: enter opens the highlighted one in the pager, `e` in the editor; binary files are
listed but not offered."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from gpuopt_tui.core.format import human_bytes
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.ui.widgets.confirm import Dialog
from gpuopt_tui.ui.widgets.run_results import result_files


@dataclass(frozen=True)
class Picked:
    path: Path
    role: str  # "pager" or "editor"


def run_files(run_dir: Path) -> list[tuple[Path, int]]:
    """The run's result files, then its log, frozen profile, events and meta data (those that exist)."""
    found = [(RunDir(run_dir).results / name, size) for name, size in result_files(run_dir)]
    for name in RunDir.OWN_FILES:
        try:
            found.append((run_dir / name, (run_dir / name).stat().st_size))
        except OSError:
            continue
    return found


def is_binary(path: Path) -> bool:
    """Whether the file holds binary data (a NUL byte in its first KiB, as tensors and arrays have): a pager or
    an editor would show it as garbage, so it is listed but not offered."""
    try:
        with path.open("rb") as f:
            return b"\0" in f.read(1024)
    except OSError:
        return False  # the pager says why it cannot be read


def _option(path: Path, size: int, run_dir: Path) -> Option:
    label = f"{path.relative_to(run_dir)}  {human_bytes(size)}"
    if is_binary(path):
        return Option(Content.assemble(label, ("  binary: read it with Python", "dim")), id=str(path), disabled=True)
    return Option(label, id=str(path))


class FilePicker(Dialog[Picked | None]):
    """Dismissed with the file picked and how to open it, or None (escape)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("e", "pick('editor')", "Editor", id="files.editor", tooltip="Open the file in $EDITOR"),
        Binding("escape", "dismiss(None)", "Close", id="files.close"),
    ]
    DEFAULT_CSS = """
    FilePicker .dialog { width: 90; }
    FilePicker OptionList { height: auto; max-height: 20; }
    """

    def __init__(self, run_id: str, run_dir: Path) -> None:
        super().__init__()
        self._run_id = run_id
        self._run_dir = run_dir
        self._files = run_files(run_dir)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(
                Content.assemble(
                    "Files of ", (self._run_id, "bold"), ": enter opens one in $PAGER, e in $EDITOR, escape closes."
                ),
                classes="dialog-text",
            )
            yield OptionList(
                *(_option(path, size, self._run_dir) for path, size in self._files), id="run-files", compact=True
            )

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    @on(OptionList.OptionSelected)
    def _selected(self) -> None:
        self.action_pick("pager")

    def action_pick(self, role: str) -> None:
        options = self.query_one(OptionList)
        if options.highlighted is not None:
            option_id = options.get_option_at_index(options.highlighted).id
            self.dismiss(Picked(Path(str(option_id)), role))
