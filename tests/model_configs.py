"""Hugging Face config.json contents of real models, for the planner's tests (only configs are read: no weights,
no torch). Import as `from model_configs import ...` (pytest puts tests/ on the path for its conftest)."""

from __future__ import annotations

from typing import Any

BERT_BASE: dict[str, Any] = {  # bert-base-uncased
    "model_type": "bert",
    "architectures": ["BertModel"],
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "max_position_embeddings": 512,
}
BERT_BASE_CLASSIFIER: dict[str, Any] = {**BERT_BASE, "architectures": ["BertForSequenceClassification"]}
