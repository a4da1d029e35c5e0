"""`gpuopt-tui cache [--list | --size | --clear]`: the layer-probing feature cache."""

from __future__ import annotations

import argparse

from rich.console import Console

from gpuopt_tui.core.feature_cache import FeatureCache
from gpuopt_tui.core.format import human_bytes, human_time

NAME = "cache"
HELP = "show the size of the feature cache (layer probing), list its entries or clear it"


def configure(parser: argparse.ArgumentParser) -> None:
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--size", action="store_true", help="entries and bytes used (the default)")
    action.add_argument("--list", action="store_true", help="one line per cached (representation, layer) entry")
    action.add_argument("--clear", action="store_true", help="delete every entry (they are recomputed when needed)")


def run(args: argparse.Namespace) -> int:
    cache = FeatureCache()
    out = Console(highlight=False)
    if args.clear:
        entries, freed = cache.clear()
        out.print(f"removed {entries} entries ({human_bytes(freed)}) from {cache.root}")
        return 0
    entries = cache.entries()
    if args.list:
        if not entries:
            out.print(f"the feature cache is empty ({cache.root})")
            return 0
        header = ("key", "representation", "layer", "shape", "size", "created", "source")
        rows = [header] + [
            (
                e.key[:12],
                str(e.description.get("representation", "?")) if e.ok else "broken",
                str(e.description.get("layer", "")),
                "x".join(map(str, e.shape)),
                human_bytes(e.size),
                human_time(e.created),
                str(e.description.get("source", "")),
            )
            for e in entries
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
        for row in rows:
            line = "  ".join(value.ljust(width) for value, width in zip(row, widths))
            out.print(f"{line}  {row[-1]}", markup=False, soft_wrap=True, style="bold" if row is header else None)
    out.print(f"feature cache: {len(entries)} entries, {human_bytes(cache.size_bytes())} in {cache.root}")
    return 0
