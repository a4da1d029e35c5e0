"""Memory planning for a training step, without torch.

- `model_spec`: architecture numbers from a Hugging Face config (BERT, RoBERTa, DistilBERT, GPT-2, Llama-style).
- `estimate`: the closed-form tier, a per-component breakdown of peak GPU memory.
- `search`: the largest micro-batch under a budget, accumulation for an effective batch, candidates, stages.
- `fit` and `measure`: the measured tier, probes on the GPU in fresh processes and a line fit of their peaks.
- `trainconfig`, `compose` and `yamledit`: reading a training YAML config (Hydra-style composition included)
  and previewing new values in it as a minimal diff.
- `apply` and `backups`: writing previewed edits (numbered, verified backups; atomic replaces) and undoing them.
- `report`: a plan's report as data (header lines, candidate rows, a memory bar's cells), drawn by
  ui/plan_report.py.

Importing this package imports nothing heavy; `yamledit` imports ruamel.yaml only when it parses.
"""
