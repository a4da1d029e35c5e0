"""A finished causal LM attribution run of the size of a 1B-model run, written for the results view's benchmark.

Issue 34's 1B-model run attributes 2048 prompts of 64-512 tokens with 16-token completions, per completion token
(`per_target_token = true`): each line of attributions.jsonl carries a [16, P] matrix. Committing such a run is
out of the question (its jsonl is over 100 MB), so `write_lm_run` writes one from seeded random values through
the job's own writers (CompletionRun.records / tensors, write_tensors, write_samples (with its index), token_ranking,
delta_summary, steps_summary): the files have the layout, sizes and field order a real run writes; only the
numbers are random. The run's other files (profile, events, log, meta) are those of the frozen small run in
tests/fixtures/runs/attribution-lm, with its sample counts changed to these.

    python benchmarks/lm_results_run.py /tmp/runs   # writes /tmp/runs/<RUN_NAME>
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuopt_tui.core.atomic import write_json
from gpuopt_tui.core.results.attribution import write_samples
from gpuopt_tui.jobs.attribution.completions import CompletionRun
from gpuopt_tui.jobs.attribution.deltas import delta_summary, steps_summary
from gpuopt_tui.jobs.attribution.outputs import Collected, token_ranking, write_tensors
from gpuopt_tui.jobs.completion_data import COMPLETIONS, per_token_rows
from gpuopt_tui.jobs.data import TextDataset

REPO = Path(__file__).resolve().parents[1]
SMALL_RUN = REPO / "tests" / "fixtures" / "runs" / "attribution-lm" / "20250101-120000-attribution-lm-0001"
RUN_NAME = "20261129-090000-attribution-1b00"
SAMPLES, MIN_PROMPT, MAX_PROMPT, COMPLETION = 2048, 64, 512, 16
VOCAB_SIZE = 8000
BOS, PAD = 0, 1  # structure tokens: neither ranked overall nor per sample
TOP_K_SAMPLE, TOP_K, MIN_COUNT, MAX_STEPS = 5, 10, 3, 1025
SOURCE = 'data.target_field = "completion"'


def _vocabulary(generator: torch.Generator) -> list[str]:
    """Distinct word-like token strings (two to four syllables), BOS and PAD first."""
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    words: dict[str, None] = {"<s>": None, "<pad>": None}
    while len(words) < VOCAB_SIZE:
        n = int(torch.randint(2, 5, (1,), generator=generator))
        picks = torch.randint(0, 70, (n,), generator=generator).tolist()
        words[("Ġ" if picks[0] % 3 else "") + "".join(consonants[p % 14] + vowels[p % 5] for p in picks)] = None
    return list(words)


def _dataset(generator: torch.Generator, vocab: list[str]) -> TextDataset:
    """The prompts (right-padded to MAX_PROMPT, BOS first) and their COMPLETION-token completions."""
    lengths = torch.randint(MIN_PROMPT, MAX_PROMPT + 1, (SAMPLES,), generator=generator)
    mask = (torch.arange(MAX_PROMPT) < lengths[:, None]).long()
    ids = torch.randint(2, VOCAB_SIZE, (SAMPLES, MAX_PROMPT), generator=generator) * mask + PAD * (1 - mask)
    ids[:, 0] = BOS
    completion_ids = torch.randint(2, VOCAB_SIZE, (SAMPLES, COMPLETION), generator=generator)
    words = [[vocab[i] for i in row] for row in ids.tolist()]
    texts = ["".join(w[1:n]).replace("Ġ", " ").strip() for w, n in zip(words, lengths.tolist())]
    completions = ["".join(vocab[i] for i in row).replace("Ġ", " ").strip() for row in completion_ids.tolist()]
    tensors = {
        "input_ids": ids,
        "attention_mask": mask,
        "completion_ids": completion_ids,
        "completion_mask": torch.ones_like(completion_ids),
    }
    return TextDataset(
        tensors, texts, {"input_ids": "attention_mask"}, "lm-1b benchmark:test", {COMPLETIONS: completions}
    )


def _rows_collected(generator: torch.Generator, rows: TextDataset) -> Collected:
    """Per-token rows' results as the engine collects them: scores on the real prompt tokens but BOS, a
    log-probability per row, small convergence deltas, "auto" steps within the tolerance."""
    n = len(rows)
    mask = rows.tensors["attention_mask"]
    token_scores = torch.randn(n, MAX_PROMPT, generator=generator).abs().pow(2) * 0.05 * mask
    token_scores[:, 0] = 0.0
    scores = -torch.rand(n, generator=generator) * 3
    baseline = scores - token_scores.sum(1)
    deltas = torch.randn(n, generator=generator) * 1e-3
    steps = 17 + 8 * torch.randint(0, 30, (n,), generator=generator)
    return Collected(
        input_ids=rows.tensors["input_ids"],
        attention_mask=mask,
        token_scores=token_scores,
        deltas=deltas,
        relative_deltas=deltas.abs() / (scores - baseline).abs().clamp_min(1e-12),
        scores=scores,
        baseline_scores=baseline,
        target=torch.zeros(n, dtype=torch.long),
        prediction=torch.zeros(n, dtype=torch.long),
        probability=scores.exp(),
        margin=torch.full((n,), float("inf")),
        low_margin=torch.zeros(n, dtype=torch.bool),
        steps=steps,
        fallback=torch.zeros(n, dtype=torch.int8),
        error=torch.rand(n, generator=generator) * 5e-3,
        within=torch.ones(n, dtype=torch.bool),
        labels=None,
    )


def _summary(collected: Collected, to_tokens: object) -> dict[str, object]:
    """The small run's summary.json with this run's counts, deltas, steps and ranking."""
    summary = json.loads((SMALL_RUN / "results" / "summary.json").read_text(encoding="utf-8"))
    threshold = summary["settings"].get("delta_warning", 0.05)
    steps = steps_summary(collected.steps, collected.within, tolerance=0.01, max_steps=MAX_STEPS)
    return summary | {
        "n_samples": SAMPLES,
        "model": "Llama-3.2-1B shapes (benchmark: random results)",
        "data": "lm-1b benchmark:test",
        "deltas": delta_summary(
            collected.deltas,
            collected.scores,
            collected.baseline_scores,
            n_steps="auto",
            method="adaptive_simpson",
            threshold=threshold,
        ),
        "steps": steps | {"start_precision": None},
        "audit": None,
        "top_k": token_ranking(collected, to_tokens, {BOS, PAD}, TOP_K, MIN_COUNT),  # type: ignore[arg-type]
    }


def _side_files(run_dir: Path) -> None:
    """profile, meta, pid, log and events of the small run, with this run's name and sample counts."""
    shutil.copytree(SMALL_RUN, run_dir, ignore=shutil.ignore_patterns("results"))
    meta = json.loads((run_dir / "meta.json").read_text(encoding="utf-8"))
    write_json(run_dir / "meta.json", meta | {"id": RUN_NAME, "name": "lm-1b-attribution"})
    profile = (run_dir / "profile.toml").read_text(encoding="utf-8")
    profile = profile.replace("n_samples = 6", f"n_samples = {SAMPLES}").replace("max_length = 128", "max_length = 512")
    (run_dir / "profile.toml").write_text(profile, encoding="utf-8")
    rows = str(SAMPLES * COMPLETION)
    for name in ("events.jsonl", "log.txt"):
        text = (run_dir / name).read_text(encoding="utf-8").replace(SMALL_RUN.name, RUN_NAME)
        text = text.replace('"n_samples": 6', f'"n_samples": {SAMPLES}').replace('"total": 24', f'"total": {rows}')
        (run_dir / name).write_text(text.replace("24 samples", f"{rows} samples"), encoding="utf-8")


def write_lm_run(runs_dir: Path, seed: int = 0) -> Path:
    """Write the run into `runs_dir` (the same files for the same seed); returns its directory."""
    generator = torch.Generator().manual_seed(seed)
    vocab = _vocabulary(generator)

    def to_tokens(ids: list[int]) -> list[str]:
        return [vocab[i] for i in ids]

    samples = _dataset(generator, vocab)
    rows = per_token_rows(samples)
    run = CompletionRun(samples, rows, SOURCE, per_token=True)
    collected = run.per_sample(_rows_collected(generator, rows))
    run_dir = runs_dir / RUN_NAME
    _side_files(run_dir)
    results = run_dir / "results"
    results.mkdir()
    write_samples(results / "attributions.jsonl", run.records(collected, to_tokens, {BOS, PAD}, TOP_K_SAMPLE))
    write_tensors(results / "attributions.safetensors", collected, run.tensors(collected))
    write_json(results / "summary.json", _summary(collected, to_tokens))
    return run_dir


if __name__ == "__main__":
    print(write_lm_run(Path(sys.argv[1])))
