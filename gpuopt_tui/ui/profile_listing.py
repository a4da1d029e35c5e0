"""What a kind screen's profile picker and form show, read off the UI thread: the profiles of a kind (and the
unreadable ones, so that their errors can be seen) and the one to open.

The app reads every kind's listing in a thread after its first frame (`prefetch`, into the app's
`profile_listings`), so that a kind screen shown for the first time opens its profile at once, with no file read
on the UI thread and no form drawn with defaults first; later reads (after a save, on picking a profile) are the
screen's thread workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.kinds import KINDS
from gpuopt_tui.core.profiles.common import ProfileBase
from gpuopt_tui.core.profiles.io import ProfileEntry, keys_in_file, list_profiles, load_profile


@dataclass(frozen=True)
class ProfileListing:
    """`entries` to list (None: the list is not read again), the profile at `path` to open (None: none to open)
    as read with the keys its file sets (`keys_in_file`), or why it cannot be read."""

    entries: list[ProfileEntry] | None
    path: Path | None
    profile: ProfileBase | None = None
    error: str = ""
    keys: frozenset[str] = frozenset()


def kind_entries(kind: str, every: list[ProfileEntry]) -> list[ProfileEntry]:
    """Of all profiles, those of `kind` and those whose kind cannot be told."""
    return [e for e in every if e.kind == kind or e.error or e.kind not in KINDS]


def default_path(kind: str, entries: list[ProfileEntry]) -> Path | None:
    """The kind's demo profile, else its first readable one."""
    usable = [e for e in entries if e.kind == kind and not e.error]
    demo = next((e for e in usable if e.name == f"demo-{kind}"), None)
    return (demo or usable[0]).path if usable else None


def read_profile(path: Path | None, entries: list[ProfileEntry] | None) -> ProfileListing:
    """The profile at `path` (listed as unreadable in `entries`, if it is)."""
    if path is None:
        return ProfileListing(entries, None)
    entry = next((e for e in entries or () if e.path == path), None)
    try:
        if entry is not None and entry.error:
            raise UserError(entry.error)
        return ProfileListing(entries, path, load_profile(path), keys=keys_in_file(path))
    except UserError as e:
        return ProfileListing(entries, path, error=str(e))


def read_listing(kind: str, wanted: Path | None, every: list[ProfileEntry] | None = None) -> ProfileListing:
    """The kind's profiles (of `every` profile, read when not given), and `wanted` (else the kind's default) opened
    if it is one of them."""
    entries = kind_entries(kind, list_profiles() if every is None else every)
    path = wanted or default_path(kind, entries)
    return read_profile(path if path is not None and path in {e.path for e in entries} else None, entries)


def prefetch(into: dict[str, ProfileListing]) -> None:
    """Read every kind's listing into `into` (in a thread), for the kind screens to take when first shown."""
    every = list_profiles()  # once for all kinds: each profile file is read and checked once
    for kind in KINDS:
        into[kind] = read_listing(kind, None, every)
