"""`python -m gpuopt_tui.jobs RUN_DIR`: the process of one run."""

import sys

from gpuopt_tui.jobs.runner import main

raise SystemExit(main(sys.argv[1:]))
