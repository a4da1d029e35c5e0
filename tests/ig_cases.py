"""A tiny random BERT classifier and a batch of its input embeddings, for the IG engine's tests. Import as
`from ig_cases import ...` (pytest puts tests/ on the path for its conftest)."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForSequenceClassification


def tiny_bert_case(
    seed: int, data_seed: int, rows: int, padded: tuple[int, int]
) -> tuple[BertForSequenceClassification, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(model in eval mode, embeddings [rows, 12, 32], zero baselines, mask): 3 labels, weights drawn from `seed`,
    token ids from `data_seed`; row padded[0] is padded from position padded[1] on."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        initializer_range=0.2,
        num_labels=3,
    )
    model = BertForSequenceClassification(config).eval()
    ids = torch.randint(5, 100, (rows, 12), generator=torch.Generator().manual_seed(data_seed))
    mask = torch.ones_like(ids)
    mask[padded[0], padded[1] :] = 0
    emb = model.get_input_embeddings()(ids).detach()
    return model, emb, torch.zeros_like(emb), mask
