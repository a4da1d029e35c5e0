"""The demo models' sizes and dropout, in Hugging Face config keys (two BERT models and a Llama decoder): the demo
code builds its models from them (with its vocabulary's size) and the planner plans for them, as the task each
trains for, without importing torch or starting a process. tests/jobs/test_demo_architectures.py checks that the
planner sees the model the demo code builds."""

from __future__ import annotations

from typing import Any

DEMO_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "classifier": {
        "model_type": "bert",
        "vocab_size": 161,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "max_position_embeddings": 32,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "num_labels": 2,
    },
    "two_tower": {
        "model_type": "bert",
        "vocab_size": 105,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "max_position_embeddings": 16,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    },
    "causal_lm": {
        "model_type": "llama",
        "vocab_size": 78,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    },
}
DEMO_TASKS = {"classifier": "classification", "two_tower": "embedding", "causal_lm": "causal_lm"}


def config_sizes(kind: str) -> dict[str, Any]:
    """The config arguments of a demo's sizes (its vocabulary's size is the demo code's to say)."""
    return {k: v for k, v in DEMO_ARCHITECTURES[kind].items() if k not in ("model_type", "vocab_size", "num_labels")}
