"""Each run kind's result files, named and read without torch (the TUI and the CLI read them through here; the
engines write them under these names).

- `attribution` (attributions.jsonl, the sample index), `attribution_summary` (summary.json, check.json) and
  `attribution_query` (the sample list's filter and sort).
- `tracin` (influence and self-influence rows) and `tracin_summary` (summary.json).
- `ablation` (results.json and results.csv of layer probing); `plan` (a plan run's plan.json, the configs it names).
- `record_fields`: checked reads of a record's fields, shared by the readers.
"""
