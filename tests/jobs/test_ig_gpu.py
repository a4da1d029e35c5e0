"""Integrated Gradients on a CUDA GPU: the memory probe of automatic chunking, reduced precision against
fp32, and a torch.compile'd forward. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from gpuopt_tui.jobs.attribution import ChunkPlanner, integrated_gradients
from gpuopt_tui.jobs.attribution.check import relative_difference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=200,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=64,
        initializer_range=0.1,
        num_labels=2,
    )
    model = BertForSequenceClassification(config).eval().cuda()
    ids = torch.randint(5, 200, (8, 48), device="cuda")
    mask = torch.ones_like(ids)
    mask[::2, 30:] = 0
    emb = model.get_input_embeddings()(ids).detach()
    base = torch.zeros_like(emb)
    return model, emb, base, mask


def forward_of(model):
    return lambda e, m, c: model(inputs_embeds=e, attention_mask=m).logits


def test_auto_chunks_probe_the_memory_and_give_the_same_result(case) -> None:
    model, emb, base, mask = case
    events = []
    planner = ChunkPlanner("auto", memory_fraction=0.5, on_event=lambda type, **f: events.append((type, f)))
    chunked = integrated_gradients(forward_of(model), emb, base, mask, n_steps=200, alpha_batch_size=planner)
    whole = integrated_gradients(forward_of(model), emb, base, mask, n_steps=200, alpha_batch_size=None)
    assert events[0][0] == "chunk_probe" and events[0][1]["peak_bytes"] > 0
    assert planner.bytes_per_row_token and planner.bytes_per_row_token > 0
    assert float(relative_difference(chunked.token_scores(), whole.token_scores()).max()) < 1e-5


@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp16"])
def test_reduced_precision_stays_within_1e_2_of_fp32(case, precision: str) -> None:
    model, emb, base, mask = case
    fp32 = integrated_gradients(forward_of(model), emb, base, mask, n_steps=50, precision="fp32")
    fast = integrated_gradients(forward_of(model), emb, base, mask, n_steps=50, precision=precision)
    error = relative_difference(fast.token_scores(), fp32.token_scores())
    assert 0 < float(error.median()) < 1e-2
    assert fast.attributions.dtype == torch.float32


def test_compiled_forward_matches_eager(case) -> None:
    model, emb, base, mask = case
    eager = integrated_gradients(forward_of(model), emb, base, mask, n_steps=32, alpha_batch_size=8)
    compiled = torch.compile(forward_of(model))
    result = integrated_gradients(compiled, emb, base, mask, n_steps=32, alpha_batch_size=8, model=model)
    assert float(relative_difference(result.token_scores(), eager.token_scores()).max()) < 1e-4
