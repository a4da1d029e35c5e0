"""Reading a process's facts from /proc (Linux)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuopt_tui.core.runs.proc_files import (
    proc_mounted,
    read_cmdline,
    read_comm,
    read_cwd,
    read_stat,
    read_uid,
    seconds_running,
)

pytestmark = pytest.mark.skipif(not proc_mounted(), reason="no /proc here")


def test_this_process() -> None:
    stat = read_stat(os.getpid())
    assert stat is not None and stat == read_stat("self")
    assert (stat.state, stat.pgrp, stat.session) == ("R", os.getpgrp(), os.getsid(0))
    assert read_uid(os.getpid()) == os.getuid()
    assert read_cwd(os.getpid()) == os.getcwd()
    cmdline = read_cmdline(os.getpid())
    assert cmdline is not None and cmdline.split(b"\0")[:-1] == [os.fsencode(a) for a in sys.orig_argv]
    age = seconds_running()
    assert age is not None and 0 < age < 24 * 3600


def test_a_command_name_with_parentheses_and_spaces(tmp_path: Path) -> None:
    """The name in /proc/PID/stat is free text: the fields are found after its last ')'."""
    sleep = shutil.which("sleep")
    if sleep is None:
        pytest.skip("no sleep command")
    odd = tmp_path / "a) b ) c"
    shutil.copy(sleep, odd)
    proc = subprocess.Popen([str(odd), "30"], start_new_session=True)
    try:
        stat = read_stat(proc.pid)
        assert read_comm(proc.pid) == "a) b ) c"
        assert stat is not None and stat.pgrp == stat.session == proc.pid and not stat.ended
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_is_not_there() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert read_stat(gone.pid) is None and read_uid(gone.pid) is None
    assert read_cmdline(gone.pid) is None and read_comm(gone.pid) is None and read_cwd(gone.pid) is None
