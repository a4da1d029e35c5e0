"""The planner's model arithmetic against independent references: parameter counts of models transformers
builds, the bytes autograd really saves for backward (saved-tensor hooks, fp32 on the CPU), and the probe's
own model (LoRA, frozen encoder) measured in a child process."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gpuopt_tui.core.planner.activations import layer_inventory, saved_bytes_per_token  # noqa: E402
from gpuopt_tui.core.planner.estimate import estimate  # noqa: E402
from gpuopt_tui.core.planner.measure import probe_request, run_probe  # noqa: E402
from gpuopt_tui.core.planner.model_spec import spec_from_config  # noqa: E402
from gpuopt_tui.core.planner.train_setup import TrainSetup  # noqa: E402
from gpuopt_tui.jobs.memprobe import LiveTensors, add_lora, build_model  # noqa: E402

H, F, V = 32, 64, 100
CONFIGS = {
    "bert": lambda L: transformers.BertConfig(
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=L,
        num_attention_heads=4,
        intermediate_size=F,
        max_position_embeddings=40,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
    "roberta": lambda L: transformers.RobertaConfig(
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=L,
        num_attention_heads=4,
        intermediate_size=F,
        max_position_embeddings=40,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
    "distilbert": lambda L: transformers.DistilBertConfig(
        vocab_size=V,
        dim=H,
        n_layers=L,
        n_heads=4,
        hidden_dim=F,
        max_position_embeddings=40,
        dropout=0.0,
        attention_dropout=0.0,
    ),
    "gpt2": lambda L: transformers.GPT2Config(
        vocab_size=V, n_embd=H, n_layer=L, n_head=4, n_positions=40, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    ),
    "llama": lambda L: transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=F,
        max_position_embeddings=40,
    ),
    "qwen2": lambda L: transformers.Qwen2Config(
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=F,
        max_position_embeddings=40,
    ),
    "mistral": lambda L: transformers.MistralConfig(
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=F,
        max_position_embeddings=40,
        sliding_window=None,
    ),
    "qwen3": lambda L: transformers.Qwen3Config(
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=F,
        max_position_embeddings=40,
        head_dim=8,
    ),
}
AUTO = {
    "classification": transformers.AutoModelForSequenceClassification,
    "causal_lm": transformers.AutoModelForCausalLM,
    "masked_lm": transformers.AutoModelForMaskedLM,
    "embedding": transformers.AutoModel,
}
TASKS = {
    "bert": ("classification", "masked_lm", "embedding"),
    "roberta": ("classification", "masked_lm", "embedding"),
    "distilbert": ("classification", "masked_lm", "embedding"),
    "gpt2": ("classification", "causal_lm", "embedding"),
    "llama": ("classification", "causal_lm", "embedding"),
    "qwen2": ("causal_lm",),
    "mistral": ("causal_lm",),
    "qwen3": ("causal_lm",),
}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_parameter_counts_match_transformers(family: str) -> None:
    torch.manual_seed(0)
    config = CONFIGS[family](2)
    for task in TASKS[family]:
        model = AUTO[task].from_config(config)
        spec = spec_from_config(config.to_dict(), family, task)
        assert spec.params == sum(p.numel() for p in model.parameters()), task


def _saved_bytes(model: torch.nn.Module, embeds: torch.Tensor) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs_embeds=embeds)
    return sum(seen.values())


# The CPU attention kernel copies two of GPT-2's q/k/v (views of one c_attn output) to contiguous tensors;
# the CUDA kernels take the strided views. That is 2 x 4 bytes x hidden per token more on the CPU.
CPU_ONLY = {"gpt2": 2 * 4 * H}


@pytest.mark.parametrize("family", ["bert", "distilbert", "gpt2", "llama", "qwen2", "mistral"])
@pytest.mark.parametrize("weights_train", [True, False])
def test_layer_inventory_matches_what_autograd_saves(family: str, weights_train: bool) -> None:
    """Per layer and token, fp32: the difference between a 3-layer and a 1-layer model, inputs requiring grad."""
    torch.manual_seed(0)
    rows, length = 3, 16
    models = []
    for layers in (1, 3):
        config = CONFIGS[family](layers)
        config._attn_implementation = "sdpa"
        model = transformers.AutoModel.from_config(config).train()
        model.requires_grad_(weights_train)
        models.append(model)
    embeds = torch.randn(rows, length, H, requires_grad=True)
    measured = (_saved_bytes(models[1], embeds) - _saved_bytes(models[0], embeds)) / 2 / (rows * length)
    spec = spec_from_config(CONFIGS[family](1).to_dict(), family, "embedding")
    predicted = saved_bytes_per_token(layer_inventory(spec), spec, 4, False, lambda name: weights_train)
    assert measured == predicted + CPU_ONLY.get(family, 0)


LORA_TARGETS = {
    "bert": ("query", "value"),
    "gpt2": ("c_attn",),
    "llama": ("q_proj", "v_proj"),
    "qwen2": ("q_proj", "v_proj"),
    "mistral": ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"),
}


def _layer_models(family: str, setup: TrainSetup) -> list[torch.nn.Module]:
    """A 1-layer and a 3-layer model, trained as `setup` says (LoRA adapters through the probe's own module)."""
    models = []
    for layers in (1, 3):
        config = CONFIGS[family](layers)
        config._attn_implementation = "sdpa"
        model = transformers.AutoModel.from_config(config).train()
        if setup.trainable == "lora":
            model.requires_grad_(False)
            add_lora(model, list(setup.lora_targets), setup.lora_rank)
        if setup.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        models.append(model)
    return models


@pytest.mark.parametrize("family", list(LORA_TARGETS))
def test_lora_layers_keep_adapter_inputs_and_rank_intermediates(family: str) -> None:
    """Per layer and token, fp32, LoRA: the frozen base keeps what gradients upstream need, each adapter its
    input and its rank-r output; counted with saved-tensor hooks."""
    torch.manual_seed(0)
    setup = TrainSetup(trainable="lora", lora_targets=LORA_TARGETS[family], lora_rank=4, precision="fp32")
    rows, length = 3, 16
    small, large = _layer_models(family, setup)
    embeds = torch.randn(rows, length, H, requires_grad=True)
    measured = (_saved_bytes(large, embeds) - _saved_bytes(small, embeds)) / 2 / (rows * length)
    spec = spec_from_config(CONFIGS[family](1).to_dict(), family, "embedding")
    targets = {lin.name for lin in spec.lora_linears(setup.lora_targets)}
    predicted = saved_bytes_per_token(layer_inventory(spec), spec, 4, False, lambda name: name in targets)
    predicted += 4 * setup.lora_rank * len(spec.lora_linears(setup.lora_targets))
    assert measured == predicted + CPU_ONLY.get(family, 0)


def _kept_by_forward(model: torch.nn.Module, embeds: torch.Tensor) -> int:
    """Bytes the forward pass leaves allocated (saved for backward, checkpoints, the output)."""
    with LiveTensors([*model.parameters(), *model.buffers(), embeds]) as live:
        before = live.live
        out = model(inputs_embeds=embeds).last_hidden_state
        kept = live.live - before
    del out
    return kept


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "qwen2", "mistral"])
def test_checkpointing_keeps_each_layers_input(family: str) -> None:
    """HF gradient checkpointing, fp32: each layer keeps only its input (the residual stream) through the forward
    pass, what the estimate counts as the checkpointed activations (live tensors, 3 layers against 1)."""
    torch.manual_seed(0)
    rows, length = 3, 16
    setup = TrainSetup(gradient_checkpointing=True, precision="fp32", micro_batch=rows, seq_len=length)
    small, large = _layer_models(family, setup)
    embeds = torch.randn(rows, length, H, requires_grad=True)
    measured = (_kept_by_forward(large, embeds) - _kept_by_forward(small, embeds)) / 2
    spec = spec_from_config(CONFIGS[family](1).to_dict(), family, "embedding")
    per_layer = (
        estimate(spec, setup).component("activations").bytes
        - estimate(dataclasses.replace(spec, layers=0), setup).component("activations").bytes
    )
    assert measured == per_layer == 4 * H * rows * length


@pytest.mark.parametrize(
    ("family", "task", "setup"),
    [
        ("bert", "classification", TrainSetup(trainable="lora", lora_targets=("query", "value"), lora_rank=4)),
        ("bert", "classification", TrainSetup(trainable="frozen_encoder")),
        ("gpt2", "causal_lm", TrainSetup(trainable="lora", lora_targets=("c_attn", "c_proj"), lora_rank=2)),
        ("llama", "causal_lm", TrainSetup(trainable="lora", lora_targets=("all-linear",), lora_rank=4)),
        ("distilbert", "classification", TrainSetup(trainable="all")),
    ],
)
def test_the_probe_model_trains_what_the_estimate_counts(family: str, task: str, setup: TrainSetup) -> None:
    config = CONFIGS[family](2).to_dict()
    request = probe_request(config, task, setup, device="cpu")
    model = build_model(request, torch.device("cpu"))
    est = estimate(spec_from_config(config, family, task), setup)
    assert sum(p.numel() for p in model.parameters()) == est.params
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == est.trainable_params


@pytest.mark.slow
def test_a_probe_runs_in_a_child_process_on_the_cpu() -> None:
    config = CONFIGS["bert"](2).to_dict()
    setup = TrainSetup(micro_batch=2, seq_len=8, n_positives=1, n_negatives=1, trainable="lora", precision="fp32")
    result = run_probe(probe_request(config, "embedding", setup, device="cpu"), timeout=120)
    assert result.ok, result.error
    assert (result.micro_batch, result.sequences, result.device) == (2, 6, "cpu")
    assert result.trainable_params == estimate(spec_from_config(config, "bert", "embedding"), setup).trainable_params
