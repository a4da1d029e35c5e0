"""Numbered backups of the config files the planner writes: NAME.backup.1 is the file before the planner first
wrote it, a higher number a later write's. One write of several files (a composed config and its stage files)
gives all of them the same number, above every backup of the config's files, so undo restores exactly what the
newest write changed.

A backup is written to a temporary file, fsynced and read back before it gets its name, and it gets it through a
hard link, which never replaces or follows anything already there: an existing name, a symlink among them, only
moves the number on. Only backups the planner recorded (backup_records: path and digest), still regular files,
count as backups. A symlinked config is backed up, written and restored at its target, next to which its backups
lie; the link stays a link.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from gpuopt_tui.core.atomic import fsync_dir, write_all
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner import backup_records

SUFFIX = ".backup."
_NUMBER = re.compile(r"[1-9][0-9]{0,8}")
_TRIES = 20  # numbers tried when other files take the next ones meanwhile
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS}


def target(path: Path) -> Path:
    """The file a config path names: a symlink's final target, else the path itself (absolute)."""
    return Path(os.path.realpath(path))


def backup_path(file: Path, number: int) -> Path:
    return file.with_name(f"{file.name}{SUFFIX}{number}")


def _numbers(file: Path) -> dict[int, Path]:
    """The numbers of the backup names next to `file` (a config's target), whatever wrote them, with their
    paths."""
    prefix = file.name + SUFFIX
    found = {}
    try:
        entries = list(os.scandir(file.parent))
    except OSError as e:
        raise UserError(f"{file.parent}: cannot list the directory ({e.strerror or e})") from None
    for entry in entries:
        number = entry.name[len(prefix) :]
        if entry.name.startswith(prefix) and _NUMBER.fullmatch(number):
            found[int(number)] = Path(entry.path)
    return found


def backups(file: Path) -> dict[int, Path]:
    """The backups the planner wrote of `file` (a config's target) by number, recorded and still there as regular
    files (never a symlink); a file that only has a backup's name is not one."""
    return {n: path for n, path in backup_records.numbered(file, SUFFIX).items() if _regular(path)}


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def read_backup(path: Path) -> bytes:
    """A backup's bytes, without following a symlink put in its place; UserError when it cannot be read or is
    empty (a config the planner wrote was never empty, so an empty backup is an interrupted copy)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise UserError(f"{path}: cannot read the backup ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    if not data:
        raise UserError(f"{path}: the backup is empty (an interrupted copy?); remove it to restore an older one")
    return data


def save(contents: Sequence[tuple[Path, bytes, str]], family: Iterable[Path] = ()) -> list[Path]:
    """Back up each (target, bytes, the text about to be written over them) under one number above every backup
    name of these files and of `family` (the targets of the config's other files); the backups' paths. UserError,
    with no backup left behind, when any of them cannot be written and read back."""
    tmps: list[Path] = []
    files = [file for file, _, _ in contents]
    try:
        for file, data, _ in contents:
            tmps.append(_verified_copy(file, data))
        taken = [n for f in {*files, *family} for n in (*_numbers(f), *backup_records.numbered(f, SUFFIX))]
        made = _link_all(files, tmps, max(taken, default=0) + 1)
        try:
            backup_records.add({path: (data, text) for path, (_, data, text) in zip(made, contents)})
        except UserError as e:
            _unlink(made)
            raise UserError(f"{e}; nothing was written") from None
        return made
    finally:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)


def remove(paths: Iterable[Path]) -> None:
    """Remove backups the planner wrote, and their records."""
    paths = list(paths)
    _unlink(paths)
    backup_records.drop(paths)


def _unlink(paths: Iterable[Path]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()


def _verified_copy(file: Path, data: bytes) -> Path:
    """`data` in a temporary file next to `file` with its mode, fsynced and read back equal."""
    try:
        fd, name = tempfile.mkstemp(prefix=f".{file.name}.backup.", suffix=".tmp", dir=file.parent)
    except OSError as e:
        raise UserError(f"{file}: cannot write its backup ({e.strerror or e}); nothing was written") from None
    tmp = Path(name)
    try:
        try:
            write_all(fd, data)
        finally:
            os.close(fd)
        shutil.copymode(file, tmp)
        if tmp.read_bytes() != data:
            raise OSError(errno.EIO, "the copy read back differs")
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"{file}: cannot write its backup ({e.strerror or e}); nothing was written") from None
    return tmp


def _link_all(files: list[Path], tmps: list[Path], number: int) -> list[Path]:
    """Give each temporary copy the name NAME.backup.N, one N for all from `number` on; a name taken meanwhile
    moves N on."""
    for _ in range(_TRIES):
        made: list[Path] = []
        try:
            for file, tmp in zip(files, tmps):
                made.append(backup_path(file, number))
                _link(tmp, made[-1])
        except FileExistsError:
            _unlink(made[:-1])
            number += 1
            continue
        except OSError as e:
            _unlink(made[:-1])
            raise UserError(f"{made[-1]}: cannot write the backup ({e.strerror or e}); nothing was written") from None
        for directory in {f.parent for f in files}:
            fsync_dir(directory)
        return made
    raise UserError(f"{files[0]}: no free backup number near {number} (other writes keep taking them)")


def _link(tmp: Path, name: Path) -> None:
    """Give `tmp` the new name `name`; FileExistsError when anything (a symlink too) has that name already."""
    try:
        os.link(tmp, name, follow_symlinks=False)
        return
    except OSError as e:
        if e.errno not in _NO_HARD_LINKS:
            raise
    # no hard links on this file system: take the name exclusively, then rename the copy over it
    os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    try:
        os.replace(tmp, name)
    except OSError:
        name.unlink(missing_ok=True)
        raise
