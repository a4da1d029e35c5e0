"""The fused short-sequence attention kernels (gpuopt_tui/jobs/short_attention.py) against the textbook formula.

Without a GPU the kernels run in triton's interpreter (on the CPU, any dtype, float64 included; tests/conftest.py
chooses it); those tests are skipped where triton is not installed. The GPU tests check bf16 against float64, torch.compile, and that
the lean forward of a BERT classifier runs these kernels and keeps its logits and input gradients.
"""

from __future__ import annotations

import pytest
import torch

from gpuopt_tui.jobs import short_attention as sa

needs_triton = pytest.mark.skipif(sa._kernels() is None, reason="needs triton (the kernels' interpreter on CPU)")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def textbook(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v over [batch, seq, heads, dim], in float64; rows with no key left give 0."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    weights = torch.nan_to_num(scores.softmax(-1))
    return torch.einsum("bhqk,bkhd->bqhd", weights, v)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def lengths_mask(lengths: list[int], seq: int) -> torch.Tensor:
    return torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]


def random_qkv(
    shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))


@needs_triton
@pytest.mark.parametrize(
    ("seq", "dim", "lengths"),
    [(1, 16, None), (17, 16, [17, 5, 1]), (64, 32, None), (100, 64, [100, 64, 33]), (128, 16, [128, 1, 90])],
)
def test_equals_the_textbook_formula_and_its_gradients(seq: int, dim: int, lengths: list[int] | None) -> None:
    q, k, v = random_qkv((3, seq, 2, dim), torch.float32, seed=seq)
    key_mask = None if lengths is None else lengths_mask(lengths, seq)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    out = sa.short_attention(q, k, v, key_mask)
    got = torch.autograd.grad(out, (q, k, v), grad)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_out = textbook(*leaves, key_mask)
    want = torch.autograd.grad(want_out, leaves, grad.double())
    assert out.dtype == q.dtype and out.shape == q.shape
    assert relative(out, want_out) < 1e-5
    for a, b in zip(got, want):
        assert relative(a, b) < 1e-5


@needs_triton
def test_gradcheck_in_float64_on_strided_inputs() -> None:
    fused = torch.randn(2, 5, 3, 1, 16, dtype=torch.float64)  # q, k, v of one projection, as strided views
    key_mask = lengths_mask([5, 3], 5)

    def attention(x: torch.Tensor) -> torch.Tensor:
        return sa.short_attention(x[:, :, 0], x[:, :, 1], x[:, :, 2], key_mask)

    assert not fused[:, :, 0].is_contiguous()
    assert torch.autograd.gradcheck(attention, (fused.requires_grad_(),))


@needs_triton
def test_a_sequence_with_every_key_masked_gives_zeros_not_nan() -> None:
    q, k, v = random_qkv((2, 9, 2, 16), torch.float32)
    key_mask = lengths_mask([9, 0], 9)
    out = sa.short_attention(q, k, v, key_mask)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert all(torch.isfinite(g).all() for g in grads)
    assert relative(out[0], textbook(q, k, v, key_mask)[0]) < 1e-5


def test_supports_only_short_half_precision_gpu_inputs() -> None:
    assert not sa.supports(torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16))  # on the CPU
    assert not sa.applies_to(torch.device("cpu"), torch.bfloat16)
    if not torch.cuda.is_available() or sa._kernels() is None:
        return
    assert sa.applies_to(torch.device("cuda"), torch.bfloat16)
    assert not sa.applies_to(torch.device("cuda"), torch.float32)
    half = torch.zeros(2, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert sa.supports(half)
    assert sa.supports(half, torch.ones(2, 128, dtype=torch.bool, device="cuda"))
    assert not sa.supports(half.float())
    assert not sa.supports(torch.zeros(2, 129, 2, 64, device="cuda", dtype=torch.bfloat16))
    assert not sa.supports(torch.zeros(2, 16, 2, 48, device="cuda", dtype=torch.bfloat16))
    with sa.switched_off():
        assert not sa.supports(half)
    assert sa.supports(half)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("seq", "masked"), [(128, False), (128, True), (77, True)])
def test_half_precision_on_the_gpu_is_as_close_to_float64_as_torch(dtype: torch.dtype, seq: int, masked: bool) -> None:
    q, k, v = random_qkv((64, seq, 12, 64), dtype, "cuda")
    key_mask = lengths_mask(torch.randint(1, seq + 1, (64,)).tolist(), seq).cuda() if masked else None
    grad = torch.randn(q.shape, device="cuda", dtype=dtype)
    assert sa.supports(q, key_mask)
    ours = sa.short_attention(q, k, v, key_mask)
    ours_grads = torch.autograd.grad(ours, (q, k, v), grad)
    mask4 = None if key_mask is None else key_mask[:, None, None, :]
    transposed = (t.transpose(1, 2) for t in (q, k, v))
    theirs = torch.nn.functional.scaled_dot_product_attention(*transposed, attn_mask=mask4).transpose(1, 2)
    theirs_grads = torch.autograd.grad(theirs, (q, k, v), grad)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact = textbook(*leaves, key_mask)
    exact_grads = torch.autograd.grad(exact, leaves, grad.double())
    for a, b, x in zip((ours, *ours_grads), (theirs, *theirs_grads), (exact, *exact_grads)):
        assert relative(a, x) < max(2 * relative(b, x), 1e-3)  # within twice torch's own error
        assert relative(a, x) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torch_compile_keeps_the_kernels_and_their_results() -> None:
    q, k, v = random_qkv((8, 128, 4, 64), torch.bfloat16, "cuda")
    key_mask = lengths_mask([128, 100, 64, 1, 128, 7, 50, 99], 128).cuda()
    proj = torch.nn.Linear(64, 64, device="cuda", dtype=torch.bfloat16)

    def layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return proj(sa.short_attention(q, k, v, key_mask)).float().square().sum()

    eager = torch.autograd.grad(layer(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(layer, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(compiled, eager):
        assert relative(a, b) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_lean_forward_runs_them_and_keeps_logits_and_input_gradients() -> None:
    from torch.profiler import ProfilerActivity, profile
    from transformers import BertConfig, BertForSequenceClassification

    from gpuopt_tui.jobs.models.first_token import first_token_only

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=128, num_hidden_layers=3, num_attention_heads=2, intermediate_size=256
    )
    model = BertForSequenceClassification(config).eval().cuda().to(torch.bfloat16)
    embeds = torch.randn(6, 40, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask = lengths_mask([40, 33, 12, 40, 2, 27], 40).long().cuda()

    def logits_and_grad() -> tuple[torch.Tensor, torch.Tensor]:
        with first_token_only(model) as lean:
            assert lean
            logits = model(inputs_embeds=embeds, attention_mask=mask).logits
        return logits, torch.autograd.grad(logits[:, 0].float().sum(), embeds)[0]

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        logits, grad = logits_and_grad()
        torch.cuda.synchronize()
    kernels = {e.key for e in prof.key_averages()}
    assert {"attention_forward", "attention_backward"} <= kernels
    with sa.switched_off():
        want_logits, want_grad = logits_and_grad()
    assert relative(logits, want_logits) < 2e-2
    assert relative(grad, want_grad) < 2e-2


@needs_triton
def test_per_example_gradients_under_torch_func_vmap_equal_a_loop_over_the_kernels() -> None:
    """torch.func cannot run the kernels' autograd rule: within vmap(grad(...)) the attention is computed by
    scaled_dot_product_attention, and the per-example gradients are those of the kernels one example at a time."""
    q, k, v = (t.detach() for t in random_qkv((3, 12, 2, 16), torch.float32, seed=5))
    key_mask = lengths_mask([12, 7, 3], 12)

    def loss(q1: torch.Tensor, k1: torch.Tensor, v1: torch.Tensor, m1: torch.Tensor) -> torch.Tensor:
        return sa.short_attention(q1[None], k1[None], v1[None], m1[None]).square().sum()

    batched = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(q, k, v, key_mask)
    for i in range(3):
        leaves = [t[i : i + 1].clone().requires_grad_() for t in (q, k, v)]
        out = sa.short_attention(*leaves, key_mask[i : i + 1])
        want = torch.autograd.grad(out.square().sum(), leaves)
        for got, ref in zip(batched, want):
            assert relative(got[i], ref[0]) < 1e-5


def test_supports_says_no_inside_torch_func_transforms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sa, "_capable", lambda device: True)
    q = torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16)
    seen: list[bool] = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(sa.supports(x[None]))
        return x.float().sum()

    torch.func.vmap(torch.func.grad(probe))(q)
    assert sa.supports(q) and seen == [False]
