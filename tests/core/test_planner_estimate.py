"""The closed-form estimate: exact model-state arithmetic, activation rules, peak composition, and its error
against a measured table (H200, torch 2.11, bf16 autocast, AdamW, SDPA)."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
from model_configs import BERT_BASE_CLASSIFIER

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner.estimate import Overheads, estimate
from gpuopt_tui.core.planner.model_spec import spec_from_config
from gpuopt_tui.core.planner.train_setup import GiB, TrainSetup

GPT2_SMALL = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": 50257,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_positions": 1024,
    "activation_function": "gelu_new",
}
BERT = spec_from_config(BERT_BASE_CLASSIFIER, "bert-base")
GPT2 = spec_from_config(GPT2_SMALL, "gpt2")

# case, spec, setup, measured peak reserved GiB (the measured table; its loop zeroes gradients before forward)
MEASURED = [
    ("BERT-base b32", BERT, {"micro_batch": 32}, 3.32),
    ("BERT-base b128", BERT, {"micro_batch": 128}, 8.04),
    ("BERT-base checkpointing b128", BERT, {"micro_batch": 128, "gradient_checkpointing": True}, 3.04),
    ("BERT-base frozen encoder b128", BERT, {"micro_batch": 128, "trainable": "frozen_encoder"}, 1.04),
    ("GPT-2 b8 s512", GPT2, {"micro_batch": 8, "seq_len": 512}, 8.33),
    ("GPT-2 b32 s512", GPT2, {"micro_batch": 32, "seq_len": 512}, 27.55),
    ("GPT-2 checkpointing b32 s512", GPT2, {"micro_batch": 32, "seq_len": 512, "gradient_checkpointing": True}, 16.00),
]


def test_error_against_the_measured_table() -> None:
    errors = []
    for _, spec, kw, measured in MEASURED:
        est = estimate(spec, TrainSetup(loop="plain", **kw))
        errors.append(est.reserved / GiB / measured - 1)
    assert statistics.median(abs(e) for e in errors) <= 0.15
    assert max(abs(e) for e in errors) <= 0.15, errors


def test_parameter_counts_of_reference_models() -> None:
    assert BERT.params == 109_483_778  # BertForSequenceClassification, 2 labels
    assert GPT2.params == 124_439_808  # GPT2LMHeadModel, tied head


def test_model_states_are_exact() -> None:
    est = estimate(BERT, TrainSetup(micro_batch=1, seq_len=8))
    p = BERT.params
    assert est.component("weights").bytes == 4 * p
    assert est.component("gradients").bytes == 4 * p
    assert est.component("optimizer").bytes == 8 * p
    assert est.component("optimizer_temp").bytes == 4 * p
    sgd = estimate(BERT, TrainSetup(micro_batch=1, seq_len=8, optimizer="sgd"))
    assert sgd.component("optimizer").bytes == 4 * p
    adam8 = estimate(BERT, TrainSetup(micro_batch=1, seq_len=8, optimizer="adam8bit"))
    assert 2 * p < adam8.component("optimizer").bytes < 2.01 * p


def test_autocast_layer_activations_per_token_follow_the_rules() -> None:
    """BERT layer under autocast, per token: three 16-bit casts of the fp32 input (6h), q/k/v (6h), attention
    output shared with the output projection's input (2h), log-sum-exp (4 B x heads), two dropout masks (2h),
    two LayerNorm fp32 inputs (8h) with mean/rstd (16 B), the intermediate's cast input (2h), GELU input (8h)
    and output (8h); and the padded batch's mask as a 16-bit bias (seq_len per token)."""
    one = estimate(BERT, TrainSetup(micro_batch=1, seq_len=1))
    two = estimate(BERT, TrainSetup(micro_batch=2, seq_len=1))
    h, layers = 768, 12
    per_layer = 42 * h + 4 * 12 + 16 + 2 * 1
    embeddings = 4 * h + 8 + h  # LayerNorm input and statistics, dropout mask
    assert two.component("activations").bytes - one.component("activations").bytes == layers * per_layer + embeddings


def test_fp32_keeps_one_input_for_the_three_projections() -> None:
    fp32 = estimate(BERT, TrainSetup(micro_batch=1, seq_len=1, precision="fp32"))
    fp32_2 = estimate(BERT, TrainSetup(micro_batch=2, seq_len=1, precision="fp32"))
    h = 768
    per_layer = (4 + 12 + 4 + 1 + 4 + 4 + 16 + 16 + 1 + 4) * h + 4 * 12 + 16 + 4 * 1
    assert fp32_2.component("activations").bytes - fp32.component("activations").bytes == 12 * per_layer + 5 * h + 8


def test_samples_per_anchor_multiply_the_sequences() -> None:
    contrastive = estimate(BERT, TrainSetup(micro_batch=4, n_positives=2, n_negatives=3))
    plain = estimate(BERT, TrainSetup(micro_batch=24))
    assert contrastive.setup.sequences == 24
    assert contrastive.component("activations").bytes == plain.component("activations").bytes


def test_checkpointing_frozen_encoder_and_lora() -> None:
    base = TrainSetup(micro_batch=64)
    full = estimate(BERT, base)
    ckpt = estimate(BERT, dataclasses.replace(base, gradient_checkpointing=True))
    assert ckpt.component("activations").bytes < full.component("activations").bytes / 5
    assert ckpt.component("recompute").bytes > 0 and ckpt.total < full.total
    frozen = estimate(BERT, dataclasses.replace(base, trainable="frozen_encoder"))
    assert "activations" not in {c.key for c in frozen.components}
    assert frozen.trainable_params == BERT.head_params
    lora = estimate(BERT, dataclasses.replace(base, trainable="lora", lora_rank=8, lora_targets=("query", "value")))
    assert lora.trainable_params == 12 * 2 * 8 * (768 + 768) + BERT.head_params
    assert lora.params == BERT.params + 12 * 2 * 8 * (768 + 768)
    # LoRA keeps every layer's activations except the inputs of linears it does not adapt
    assert frozen.total < lora.total < full.total


def test_a_frozen_encoder_forward_holds_one_layer_moment_and_leaves_holes() -> None:
    """BERT-base under bf16, per token: the embedding output and the layer input (2 x 4h), and at the MLP's output
    the attention block's output (4h), the GELU output (2f), the down projection after dropout (2h), the residual
    sum and the LayerNorm output (2 x 4h): 7.5 fp32 hidden-sized tensors. The allocator keeps three more."""
    h, tokens = 768, 1024 * 128
    est = estimate(BERT, TrainSetup(micro_batch=1024, trainable="frozen_encoder"))
    assert est.phase == "no-grad forward"
    assert est.component("working").bytes == (8 * h + 4 * h + 2 * 3072 + 2 * h + 8 * h) * tokens == 7.5 * 4 * h * tokens
    assert est.reserved - est.allocated == 3 * 4 * h * tokens + Overheads().workspaces
    small = estimate(BERT, TrainSetup(micro_batch=8, trainable="frozen_encoder"))
    assert small.reserved - small.allocated == Overheads().allocator + Overheads().workspaces


def test_in_peak_components_add_up_to_the_total() -> None:
    setups = [
        TrainSetup(micro_batch=b, **kw)
        for b in (1, 16, 256)
        for kw in (
            {},
            {"gradient_checkpointing": True},
            {"trainable": "lora"},
            {"trainable": "frozen_encoder"},
            {"precision": "fp32", "optimizer": "sgd"},
            {"accumulate": 4, "loop": "plain"},
            {"n_gpus": 4, "zero_stage": 2},
        )
    ]
    for spec in (BERT, GPT2):
        for setup in setups:
            if spec is GPT2 and setup.trainable == "frozen_encoder":
                continue
            if spec is GPT2 and setup.trainable == "lora":
                setup = dataclasses.replace(setup, lora_targets=("c_attn",))
            est = estimate(spec, setup)
            assert sum(c.bytes for c in est.components if c.in_peak) == est.total, (spec.model_type, setup)
            assert est.total == est.reserved + Overheads().context
            assert est.phases[est.phase] == max(est.phases.values())


def test_peak_grows_with_the_batch() -> None:
    totals = [estimate(GPT2, TrainSetup(micro_batch=b, seq_len=256)).total for b in range(1, 40)]
    assert totals == sorted(totals) and totals[0] < totals[-1]


def test_zero_stages_shard_states_and_ddp_adds_buckets() -> None:
    p = BERT.params
    ddp = estimate(BERT, TrainSetup(micro_batch=8, n_gpus=4))
    assert ddp.component("buckets").bytes == 4 * p
    z1 = estimate(BERT, TrainSetup(micro_batch=8, n_gpus=4, zero_stage=1))
    assert z1.component("optimizer").bytes == 8 * p // 4 and z1.component("master").bytes == 4 * p // 4
    assert z1.component("weights").bytes == 2 * p  # 16-bit weights
    assert z1.component("gradients").bytes == 2 * p
    z2 = estimate(BERT, TrainSetup(micro_batch=8, n_gpus=4, zero_stage=2))
    assert z2.component("gradients").bytes == 2 * p // 4
    z3 = estimate(BERT, TrainSetup(micro_batch=8, n_gpus=4, zero_stage=3))
    assert z3.component("weights").bytes == 2 * p // 4
    assert z3.total < z2.total < z1.total < ddp.total


def test_accumulation_keeps_gradients_through_the_step() -> None:
    one = estimate(BERT, TrainSetup(micro_batch=64, loop="plain"))
    acc = estimate(BERT, TrainSetup(micro_batch=64, loop="plain", accumulate=4))
    assert acc.total - one.total == pytest.approx(4 * BERT.params, rel=0.01)


def test_lm_logits_dominate_gpt2() -> None:
    est = estimate(GPT2, TrainSetup(micro_batch=8, seq_len=512, loop="plain"))
    assert est.phase == "start of backward"
    assert est.component("logits").bytes > est.component("activations").bytes / 2


def test_bad_inputs_are_user_errors() -> None:
    with pytest.raises(UserError, match="supports bert, roberta, distilbert, gpt2, llama"):
        spec_from_config({"model_type": "t5"}, "t5/config.json")
    with pytest.raises(UserError, match="missing key 'hidden_size'"):
        spec_from_config({"model_type": "bert"}, "x")
    with pytest.raises(UserError, match="nothing trains"):
        estimate(GPT2, TrainSetup(trainable="frozen_encoder"))
    with pytest.raises(UserError, match="its layers have: c_attn, c_fc, c_proj"):
        estimate(GPT2, TrainSetup(trainable="lora", lora_targets=("query",)))
    with pytest.raises(UserError, match='precision "bf16"'):
        estimate(BERT, TrainSetup(precision="bf16"))
    with pytest.raises(UserError, match="micro_batch = 0"):
        estimate(BERT, TrainSetup(micro_batch=0))
