"""`gpuopt-tui profiles`: list, show and validate profiles."""

from __future__ import annotations

import argparse
import textwrap

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuopt_tui.commands import add_overrides_option
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.format import safe_text
from gpuopt_tui.core.kinds import KINDS
from gpuopt_tui.core.profile_paths import resolve_paths
from gpuopt_tui.core.profiles.io import find_profile, list_profiles, load_profile, profile_to_toml
from gpuopt_tui.core.profiles.schema import describe

NAME = "profiles"
HELP = "list profiles, show one resolved, validate files, or list a kind's keys"


def configure(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--show", metavar="PROFILE", help="print a profile with every default filled in")
    group.add_argument(
        "--validate",
        nargs="+",
        metavar="FILE",
        help="check profile files, and that the files and directories they name exist; exit 1 if any is invalid",
    )
    group.add_argument("--keys", choices=sorted(KINDS), help="list every key of a run kind with its help")
    add_overrides_option(parser, "with --show: apply overrides first")


def run(args: argparse.Namespace) -> int:
    out = Console(highlight=False)
    if args.show:
        print(profile_to_toml(load_profile(find_profile(args.show), args.overrides)), end="")
        return 0
    if args.validate:
        bad = 0
        for name in args.validate:
            try:
                path = find_profile(name)
                profile = load_profile(path)
                resolve_paths(profile, path.parent.resolve(), str(path))  # a run would need them to exist
                out.print(Text.assemble(("ok", "green"), f" {safe_text(name)} ({profile.kind})"), soft_wrap=True)
            except UserError as e:
                bad += 1
                out.print(Text.assemble(("invalid", "red"), f" {safe_text(e)}"), soft_wrap=True)
        return 1 if bad else 0
    if args.keys:
        # one key a line, never cut (the key is what --set takes), its help below it, indented and wrapped to the
        # width there is: readable at 80 columns and when piped, where a four-column table squeezes the help
        for f in describe(KINDS[args.keys].profile):
            kind = " | ".join(f.choices) if f.choices else f.type_name + (' | "auto"' if f.auto else "")
            out.print(Text.assemble((f.key, "bold"), f"  {kind}  default {f.default!r}"))
            for line in textwrap.wrap(f.help, max(out.width - 4, 30)):
                out.print(Text("    " + line), soft_wrap=True)
        return 0
    entries = list_profiles()
    # names are never cut or wrapped (they are what `run` takes): the path and the description give way
    table = Table(box=None, header_style="bold")
    table.add_column("name", no_wrap=True, min_width=max((len(safe_text(e.name)) for e in entries), default=4))
    table.add_column("kind", no_wrap=True)
    table.add_column("where", overflow="fold", min_width=len("shipped"))
    table.add_column("description", overflow="fold", min_width=len("description"), ratio=1)
    for e in entries:  # names, descriptions and errors come from files: plain text, never markup
        where = "shipped" if e.shipped else str(e.path)
        desc = Text(safe_text(e.error), style="red") if e.error else Text(safe_text(e.description))
        table.add_row(*(Text(safe_text(cell)) for cell in (e.name, e.kind, where)), desc)
    out.print(table)
    return 0
