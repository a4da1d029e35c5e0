"""Model adapters: loading (hf, plugin), forward paths that must agree, errors, and the device helpers."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.common import ModelSection
from gpuopt_tui.jobs.device import autocast, cuda_memory_fields, is_oom, precision, resolve_device
from gpuopt_tui.jobs.models import Adapter, load_adapter, select_rows, tile_rows
from gpuopt_tui.jobs.models.hf import load_hf_adapter

CPU = torch.device("cpu")
TEXTS = ["the cat sat on the mat", "a dog", "very happy blue river and the sun", "not bad"]


@pytest.fixture(scope="module")
def adapter(tiny_bert_dir: Path) -> Adapter:
    return load_hf_adapter(tiny_bert_dir, CPU)


@pytest.fixture(scope="module")
def batch(adapter: Adapter) -> dict[str, torch.Tensor]:
    b = adapter.tokenize(TEXTS, max_length=32)
    b["labels"] = torch.tensor([0, 2, 1, 2])
    return b


# --- hf ----------------------------------------------------------------------------------------------------
def test_hf_adapter_matches_the_model_loaded_directly(tiny_bert_dir: Path, adapter: Adapter, batch) -> None:
    from transformers import BertForSequenceClassification

    reference = BertForSequenceClassification.from_pretrained(tiny_bert_dir).eval()
    with torch.no_grad():
        expected = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = adapter.logits(batch)
    assert got.shape == (4, 3)
    torch.testing.assert_close(got, expected)
    assert adapter.num_labels == 3
    assert not adapter.model.training
    assert adapter.special_ids.pad == 0 and adapter.special_ids.cls == 2 and adapter.special_ids.sep == 3
    assert adapter.special_ids.mask == 4
    name, head = adapter.classifier_head()
    assert name == "classifier" and head.out_features == 3


def test_tokenize_pads_to_the_longest_text_and_caps_at_max_length(adapter: Adapter) -> None:
    b = adapter.tokenize(TEXTS, max_length=32)
    assert b["input_ids"].shape == (4, 9)  # 7 words + [CLS] + [SEP]
    assert b["attention_mask"].sum(1).tolist() == [8, 4, 9, 4]
    assert adapter.tokenize(TEXTS, max_length=5)["input_ids"].shape == (4, 5)
    assert adapter.tokens(b["input_ids"][1, :4]) == ["[CLS]", "a", "dog", "[SEP]"]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_all_forward_paths_agree(adapter: Adapter, batch, attn: str) -> None:
    adapter.model.set_attn_implementation(attn)
    try:
        with torch.no_grad():
            plain = adapter.logits(batch)
            embeds = adapter.word_embeddings()(batch["input_ids"])
            from_embeds = adapter.logits_from_embeds(embeds, batch["attention_mask"], adapter.encode_context(batch))
            params = dict(adapter.model.named_parameters())
            functional = adapter.functional_logits(params, batch)
    finally:
        adapter.model.set_attn_implementation("sdpa")
    torch.testing.assert_close(from_embeds, plain)
    torch.testing.assert_close(functional, plain)
    assert not torch.allclose(plain[0], plain[1])  # padding differs per row and the outputs are not constant


def test_loss_per_example_is_cross_entropy(adapter: Adapter, batch) -> None:
    with torch.no_grad():
        expected = F.cross_entropy(adapter.logits(batch), batch["labels"], reduction="none")
        torch.testing.assert_close(adapter.loss_per_example(batch), expected)


def test_vmap_per_example_gradients_match_one_backward_per_example(adapter: Adapter, batch) -> None:
    chosen = ("classifier.weight", "bert.encoder.layer.1.attention.self.query.weight")
    params = {n: p.detach() for n, p in adapter.model.named_parameters() if n in chosen}

    def one(p, example):
        row = {k: v.unsqueeze(0) for k, v in example.items()}
        return adapter.functional_loss(p, row)[0]

    grads = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0))(params, batch)
    named = dict(adapter.model.named_parameters())
    for i in range(len(TEXTS)):
        adapter.model.zero_grad()
        adapter.loss_per_example(select_rows(batch, [i]))[0].backward()
        for n in chosen:
            torch.testing.assert_close(grads[n][i], named[n].grad, rtol=1e-4, atol=1e-6)
    adapter.model.zero_grad()


def test_hidden_states_one_per_layer_plus_embeddings(adapter: Adapter, batch) -> None:
    with torch.no_grad():
        states = adapter.hidden_states(batch)
    assert len(states) == 3
    assert all(s.shape == (4, 9, 32) for s in states)


def test_tile_rows_is_step_major() -> None:
    x = torch.arange(6).reshape(3, 2)
    tiled = tile_rows({"x": x}, 2)["x"]
    assert tiled.tolist() == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3], [4, 5]]


def test_load_weights_roundtrip_and_mismatch(adapter: Adapter, tmp_path: Path, batch) -> None:
    state = {k: v.clone() for k, v in adapter.model.state_dict().items()}
    changed = {k: v + 0.01 if v.is_floating_point() else v for k, v in state.items()}
    save_file(changed, str(tmp_path / "changed.safetensors"))
    torch.save(state, tmp_path / "orig.pt")
    with torch.no_grad():
        before = adapter.logits(batch)
        adapter.load_weights(tmp_path / "changed.safetensors")
        assert not torch.allclose(adapter.logits(batch), before)
        adapter.load_weights(tmp_path / "orig.pt")
        torch.testing.assert_close(adapter.logits(batch), before)
    # a DistributedDataParallel prefix and a buffer that older transformers versions saved are tolerated
    wrapped = {f"module.{k}": v for k, v in changed.items()}
    wrapped["module.bert.embeddings.position_ids"] = torch.arange(64).unsqueeze(0)
    torch.save(wrapped, tmp_path / "ddp.pt")
    with torch.no_grad():
        adapter.load_weights(tmp_path / "ddp.pt")
        assert not torch.allclose(adapter.logits(batch), before)
        adapter.load_weights(tmp_path / "orig.pt")
    save_file({"nope.weight": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(UserError, match=r"other\.safetensors.*does not match.*nope\.weight"):
        adapter.load_weights(tmp_path / "other.safetensors")
    with pytest.raises(UserError, match="not found"):
        adapter.load_weights(tmp_path / "missing.safetensors")


def test_load_adapter_dispatches_on_the_model_section(tiny_bert_dir: Path, tmp_path: Path) -> None:
    adapter = load_adapter(ModelSection(adapter="hf", path=str(tiny_bert_dir)), CPU, tmp_path)
    assert adapter.num_labels == 3 and adapter.name == tiny_bert_dir.name


def test_hf_errors_name_the_path(tmp_path: Path, tiny_bert_dir: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(UserError, match=f"{missing}: model directory not found"):
        load_hf_adapter(missing, CPU)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=f"{empty}: no config.json"):
        load_hf_adapter(empty, CPU)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(UserError, match=f"{broken}: cannot load"):
        load_hf_adapter(broken, CPU)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny_bert_dir / "config.json").read_text())
    with pytest.raises(UserError, match=f"{no_weights}"):
        load_hf_adapter(no_weights, CPU)


def weights_only_copy(model_dir: Path, to: Path) -> Path:
    """The model's config and weights in a new directory, without its tokenizer."""
    to.mkdir()
    for name in ("config.json", "model.safetensors"):
        (to / name).write_bytes((model_dir / name).read_bytes())
    return to


def test_hf_refuses_a_directory_without_its_tokenizer(tmp_path: Path, tiny_bert_dir: Path) -> None:
    # transformers would build a tokenizer of special tokens only, turning every word into [UNK]
    bare = weights_only_copy(tiny_bert_dir, tmp_path / "bare")
    with pytest.raises(UserError, match=f"{bare}: no tokenizer vocabulary .*save_pretrained"):
        load_hf_adapter(bare, CPU)


def test_hf_refuses_a_tokenizer_larger_than_the_embeddings(tmp_path: Path, tiny_bert_dir: Path) -> None:
    from transformers import BertTokenizer

    other = weights_only_copy(tiny_bert_dir, tmp_path / "other-tokenizer")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(200))]
    BertTokenizer(vocab={word: i for i, word in enumerate(vocab)}).save_pretrained(other)
    with pytest.raises(UserError, match=r"205 tokens but the model's embeddings have \d+ rows"):
        load_hf_adapter(other, CPU)


def test_builtin_dataset_only_for_demo(adapter: Adapter) -> None:
    with pytest.raises(UserError, match="needs model adapter = demo"):
        adapter.builtin_dataset("test")


# --- plugin ------------------------------------------------------------------------------------------------
PLUGIN = """
from gpuopt_tui.jobs.models.hf import load_hf_adapter

MODEL_DIR = {model_dir!r}

def good(device, cache_dir):
    adapter = load_hf_adapter(__import__("pathlib").Path(MODEL_DIR), device)
    adapter.info["cache_dir"] = str(cache_dir)
    return adapter

def wrong_type(device, cache_dir):
    return "not an adapter"

def broken(device, cache_dir):
    raise RuntimeError("weights are on holiday")

not_callable = 3
"""


@pytest.fixture
def plugin_module(tmp_path: Path, tiny_bert_dir: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"gpuopt_test_plugin_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN.format(model_dir=str(tiny_bert_dir))))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_plugin_factory_is_called_with_device_and_cache_dir(plugin_module: str, tmp_path: Path) -> None:
    section = ModelSection(adapter="plugin", factory=f"{plugin_module}:good")
    adapter = load_adapter(section, CPU, tmp_path / "cache")
    assert isinstance(adapter, Adapter) and adapter.num_labels == 3
    assert adapter.info["cache_dir"] == str(tmp_path / "cache")


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("no_colon_here", 'expected "package.module:function"'),
        ("gpuopt_no_such_module_xyz:make", "cannot import gpuopt_no_such_module_xyz"),
        ("{mod}:missing", "has no function missing"),
        ("{mod}:not_callable", "has no function not_callable"),
        ("{mod}:wrong_type", "returned str, expected a gpuopt_tui.jobs.models.Adapter"),
        ("{mod}:broken", "failed: RuntimeError: weights are on holiday"),
    ],
)
def test_plugin_errors(plugin_module: str, tmp_path: Path, factory: str, message: str) -> None:
    factory = factory.format(mod=plugin_module)
    with pytest.raises(UserError, match=f'model.factory "{factory}'):
        try:
            load_adapter(ModelSection(adapter="plugin", factory=factory), CPU, tmp_path)
        except UserError as exc:
            assert message in str(exc)
            raise


# --- device helpers --------------------------------------------------------------------------------------------
def test_resolve_device() -> None:
    assert resolve_device("cpu") == CPU
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else CPU
    assert resolve_device("auto") == expected
    with pytest.raises(UserError, match='device = "gpu0"'):
        resolve_device("gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
@pytest.mark.parametrize(
    ("build", "why"), [(None, "is a CPU-only build"), ("12.8", "is built for CUDA 12.8 but finds no GPU")]
)
def test_cuda_requested_without_cuda(spec: str, build: str | None, why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The message says which build of torch this is: a CUDA build is never called CPU-only."""
    monkeypatch.setattr(torch.version, "cuda", build)
    with pytest.raises(UserError, match=f'device = "{spec}" but CUDA is not available here: this torch') as caught:
        resolve_device(spec)
    assert why in str(caught.value)


def test_autocast_on_cpu() -> None:
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with autocast(CPU, "bf16"):
        assert (a @ b).dtype == torch.bfloat16
    for name in ("fp16", "fp32", "tf32"):
        with autocast(CPU, name):
            assert (a @ b).dtype == torch.float32
    with pytest.raises(ValueError, match="precision"), autocast(CPU, "fp8"):
        pass
    assert precision(True, "fp16") == "fp16" and precision(False, "bf16", tf32=True) == "tf32"
    assert precision(False, "bf16") == "fp32"


def test_is_oom() -> None:
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    assert is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("out of memory"))


def test_cuda_memory_fields() -> None:
    assert cuda_memory_fields(CPU) == {}
    fields = cuda_memory_fields()
    if torch.cuda.is_available():
        assert set(fields) == {"gpu_allocated", "gpu_reserved", "gpu_peak"}
    else:
        assert fields == {}


@pytest.mark.gpu
def test_cuda_memory_fields_on_gpu(adapter: Adapter, batch) -> None:
    device = resolve_device("cuda")
    model = adapter.model.to(device)
    try:
        with torch.no_grad(), autocast(device, "bf16"):
            out = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
        assert out.logits.dtype == torch.bfloat16
        fields = cuda_memory_fields(device)
        assert fields["gpu_peak"] >= fields["gpu_allocated"] > 0
    finally:
        adapter.model.to(CPU)
