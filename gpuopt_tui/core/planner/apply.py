"""Writing previewed config edits and undoing them: the one implementation behind `gpuopt-tui plan --apply/--undo`
and the planner screen.

apply: every file is checked first (unchanged since its preview, writable); then all get a verified numbered
backup (backups.py) of the very bytes the preview read; only then is each replaced atomically. A failure part way
puts the files already written back and removes this write's backups, so the configs and the backups there were
before stay byte-identical.

undo: restores the newest write, file by file (NAME.backup.N of the highest N among the config's files that the
planner recorded, its bytes as recorded), after a preview of its own; it is refused when a file or its backup
changed since that preview. The backup is removed once its file is restored, so repeated undos walk back to
NAME.backup.1, the file before the planner first wrote it. Symlinked configs are read, written and restored at
their target; the link stays a link.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuopt_tui.core.atomic import replace_file
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner import backup_records, backups
from gpuopt_tui.core.planner.yamledit import FilePatch, unified_diff


@dataclass(frozen=True)
class Written:
    path: Path  # as the config names it
    target: Path  # the file written: the link's target for a symlinked config
    backup: Path  # the previous version


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read it {what}({e.strerror or e}); nothing was written") from None


def _check_writable(path: Path) -> None:
    """`path` (a target, not a link) and its directory can be written."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise UserError(f"{path}: cannot access it ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        raise UserError(f"{path}: not a regular file; nothing was written")
    if not (mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)) or not os.access(path, os.W_OK):
        raise UserError(f"{path}: the file is read-only; nothing was written")
    if not os.access(path.parent, os.W_OK):
        raise UserError(f"{path.parent}: the directory is not writable; nothing was written")


def apply(patches: Sequence[FilePatch], config: Iterable[Path] = ()) -> list[Written]:
    """Write previewed patches (those that change something) of the config made of the files `config` (all of
    them: their backups number the writes): all files are checked before any backup is made, and all backups are
    made and verified before any file is written. UserError when anything fails, with every file as it was."""
    plan: list[tuple[FilePatch, Path, bytes]] = []
    for patch in patches:
        if patch.new_text == patch.old_text:
            continue
        file = backups.target(patch.path)
        if any(file == other for _, other, _ in plan):
            raise UserError(f"{patch.path}: {file} is previewed twice (through a link?); nothing was written")
        old = _read(file, "again ")
        if _sha256(old) != patch.sha256:
            raise UserError(f"{patch.path}: the file changed since the preview; nothing was written, preview again")
        _check_writable(file)
        plan.append((patch, file, old))
    family = {backups.target(f) for f in config}
    saved = backups.save([(file, old, patch.new_text) for patch, file, old in plan], family)
    written: list[tuple[Written, bytes]] = []
    for (patch, file, old), backup in zip(plan, saved):
        try:
            if _sha256(_read(file, "again ")) != patch.sha256:
                raise UserError(f"{file}: the file changed while writing; nothing was written, preview again")
            replace_file(file, patch.new_text.encode("utf-8"))
        except UserError as e:
            raise UserError(_roll_back(str(e), written, saved[len(written) :])) from None
        written.append((Written(patch.path, file, backup), old))
    return [w for w, _ in written]


def _roll_back(error: str, written: list[tuple[Written, bytes]], unused: list[Path]) -> str:
    """Put the files written back and remove their backups and the unused ones; the message saying so."""
    backups.remove(unused)
    stuck = []
    for w, old in written:
        try:
            replace_file(w.target, old)
        except UserError:
            stuck.append(f"{w.target} was written and could not be put back: its previous version is {w.backup}")
            continue
        backups.remove([w.backup])
    if stuck:
        return f"{error}; " + "; ".join(stuck)
    return error + ("; the files written before it were put back" if written else "")


# --- undo ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Restore:
    """One file of an undo, as previewed."""

    path: Path  # as the config names it
    target: Path  # the file restored: the link's target for a symlinked config
    backup: Path
    current: str  # SHA-256 of the file when previewed ("" when it did not exist)
    saved: bytes  # the backup's bytes when previewed
    diff: str  # from the file back to its backup
    edits: str = ""  # from what the planner wrote to the file now: changes made after its write, lost by undo


def _targets(files: Iterable[Path]) -> dict[Path, Path]:
    """Each file's target, keeping the first name of a target named twice."""
    out: dict[Path, Path] = {}
    for f in files:
        out.setdefault(backups.target(f), f)
    return out


def _newest(files: Iterable[Path]) -> list[tuple[Path, Path]]:
    """(target, backup) of each file that the newest write among `files` backed up."""
    found = {t: backups.backups(t) for t in _targets(files)}
    newest = max((n for numbered in found.values() for n in numbered), default=None)
    return [(t, numbered[newest]) for t, numbered in found.items() if newest in numbered]


def newest_backups(files: Iterable[Path]) -> list[Path]:
    """The backups an undo would restore now: those of the newest write among `files`."""
    return [backup for _, backup in _newest(files)]


def _current(file: Path) -> bytes | None:
    try:
        return file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UserError(f"{file}: cannot read it ({e.strerror or e}); nothing was restored") from None


def undo_preview(files: Iterable[Path]) -> list[Restore]:
    """What undo would restore among `files` (the config's files): the newest write's backups, with diffs.
    UserError when none of them has a backup."""
    files = list(files)
    named = _targets(files)
    restores = []
    for file, backup in _newest(files):
        saved = backups.read_backup(backup)
        if not backup_records.matches(backup, saved):
            raise UserError(
                f"{backup}: changed since the planner wrote it; nothing was restored (restore it by hand, or remove "
                "it to undo an older write)"
            )
        current = _current(file)
        text = (current or b"").decode("utf-8", errors="replace")
        diff = unified_diff(named[file], text, saved.decode("utf-8", errors="replace"))
        digest = _sha256(current) if current is not None else ""
        wrote = backup_records.written_over(backup)
        edits = "" if wrote is None or wrote == text else unified_diff(named[file], wrote, text)
        restores.append(Restore(named[file], file, backup, digest, saved, diff, edits))
    if not restores:
        names = ", ".join(str(f) for f in files)
        raise UserError(f"no backups the planner wrote (NAME{backups.SUFFIX}N) next to {names}: nothing to undo")
    return restores


def undo(restores: Sequence[Restore]) -> None:
    """Restore previewed backups, if no file and no backup changed since the preview (all are checked before
    any is restored); each backup is removed once every file is restored."""
    for r in restores:
        current = _current(r.target)
        if (_sha256(current) if current is not None else "") != r.current:
            raise UserError(f"{r.path}: the file changed since the preview; nothing was restored, undo again")
        if backups.read_backup(r.backup) != r.saved:
            raise UserError(f"{r.backup}: the backup changed since the preview; nothing was restored, undo again")
        if current is not None:
            _check_writable(r.target)
    restored: list[str] = []
    for r in restores:
        try:
            replace_file(r.target, r.saved)
        except UserError as e:
            done = f"; restored {', '.join(restored)}" if restored else ""
            raise UserError(f"{e}{done}; every backup is kept: undo again") from None
        restored.append(str(r.path))
    backups.remove(r.backup for r in restores)
