"""`python -m gpuopt_tui.jobs RUN_DIR`: the process of one run; `... --warm ...`: a warm runner (jobs/warm.py)."""

import sys

if sys.argv[1:2] == ["--warm"]:
    from gpuopt_tui.jobs.warm import main
else:
    from gpuopt_tui.jobs.runner import main

raise SystemExit(main(sys.argv[1:]))
