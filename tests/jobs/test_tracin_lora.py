"""TracIn over PEFT LoRA adapter checkpoints on tiny random decoders, in float64, against the naive per-example loop
of test_tracin_causal_lm (one loss.backward() per unpadded example, gradients of the adapter's A and B matrices
dotted and summed over checkpoints). The checkpoints are written by peft itself (`save_pretrained`), with random
nonzero B matrices so that A's gradients are not zero, and LoRA dropout on (which the scores must not see)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from lm_cases import tiny_decoder, tiny_tokenizer
from test_tracin_causal_lm import TEST, TRAIN, dataset, reference_tracin
from test_tracin_support import max_rel_error

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.tracin import CheckpointSpec
from gpuopt_tui.jobs.models.base import Adapter
from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter
from gpuopt_tui.jobs.tracin import TracInOptions, select_parameters, tracin_scores
from gpuopt_tui.jobs.tracin.checkpoints import resolve_checkpoints
from gpuopt_tui.jobs.tracin.faithfulness import exact_agreement
from gpuopt_tui.jobs.tracin.interface import Reporter
from gpuopt_tui.jobs.tracin.params import resolved_layers

peft = pytest.importorskip("peft")

CPU = torch.device("cpu")
LRS = (0.3, 0.2, 0.1)
LORA_FAMILIES = ("gpt2", "llama", "qwen2", "gpt_neox")


def save_lora_checkpoints(
    family: str, folder: Path, lrs: tuple[float, ...] = LRS, dtype: torch.dtype = torch.float64
) -> list[CheckpointSpec]:
    """Adapter directories of one LoRA adapter (rank 4 on every linear layer, B random) at len(lrs) steps, each
    step's A and B moved at random from the last."""
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(tiny_decoder(family).to(dtype), config)
    specs = []
    for i, lr in enumerate(lrs):
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(folder / f"step{i}")
        specs.append(CheckpointSpec(str(folder / f"step{i}"), lr))
    return specs


def lora_adapter(family: str, specs: list[CheckpointSpec]) -> tuple[CausalLMAdapter, list]:
    adapter = CausalLMAdapter(family, tiny_decoder(family).double(), tiny_tokenizer(), CPU)
    return adapter, resolve_checkpoints(specs, adapter)


@pytest.fixture(scope="module", params=LORA_FAMILIES)
def lora64(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    specs = save_lora_checkpoints(request.param, tmp_path_factory.mktemp("lora"))
    adapter, checkpoints = lora_adapter(request.param, specs)
    return adapter, checkpoints, specs


def adapter_names(adapter: CausalLMAdapter) -> list[str]:
    return select_parameters(adapter, dataset(adapter, TEST).batch([0]), "auto")


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("method", ["auto", "vmap", "factored"])
def test_lora_scores_match_a_naive_per_example_loop(lora64, method: str, side: str) -> None:
    adapter, checkpoints, _ = lora64
    train, test = dataset(adapter, TRAIN, side), dataset(adapter, TEST, side)
    names = adapter_names(adapter)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    result = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(method=method, batch_size=3))
    assert result.stats["excluded_parameters"] == {}
    reference = reference_tracin(adapter, checkpoints, train, test, names)
    assert result.matrix is not None
    assert max_rel_error(result.matrix, reference) < 1e-6
    assert reference.abs().max() > 1e-3


def test_each_checkpoint_loads_the_weights_peft_itself_loads(lora64) -> None:
    """The adapter at each checkpoint computes what PeftModel.from_pretrained of that directory computes (the
    scores' reference loads checkpoints through the adapter, so this checks the loading apart)."""
    adapter, checkpoints, specs = lora64
    ids = dataset(adapter, TRAIN).tensors["input_ids"]
    outputs = []
    for ckpt, spec in zip(checkpoints, specs):
        adapter.load_weights(ckpt.path)
        fresh = peft.PeftModel.from_pretrained(tiny_decoder(adapter.name).double(), spec.path).eval()
        with torch.no_grad():
            ours, theirs = adapter.model(input_ids=ids).logits, fresh(input_ids=ids).logits
        assert max_rel_error(ours, theirs) < 1e-12
        outputs.append(ours)
    assert max_rel_error(outputs[0], outputs[-1]) > 1e-3  # the checkpoints differ


def test_the_adapter_parameters_are_the_default_and_said_so(lora64) -> None:
    adapter, _, _ = lora64
    trainable = [n for n, p in adapter.model.named_parameters() if p.requires_grad]
    assert adapter_names(adapter) == trainable
    layers, source = resolved_layers(adapter, "auto")
    assert layers == "adapter" and "PEFT adapters" in source
    assert resolved_layers(adapter, "last")[0] == "last"


class Quiet(Reporter):
    pass


def test_the_agreement_check_compares_with_exact_adapter_gradients(lora64) -> None:
    adapter, checkpoints, _ = lora64
    train, test = dataset(adapter, TRAIN), dataset(adapter, TEST)
    names = adapter_names(adapter)
    projected = TracInOptions(method="factored", projection_in=2, projection_out=2)
    found = exact_agreement(adapter, checkpoints, train, test, names, projected, 4, Quiet())
    assert found["n_train"] == 4 and "PEFT adapter" in found["reference"]
    assert found["excluded_from_reference"] == []
    exact = exact_agreement(adapter, checkpoints, train, test, names, TracInOptions(method="vmap"), 5, Quiet())
    assert exact["spearman"] == pytest.approx(1.0) and exact["top_k_overlap"] == 1.0


def test_checkpoints_of_two_kinds_or_configurations_are_refused(tmp_path: Path) -> None:
    specs = save_lora_checkpoints("llama", tmp_path / "a", lrs=(0.1,))
    plain: Adapter = CausalLMAdapter("llama", tiny_decoder("llama"), tiny_tokenizer(), CPU)
    state = tmp_path / "full.pt"
    torch.save(plain.model.state_dict(), state)
    with pytest.raises(UserError, match=r"checkpoints\[1\]: .*full.pt is a state dict checkpoint.*one kind"):
        resolve_checkpoints([specs[0], CheckpointSpec(str(state), 0.1)], plain)
    config = peft.LoraConfig(r=2, lora_alpha=8, lora_dropout=0.3, target_modules="all-linear")
    peft.get_peft_model(tiny_decoder("llama"), config).save_pretrained(tmp_path / "r2")
    with pytest.raises(UserError, match=r"r2/adapter_config.json: differs from .* in r: "):
        resolve_checkpoints([specs[0], CheckpointSpec(str(tmp_path / "r2"), 0.1)], plain)
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    peft.get_peft_model(tiny_decoder("llama"), config).save_pretrained(tmp_path / "prompt")
    with pytest.raises(UserError, match=r"prompt: a PROMPT_TUNING adapter adds virtual tokens"):
        resolve_checkpoints([CheckpointSpec(str(tmp_path / "prompt"), 0.1)], plain)
    assert plain.peft_trainable is None
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"empty is a directory but not a PEFT adapter directory"):
        resolve_checkpoints([CheckpointSpec(str(tmp_path / "empty"), 0.1)], plain)
    with pytest.raises(UserError, match='layers = "adapter" needs PEFT adapter checkpoints'):
        select_parameters(plain, dataset(plain, TEST).batch([0]), "adapter")


def test_adapter_checkpoints_without_peft_say_how_to_install_it(tmp_path: Path, monkeypatch) -> None:
    specs = save_lora_checkpoints("llama", tmp_path, lrs=(0.1,))
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    plain = CausalLMAdapter("llama", tiny_decoder("llama"), tiny_tokenizer(), CPU)
    with pytest.raises(
        UserError, match=r"step0 is a PEFT adapter directory; install peft: pip install 'gpuopt-tui\[lm\]'"
    ):
        resolve_checkpoints(specs, plain)


def test_cached_training_gradients_are_kept_apart_by_the_base_model(lora64, tmp_path: Path) -> None:
    """The adapter files alone do not make the weights: gradients cached on one base model are not read for
    another (the job passes the base's digest and the adapter configuration as `adapter_base`)."""
    adapter, checkpoints, _ = lora64
    train, test = dataset(adapter, TRAIN), dataset(adapter, TEST)

    def blocks(base: str) -> dict[str, int]:
        options = TracInOptions(train_cache=tmp_path, adapter_base={"weights": base})
        return tracin_scores(adapter, checkpoints, train, test, adapter_names(adapter), options).stats["cache_blocks"]

    first = blocks("base-1")
    assert first["read"] == 0 and first["computed"] > 0
    assert blocks("base-1")["read"] == first["computed"]
    assert blocks("base-2")["read"] == 0
