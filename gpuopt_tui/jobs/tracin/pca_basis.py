"""Projection factors fitted to the data for the factored method (tracin.projection_basis = "pca").

A layer's per-example gradient is sum_t g_t x_t^T (factored.py). Random factors keep any k directions of each side;
these keep the k directions along which the layer's inputs x (input side) and output gradients g (output side) vary
most over some training examples: the top eigenvectors of C_x = sum x x^T and C_g = sum g g^T over the tokens the
loss's gradient reaches (g != 0; the others add nothing to any gradient), the two Kronecker factors of K-FAC, as
LoGra's PCA initialisation does. The inner product of two projected gradients is then the inner
product of the gradients' components in those subspaces: a truncation, not an unbiased estimate, but where the
covariances' spectra fall fast it keeps most of each gradient, and rankings agreed with exact TracIn better than with
random factors of the same size in every case measured (benchmarks/results/tracin_lm_pca_cpu.md).

Each side's covariance is never formed: a streaming Nyström sketch keeps C Omega [dim, m] (Omega: a seeded
orthonormal test matrix, m = 2k + 16 columns, all of them when that reaches dim: then the sketch is exact), and the
eigenvectors come from it at the end (Tropp, Yurtsever, Udell and Cevher, "Fixed-rank approximation of a positive-
semidefinite matrix from streaming data", 2017). A PEFT LoRA layer's A output side (B^T g) and B input side (A x) are
r-dimensional: their covariances are B^T C_g B and A C_x A^T, taken from the same sketches. Embeddings (and weights tied
to them), biases and LayerNorm parameters keep random factors. Factors are orthonormal, each column's sign fixed (its
largest entry positive), and fitted per checkpoint, with the checkpoint's weights, from the same training examples (with
the training-gradient cache on, once: grad_cache.py keeps them with the gradients).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.data import TextDataset, trim_batch
from gpuopt_tui.jobs.device import free_memory, is_oom
from gpuopt_tui.jobs.models.base import to_device
from gpuopt_tui.jobs.tracin.factored import MATRIX_SIDES, FactoredGradients, Use, example_rows, masked_padding
from gpuopt_tui.jobs.tracin.project import Projector

OVERSAMPLE = 16  # sketch columns beyond 2k
FIT_BATCH = 8  # examples per micro-batch of the fitting pass (halved on out-of-memory)
# role -> the sketch of each axis ("in": layer inputs, "out": output gradients); an embedding's input side is its
# vocabulary (one-hot tokens): embeddings keep random factors
SIDES = {role: sides for role, sides in MATRIX_SIDES.items() if role != "embedding"}


class CovarianceSketch:
    """A streaming Nyström sketch of C = sum over rows of x x^T, for rows x of `dim` numbers: keeps C Omega only."""

    def __init__(self, omega: Tensor) -> None:
        """`omega` [dim, m]: the test matrix, with orthonormal columns (times any scale)."""
        self.omega = omega
        self.y = torch.zeros_like(omega)

    def add(self, rows: Tensor) -> None:
        """Add rows [..., dim] (zero rows add nothing)."""
        x = rows.detach().reshape(-1, rows.shape[-1]).float()  # a layer's input is in the graph: kept out of it
        self.y.addmm_(x.T, x @ self.omega)

    def eig(self) -> tuple[Tensor, Tensor]:
        """(eigenvectors [dim, m], eigenvalues [m], descending) of the sketch's approximation of C, in float64."""
        y, omega = self.y.double().cpu(), self.omega.double().cpu()
        if not torch.isfinite(y).all():
            raise UserError(
                "fitting the projection's directions met activations or gradients that are not finite (an fp16 "
                'overflow?): use tracin.amp_dtype = "bf16", use_amp = false, or projection_basis = "random"'
            )
        # a shift above the float32 sums' rounding keeps the Cholesky factor real; larger if the rounding needs it
        for scale in (1e-6, 1e-4, 1e-2):
            shift = max(scale * float(y.norm()), 1e-30)
            shifted = y + shift * omega
            core = omega.T @ shifted
            lower, info = torch.linalg.cholesky_ex((core + core.T) / 2)
            if not info:
                break
        else:
            raise RuntimeError("the projection sketch's core matrix is not positive definite")  # a bug if reached
        solved = torch.linalg.solve_triangular(lower, shifted.T, upper=False).T
        u, sigma, _ = torch.linalg.svd(solved, full_matrices=False)
        return u, (sigma**2 - shift).clamp(min=0)


def top_directions(eig: tuple[Tensor, Tensor], k: int, through: Tensor | None = None) -> Tensor:
    """[d, k] orthonormal: the top k eigenvectors of M^T C M (C from `eig`; M = `through` [dim, d], the identity
    when None), each column's largest entry positive."""
    u, values = eig
    spread = u * values.sqrt()
    if through is not None:
        spread = through.T.double().cpu() @ spread
    directions = torch.linalg.svd(spread, full_matrices=False)[0][:, :k]
    sign = directions.gather(0, directions.abs().argmax(0, keepdim=True)).sign()
    return directions * torch.where(sign == 0, 1.0, sign)


def fit_bases(
    factored: FactoredGradients, batches: Iterable[Mapping[str, Tensor]], seed: int
) -> dict[tuple[str, int], Tensor]:
    """(parameter, axis) -> its fitted factor [dim, k] (engine dtype, on the device), for each projected side of a
    Linear, Conv1D or LoRA matrix, from one forward and backward of each batch at the model's current weights."""
    widest = _sketched_sides(factored)  # (module, "in" or "out") -> the largest k asked of it
    if not widest:
        return {}  # every side exact, or none of a Linear, Conv1D or LoRA layer: nothing to fit
    names = {id(factored.modules[module]): module for module, _ in widest}
    projector = Projector(1, seed, factored.adapter.device, torch.float32)
    sketches: dict[tuple[str, str], CovarianceSketch] = {}

    def add(module: str, side: str, rows: Tensor) -> None:
        key = (module, side)
        if key in widest:
            if key not in sketches:
                dim = rows.shape[-1]
                omega = projector.factor(f"sketch:{module}:{side}", 0, dim, min(dim, 2 * widest[key] + OVERSAMPLE))
                sketches[key] = CovarianceSketch(omega)
            sketches[key].add(rows)

    def on_input(
        module: nn.Module, uses: list[Use], x: Tensor, n: int, keep: Tensor | None
    ) -> tuple[str, Tensor] | None:
        name = names.get(id(module))
        return None if name is None else (name, x.detach())  # held as it is (no copy) until its gradient comes

    def on_output(uses: list[Use], g: Tensor, n: int, keep: Tensor | None, saved: tuple[str, Tensor] | None) -> None:
        if saved is not None:
            name, x = saved
            g = masked_padding(example_rows(g, n).float(), keep)
            add(name, "out", g)
            # the tokens whose inputs count: those the loss's gradient reaches (a causal LM's output layer also runs
            # on padded completion positions, where it is zero); each adds nothing to any gradient otherwise
            add(name, "in", masked_padding(example_rows(x, n).float(), keep) * (g != 0).any(-1, keepdim=True))

    for batch in batches:
        factored.run_hooked(batch, on_input, on_output)
    eigs = {key: sketch.eig() for key, sketch in sketches.items()}
    return _factors(factored, eigs)


def fit_to_examples(
    factored: FactoredGradients, ds: TextDataset, rows: Sequence[int], seed: int
) -> dict[tuple[str, int], Tensor]:
    """`fit_bases` on `rows` of `ds`, FIT_BATCH examples a micro-batch: on out-of-memory, again from the start with
    half as many (the sketches of a batch cut short would be off)."""
    device, size = factored.adapter.device, FIT_BATCH
    while True:
        batches = (
            to_device(trim_batch(ds.batch(rows[i : i + size]), ds.token_fields), device)
            for i in range(0, len(rows), size)
        )
        try:
            return fit_bases(factored, batches, seed)
        except Exception as exc:
            if not is_oom(exc):
                raise
            if size == 1:
                raise UserError(
                    "out of memory fitting the projection's directions with one example per micro-batch: use "
                    "projection_basis = random, shorter examples (data.max_length), or a larger GPU"
                ) from None
        gc.collect()  # the failed attempt's tensors
        free_memory(device)
        size //= 2


def _projected_sides(factored: FactoredGradients) -> Iterator[tuple[str, Use, int, str]]:
    """(module, use, axis, the sketch it comes from) of each projected side that gets a fitted factor. A weight used
    in another role too (an output layer tied to the embedding) keeps random factors: every use of a parameter is
    projected with the same factors."""
    elsewhere = {u.param for uses in factored.uses.values() for u in uses if u.role not in SIDES}
    for module, uses in factored.uses.items():
        for use in uses:
            if use.param in elsewhere:
                continue
            for axis, side in enumerate(SIDES.get(use.role, ())):
                if factored.sizes[use.param][axis] < factored.shapes[use.param][axis]:
                    yield module, use, axis, side


def _sketched_sides(factored: FactoredGradients) -> dict[tuple[str, str], int]:
    widest: dict[tuple[str, str], int] = {}
    for module, use, axis, side in _projected_sides(factored):
        k = factored.sizes[use.param][axis]
        widest[(module, side)] = max(widest.get((module, side), 0), k)
    return widest


def _factors(
    factored: FactoredGradients, eigs: Mapping[tuple[str, str], tuple[Tensor, Tensor]]
) -> dict[tuple[str, int], Tensor]:
    lora = {name: layer for layer in factored.lora.values() for name in (layer.a, layer.b)}
    bases: dict[tuple[str, int], Tensor] = {}
    for module, use, axis, side in _projected_sides(factored):
        if (module, side) not in eigs:
            continue  # no batch reached the layer
        through = None
        if use.param in lora and (use.role, axis) in (("lora_a", 0), ("lora_b", 1)):  # the r-wide sides
            a, b = lora[use.param].matrices()
            through = b.detach() if use.role == "lora_a" else a.detach().T
        directions = top_directions(eigs[(module, side)], factored.sizes[use.param][axis], through)
        # contiguous, as read back from the cache: the same layout gives the same bits in the products
        bases[(use.param, axis)] = directions.to(factored.adapter.device, factored.dtype).contiguous()
    return bases
