"""The backups the planner wrote, each with the SHA-256 of its bytes and the text the planner then wrote into the
config over it, recorded in the data directory.

Undo restores and removes only recorded backups whose bytes still match their record, so a file that merely
looks like one (a user's own NAME.backup.5, another tool's NAME.backup.999999999) is never restored or deleted;
the text written lets undo see edits made to the config after the planner's write (records of older versions hold
the digest alone). A record whose backup is gone is dropped the next time the records are written.
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


Record = str | dict[str, str]  # the backup's SHA-256, or {"sha256": ..., "wrote": the text written over it}


def load() -> dict[str, Record]:
    """Backup path -> its record; UserError when the records cannot be read."""
    path = records_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read the record of the planner's backups ({e}); remove it") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and _is_record(v) for k, v in data.items()):
        raise UserError(f"{path}: not a record of the planner's backups (expected backup paths and digests)")
    return data


def _is_record(value: object) -> bool:
    if isinstance(value, dict):
        return set(value) == {"sha256", "wrote"} and all(isinstance(v, str) for v in value.values())
    return isinstance(value, str)


def _sha256_of(record: Record | None) -> str | None:
    return record["sha256"] if isinstance(record, dict) else record


def add(written: Mapping[Path, tuple[bytes, str]]) -> None:
    """Record backups just made: path -> (their bytes, the text the planner is about to write over them into the
    config); UserError when the records cannot be written."""
    records = {k: v for k, v in load().items() if Path(k).exists()}
    records.update({str(path): {"sha256": digest(data), "wrote": text} for path, (data, text) in written.items()})
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
    return _sha256_of(load().get(str(path))) == digest(data)


def written_over(path: Path) -> str | None:
    """The text the planner wrote into the config when it made the backup `path` (None for older records)."""
    record = load().get(str(path))
    return record["wrote"] if isinstance(record, dict) else None


def _write(records: Mapping[str, Record]) -> None:
    path = records_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, dict(records))
    except OSError as e:
        raise UserError(f"{path}: cannot record the planner's backups ({e.strerror or e})") from None
