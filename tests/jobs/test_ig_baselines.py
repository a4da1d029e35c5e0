"""Baselines keep [CLS]/[SEP] and padding and fill the content positions."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.attribution.baselines import baseline_embeddings, baseline_token_id
from gpuopt_tui.jobs.models.hf import SequenceClassifierAdapter

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad", "film"]


def adapter(vocab: list[str] = VOCAB, **tokenizer_options: object) -> SequenceClassifierAdapter:
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
    )
    tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(vocab)}, **tokenizer_options)
    return SequenceClassifierAdapter("tiny", BertForSequenceClassification(config), tokenizer, 2, torch.device("cpu"))


@pytest.mark.parametrize(("kind", "token"), [("pad", "[PAD]"), ("mask", "[MASK]"), ("custom", "film"), ("zero", None)])
def test_content_positions_are_filled_and_structure_is_kept(kind: str, token: str | None) -> None:
    a = adapter()
    batch = a.tokenize(["good film", "bad"], max_length=8)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        emb = a.word_embeddings()(ids)
        token_id = baseline_token_id(a, kind, "film")
        base = baseline_embeddings(a, ids, mask, emb, token_id)
    assert token_id == (None if token is None else VOCAB.index(token))
    table = a.word_embeddings().weight
    fill = torch.zeros(8) if token is None else table[VOCAB.index(token)]
    # "[CLS] good film [SEP]" and "[CLS] bad [SEP] [PAD]"
    content = torch.tensor([[False, True, True, False], [False, True, False, False]])
    assert torch.equal(base[content], fill.expand(3, 8))
    assert torch.equal(base[~content], emb[~content])


def test_zero_all_zeroes_the_structure_tokens_too() -> None:
    a = adapter()
    batch = a.tokenize(["good film", "bad"], max_length=8)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        emb = a.word_embeddings()(ids)
        base = baseline_embeddings(a, ids, mask, emb, baseline_token_id(a, "zero-all"), keep_structure=False)
    real = mask.bool()
    assert torch.equal(base[real], torch.zeros(int(real.sum()), 8))
    assert torch.equal(base[~real], emb[~real])  # the padding of "bad"


def test_missing_or_unknown_baseline_tokens_are_user_errors() -> None:
    without_mask = [t for t in VOCAB if t != "[MASK]"]
    with pytest.raises(UserError, match="has no mask token"):
        baseline_token_id(adapter(without_mask, mask_token=None), "mask")
    with pytest.raises(UserError, match="outside the embedding table"):  # [MASK] added past the vocabulary
        baseline_token_id(adapter(without_mask), "mask")
    with pytest.raises(UserError, match='"great" is not a single token'):
        baseline_token_id(adapter(), "custom", "great")
    assert baseline_token_id(adapter(), "custom", "[UNK]") == 1  # the unknown token itself is allowed
