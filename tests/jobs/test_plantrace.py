"""The traced tier: a training step of the model class on fake tensors, every allocation tracked.

References, each independent of the trace: the live-tensor peak of the same step run for real on the CPU
(`memprobe.probe`, `LiveTensors`, with CUDA's autocast lists as the trace runs them), which the trace must reproduce
(it runs the same ops; only the tensors are fake), a count by hand of what CUDA's autocast lists keep, and the closed
form, which is written by hand per family and must agree within `CLOSED_FORM_TOLERANCE`
on the families it covers. Models are built as in the live-peak test (no dropout; GPT-2 in fp32)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_planner_live_peak import CONFIGS  # noqa: E402

from gpuopt_tui.cli import main  # noqa: E402
from gpuopt_tui.core.planner.estimate import estimate  # noqa: E402
from gpuopt_tui.core.planner.measure import probe_request  # noqa: E402
from gpuopt_tui.core.planner.model_spec import spec_from_config  # noqa: E402
from gpuopt_tui.core.planner.traced import traced_estimate  # noqa: E402
from gpuopt_tui.core.planner.train_setup import TrainSetup  # noqa: E402
from gpuopt_tui.jobs import fakecompat, memprobe, plantrace  # noqa: E402
from gpuopt_tui.jobs.fakecompat import cuda_autocast  # noqa: E402
from gpuopt_tui.jobs.plantrace import trace  # noqa: E402
from gpuopt_tui.jobs.tracemem import ACTIVATIONS, BACKWARD, FORWARD, OPTIMIZER_STEP, MemoryTrace  # noqa: E402

SEQ = 128
# the closed form against the trace on tiny models (where its per-token approximations weigh most)
CLOSED_FORM_TOLERANCE = 0.12
# the trace against the real step's live tensors: the all-ones attention mask of a model with SDPA attention,
# which the traced batch leaves out (a real step reads it and builds no mask from it)
LIVE_TOLERANCE = 0.002
BUFFERS = 64 * 1024  # position ids and rotary tables of the tiny models, counted with the weights
SETUPS = {
    "full fp32 (hf loop)": TrainSetup(precision="fp32", seq_len=SEQ, micro_batch=4, loop="hf"),
    "bf16 + checkpointing (lightning loop)": TrainSetup(
        seq_len=SEQ, micro_batch=4, loop="lightning", gradient_checkpointing=True
    ),
    "bf16 LoRA all-linear (plain loop)": TrainSetup(
        seq_len=SEQ, micro_batch=4, loop="plain", trainable="lora", lora_targets=("all-linear",)
    ),
}


@pytest.fixture
def gpu_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real CPU step with the multi-tensor optimizer update, as on a GPU and in the trace (the CPU's default
    updates one parameter at a time, with other temporaries)."""
    monkeypatch.setattr(memprobe, "make_optimizer", partial(memprobe.make_optimizer, foreach=True))


def _live(request: dict[str, object]) -> int:
    """The peak of live tensors of the same step run for real on the CPU, under CUDA's autocast lists as traced."""
    with cuda_autocast():
        return memprobe.probe(request)["max_allocated"]


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("name", sorted(SETUPS))
def test_trace_reproduces_the_real_step_and_agrees_with_the_closed_form(
    family: str, name: str, gpu_optimizer: None
) -> None:
    setup = SETUPS[name]
    config = CONFIGS[family].to_dict()
    request = probe_request(config, "classification", setup, device="cpu", steps=1)
    traced = trace(request)
    assert not traced.get("error"), traced.get("error")
    live = _live(request)
    assert abs(traced["max_allocated"] / live - 1) <= LIVE_TOLERANCE, (traced["max_allocated"], live)
    closed = estimate(spec_from_config(config, family, "classification"), setup).allocated
    assert abs(closed / traced["max_allocated"] - 1) <= CLOSED_FORM_TOLERANCE, (closed, traced["max_allocated"])
    parts = traced["components"]
    assert sum(parts.values()) == traced["max_allocated"]  # the table adds up to the peak
    assert 0 <= parts["weights"] - 4 * traced["params"] < BUFFERS  # fp32 parameters (a tied one once), buffers


SMALL = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
OTHER_FAMILIES = {
    "gemma": (transformers.GemmaConfig(**SMALL, intermediate_size=128, num_key_value_heads=2, head_dim=16), "causal_lm"),
    "gemma3_text": (
        transformers.Gemma3TextConfig(
            **SMALL, intermediate_size=128, num_key_value_heads=2, head_dim=16, sliding_window=32
        ),
        "causal_lm",
    ),
    "phi": (transformers.PhiConfig(**SMALL, intermediate_size=128), "causal_lm"),
    "phi3": (transformers.Phi3Config(**SMALL, intermediate_size=128, pad_token_id=0), "causal_lm"),
    "gpt_neox": (transformers.GPTNeoXConfig(**SMALL, intermediate_size=128), "causal_lm"),
    "falcon": (transformers.FalconConfig(**SMALL), "causal_lm"),
    "opt": (
        transformers.OPTConfig(
            vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
            word_embed_proj_dim=64, dropout=0.0,  # the CPU's dropout keeps masks CUDA's (traced) does not
        ),
        "causal_lm",
    ),
    "t5": (
        transformers.T5Config(
            vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0,
            pad_token_id=0, dropout_rate=0.0,
        ),
        "causal_lm",
    ),
    "mixtral": (
        transformers.MixtralConfig(
            **SMALL, intermediate_size=128, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
        ),
        "causal_lm",
    ),
    "deberta-v2": (
        transformers.DebertaV2Config(
            **SMALL, intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        ),
        "classification",
    ),
    "modernbert": (
        transformers.ModernBertConfig(
            **SMALL, intermediate_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
            sep_token_id=2,
        ),
        "classification",
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(OTHER_FAMILIES))
def test_families_the_closed_form_refuses_are_traced(family: str, gpu_optimizer: None) -> None:
    config, task = OTHER_FAMILIES[family]
    lora = family in (
        "phi",
        "gpt_neox",
        "t5",
        "deberta-v2",
    )  # LoRA + checkpointing for some, full training for the others
    setup = TrainSetup(
        seq_len=64,
        micro_batch=2,
        loop="hf",
        trainable="lora" if lora else "all",
        lora_targets=("all-linear",),
        gradient_checkpointing=lora,
    )
    request = probe_request(config.to_dict(), task, setup, device="cpu", steps=1)
    result = trace(request)
    assert not result.get("error"), result["error"]
    live = _live(request)  # the same step run for real on the CPU
    assert abs(result["max_allocated"] / live - 1) <= LIVE_TOLERANCE, (result["max_allocated"], live)
    assert 0 <= result["components"]["weights"] - 4 * result["params"] < BUFFERS
    assert result["peak_phase"] in (FORWARD, BACKWARD, OPTIMIZER_STEP)
    if lora:
        assert 0 < result["trainable_params"] < result["params"] / 2
        kept = trace(probe_request(config.to_dict(), task, dataclasses.replace(setup, gradient_checkpointing=False)))
        assert kept["max_allocated"] > result["max_allocated"]  # checkpointing keeps less for backward
    est = traced_estimate(result, task, setup)
    assert est.reserved > est.allocated == result["max_allocated"]


def test_dropout_costs_what_cuda_kernels_keep(gpu_optimizer: None) -> None:
    """Fake tensors on the CPU, CUDA's dropout memory: attention dropout costs nothing (CUDA's fused kernels redraw
    the mask in backward; the CPU's unfused fallback keeps the probabilities), and a hidden dropout keeps a one-byte
    mask per element (the CPU's keeps one of the input's dtype)."""
    setup = TrainSetup(precision="fp32", seq_len=SEQ, micro_batch=4, loop="hf")

    def peaks(hidden: float, attention: float) -> tuple[int, int]:
        config = CONFIGS["bert"].to_dict() | {"hidden_dropout_prob": hidden, "attention_probs_dropout_prob": attention}
        request = probe_request(config, "classification", setup, device="cpu", steps=1)
        return trace(request)["max_allocated"], _live(request)

    base, hidden, attention = peaks(0.0, 0.0), peaks(0.1, 0.0), peaks(0.0, 0.1)
    assert attention[0] == base[0] < attention[1]
    mask = 4 * SEQ * CONFIGS["bert"].hidden_size  # one byte per element of a hidden-sized activation
    assert (hidden[0] - base[0]) % mask == 0 and 0 < hidden[0] - base[0] < hidden[1] - base[1]


def test_cuda_autocast_lists_hold_inside_and_are_undone_after() -> None:
    x = torch.ones(4, 8, requires_grad=True)

    def dtypes() -> tuple[torch.dtype, ...]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = x @ x.T  # bf16 under both lists
            return (
                h.dtype,
                torch.pow(h, 3.0).dtype,
                torch.nn.functional.layer_norm(h, (4,)).dtype,
                h.softmax(-1).dtype,
                h.softmax(-1, dtype=torch.bfloat16).dtype,  # a dtype the caller gave is kept
                h.sum(dim=1).dtype,
            )

    bf16, fp32 = torch.bfloat16, torch.float32
    assert dtypes() == (bf16,) * 6  # the CPU's lists
    with cuda_autocast() as ops:
        assert "pow.Tensor_Scalar" in ops and "softmax.int" in ops
        assert dtypes() == (bf16, fp32, fp32, fp32, bf16, fp32)  # CUDA's
    assert dtypes() == (bf16,) * 6


GELU_TANH = {  # MLPs with GELU-tanh ("gelu_new"), written with torch.pow
    "gpt2": transformers.GPT2Config(
        vocab_size=256, n_embd=64, n_inner=256, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    "phi": transformers.PhiConfig(
        vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(GELU_TANH))
def test_fake_cpu_tensors_keep_what_cuda_autocast_keeps(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """GELU-tanh under bf16 autocast on CUDA: pow runs in fp32, so tanh(...) and 1 + tanh(...), both saved for
    backward, are fp32 (4 bytes an element, 2 under the CPU's lists), and their fp32 product reaches the next LoRA
    layer, whose base and A matrices each keep a bf16 copy of it (2 + 2; the CPU's bf16 product is kept once, 2).
    By hand: 6 more bytes per MLP element in each layer, all of it in the MLP, which the CPU's lists miss."""
    config = GELU_TANH[family]
    setup = TrainSetup(seq_len=64, micro_batch=2, loop="hf", trainable="lora", lora_targets=("all-linear",))
    request = probe_request(config.to_dict(), "causal_lm", setup, device="cpu", steps=1)
    cuda_lists = trace(request)
    monkeypatch.setattr(plantrace, "cuda_autocast", nullcontext)
    cpu_lists = trace(request)
    extra = 6 * setup.micro_batch * setup.seq_len * 256 * config.num_hidden_layers
    assert cuda_lists["max_allocated"] - cpu_lists["max_allocated"] == extra
    cuda_mlp, cpu_mlp = (
        next(n for name, n in result["activations_by_module"] if name.endswith(".mlp"))
        for result in (cuda_lists, cpu_lists)
    )
    assert cuda_mlp - cpu_mlp == extra
    live = _live(request)  # the real step under the same lists keeps as much
    assert abs(cuda_lists["max_allocated"] / live - 1) <= LIVE_TOLERANCE, (cuda_lists["max_allocated"], live)


def test_a_bf16_cross_entropy_is_traced_as_cuda_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """T5 computes its loss on bf16 logits. CUDA's autocast does not list cross_entropy_loss: its log_softmax takes
    the bf16 logits and gives fp32. The CPU's lists it, casting the logits to fp32 first: 2 bytes more per logit at
    the peak (T5-small at 16 x 512 on an H200: the CPU's trace was +5.4% over the real step, CUDA's -0.8%; with
    cross_entropy_loss running through, the CPU's trace equals CUDA's to 96 bytes, planner_traced_H200.md)."""
    config = transformers.T5Config(
        vocab_size=512, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    # the plain loop: the HF Trainer's fp32 copy of the outputs (see the test after this one) moves the peak
    setup = TrainSetup(seq_len=64, micro_batch=4, loop="plain")
    request = probe_request(config.to_dict(), "causal_lm", setup, device="cpu", steps=1)
    as_cuda = trace(request)["max_allocated"]
    monkeypatch.setattr(fakecompat, "_CPU_ONLY_FP32", ())
    as_cpu = trace(request)["max_allocated"]
    logits = setup.micro_batch * setup.seq_len * config.vocab_size
    assert abs(as_cpu - as_cuda - 2 * logits) <= 16  # and a scalar


def test_layerdrop_is_traced_as_the_step_that_keeps_every_layer() -> None:
    """OPT reads `torch.rand([]) < layerdrop` in Python before each layer (transformers 5.17 even with layerdrop 0),
    which no fake tensor can answer: the trace takes the draw that skips no layer, the most memory a step takes."""
    config, task = OTHER_FAMILIES["opt"]
    setup = TrainSetup(seq_len=64, micro_batch=2, loop="hf")
    peaks = []
    for layerdrop in (0.0, 0.5):
        result = trace(probe_request({**config.to_dict(), "layerdrop": layerdrop}, task, setup))
        assert not result.get("error"), result["error"]
        peaks.append(result["max_allocated"])
    assert peaks[0] == peaks[1]


def _eager_experts() -> dict[str, object]:
    """Mixtral with transformers' eager experts: a loop over the experts that tokens were routed to, found with
    nonzero(), whose output shape depends on the data."""
    config, _ = OTHER_FAMILIES["mixtral"]
    return {**config.to_dict(), "experts_implementation": "eager", "architectures": ["MixtralForCausalLM"]}


def test_a_model_that_cannot_run_on_fake_tensors_is_named_with_the_op() -> None:
    result = trace(probe_request(_eager_experts(), "causal_lm", TrainSetup(seq_len=32, micro_batch=2)))
    assert "mixtral (MixtralForCausalLM)" in result["error"]
    assert "aten.nonzero" in result["error"] and "modeling_mixtral.py" in result["error"]


def test_the_tracker_attributes_storages_to_module_and_phase() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.ones(16, 8)
    with MemoryTrace() as memory, memory.watch(model):
        memory.phase = FORWARD
        loss = model(x).sum()
        memory.phase = BACKWARD
        loss.backward()
        memory.snapshot()
    relu_out = [b for b in memory.peak_blocks if b.module == "1" and b.kind == ACTIVATIONS]
    assert [b.nbytes for b in relu_out] == [16 * 32 * 4]  # ReLU's output, saved for backward
    assert memory.peak >= sum(b.nbytes for b in memory.peak_blocks)


def test_tracing_a_1b_model_allocates_no_real_memory() -> None:
    """Llama-3.2-1B shapes at sequence length 2048, batch 8 (a 70 GiB step) traced in a child process, whose
    resident memory must stay far below the model's 5 GB of fp32 weights."""
    config = transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        tie_word_embeddings=True,
    )
    request = probe_request(config.to_dict(), "causal_lm", TrainSetup(seq_len=2048, micro_batch=8, loop="hf"))
    script = (
        "import json, resource, sys; from gpuopt_tui.jobs.plantrace import trace; "
        "r = trace(json.loads(sys.stdin.read())); "
        "r['rss'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024; print(json.dumps(r))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], input=json.dumps(request), capture_output=True, text=True, env=dict(os.environ)
    )
    result = json.loads(done.stdout.splitlines()[-1])
    assert not result.get("error"), result.get("error")
    assert result["params"] > 1.2e9 and result["max_allocated"] > 40 * 1024**3
    assert result["rss"] < 2.5 * 1024**3, result["rss"]  # torch and transformers alone hold about 1 GB


def _plan(capsys: pytest.CaptureFixture[str], model: Path, *args: str) -> tuple[int, str]:
    code = main(["plan", "--model", str(model), "--gpu-memory", "80", "--seq-len", "64", "--batch", "2", *args])
    out = capsys.readouterr()
    return code, " ".join((out.out + out.err).split())


def test_plan_show_traces_a_family_the_closed_form_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = OTHER_FAMILIES["phi"]
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["PhiForCausalLM"]}))
    code, out = _plan(capsys, tmp_path, "--show")
    assert code == 0, out
    assert "phi causal_lm (a family the closed form does not cover: traced tier)" in out
    assert "traced on fake tensors (no GPU), PhiForCausalLM" in out
    assert "building phi from its config on fake tensors step 1 of 2: forward" in out  # the trace's progress
    assert "step 2 of 2: optimizer step" in out
    assert "model.layers.*.mlp" in out  # activations by module
    assert "closed form no estimate: " in out and 'model_type "phi"' in out
    assert "candidates" not in out  # --show alone: no search


def test_plan_show_trace_sets_the_tiers_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {**CONFIGS["llama"].to_dict(), "architectures": ["LlamaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out = _plan(capsys, tmp_path, "--show", "--trace", "--loop", "hf")
    assert code == 0, out
    assert "tiers side by side" in out and "closed-form estimate" in out
    traced_line = out.split("tiers side by side")[1]
    assert re.search(r"[+-]\d+\.\d%", traced_line)  # the closed form's difference from the trace


def test_an_untraceable_model_fails_with_a_message_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_eager_experts()))
    code, out = _plan(capsys, tmp_path, "--show")
    assert code != 0
    assert "traced tier: mixtral (MixtralForCausalLM): the op aten.nonzero" in out


def test_plan_auto_searches_on_the_traced_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No GPU and a family the closed form refuses: traces bracket the largest micro-batch on a line and one more
    confirms it; the recommendation keeps the effective batch of 4."""
    config, _ = OTHER_FAMILIES["phi"]
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["PhiForCausalLM"]}))
    code = main(["plan", "--model", str(tmp_path), "--gpu-memory", "1.6", "--seq-len", "256", "--batch", "4", "--auto"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0, out
    traced = [int(b) for b in re.findall(r"trace b=(\d+): peak reserved", out)]
    assert 3 <= len(traced) <= 5, out
    largest = int(re.search(r"largest micro-batch that fits: (\d+)", out).group(1))
    assert f"confirmed micro-batch {largest}:" in out and largest == traced[-1]
    assert "traced; 5% of the budget kept back for its error" in out
    assert re.search(rf"> recommended \(exact\): micro-batch 4 x accumulate 1 = 4, .* fits: {largest} ", out)


def test_lora_targets_that_match_nothing_are_named_with_the_layers_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, _ = OTHER_FAMILIES["phi"]
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["PhiForCausalLM"]}))
    code, out = _plan(capsys, tmp_path, "--show", "--trainable", "lora", "--lora-targets", "query,value")
    assert code != 0
    assert "LoRA targets query, value match no linear layer inside the layers; they have: dense, fc1, fc2" in out


def test_the_trainer_s_outputs_are_traced_in_fp32_under_mixed_precision() -> None:
    """The HF Trainer's accelerate copies a 16-bit model output to fp32 at the end of the forward
    (`convert_outputs_to_fp32`): a T5 whose activations are small peaks there, with its logits twice (T5-small in
    the Trainer on an H200: the trace without the copy was 6.6% under the Trainer's peak allocated, with it 0.4%)."""
    config = transformers.T5Config(
        vocab_size=4096, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    peaks = {}
    for loop in ("hf", "plain"):
        setup = TrainSetup(seq_len=64, micro_batch=4, loop=loop, precision="bf16-mixed")
        peaks[loop] = trace(probe_request(config.to_dict(), "causal_lm", setup, device="cpu", steps=1))["max_allocated"]
    logits = 4 * 64 * config.vocab_size
    # without the copy the two loops differ only by the Trainer's gradient clipping, a few scalars; with it, the
    # forward's end holds the fp32 copy beside the 16-bit logits, over the plain loop's peak in its backward
    assert peaks["hf"] - peaks["plain"] >= 2 * logits
