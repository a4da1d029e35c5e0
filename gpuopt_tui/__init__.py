"""gpuopt-tui: a terminal workbench for fast GPU interpretability runs, GPU telemetry and memory planning."""

__version__ = "0.1.0"
