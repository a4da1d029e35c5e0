"""`gpuopt-tui cache [--list | --size | --clear]`: the layer-probing feature cache and TracIn's training-gradient
cache."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from gpuopt_tui.core.caches import gradients as gradient_cache
from gpuopt_tui.core.caches.features import FeatureCache
from gpuopt_tui.core.caches.files import Cleared
from gpuopt_tui.core.format import human_bytes, human_time

NAME = "cache"
HELP = "show the size of the feature cache (layer probing) and TracIn gradient cache, list entries or clear them"


def configure(parser: argparse.ArgumentParser) -> None:
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--size", action="store_true", help="entries and bytes used (the default)")
    action.add_argument("--list", action="store_true", help="one line per cached (representation, layer) entry")
    action.add_argument("--clear", action="store_true", help="delete every entry (they are recomputed when needed)")


def run(args: argparse.Namespace) -> int:
    cache = FeatureCache()
    out = Console(highlight=False)
    if args.clear:
        _cleared(out, "entries", cache.root, cache.clear())
        _cleared(out, "TracIn gradient entries", gradient_cache.default_root(), gradient_cache.clear())
        return 0
    entries = cache.entries()
    if args.list:
        if not entries:
            out.print(f"the feature cache is empty ({cache.root})")
            _gradients(out, listing=True)
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
    _gradients(out, listing=args.list)
    return 0


def _cleared(out: Console, what: str, root: Path, cleared: Cleared) -> None:
    out.print(f"removed {cleared.removed} {what} ({human_bytes(cleared.freed)}) from {root}", soft_wrap=True)
    for link in cleared.kept:
        out.print(f"kept {link}: a symbolic link (remove it yourself if it is no longer wanted)", soft_wrap=True)


def _projection_text(description: dict) -> str:
    """How an entry's gradients were projected, from its manifest (`projection`: [dim, in, out, seed])."""
    found = description.get("projection")
    if not (isinstance(found, list) and len(found) == 4 and all(isinstance(v, int) for v in found)):
        return f"projection {found if found is not None else '?'}"
    dim, size_in, size_out, seed = found
    if size_in or size_out:
        text = f"projected {size_out or 'exact'} x {size_in or 'exact'} (output x input), seed {seed}"
        basis, n_train = description.get("projection_basis"), description.get("n_train")
        if isinstance(basis, list) and len(basis) == 2 and isinstance(basis[1], int):
            fitted = min(basis[1], n_train) if isinstance(n_train, int) else basis[1]
            text += f", PCA directions of {fitted} examples"
        return text
    return f"projected to <= {dim} per tensor, seed {seed}" if dim else "exact gradients"


def _gradients(out: Console, *, listing: bool) -> None:
    """TracIn's training-gradient cache: one entry per (checkpoint, data, gradient settings)."""
    found = gradient_cache.entries()
    if listing:
        for e in found:
            d = e.description
            out.print(
                f"{e.key[:12]}  {d.get('model', '?')}  {d.get('method', '?')}  {_projection_text(d)}  "
                f"{d.get('n_train', '?')} training examples  {e.blocks} blocks  {human_bytes(e.size)}",
                markup=False,
                soft_wrap=True,
            )
    size = sum(e.size for e in found)
    out.print(f"TracIn gradient cache: {len(found)} entries, {human_bytes(size)} in {gradient_cache.default_root()}")
