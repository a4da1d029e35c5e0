"""The factored projection's LoRA layers (lora_layers.py): one hook per PEFT LoRA layer and a forward without PEFT's
casts give the projected gradients that hooks on the lora_A / lora_B sub-layers under PEFT's own forward give, in
float64 (projected and exact sides, the GPT-2 Conv1D base included); under bf16 autocast the forward's losses are
PEFT's to the bit; DoRA layers are left out, with the reason; the forward is PEFT's again after."""

from __future__ import annotations

import pytest
import torch
from lm_cases import tiny_decoder, tiny_tokenizer
from test_tracin_causal_lm import TRAIN, dataset
from test_tracin_support import max_rel_error

from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter
from gpuopt_tui.jobs.tracin import factored
from gpuopt_tui.jobs.tracin.factored import FactoredGradients
from gpuopt_tui.jobs.tracin.lora_layers import lora_layers

peft = pytest.importorskip("peft")

CPU = torch.device("cpu")


def lora_model(family: str, dtype: torch.dtype, **lora: object) -> CausalLMAdapter:
    torch.manual_seed(2)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.2, target_modules="all-linear", init_lora_weights=False, **lora
    )
    model = peft.get_peft_model(tiny_decoder(family).to(dtype), config).eval()
    return CausalLMAdapter(family, model, tiny_tokenizer(), CPU)


def adapter_names(adapter: CausalLMAdapter) -> list[str]:
    return [n for n, p in adapter.model.named_parameters() if p.requires_grad]


def features(adapter: CausalLMAdapter, k: int, precision: str, *, sub_layers: bool = False) -> torch.Tensor:
    names = adapter_names(adapter)
    if sub_layers:  # as before lora_layers.py: hooks on lora_A / lora_B under PEFT's forward
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(factored, "lora_layers", lambda model, names: {})
            engine = FactoredGradients(adapter, names, k_in=k, k_out=k, seed=0, precision=precision)
        assert not engine.lora
    else:
        engine = FactoredGradients(adapter, names, k_in=k, k_out=k, seed=0, precision=precision)
        assert len(engine.lora) == len(names) // 2  # every LoRA layer through its own hook
    return engine.features(dataset(adapter, TRAIN, "left").tensors)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
@pytest.mark.parametrize("k", [3, 0])
def test_one_hook_per_lora_layer_gives_the_sub_layers_gradients(family: str, k: int) -> None:
    adapter = lora_model(family, torch.float64)
    ours = features(adapter, k, "fp32")
    assert max_rel_error(ours, features(adapter, k, "fp32", sub_layers=True)) < 1e-10
    assert ours.abs().amax() > 0


def test_under_bf16_autocast_the_forward_is_pefts_to_the_bit() -> None:
    adapter = lora_model("llama", torch.bfloat16)  # PEFT keeps fp32 adapters on a bf16 base
    layers = lora_layers(adapter.model, adapter_names(adapter))
    assert layers and all(layer.matrices()[0].dtype == torch.float32 for layer in layers.values())
    batch = dataset(adapter, TRAIN).tensors
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        pefts = adapter.loss_per_example(batch)
        with factored.plain_forwards(layers):
            ours = adapter.loss_per_example(batch)
    assert torch.equal(ours, pefts)
    assert not any("forward" in vars(layer.module) for layer in layers.values())  # PEFT's forward again


def test_bf16_features_agree_with_the_sub_layers_within_bf16_rounding() -> None:
    adapter = lora_model("llama", torch.bfloat16)
    ours, theirs = features(adapter, 4, "bf16"), features(adapter, 4, "bf16", sub_layers=True)
    assert max_rel_error(ours, theirs) < 3e-2


def test_dora_layers_are_left_out_with_the_reason() -> None:
    """DoRA's weight norm depends on A and B too (hooks on the sub-layers would miss that part of the gradient)."""
    adapter = lora_model("llama", torch.float64, use_dora=True)
    names = adapter_names(adapter)
    assert lora_layers(adapter.model, names) == {}
    engine = FactoredGradients(adapter, names, k_in=0, k_out=0, seed=0, precision="fp32")
    assert not engine.lora and not engine.names
    assert set(engine.excluded) == set(names) and all("LoRA variant" in why for why in engine.excluded.values())


def test_the_forward_is_pefts_again_after_an_error() -> None:
    adapter = lora_model("llama", torch.float64)
    engine = FactoredGradients(adapter, adapter_names(adapter), k_in=2, k_out=2, seed=0, precision="fp32")
    batch = dataset(adapter, TRAIN).tensors
    batch["input_ids"] = batch["input_ids"] + 10_000  # ids past the vocabulary: the embedding fails
    with pytest.raises(IndexError):
        engine.features(batch)
    assert not any("forward" in vars(layer.module) for layer in engine.lora.values())
