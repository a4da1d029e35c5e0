"""Step precision and compilation of the batched engine, on the CPU: a cast copy of the weights (bf16) against
fp32, the weights put back untouched, torch.compile (through the aot_eager backend, which traces the forward
and its backward like inductor but needs no C++ toolchain) against eager, and the fallback to eager when
compiling fails."""

from __future__ import annotations

import pytest
import torch
from ig_cases import tiny_bert_case

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.attribution import AttributionSection
from gpuopt_tui.jobs.attribution import IGOptions, integrated_gradients, integrated_gradients_reference
from gpuopt_tui.jobs.attribution import compiled as compiled_module
from gpuopt_tui.jobs.attribution.check import relative_difference
from gpuopt_tui.jobs.attribution.compiled import AUTO_MIN_SAMPLE_STEPS, StepCompiler, should_compile
from gpuopt_tui.jobs.attribution.precision import StepPrecision, output_margins, weights_cast


@pytest.fixture(scope="module")
def case():
    return tiny_bert_case(seed=0, data_seed=1, rows=4, padded=(1, 8))


def forward_of(model):
    return lambda e, m, c: model(inputs_embeds=e, attention_mask=m).logits


def test_bf16_weights_are_close_to_fp32_and_come_back_untouched(case) -> None:
    model, emb, base, mask = case
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    fp32 = integrated_gradients(forward_of(model), emb, base, mask, options=IGOptions(n_steps=16, alpha_batch_size=8))
    cast = integrated_gradients(
        forward_of(model),
        emb,
        base,
        mask,
        options=IGOptions(n_steps=16, alpha_batch_size=8, precision="bf16", cast_weights=True),
    )
    error = relative_difference(cast.token_scores(), fp32.token_scores())
    assert 0 < float(error.max()) < 5e-2  # bf16 arithmetic, yet the same attributions
    assert cast.attributions.dtype == torch.float32 and cast.deltas.dtype == torch.float32
    assert torch.equal(cast.scores, fp32.scores)  # F(x) ran on the fp32 weights
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[name]), name


def test_batched_and_reference_paths_agree_with_cast_weights(case) -> None:
    model, emb, base, mask = case
    options = IGOptions(n_steps=6, method="riemann_middle", alpha_batch_size=3, precision="bf16", cast_weights=True)
    batched = integrated_gradients(forward_of(model), emb, base, mask, options=options)
    reference = integrated_gradients_reference(forward_of(model), emb, base, mask, options=options)
    assert float(relative_difference(batched.token_scores(), reference.token_scores()).max()) < 2e-2


def test_weights_cast_puts_the_originals_back_after_an_error(case) -> None:
    model = case[0]

    def storage() -> list[tuple[int, torch.dtype]]:
        return [(t.data_ptr(), t.dtype) for t in (*model.parameters(), *model.buffers())]

    originals = storage()
    with pytest.raises(RuntimeError, match="inside"), weights_cast(model, torch.bfloat16):
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        raise RuntimeError("inside")
    assert storage() == originals  # the very same fp32 tensors, not copies cast back


def test_step_precision_only_casts_reduced_types() -> None:
    assert StepPrecision.of("bf16", cast_weights=True) == StepPrecision("fp32", torch.bfloat16)
    assert StepPrecision.of("fp16", cast_weights=True) == StepPrecision("fp32", torch.float16)
    assert StepPrecision.of("bf16") == StepPrecision("bf16", None)
    assert StepPrecision.of("tf32", cast_weights=True) == StepPrecision("tf32", None)
    context = StepPrecision.of("bf16", True).context({"user": torch.ones(2, 3), "ids": torch.ones(2, dtype=torch.long)})
    assert context["user"].dtype == torch.bfloat16 and context["ids"].dtype == torch.long


def test_compiled_steps_equal_eager_and_compile_once(case) -> None:
    model, emb, base, mask = case
    events = []
    compiler = StepCompiler(
        backend="aot_eager",
        on_event=lambda type, **fields: events.append((type, fields)),
        on_compiling=lambda: events.append(("compiling", {})),  # the run's stage while it compiles
    )
    for rows, length, steps in ((4, 12, 8), (3, 10, 6)):
        args = (emb[:rows, :length], base[:rows, :length], mask[:rows, :length])
        eager = integrated_gradients(forward_of(model), *args, options=IGOptions(n_steps=steps, alpha_batch_size=4))
        compiled = integrated_gradients(
            forward_of(model),
            *args,
            options=IGOptions(n_steps=steps, alpha_batch_size=4),
            compiler=compiler,
            model=model,
        )
        assert float(relative_difference(compiled.token_scores(), eager.token_scores()).max()) < 1e-5
    assert compiler.error is None and compiler.compile_seconds > 0
    assert [type for type, _ in events] == ["compiling", "compiled"]  # dynamic: the second batch reuses the graph


def test_a_failing_compilation_falls_back_to_eager(case, monkeypatch: pytest.MonkeyPatch) -> None:
    model, emb, base, mask = case

    def broken_compile(forward, **options):
        def run(*args):
            raise RuntimeError("backend exploded")

        return run

    monkeypatch.setattr(compiled_module.torch, "compile", broken_compile)
    events = []
    compiler = StepCompiler(on_event=lambda type, **fields: events.append((type, fields)))
    eager = integrated_gradients(forward_of(model), emb, base, mask, options=IGOptions(n_steps=8, alpha_batch_size=4))
    result = integrated_gradients(
        forward_of(model), emb, base, mask, options=IGOptions(n_steps=8, alpha_batch_size=4), compiler=compiler
    )
    assert torch.equal(result.attributions, eager.attributions)
    assert compiler.error is not None and "backend exploded" in compiler.error
    assert events == [("compile_failed", {"error": compiler.error})]


def test_compile_setting() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert should_compile("auto", cuda, 40_000, 2000)
    assert not should_compile("auto", cuda, 64, 50)
    assert should_compile("auto", cuda, AUTO_MIN_SAMPLE_STEPS, 1)
    assert not should_compile("auto", cpu, 40_000, 2000)
    assert should_compile("on", cpu, 1, 1) and not should_compile("off", cuda, 40_000, 2000)
    section = AttributionSection()
    assert (section.use_amp, section.amp_dtype, section.amp_mode, section.compile) == (True, "fp16", "weights", "auto")


def test_non_finite_gradients_are_an_error(case) -> None:
    model, emb, base, mask = case

    def forward(e, m, c):
        logits = model(inputs_embeds=e, attention_mask=m).logits
        return logits * torch.where(e.sum() > 1e30, 1.0, float("inf"))  # finite at neither end of the path

    with pytest.raises(UserError, match="not finite in fp16.*amp_dtype = bf16"):
        integrated_gradients(
            forward, emb, base, mask, options=IGOptions(n_steps=4, precision="fp16"), target=torch.zeros(4).long()
        )


class NearTie(torch.nn.Module):
    """Two outputs 1e-4 apart in fp32 whose weights round to the same bf16 values: bf16 sees a tie."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 2, bias=False)
        with torch.no_grad():
            self.linear.weight[0] = 0.5
            self.linear.weight[1] = 0.5 + 2e-5

    def forward(self, embeds: torch.Tensor, mask: torch.Tensor | None, context: object) -> torch.Tensor:
        return self.linear(embeds.sum(1))


@pytest.mark.parametrize("cast_weights", [True, False])
def test_target_and_margin_come_from_an_fp32_forward_under_bf16(cast_weights: bool) -> None:
    model = NearTie().eval()
    emb = torch.ones(2, 3, 8)
    emb[1, :, :] = -1.0  # class 0 wins by 4.8e-4
    step = StepPrecision.of("bf16", cast_weights)
    with (
        torch.no_grad(),
        weights_cast(model, step.weights),
        torch.autocast("cpu", torch.bfloat16, enabled=not cast_weights),
    ):
        low = model(emb.to(step.weights or emb.dtype), None, {})
    assert low[0, 0] == low[0, 1]  # bf16 cannot tell the two outputs of sample 0 apart
    result = integrated_gradients(
        model, emb, torch.zeros_like(emb), options=IGOptions(n_steps=4, precision="bf16", cast_weights=cast_weights)
    )
    assert result.target.tolist() == [1, 0]  # fp32's argmax, not bf16's tie
    margin, low_margin = output_margins(result.outputs, "bf16")
    assert margin.tolist() == pytest.approx([4.8e-4, 4.8e-4], rel=1e-2)
    assert low_margin.tolist() == [True, True]  # 8e-3 x max |output| (about 12) is far above the margin
    assert output_margins(result.outputs, "fp32")[1].tolist() == [False, False]
