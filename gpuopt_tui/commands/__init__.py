"""Subcommands of the `gpuopt-tui` CLI.

Each module defines NAME, HELP, `configure(parser)` and `run(args) -> int` (the exit code). Modules are imported
by cli.py at start-up, so they must not import torch or transformers at module level: import them inside
`run` (or leave heavy work to a run's child process). Problems the user can fix raise `UserError`.
"""

import argparse


def add_overrides_option(parser: argparse.ArgumentParser, help: str) -> None:
    """The `--set KEY=VALUE` option (repeatable) shared by the commands that read profiles."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)
