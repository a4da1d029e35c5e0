"""Integrated Gradients on a CUDA GPU: the memory probe of automatic chunking, reduced precision (autocast and
cast weights) against fp32, and the compiled step forward. Skipped without CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from gpuopt_tui.jobs.attribution import ChunkPlanner, IGOptions, integrated_gradients
from gpuopt_tui.jobs.attribution.adaptive import precision_floor
from gpuopt_tui.jobs.attribution.check import relative_difference
from gpuopt_tui.jobs.attribution.compiled import StepCompiler

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=200,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=64,
        initializer_range=0.1,
        num_labels=2,
    )
    model = BertForSequenceClassification(config).eval().cuda()
    ids = torch.randint(5, 200, (8, 48), device="cuda")
    mask = torch.ones_like(ids)
    mask[::2, 30:] = 0
    emb = model.get_input_embeddings()(ids).detach()
    base = torch.zeros_like(emb)
    return model, emb, base, mask


def forward_of(model):
    return lambda e, m, c: model(inputs_embeds=e, attention_mask=m).logits


def test_auto_chunks_probe_the_memory_and_give_the_same_result(case) -> None:
    model, emb, base, mask = case
    events = []
    planner = ChunkPlanner("auto", memory_fraction=0.5, on_event=lambda type, **f: events.append((type, f)))
    chunked = integrated_gradients(forward_of(model), emb, base, mask, options=IGOptions(n_steps=200), planner=planner)
    whole = integrated_gradients(
        forward_of(model), emb, base, mask, options=IGOptions(n_steps=200, alpha_batch_size=None)
    )
    assert events[0][0] == "chunk_probe" and events[0][1]["peak_bytes"] > 0
    assert planner.bytes_per_row_token and planner.bytes_per_row_token > 0
    assert float(relative_difference(chunked.token_scores(), whole.token_scores()).max()) < 1e-5


@pytest.mark.parametrize(
    ("precision", "cast_weights"), [("tf32", False), ("bf16", False), ("fp16", False), ("bf16", True), ("fp16", True)]
)
def test_reduced_precision_stays_within_1e_2_of_fp32(case, precision: str, cast_weights: bool) -> None:
    model, emb, base, mask = case
    weights = [p.clone() for p in model.parameters()]
    fp32 = integrated_gradients(forward_of(model), emb, base, mask, options=IGOptions(n_steps=50, precision="fp32"))
    fast = integrated_gradients(
        forward_of(model),
        emb,
        base,
        mask,
        options=IGOptions(n_steps=50, precision=precision, cast_weights=cast_weights),
    )
    error = relative_difference(fast.token_scores(), fp32.token_scores())
    assert 0 < float(error.median()) < 1e-2
    assert fast.attributions.dtype == torch.float32
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))  # the fp32 weights came back


def test_compiled_steps_match_eager_across_shapes(case) -> None:
    model, emb, base, mask = case
    events = []
    compiler = StepCompiler(on_event=lambda type, **f: events.append(type))
    for rows, length, steps in ((8, 48, 32), (5, 40, 24)):  # a second shape must not fail or recompile much
        args = (emb[:rows, :length], base[:rows, :length], mask[:rows, :length])
        options = IGOptions(n_steps=steps, alpha_batch_size=8, precision="bf16", cast_weights=True)
        eager = integrated_gradients(forward_of(model), *args, options=options)
        compiled = integrated_gradients(forward_of(model), *args, options=options, compiler=compiler, model=model)
        assert float(relative_difference(compiled.token_scores(), eager.token_scores()).max()) < 2e-2
    assert compiler.error is None and compiler.compile_seconds > 0
    assert events == ["compiled"]


def test_auto_steps_in_fp16_weights_compiled_agree_with_many_fp32_steps(case) -> None:
    """Refinement passes over fewer and fewer samples (new chunk shapes) under one compiler, fp16 weights."""
    model, emb, base, mask = case
    compiler = StepCompiler()
    auto = integrated_gradients(
        forward_of(model),
        emb,
        base,
        mask,
        options=IGOptions(n_steps="auto", tolerance=1e-2, precision="fp16", cast_weights=True, alpha_batch_size="auto"),
        compiler=compiler,
        model=model,
    )
    reference = integrated_gradients(
        forward_of(model), emb, base, mask, options=IGOptions(n_steps=500, precision="fp32")
    )
    assert compiler.error is None
    assert auto.steps.min() >= 9 and int(auto.steps.sum()) < 500 * emb.shape[0]
    assert float(relative_difference(auto.token_scores(), reference.token_scores()).max()) < 2e-2


def test_full_precision_fallback_runs_its_samples_in_tf32_beside_compiled_fp16(case) -> None:
    """The samples fp16 cannot resolve (routed by their output change, by their measured rounding, or after not
    settling) run eagerly in TF32 (their own passes) while the others run compiled in fp16:
    each group matches a run of it alone in its precision, and the fallback is closer to fp32 than fp16 alone."""
    model, emb, base, mask = case
    with torch.no_grad():  # a tolerance at which the rule flags about half of these samples
        out_x, out_b = (forward_of(model)(e, mask, {}) for e in (emb, base))
        target = out_x.argmax(-1, keepdim=True)
        ends = out_x.gather(1, target).squeeze(1), out_b.gather(1, target).squeeze(1)
    moved = (ends[0] - ends[1]).abs() / torch.maximum(ends[0].abs(), ends[1].abs())
    tolerance = precision_floor("fp16") / float(moved.median())
    common = IGOptions(n_steps="auto", tolerance=tolerance, alpha_batch_size=64)
    fp16 = dataclasses.replace(common, precision="fp16", cast_weights=True, full_precision_fallback=True)
    mixed = integrated_gradients(forward_of(model), emb, base, mask, options=fp16, compiler=StepCompiler(), model=model)
    full = mixed.full_precision
    assert 0 < int(full.sum()) < full.numel(), full
    flagged, rest = full.nonzero().squeeze(1), (~full).nonzero().squeeze(1)

    def alone(rows: torch.Tensor, **precision: object):
        options = dataclasses.replace(common, **precision)
        return integrated_gradients(
            forward_of(model), emb[rows], base[rows], mask[rows], mixed.target[rows], options, model=model
        )

    tf32 = alone(flagged, precision="tf32")
    fp16 = alone(rest, precision="fp16", cast_weights=True, full_precision_fallback=True)  # the same probe
    assert not fp16.full_precision.any()
    assert torch.equal(mixed.steps[flagged], tf32.steps) and torch.equal(mixed.steps[rest], fp16.steps)
    # TF32 kernels chosen for other shapes round differently: each run is within TF32's floor of fp32, so the two
    # agree within twice it (an H200 measured up to 9.8e-4 here), not to fp32's rounding
    tf32_rounding = 2 * precision_floor("tf32")
    assert float(relative_difference(mixed.token_scores()[flagged], tf32.token_scores()).max()) < tf32_rounding
    assert float(relative_difference(mixed.token_scores()[rest], fp16.token_scores()).max()) < 1e-2  # compiled
    fp32 = alone(flagged, precision="fp32")
    in_fp16 = alone(flagged, precision="fp16", cast_weights=True)
    ours = relative_difference(mixed.token_scores()[flagged], fp32.token_scores()).max()
    assert ours < relative_difference(in_fp16.token_scores(), fp32.token_scores()).max()
