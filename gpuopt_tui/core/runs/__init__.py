"""Runs, read and driven without torch: a run directory's layout and files, its events, its status and processes.

- `layout`: `RunDir`, the one place that names a run directory's files.
- `lifecycle`: finding, creating, starting, cancelling, resuming and deleting runs.
- `status`: what a run is doing, folded from its events and whether its process lives.
- `events`: the events.jsonl protocol; `startup`: a run's start-up profile, stage by stage.
- `files`: reading a run's own files without trusting them; `processes` and `proc_files`: its processes, verified
  before any signal, and what /proc says about them.
- `distributed`: the torchrun command of a run over several processes or nodes.
"""
