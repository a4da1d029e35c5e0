"""`gpuopt-tui run PROFILE`: start a run in the background and follow it (or detach)."""

from __future__ import annotations

import argparse

from gpuopt_tui.commands import add_overrides_option
from gpuopt_tui.core.profiles.io import find_profile, load_profile
from gpuopt_tui.core.runs.lifecycle import start_run
from gpuopt_tui.core.runs.startup import this_process_started

NAME = "run"
HELP = "start a run from a profile (a .toml path or a profile name, see `gpuopt-tui profiles`)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", help="profile file or name, e.g. demo-attribution")
    add_overrides_option(parser, "override a profile value, e.g. --set attribution.n_steps=100 (repeatable)")
    parser.add_argument("--detach", action="store_true", help="start the run and return at once")
    parser.epilog = "Exit codes: 0 finished, 1 failed, 130 cancelled with Ctrl-C (the run stops cleanly)."


def run(args: argparse.Namespace) -> int:
    path = find_profile(args.profile)
    profile = load_profile(path, args.overrides)
    run_dir = start_run(profile, source=path, launched_at=this_process_started())
    from gpuopt_tui.commands.follow import console, follow  # after the launch: the run starts meanwhile

    console.print(f"started {run_dir.name}  ({profile.kind}: {profile.name})")
    console.print(f"  run directory: {run_dir}")
    if args.detach:
        console.print(f"  follow it with: gpuopt-tui attach {run_dir.name}")
        print(run_dir.name)
        return 0
    return follow(run_dir, cancel_on_interrupt=True)
