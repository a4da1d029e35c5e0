"""The `gpuopt-tui` command: the TUI without a subcommand, headless subcommands otherwise."""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import NoReturn

from gpuopt_tui import __version__
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.format import safe_text
from gpuopt_tui.core.paths import log_dir

COMMAND_MODULES = (
    "run",
    "runs",
    "show",
    "select",
    "attach",
    "cancel",
    "resume",
    "profiles",
    "gpu",
    "plan",
    "cache",
    "join",
    "warm",
)

SSH_HINT = "Over SSH colours may fall back to 256: set TEXTUAL_COLOR_SYSTEM=truecolor if your terminal supports it."


def _commands(names: tuple[str, ...] = COMMAND_MODULES) -> list[ModuleType]:
    found = []
    for name in names:
        try:
            found.append(importlib.import_module(f"gpuopt_tui.commands.{name}"))
        except ModuleNotFoundError as e:
            if e.name != f"gpuopt_tui.commands.{name}":
                raise
    return found


class _Unparsed(Exception):
    """The options alone do not explain the command line."""


class _OptionsOnlyParser(argparse.ArgumentParser):
    """Raises instead of printing usage and exiting: the full parser is the one that reports errors."""

    def error(self, message: str) -> NoReturn:
        raise _Unparsed(message)


def _global_parser(cls: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The command and its options, without the subcommands."""
    parser = cls(
        prog="gpuopt-tui",
        description=(
            "Fast GPU interpretability runs (Integrated Gradients, TracIn, layer probing), a live GPU panel "
            "and a memory planner. Without a subcommand the terminal UI starts."
        ),
        epilog=SSH_HINT,
        add_help=cls is not _OptionsOnlyParser,
    )
    parser.add_argument("--version", action="version", version=f"gpuopt-tui {__version__}")
    parser.add_argument(
        "--runs-dir", type=Path, help="where runs are kept (default: the user data dir; env GPUOPT_TUI_RUNS_DIR)"
    )
    parser.add_argument("--no-mouse", action="store_true", help="TUI: ignore the mouse (useful over some SSH clients)")
    parser.add_argument(
        "--replay", type=Path, metavar="TRACE", help="TUI: show a recorded GPU trace instead of live NVML"
    )
    parser.add_argument("--readonly", action="store_true", help="TUI: never signal processes from the GPU screen")
    parser.add_argument(
        "--warm",
        action="store_true",
        help="TUI: keep a warm runner (torch, transformers and the engines imported) while the app is open, so that "
        "runs started from it skip those imports (see also `gpuopt-tui warm`)",
    )
    parser.add_argument(
        "--screen", help="TUI: screen to open first (dashboard, attribution, tracin, ablation, planner, runs, gpu)"
    )
    return parser


def build_parser(names: tuple[str, ...] = COMMAND_MODULES) -> argparse.ArgumentParser:
    """The parser with the subcommands `names` (default: all), their modules imported."""
    parser = _global_parser()
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _commands(names):
        sub = subparsers.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.configure(sub)
        sub.set_defaults(handler=module.run)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The TUI's command line is parsed without importing a subcommand module (they are not needed to start
    the app), a subcommand's with its own module only (importing all of them takes a tenth of a second or more,
    which `gpuopt-tui run` would wait before its run starts); --help, or anything else the options alone do not
    explain takes the full parser."""
    try:
        args, rest = _global_parser(_OptionsOnlyParser).parse_known_args(argv)
        if not rest:
            return args
        if rest[0] in COMMAND_MODULES:
            return build_parser((rest[0],)).parse_args(argv)
    except _Unparsed:
        pass
    return build_parser().parse_args(argv)


def _crash_log(exc: BaseException) -> Path | None:
    try:
        directory = log_dir()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "gpuopt-tui.log"
        with path.open("a", encoding="utf-8") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} gpuopt-tui {__version__} {' '.join(sys.argv)}\n")
            f.write("".join(traceback.format_exception(exc)))
        return path
    except OSError:
        return None


def run_tui(args: argparse.Namespace) -> int:
    # Start-up makes objects that live as long as the app (modules, classes, the first screen): collecting them is
    # time lost before the first frame. The app freezes them and turns the collector on after it (ui/warmup.py).
    gc.disable()
    from gpuopt_tui.app import make_app

    app = make_app(replay=args.replay, readonly=args.readonly, screen=args.screen, warm=args.warm)
    app.run(mouse=not args.no_mouse)
    return app.return_code or 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.runs_dir:
        os.environ["GPUOPT_TUI_RUNS_DIR"] = str(args.runs_dir.expanduser().resolve())
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        handler = getattr(args, "handler", None)
        return handler(args) if handler else run_tui(args)
    except UserError as e:
        print(f"gpuopt-tui: error: {safe_text(e)}", file=sys.stderr)  # messages may quote files' contents
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`gpuopt-tui gpu --once --csv | head`): quiet, like other Unix tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        path = _crash_log(e)
        where = f"; details in {path}" if path else ""
        print(f"gpuopt-tui: internal error: {type(e).__name__}: {safe_text(e)}{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
