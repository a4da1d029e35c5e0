"""The backups the planner wrote, each with the SHA-256 of its bytes, recorded in the data directory.

Undo restores and removes only recorded backups whose bytes still match their record, so a file that merely
looks like one (a user's own NAME.backup.5, another tool's NAME.backup.999999999) is never restored or deleted.
A record whose backup is gone is dropped the next time the records are written.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from gpuopt_tui.core.atomic import write_json
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.paths import data_dir

RECORDS_NAME = "plan_backups.json"


def records_path() -> Path:
    return data_dir() / RECORDS_NAME


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load() -> dict[str, str]:
    """Backup path -> SHA-256 of the bytes the planner wrote there; UserError when the record cannot be read."""
    path = records_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read the record of the planner's backups ({e}); remove it") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise UserError(f"{path}: not a record of the planner's backups (expected backup paths and digests)")
    return data


def add(written: Mapping[Path, bytes]) -> None:
    """Record backups just written (path -> their bytes); UserError when the record cannot be written."""
    records = {k: v for k, v in load().items() if Path(k).exists()}
    records.update({str(path): digest(data) for path, data in written.items()})
    _write(records)


def drop(paths: Iterable[Path]) -> None:
    """Forget backups the planner removed."""
    gone = {str(p) for p in paths}
    records = load()
    if gone & records.keys():
        _write({k: v for k, v in records.items() if k not in gone})


def numbered(file: Path, suffix: str) -> dict[int, Path]:
    """The recorded backups of `file` (a config's target) by number: FILE{suffix}N."""
    prefix = str(file) + suffix
    return {int(k[len(prefix) :]): Path(k) for k in load() if k.startswith(prefix) and k[len(prefix) :].isdigit()}


def matches(path: Path, data: bytes) -> bool:
    """Whether `data`, read from `path`, are the bytes the planner wrote there."""
    return load().get(str(path)) == digest(data)


def _write(records: Mapping[str, str]) -> None:
    path = records_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, dict(records))
    except OSError as e:
        raise UserError(f"{path}: cannot record the planner's backups ({e.strerror or e})") from None
