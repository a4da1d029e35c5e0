"""Finding the model a training config names on this machine: a local directory, or the Hugging Face cache.

Nothing is downloaded. A name is tried as a path (absolute, `~`, or relative to the config's directory and to the
working directory), then as a Hub repository id in the cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else
`~/.cache/huggingface/hub`): `models--org--name/snapshots/<revision>/config.json`, the revision `refs/main` names
first, else the newest snapshot.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from gpuopt_tui.core.errors import UserError


def hf_cache_dirs() -> list[Path]:
    """Where the Hugging Face hub cache may be, in the order the hub library looks."""
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"]).expanduser()]
    if os.environ.get("HF_HOME"):
        return [Path(os.environ["HF_HOME"]).expanduser() / "hub"]
    xdg = os.environ.get("XDG_CACHE_HOME")
    return [(Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"]


def _config_in(path: Path) -> Path | None:
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    if path.is_file() and path.name == "config.json":
        return path
    return None


def _in_cache(cache: Path, repo: str) -> Path | None:
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshots = root / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = root / "refs" / "main"
    if ref.is_file():
        found = _config_in(snapshots / ref.read_text(encoding="utf-8").strip())
        if found:
            return found
    configs = [c for c in snapshots.glob("*/config.json") if c.is_file()]
    return max(configs, key=lambda c: c.stat().st_mtime) if configs else None


def find(name: str, bases: Sequence[Path]) -> tuple[Path | None, list[str]]:
    """The config.json of the model `name` names, and where it was looked for (for a message when not found)."""
    tried: list[str] = []
    raw = Path(name).expanduser()
    paths = [raw] if raw.is_absolute() else [base / raw for base in bases]
    for path in paths:
        tried.append(str(path))
        found = _config_in(path)
        if found:
            return found, tried
    repo = name.strip().strip("/")
    if repo and not raw.is_absolute() and repo.count("/") <= 1 and not repo.startswith("."):
        for cache in hf_cache_dirs():
            tried.append(str(cache / ("models--" + repo.replace("/", "--"))))
            found = _in_cache(cache, repo)
            if found:
                return found, tried
    return None, tried


def require(name: str, bases: Sequence[Path], where: str) -> Path:
    """The config.json of `name`; UserError saying where it was looked for and what to do when it is not here."""
    if not isinstance(name, str) or not name.strip():
        raise UserError(f"{where}: the model name {name!r} is not a path or a Hugging Face repository id")
    found, tried = find(name, bases)
    if found is None:
        raise UserError(
            f"{where}: the config names the model {name!r}, which is not on this machine (looked in "
            f"{'; '.join(tried)}). The planner never downloads: fetch its config.json into the Hugging Face cache "
            f"(e.g. `huggingface-cli download {name} config.json`), or give --model DIR for a local copy"
        )
    return found
