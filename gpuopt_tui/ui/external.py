"""Opening a file in the user's pager or editor: the program named by $PAGER (or $VISUAL / $EDITOR), else
less (or vi), run with the app suspended so that it has the terminal to itself."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from textual.app import App, SuspendNotSupported

# the environment variables that name the program, in the order they are asked, and the program used without one
PROGRAMS = {"pager": (("PAGER",), "less"), "editor": (("VISUAL", "EDITOR"), "vi")}


@dataclass(frozen=True)
class Program:
    """The command to run (empty when there is none) and what to tell the user about the choice ("" if nothing)."""

    argv: tuple[str, ...]
    note: str


def choose_program(role: str, environ: dict[str, str]) -> Program:
    """The pager or editor (`role`) to run, from `environ`, with a note when the fallback is used or none works."""
    names, fallback = PROGRAMS[role]
    note = ""
    for name in names:
        value = environ.get(name, "").strip()
        if not value:
            continue
        try:
            argv = tuple(shlex.split(value))
        except ValueError:
            argv = ()
        if argv and shutil.which(argv[0]):
            return Program(argv, "")
        note = f"${name} is {value!r}, which was not found"
        break
    else:
        note = f"${' or $'.join(names)} is not set"
    if shutil.which(fallback):
        return Program((fallback,), f"{note}: using {fallback}")
    return Program((), f"{note}, and {fallback} is not installed: set ${names[0]} to a {role} that is")


def open_file(app: App[object], path: Path, role: str, environ: dict[str, str]) -> None:
    """Run the pager or editor on `path` with the app suspended; say so in a notification when the fallback was
    used, and why nothing was opened when nothing could be."""
    program = choose_program(role, environ)
    if not program.argv:
        app.notify(program.note, title=f"No {role}", severity="error", timeout=10, markup=False)
        return
    try:
        with app.suspend():
            subprocess.run([*program.argv, str(path)], check=False)
    except SuspendNotSupported:
        app.notify(
            f"this terminal cannot hand itself to a {role}: open {path} yourself",
            title=f"Not opened in the {role}",
            severity="error",
            markup=False,
        )
        return
    except OSError as e:
        app.notify(f"{program.argv[0]}: {e.strerror or e}", title=f"{role} failed", severity="error", markup=False)
        return
    if program.note:
        app.notify(program.note, title=f"{role.capitalize()} used", markup=False)
