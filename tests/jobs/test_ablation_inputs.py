"""Inputs of the probing engine: tensor files, LoRA state dicts, the synthetic set, and their error messages."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from gpuopt_tui.core.caches.features import FeatureCache
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.ablation.inputs import LayerSource, files_source, lora_source, synthetic_source
from gpuopt_tui.jobs.ablation.matrices import DenseBatch, LowRankProductBatch
from gpuopt_tui.jobs.ablation.synthetic import SyntheticSpec, generate

torch.set_num_threads(1)
CPU = torch.device("cpu")
SPEC = SyntheticSpec(samples=40, layers=3, signal_layer=1, rank=4, dim=8)


@pytest.fixture
def cache(tmp_path: Path) -> FeatureCache:
    return FeatureCache(tmp_path / "cache")


def _read_all(source: LayerSource, layer: str, batch_size: int = 16) -> torch.Tensor:
    parts = []
    for _, matrices in source.batches([layer], batch_size, CPU):
        batch = matrices[layer]
        assert isinstance(batch, DenseBatch)
        parts.append(batch.x)
    return torch.cat(parts)


def test_safetensors_file_layers_in_natural_order(tmp_path: Path, cache: FeatureCache) -> None:
    layers, labels = generate(SPEC)
    tensors = {"layer.10": layers["layer.0"], "layer.2": layers["layer.1"], "labels": labels + 5}
    save_file(tensors, tmp_path / "feats.safetensors")
    source = files_source(tmp_path / "feats.safetensors", "", 0, cache)
    assert source.layers == ["layer.2", "layer.10"]
    assert source.class_values == [5, 6] and torch.equal(source.labels, labels)
    assert torch.equal(_read_all(source, "layer.10"), layers["layer.0"])
    assert source.fingerprint("layer.2") != source.fingerprint("layer.10")


def test_folder_of_pt_and_npy_files(tmp_path: Path, cache: FeatureCache) -> None:
    layers, labels = generate(SPEC)
    folder = tmp_path / "feats"
    folder.mkdir()
    torch.save(layers["layer.0"], folder / "block0.pt")
    np.save(folder / "block1.npy", layers["layer.1"].numpy())
    np.save(folder / "pooled.npy", layers["layer.2"].mean(1).numpy())  # [N, features] is accepted too
    np.save(folder / "labels.npy", labels.numpy())
    source = files_source(folder, "", 30, cache)
    assert source.layers == ["block0", "block1", "pooled"] and source.samples == 30
    assert torch.equal(_read_all(source, "block1"), layers["layer.1"][:30])
    assert _read_all(source, "pooled").shape == (30, 1, 8)


def test_files_fingerprint_follows_content(tmp_path: Path, cache: FeatureCache) -> None:
    layers, labels = generate(SPEC)
    path = tmp_path / "f.safetensors"
    save_file({"a": layers["layer.0"], "labels": labels}, path)
    before = files_source(path, "", 0, cache).fingerprint("a")
    assert files_source(path, "", 0, cache).fingerprint("a") == before
    assert files_source(path, "", 20, cache).fingerprint("a") != before  # fewer samples: other features
    save_file({"a": layers["layer.0"] * 2, "labels": labels}, path)
    assert files_source(path, "", 0, cache).fingerprint("a") != before


def test_separate_labels_file(tmp_path: Path, cache: FeatureCache) -> None:
    layers, labels = generate(SPEC)
    save_file({"a": layers["layer.0"]}, tmp_path / "f.safetensors")
    torch.save(labels.float(), tmp_path / "y.pt")  # integral floats are accepted
    source = files_source(tmp_path / "f.safetensors", str(tmp_path / "y.pt"), 0, cache)
    assert torch.equal(source.labels, labels)


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("never run",))


def _write_case(folder: Path, case: str) -> str:
    """Writes a broken input under `folder`; returns the path to pass and the expected message part."""
    layers, labels = generate(SPEC)
    folder.mkdir()
    np.save(folder / "labels.npy", labels.numpy())
    x = layers["layer.0"].numpy()
    if case == "no_layers":
        return "no .pt or .npy files"
    if case == "no_labels":
        (folder / "labels.npy").unlink()
        np.save(folder / "a.npy", x)
        return "no labels"
    if case == "labels_2d":
        np.save(folder / "labels.npy", labels.numpy().reshape(4, 10))
        np.save(folder / "a.npy", x)
        return "labels must be one integer per sample"
    if case == "labels_fractional":
        np.save(folder / "labels.npy", labels.numpy() + 0.5)
        np.save(folder / "a.npy", x)
        return "labels must be integer class indices"
    if case == "one_class":
        np.save(folder / "labels.npy", np.zeros(40, dtype=np.int64))
        np.save(folder / "a.npy", x)
        return "probing needs two classes"
    if case == "layer_1d":
        np.save(folder / "a.npy", x[:, 0, 0])
        return "expected [N, features] or [N, rows, cols]"
    if case == "too_few_samples":
        np.save(folder / "a.npy", x[:30])
        return "has 30 samples, but the labels have 40"
    if case == "object_npy":
        np.save(folder / "a.npy", np.array([{"x": 1}] * 40, dtype=object), allow_pickle=True)
        return "not a readable .npy array of numbers"
    if case == "pt_dict":
        torch.save({"weights": torch.from_numpy(x)}, folder / "a.pt")
        return "expected one tensor, got dict"
    if case == "pt_unsafe":
        with (folder / "a.pt").open("wb") as f:
            pickle.dump(_Evil(), f)
        return "holds Python objects besides tensors"
    if case == "duplicate":
        np.save(folder / "a.npy", x)
        torch.save(torch.from_numpy(x), folder / "a.pt")
        return "layer a is given twice"
    raise AssertionError(case)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize(
    "case",
    [
        "no_layers",
        "no_labels",
        "labels_2d",
        "labels_fractional",
        "one_class",
        "layer_1d",
        "too_few_samples",
        "object_npy",
        "pt_dict",
        "pt_unsafe",
        "duplicate",
    ],
)
def test_folder_errors_name_the_file_and_the_problem(tmp_path: Path, cache: FeatureCache, case: str) -> None:
    folder = tmp_path / "feats"
    expected = _write_case(folder, case)
    with pytest.raises(UserError) as info:
        files_source(folder, "", 0, cache)
    message = str(info.value)
    assert expected in message
    assert str(folder) in message


def test_path_errors(tmp_path: Path, cache: FeatureCache) -> None:
    with pytest.raises(UserError, match="features_path not found"):
        files_source(tmp_path / "missing.safetensors", "", 0, cache)
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(UserError, match="expected a .safetensors file or a folder"):
        files_source(tmp_path / "x.txt", "", 0, cache)
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(UserError, match=r"bad.safetensors: not a readable safetensors file"):
        files_source(tmp_path / "bad.safetensors", "", 0, cache)
    save_file({"labels": torch.arange(4) % 2}, tmp_path / "only_labels.safetensors")
    with pytest.raises(UserError, match="no layer tensors"):
        files_source(tmp_path / "only_labels.safetensors", "", 0, cache)
    save_file({"a": torch.zeros(4, 3, dtype=torch.bool), "labels": torch.arange(4) % 2}, tmp_path / "b.safetensors")
    with pytest.raises(UserError, match=r"b.safetensors: a: expected numbers"):
        files_source(tmp_path / "b.safetensors", "", 0, cache)
    save_file({"a": torch.zeros(4, 3)}, tmp_path / "c.safetensors")
    with pytest.raises(UserError, match="labels_path not found"):
        files_source(tmp_path / "c.safetensors", str(tmp_path / "nope.npy"), 0, cache)


def _lora_state(n: int = 30, rank: int = 4) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    state = {}
    for i in (0, 1, 10):
        prefix = f"base_model.model.layers.{i}.self_attn.q_proj"
        state[f"{prefix}.lora_A.weight"] = torch.randn(n, rank, 16, generator=gen)
        state[f"{prefix}.lora_B.weight"] = torch.randn(n, 12, rank, generator=gen)
    labels = torch.arange(n) % 3
    return state, labels


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_lora_state_dict_product_and_factors(tmp_path: Path, cache: FeatureCache, suffix: str) -> None:
    state, labels = _lora_state()
    path = tmp_path / f"adapters{suffix}"
    if suffix == ".pt":
        torch.save({**state, "labels": labels}, path)
    else:
        save_file({**state, "labels": labels}, path)
    source = lora_source(path, "", "product", 0, cache)
    names = [f"base_model.model.layers.{i}.self_attn.q_proj" for i in (0, 1, 10)]
    assert source.layers == names and source.classes == 3
    _, matrices = next(source.batches([names[2]], 8, CPU))
    batch = matrices[names[2]]
    assert isinstance(batch, LowRankProductBatch)
    dense = state[f"{names[2]}.lora_B.weight"][:8] @ state[f"{names[2]}.lora_A.weight"][:8]
    torch.testing.assert_close(batch.up @ batch.down, dense)
    a_source = lora_source(path, "", "A", 0, cache)
    assert torch.equal(_read_all(a_source, names[0]), state[f"{names[0]}.lora_A.weight"])
    assert a_source.fingerprint(names[0]) != source.fingerprint(names[0])


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("drop_b", "has lora_A but no lora_B"),
        ("single_adapter", "a single adapter cannot be probed"),
        ("rank_mismatch", "does not match lora_A's rank"),
        ("no_lora", "no '<layer>.lora_A.weight'"),
    ],
)
def test_lora_errors(tmp_path: Path, cache: FeatureCache, change: str, expected: str) -> None:
    state, labels = _lora_state()
    key_a = "base_model.model.layers.1.self_attn.q_proj.lora_A.weight"
    key_b = key_a.replace("lora_A", "lora_B")
    if change == "drop_b":
        del state[key_b]
    elif change == "single_adapter":
        state[key_a] = state[key_a][0]
    elif change == "rank_mismatch":
        state[key_b] = torch.randn(30, 12, 5)
    else:
        state = {"encoder.weight": torch.randn(30, 4)}
    path = tmp_path / "adapters.safetensors"
    save_file({**state, "labels": labels}, path)
    with pytest.raises(UserError, match=expected) as info:
        lora_source(path, "", "product", 0, cache)
    assert str(path) in str(info.value)


def test_synthetic_source_is_deterministic_and_carries_the_label_late() -> None:
    a, b = synthetic_source(SPEC), synthetic_source(SPEC)
    assert a.layers == ["layer.0", "layer.1", "layer.2"]
    assert all(a.fingerprint(layer) == b.fingerprint(layer) for layer in a.layers)
    other = synthetic_source(SyntheticSpec(**{**SPEC.__dict__, "seed": 1}))
    assert other.fingerprint("layer.0") != a.fingerprint("layer.0")
    layers, labels = generate(SyntheticSpec(samples=400, layers=2, signal_layer=1, rank=4, dim=8))
    for name, carries in (("layer.0", False), ("layer.1", True)):
        s = torch.linalg.svdvals(layers[name])
        ratio = s[:, -1] / s[:, 0]  # flatter spectra (class 0) have a larger smallest/largest ratio
        gap = ratio[labels == 0].mean() - ratio[labels == 1].mean()
        assert (gap > 0.1) == carries


def test_model_source_gives_every_layers_hidden_states(
    tiny_bert_dir: Path, tiny_words: list[str], tmp_path: Path
) -> None:
    """Masked pooling of the padded, trimmed batches equals a forward of each text alone."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from gpuopt_tui.core.profiles.io import profile_from_data
    from gpuopt_tui.jobs.ablation.inputs import ModelSource, model_source

    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(tiny_words, size=int(rng.integers(2, 12)))) for _ in range(12)]
    data = tmp_path / "probe.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": i % 3}) + "\n" for i, t in enumerate(texts)))
    profile = profile_from_data(
        {
            "kind": "ablation",
            "model": {"adapter": "hf", "path": str(tiny_bert_dir)},
            "data": {"source": "jsonl", "path": str(data)},
            "ablation": {"n_samples": 10},
        },
        "test",
    )
    source = model_source(profile, CPU, tmp_path / "cache")
    assert source.layers == ["embeddings", "layer.1", "layer.2"] and source.samples == 10 and source.classes == 3
    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_dir)
    seen = 0
    for start, matrices in source.batches(source.layers, 4, CPU):
        for i in range(matrices["embeddings"].size):
            with torch.no_grad():
                alone = model(**tokenizer(texts[start + i], return_tensors="pt"), output_hidden_states=True)
            for index, layer in enumerate(source.layers):
                states = alone.hidden_states[index][0]
                torch.testing.assert_close(matrices[layer].row_mean()[i], states.mean(0), rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(matrices[layer].last_row()[i], states[-1], rtol=1e-4, atol=1e-5)
            seen += 1
    assert seen == 10
    before = source.fingerprint("layer.1")
    with torch.no_grad():
        next(source.adapter.model.parameters()).add_(0.01)
    assert ModelSource(source.adapter, source.dataset).fingerprint("layer.1") != before
    assert "token limit" not in source.description  # 2-11 words: none reaches 128 tokens
    profile.data.max_length = 6
    assert "of 10 texts" in model_source(profile, CPU, tmp_path / "cache").description  # the run log's inputs line
