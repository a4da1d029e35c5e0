"""Projection factors fitted to the data (pca_basis.py): the streaming sketch gives a covariance's top directions
(exactly, with as many columns as dimensions), also through a matrix; on a LoRA decoder every fitted factor spans
the top directions of its layer's inputs or output gradients (a naive float64 reference, example by example); a
TracIn run with projection_basis = pca fits them at each checkpoint, keeps them with its cached gradients and reads
them back (ranks that fit at once all use the first stored); the fitting pass halves its micro-batches on
out-of-memory."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from lm_cases import tiny_decoder, tiny_tokenizer
from test_tracin_causal_lm import TEST, TRAIN, dataset
from test_tracin_lora import lora_adapter, save_lora_checkpoints

from gpuopt_tui.core.caches.files import file_digest
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter
from gpuopt_tui.jobs.tracin import pca_basis
from gpuopt_tui.jobs.tracin.factored import FactoredGradients
from gpuopt_tui.jobs.tracin.grad_cache import CheckpointGradients, TrainGradientCache
from gpuopt_tui.jobs.tracin.interface import Reporter, TracInOptions
from gpuopt_tui.jobs.tracin.pca_basis import CovarianceSketch, fit_bases, top_directions
from gpuopt_tui.jobs.tracin.project import Projector
from gpuopt_tui.jobs.tracin.scores import TracInRun, tracin_scores

peft = pytest.importorskip("peft")

CPU = torch.device("cpu")
K = 12  # projected size: sketches of up to 2K + 16 = 40 dimensions are exact


def top(matrix: torch.Tensor, k: int) -> torch.Tensor:
    return torch.linalg.eigh(matrix)[1].flip(1)[:, :k]


def same_span(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far apart the spans of two orthonormal [d, k] matrices are (0: the same subspace)."""
    return float((a @ a.T - b @ b.T).abs().max())


def rows_with_a_spectrum(dim: int, decades: float = 2, n: int = 400) -> torch.Tensor:
    """Rows whose spread falls by `decades` powers of ten across the dimensions, in random directions."""
    torch.manual_seed(0)
    rotation = torch.linalg.qr(torch.randn(dim, dim, dtype=torch.float64))[0]
    scales = torch.diag(torch.logspace(0, -decades, dim, dtype=torch.float64))
    return torch.randn(n, dim, dtype=torch.float64) @ scales @ rotation


def sketch_of(rows: torch.Tensor, columns: int) -> CovarianceSketch:
    sketch = CovarianceSketch(Projector(1, 0, CPU, torch.float32).factor("test", 0, rows.shape[1], columns))
    for part in rows.split(100):  # streamed
        sketch.add(part)
    return sketch


def test_a_sketch_with_as_many_columns_as_dimensions_gives_the_top_directions() -> None:
    rows = rows_with_a_spectrum(30)
    directions = top_directions(sketch_of(rows, 30).eig(), 5)
    assert same_span(directions, top(rows.T @ rows, 5)) < 1e-5
    assert torch.allclose(directions.T @ directions, torch.eye(5, dtype=torch.float64), atol=1e-12)
    assert (directions.gather(0, directions.abs().argmax(0, keepdim=True)) > 0).all()  # signs fixed


def test_a_narrower_sketch_finds_the_top_directions_of_a_falling_spectrum() -> None:
    rows = rows_with_a_spectrum(60, decades=8)
    assert same_span(top_directions(sketch_of(rows, 26).eig(), 5), top(rows.T @ rows, 5)) < 1e-3


def test_directions_through_a_matrix_are_those_of_its_covariance() -> None:
    rows = rows_with_a_spectrum(30)
    through = torch.randn(30, 8, dtype=torch.float64)
    covariance = rows.T @ rows
    assert (
        same_span(top_directions(sketch_of(rows, 30).eig(), 3, through), top(through.T @ covariance @ through, 3))
        < 1e-5
    )


def lora_decoder() -> CausalLMAdapter:
    torch.manual_seed(3)
    config = peft.LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(tiny_decoder("llama").double(), config).eval()
    return CausalLMAdapter("llama", model, tiny_tokenizer(), CPU)


def naive_covariances(
    adapter: CausalLMAdapter, pairs: list[tuple[str, str]], modules: Iterable[str]
) -> dict[tuple[str, str], torch.Tensor]:
    """(module, "in" / "out") -> the sum over every token that the loss's gradient reaches (g != 0), of every
    example, one example at a time, of x x^T (the module's inputs) and g g^T (gradients of its output), in
    float64."""
    sums: dict[tuple[str, str], torch.Tensor] = {}

    def add(key: tuple[str, str], rows: torch.Tensor) -> None:
        rows = rows.reshape(-1, rows.shape[-1]).detach()
        sums[key] = sums.get(key, 0) + rows.T @ rows

    def hook_for(name: str):
        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            x = args[0].detach()

            def on_gradient(g: torch.Tensor) -> None:
                add((name, "out"), g)
                add((name, "in"), x[(g != 0).any(-1)])

            output.register_hook(on_gradient)

        return hook

    named = dict(adapter.model.named_modules())
    handles = [named[n].register_forward_hook(hook_for(n)) for n in modules]
    try:
        for pair in pairs:
            batch = dataset(adapter, [pair]).tensors
            adapter.loss_per_example(batch).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    return sums


def test_fitted_factors_of_a_lora_decoder_span_the_top_directions_of_its_layers() -> None:
    adapter = lora_decoder()
    names = [n for n, p in adapter.model.named_parameters() if p.requires_grad]
    engine = FactoredGradients(adapter, names, k_in=K, k_out=K, seed=0, precision="fp32")
    pairs = TRAIN + TEST
    bases = fit_bases(engine, [dataset(adapter, TRAIN, "left").tensors, dataset(adapter, TEST).tensors], seed=0)
    covariances = naive_covariances(adapter, pairs, engine.lora)
    checked = 0
    for module, layer in engine.lora.items():
        a, b = (m.detach() for m in layer.matrices())
        sides = {  # (parameter, axis) -> (its covariance's side, the matrix it is seen through)
            (layer.a, 1): ("in", None), (layer.a, 0): ("out", b), (layer.b, 0): ("out", None), (layer.b, 1): ("in", a.T)
        }  # fmt: skip
        for (param, axis), (side, through) in sides.items():
            covariance = covariances[(module, side)]
            if engine.sizes[param][axis] == engine.shapes[param][axis] or covariance.shape[0] > 2 * K + 16:
                assert (param, axis) not in bases or covariance.shape[0] > 2 * K + 16
                continue  # exact side (no factor), or a sketch narrower than its dimension (not exact)
            seen = covariance if through is None else through.T @ covariance @ through
            assert same_span(bases[(param, axis)], top(seen, K)) < 1e-4, (param, axis)
            checked += 1
    assert checked >= 8  # attention layers' sides of both kinds, the r-wide ones through A and B included


@pytest.fixture
def lora_run(tmp_path: Path) -> tuple[CausalLMAdapter, list, list[str]]:
    adapter, checkpoints = lora_adapter("llama", save_lora_checkpoints("llama", tmp_path / "adapters", lrs=(0.1, 0.05)))
    return adapter, checkpoints, [n for n, p in adapter.model.named_parameters() if p.requires_grad]


PCA = TracInOptions(method="factored", projection_in=3, projection_out=3, projection_basis="pca", shard_size=3)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fitted_factors_of_full_parameter_layers_span_their_top_directions(family: str) -> None:
    """Every Linear (Llama) or Conv1D (GPT-2, weight stored [in, out]) weight of a full-parameter decoder."""
    adapter = CausalLMAdapter(family, tiny_decoder(family).double(), tiny_tokenizer(), CPU)
    layers = [n for n, m in adapter.model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")]
    names = [f"{n}.weight" for n in layers if f"{n}.weight" in dict(adapter.model.named_parameters())]
    engine = FactoredGradients(adapter, names, k_in=K, k_out=K, seed=0, precision="fp32")
    bases = fit_bases(engine, [dataset(adapter, TRAIN).tensors, dataset(adapter, TEST).tensors], seed=0)
    covariances = naive_covariances(adapter, TRAIN + TEST, engine.uses)
    checked = 0
    for module, uses in engine.uses.items():
        for use in uses:
            sides = {"weight": ("out", "in"), "conv_weight": ("in", "out")}.get(use.role, ())
            for axis, side in enumerate(sides):
                covariance = covariances[(module, side)]
                if (use.param, axis) in bases and covariance.shape[0] <= 2 * K + 16:  # an exact sketch
                    assert same_span(bases[(use.param, axis)], top(covariance, K)) < 1e-4, (use.param, axis)
                    checked += 1
    assert checked >= 4


def test_a_run_with_pca_directions_fits_them_at_each_checkpoint(
    lora_run: tuple[CausalLMAdapter, list, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter, checkpoints, names = lora_run
    fitted: list[dict[tuple[str, int], torch.Tensor]] = []
    set_bases = FactoredGradients.set_bases

    def recording(self: FactoredGradients, bases: dict[tuple[str, int], torch.Tensor]) -> None:
        fitted.append(dict(bases))
        set_bases(self, bases)

    monkeypatch.setattr(FactoredGradients, "set_bases", recording)
    result = tracin_scores(adapter, checkpoints, dataset(adapter, TRAIN), dataset(adapter, TEST), names, PCA)
    assert len(fitted) == len(checkpoints) and fitted[0] and fitted[0].keys() == fitted[1].keys()
    assert not torch.equal(*(next(iter(f.values())) for f in fitted))  # each checkpoint's own directions
    assert result.matrix is not None and torch.isfinite(result.matrix).all()
    assert 0 < result.stats["fit_seconds"] < result.stats["seconds"]  # timed apart: the rate leaves it out


def test_cached_gradients_are_read_with_the_directions_they_were_computed_with(
    lora_run: tuple[CausalLMAdapter, list, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second run reads the blocks and the directions stored with them (fitting none) and scores as the first;
    directions whose file is damaged are fitted again, with a warning, and a block is used only with the directions
    it was computed with."""
    adapter, checkpoints, names = lora_run
    train, test = dataset(adapter, TRAIN), dataset(adapter, TEST)
    options = replace(PCA, train_cache=tmp_path / "cache")
    first = tracin_scores(adapter, checkpoints, train, test, names, options)
    blocks = first.stats["cache_blocks"]["computed"]
    assert blocks == 2 * len(checkpoints) and len(list((tmp_path / "cache").rglob("bases.safetensors"))) == 2

    def no_fit(*args: object, **kwargs: object) -> None:
        raise AssertionError("fitted again")

    with monkeypatch.context() as patch:
        patch.setattr("gpuopt_tui.jobs.tracin.pca_basis.fit_bases", no_fit)
        again = tracin_scores(adapter, checkpoints, train, test, names, options)
    assert again.stats["cache_blocks"] == {"read": blocks, "computed": 0} and again.stats["fit_seconds"] == 0
    assert torch.equal(again.matrix, first.matrix)

    damaged = sorted((tmp_path / "cache").rglob("bases.safetensors"))[0]
    damaged.write_bytes(damaged.read_bytes()[:-8] + b"\0" * 8)
    warnings: list[str] = []
    third = tracin_scores(adapter, checkpoints, train, test, names, options, reporter=Recording(warnings))
    # a block is used only with the directions it names: the one read ahead before they were fitted again is computed
    # again; the others are read, as the directions fitted again are the same bits (the CPU: the same sums)
    used = third.stats["cache_blocks"]
    assert used["computed"] >= 1 and used["read"] + used["computed"] == blocks
    assert any("bases.safetensors" in w and "fitted and the blocks computed again" in w for w in warnings)
    assert any("computed for another set of projection directions" in w for w in warnings)
    assert torch.equal(third.matrix, first.matrix)


class Recording(Reporter):
    def __init__(self, warnings: list[str]) -> None:
        super().__init__()
        self.warnings = warnings

    def warn(self, message: str) -> None:
        self.warnings.append(message)


def test_the_fitting_pass_halves_its_micro_batches_on_out_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = lora_decoder()
    names = [n for n, p in adapter.model.named_parameters() if p.requires_grad]
    engine = FactoredGradients(adapter, names, k_in=K, k_out=K, seed=0, precision="fp32")
    train = dataset(adapter, TRAIN + TEST)
    tried: list[int] = []
    real = pca_basis.fit_bases

    def fits_two(factored: FactoredGradients, batches: Iterable[dict], seed: int) -> dict:
        batches = list(batches)
        tried.append(max(len(b["input_ids"]) for b in batches))
        if tried[-1] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(factored, batches, seed)

    monkeypatch.setattr(pca_basis, "fit_bases", fits_two)
    rows = list(range(len(train)))
    assert pca_basis.fit_to_examples(engine, train, rows, seed=0)
    assert tried == [7, 4, 2]  # 8 asked (7 rows), then 4, then 2: fitted
    monkeypatch.setattr(pca_basis, "fit_bases", lambda *args: (_ for _ in ()).throw(torch.OutOfMemoryError("oom")))
    with pytest.raises(UserError, match="out of memory fitting the projection's directions"):
        pca_basis.fit_to_examples(engine, train, rows, seed=0)


def test_ranks_that_fit_at_once_all_use_the_directions_stored_first(tmp_path: Path) -> None:
    """Two ranks of one run fit the directions of the same cache entry: the one that stores them first wins, and
    the other uses those (the same for every block of the entry)."""
    parts = {"model": "m", "projection_basis": ["pca", 4]}
    checkpoint = tmp_path / "checkpoint.bin"
    checkpoint.write_bytes(b"weights")
    entry_parts = {**parts, "checkpoint": file_digest(checkpoint)}
    first = {("w", 0): torch.ones(4, 2, dtype=torch.float64)}
    mine = {("w", 0): torch.zeros(4, 2, dtype=torch.float64)}

    def fit() -> dict[tuple[str, int], torch.Tensor]:
        CheckpointGradients(tmp_path, entry_parts).save_bases(first)  # the other rank, meanwhile
        return mine

    with TrainGradientCache(tmp_path, parts, CPU, torch.float64) as cache:
        cache.checkpoint(checkpoint)
        used = cache.bases(fit)
    assert torch.equal(used[("w", 0)], first[("w", 0)])
    later = CheckpointGradients(tmp_path, entry_parts)
    assert later.stored_bases is not None and torch.equal(later.stored_bases[("w", 0)], first[("w", 0)])


def test_an_output_layer_tied_to_the_embedding_keeps_random_directions() -> None:
    """GPT-2's output layer is its token embedding: both uses of the weight must be projected with the same factors,
    and the embedding's are random."""
    adapter = CausalLMAdapter("gpt2", tiny_decoder("gpt2").double(), tiny_tokenizer(), CPU)
    names = [n for n, _ in adapter.model.named_parameters()]
    engine = FactoredGradients(adapter, names, k_in=K, k_out=K, seed=0, precision="fp32")
    tied = "transformer.wte.weight"
    assert {u.role for uses in engine.uses.values() for u in uses if u.param == tied} == {"embedding", "weight"}
    bases = fit_bases(engine, [dataset(adapter, TRAIN).tensors], seed=0)
    assert bases and not any(param == tied for param, _ in bases)


def test_under_bf16_autocast_the_directions_are_fitted_from_the_rounded_activations() -> None:
    """A bf16 forward hands the hooks bf16 inputs and gradients: the sketches take them in float32, and the factors
    come out orthonormal in the engine's dtype, spanning nearly what an fp32 forward's span."""
    adapter = lora_decoder()
    adapter.model.float()
    names = [n for n, p in adapter.model.named_parameters() if p.requires_grad]
    batches = [dataset(adapter, TRAIN + TEST).tensors]
    fitted = {
        precision: fit_bases(
            FactoredGradients(adapter, names, k_in=K, k_out=K, seed=0, precision=precision), batches, 0
        )
        for precision in ("fp32", "bf16")
    }
    assert fitted["bf16"].keys() == fitted["fp32"].keys()
    for key, factor in fitted["bf16"].items():
        assert factor.dtype == torch.float32
        assert torch.allclose(factor.T @ factor, torch.eye(factor.shape[1]), atol=1e-5)
        assert same_span(factor.double(), fitted["fp32"][key].double()) < 0.2, key  # 0.06 seen


def test_given_directions_are_used_instead_of_fitted(
    lora_run: tuple[CausalLMAdapter, list, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's agreement check scores its subset with the run's own directions (`fitted_bases`): a run on the first
    rows with them fits nothing and gives the full run's scores of those rows."""
    adapter, checkpoints, names = lora_run
    train, test = dataset(adapter, TRAIN), dataset(adapter, TEST)
    run = TracInRun(adapter, checkpoints, train, test, names, PCA)
    full = run.gather([run.compute()])
    assert set(run.fitted_bases) == {c.path for c in checkpoints}

    def no_fit(*args: object, **kwargs: object) -> None:
        raise AssertionError("fitted again")

    monkeypatch.setattr(pca_basis, "fit_bases", no_fit)
    head = tracin_scores(adapter, checkpoints, train.head(3), test, names, replace(PCA, fitted_bases=run.fitted_bases))
    torch.testing.assert_close(head.matrix, full.matrix[:, :3], rtol=1e-9, atol=1e-12)


def test_activations_that_are_not_finite_stop_the_fit_with_a_clear_message() -> None:
    sketch = CovarianceSketch(Projector(1, 0, CPU, torch.float32).factor("test", 0, 8, 4))
    sketch.add(torch.tensor([[float("inf")] + [0.0] * 7]))
    with pytest.raises(UserError, match="not finite .*fp16 overflow"):
        sketch.eig()
