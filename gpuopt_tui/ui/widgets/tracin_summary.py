"""What the TracIn results view says about a run as a whole: the Summary tab (settings, parameters, gradient
method and projection, the training gradients' Adam preconditioning, cache use, agreement with exact TracIn, speed)
and the line above the tabs."""

from __future__ import annotations

from pathlib import Path

from textual.content import Content

from gpuopt_tui.core.results.tracin_summary import Agreement, TracInSummary

MAX_TENSORS = 8  # parameter tensors named in the summary


def agreement_text(a: Agreement) -> str:
    return (
        f"Spearman {a.spearman:.4f}, top-{a.top_k} overlap {a.top_k_overlap:.0%} against {a.reference} "
        f"on the first {a.n_train:,} training × {a.n_test:,} test examples"
    )


def summary_content(s: TracInSummary) -> Content:
    def line(name: str, value: str) -> Content:
        return Content.assemble((f"{name:<12}", "bold"), value)

    def names(found: tuple[str, ...]) -> list[Content]:
        more = len(found) - MAX_TENSORS
        return [
            *(Content(f"  {name}") for name in found[:MAX_TENSORS]),
            *([Content(f"  … and {more} more")] if more > 0 else []),
        ]

    scored = f" ({s.n_scored:,} scored)" if s.n_scored != s.n_train else ""
    folders = {str(Path(c.path).parent) for c in s.checkpoints}
    shared = folders.pop() if len(folders) == 1 else ""  # then each checkpoint is named by its file name
    parts = [
        line("Model", s.model),
        line("Examples", f"{s.n_test:,} test × {s.n_train:,} training{scored}"),
        line("Checkpoints", f"{len(s.checkpoints)}" + (f" in {shared}" if shared else "")),
        *(Content(f"  lr {c.lr:<9.3g} {Path(c.path).name if shared else c.path}") for c in s.checkpoints),
        line("Parameters", f"{s.n_parameters:,} in {len(s.parameter_tensors)} tensors ({s.layers})"),
        *names(s.parameter_tensors),
    ]
    if s.excluded_parameters:
        count = len(s.excluded_parameters)
        parts.append(line("Left out", f"{count} tensors the factored gradients cannot give exactly (the log says why)"))
        parts += names(s.excluded_parameters)
    seed = f" (seed {s.projection.seed})" if s.projection and s.projection.seed is not None else ""
    parts.append(line("Mode", f"{s.mode}{seed}; {s.gradient_size:,} numbers per gradient; {s.precision} forward"))
    parts.append(line("Training", s.optimizer_state.text if s.optimizer_state else "plain gradients"))
    if s.optimizer_state is not None:
        parts.append(Content(f"  {s.optimizer_state.formula}"))
    if s.train_cache is not None:
        c = s.train_cache
        parts.append(
            line("Cache", f"training gradients: {c.read} blocks read from the cache, {c.computed} computed and stored")
        )
    if s.agreement is not None:
        parts.append(line("Agreement", agreement_text(s.agreement)))
        if s.agreement.fp32 is not None:
            spearman, overlap = s.agreement.fp32
            top = f"top-{s.agreement.top_k} overlap {overlap:.0%}"
            parts.append(Content(f"  the same settings in fp32: Spearman {spearman:.4f}, {top}"))
        if s.agreement.excluded_from_reference:
            left = len(s.agreement.excluded_from_reference)
            parts.append(Content(f"  the reference leaves out {left} tensors it cannot differentiate exactly"))
    parts.append(line("Filter", s.filter))
    if s.train_examples_per_s is not None:
        rate = f"{s.train_examples_per_s:,.0f} training examples scored per second"
        if s.train_tokens_per_s is not None:
            rate += f" ({s.train_tokens_per_s:,.0f} tokens)"
        if s.compute_seconds is not None:
            fitting = s.projection_fit_seconds
            of_it = f", {fitting:.3g} s of it fitting the projection, left out of the rate" if fitting else ""
            rate += f" ({s.compute_seconds:.3g} s computing{of_it})"
        parts.append(line("Rate", rate))
    elif s.cached_examples_per_s is not None:
        seconds = f" ({s.compute_seconds:.3g} s)" if s.compute_seconds is not None else ""
        read = f"{s.cached_examples_per_s:,.0f} training gradients a second read from the cache, none computed{seconds}"
        parts.append(line("Rate", read))
    if s.oom_retries:
        parts.append(line("Memory", f"{s.oom_retries} out-of-memory retries with a halved micro-batch"))
    if s.flipped_label_auc is not None:
        auc = f"{s.flipped_label_auc:.4f}: the chance that self-influence ranks a label the data marks as flipped"
        parts.append(line("Flipped AUC", auc + " above a clean one"))
    return Content("\n").join(parts)


def status_content(s: TracInSummary | None) -> Content:
    """One line above the tabs: the size of the run, its mode and, where known, its agreement with exact TracIn
    and its flipped-label AUC."""
    if s is None:
        return Content.from_markup("[$text-muted]No summary.json yet: showing the files written so far.[/]")
    text = f"{s.n_test:,} test × {s.n_scored:,} training · {s.mode}"
    if s.agreement is not None:
        text += f" · Spearman vs exact {s.agreement.spearman:.3f}"
    if s.flipped_label_auc is not None:
        text += f" · flipped AUC {s.flipped_label_auc:.4f}"
    return Content(text)
