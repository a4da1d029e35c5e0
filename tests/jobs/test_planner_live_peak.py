"""The closed-form estimate against the peak of live tensors of the probe's own training step on the CPU.

`memprobe.probe` on the CPU reports `max_allocated` as the peak of live tensor bytes (`LiveTensors`). The models
have no dropout (the CPU's dropout keeps a mask of the input's dtype, CUDA's one byte) and no attention dropout
(so the CPU takes its fused attention kernel, as CUDA does); GPT-2 runs in fp32 (CPU autocast leaves its pow in
16 bits, CUDA's runs it in fp32)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gpuopt_tui.core.planner.estimate import estimate  # noqa: E402
from gpuopt_tui.core.planner.measure import probe_request  # noqa: E402
from gpuopt_tui.core.planner.model_spec import spec_from_config  # noqa: E402
from gpuopt_tui.core.planner.train_setup import TrainSetup  # noqa: E402
from gpuopt_tui.jobs.memprobe import LiveTensors, probe  # noqa: E402

SEQ = 128
CONFIGS = {
    "bert": transformers.BertConfig(
        vocab_size=200,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
    "gpt2": transformers.GPT2Config(
        vocab_size=200,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "llama": transformers.LlamaConfig(
        vocab_size=200,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=192,
        max_position_embeddings=SEQ,
    ),
}


def _peaks(family: str, setup: TrainSetup) -> tuple[int, int]:
    """(live-tensor peak of the probe's measured step, the closed form's allocated peak), in bytes."""
    config = CONFIGS[family].to_dict()
    result = probe(probe_request(config, "classification", setup, device="cpu", steps=1))
    assert not result.get("error"), result.get("error")
    return result["max_allocated"], estimate(spec_from_config(config, family, "classification"), setup).allocated


def test_live_tensors_counts_storages_once_until_freed() -> None:
    kept = torch.zeros(1000)
    with LiveTensors([kept, kept[10:]]) as live:
        a = torch.ones(500, dtype=torch.float64)  # 4000 bytes
        view = a[100:]
        a.add_(1)
        b = torch.empty(2000, dtype=torch.bfloat16)  # 4000 bytes
        assert live.live == 4000 + 4000 + 4000
        del a, b
        assert live.live == 4000 + 4000  # the view keeps a's storage
        del view
        c = torch.zeros(250)
        assert live.live == 4000 + 1000
        del c
    assert live.peak == 12_000


@pytest.mark.parametrize(
    ("family", "precision"),
    [("bert", "bf16-mixed"), ("bert", "fp32"), ("gpt2", "fp32"), ("llama", "bf16-mixed")],
)
def test_frozen_encoder_forward_matches_the_live_peak(family: str, precision: str) -> None:
    """A frozen encoder keeps nothing for backward; its forward's peak is one layer's peak moment, the layer input
    and the embedding output. Checked on the total and on the growth from 8 to 16 sequences (activations only)."""
    small = _peaks(family, TrainSetup(micro_batch=8, seq_len=SEQ, precision=precision, trainable="frozen_encoder"))
    large = _peaks(family, TrainSetup(micro_batch=16, seq_len=SEQ, precision=precision, trainable="frozen_encoder"))
    live, closed = large
    assert closed == pytest.approx(live, rel=0.10)
    assert closed - small[1] == pytest.approx(live - small[0], rel=0.05)


@pytest.mark.parametrize(
    "setup",
    [
        TrainSetup(micro_batch=16, seq_len=SEQ),
        TrainSetup(micro_batch=16, seq_len=SEQ, trainable="lora", lora_targets=("query", "value")),
    ],
    ids=["full", "lora"],
)
def test_training_steps_match_the_live_peak(setup: TrainSetup) -> None:
    live, closed = _peaks("bert", setup)
    assert closed == pytest.approx(live, rel=0.10)


DECODERS = {
    family: cls(
        vocab_size=2000,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=192,
        max_position_embeddings=64,
        tie_word_embeddings=family == "qwen2",
    )
    for family, cls in (
        ("llama", transformers.LlamaConfig),
        ("qwen2", transformers.Qwen2Config),
        ("mistral", transformers.MistralConfig),
    )
}


@pytest.mark.parametrize("family", list(DECODERS))
@pytest.mark.parametrize(
    "setup",
    [
        TrainSetup(micro_batch=8, seq_len=64, loop="hf"),
        TrainSetup(
            micro_batch=8, seq_len=64, loop="plain", trainable="lora", lora_rank=16, lora_targets=("q_proj", "v_proj")
        ),
        TrainSetup(micro_batch=8, seq_len=64, loop="hf", gradient_checkpointing=True),
    ],
    ids=["full", "lora", "checkpointing"],
)
def test_decoder_lm_steps_match_the_live_peak(family: str, setup: TrainSetup) -> None:
    """Causal LM steps under bf16 autocast with the model's own loss (`labels=`): the fp32 logits copies, the
    adapters, the checkpoints and the gradients made during backward, against the live-tensor peak."""
    config = DECODERS[family].to_dict()
    result = probe(probe_request(config, "causal_lm", setup, device="cpu", steps=1, warmup=1))
    assert not result.get("error"), result.get("error")
    closed = estimate(spec_from_config(config, family, "causal_lm"), setup).allocated
    assert closed == pytest.approx(result["max_allocated"], rel=0.03)


@pytest.mark.parametrize("family", list(DECODERS))
def test_lora_checkpointing_keeps_no_frozen_weight_copies(family: str) -> None:
    """LoRA on every linear with checkpointing, on layers wide enough that the frozen linears' 16-bit copies
    would be a sixth of the peak: the checkpointed forward saves none of them."""
    config = {**DECODERS[family].to_dict(), "hidden_size": 256, "intermediate_size": 768, "head_dim": 64}
    setup = TrainSetup(
        micro_batch=2,
        seq_len=32,
        loop="plain",
        trainable="lora",
        lora_rank=16,
        lora_targets=("all-linear",),
        gradient_checkpointing=True,
    )
    result = probe(probe_request(config, "causal_lm", setup, device="cpu", steps=1, warmup=1))
    assert not result.get("error"), result.get("error")
    closed = estimate(spec_from_config(config, family, "causal_lm"), setup).allocated
    assert closed == pytest.approx(result["max_allocated"], rel=0.03)
