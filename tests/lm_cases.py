"""Tiny random decoder language models of several families and a word-level tokenizer with BOS and a chat template,
built from configs (no download), for the causal LM tests. Import as `from lm_cases import ...` (pytest puts tests/
on the path for its conftest)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tiny_words import TINY_WORDS

SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
PAD, UNK, BOS, EOS = 0, 1, 2, 3
WORDS = TINY_WORDS
VOCAB = len(SPECIAL) + len(WORDS)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# no padding_idx: a zero [PAD] row would make the pad baseline the zero vector, which RMSNorm maps to a spike
_SIZES = {"vocab_size": VOCAB, "initializer_range": 0.2, "pad_token_id": None, "bos_token_id": BOS, "eos_token_id": EOS}
_DECODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


def _configs() -> dict[str, Any]:
    from transformers import (
        GemmaConfig,
        GPT2Config,
        GPTNeoXConfig,
        LlamaConfig,
        MistralConfig,
        PhiConfig,
        Qwen2Config,
    )

    rope = {"max_position_embeddings": 64, "num_key_value_heads": 2}
    return {
        "gpt2": lambda: GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **_SIZES),
        "llama": lambda: LlamaConfig(**_DECODER, **rope, **_SIZES),
        "qwen2": lambda: Qwen2Config(**_DECODER, **rope, **_SIZES),
        "mistral": lambda: MistralConfig(**_DECODER, **rope, sliding_window=None, **_SIZES),
        "gemma": lambda: GemmaConfig(**_DECODER, **rope, head_dim=8, **_SIZES),
        "phi": lambda: PhiConfig(**_DECODER, max_position_embeddings=64, **_SIZES),
        "gpt_neox": lambda: GPTNeoXConfig(**_DECODER, max_position_embeddings=64, **_SIZES),
    }


FAMILIES = ("gpt2", "llama", "qwen2", "mistral", "gemma", "phi", "gpt_neox")


def tiny_decoder(family: str, seed: int = 0) -> torch.nn.Module:
    """A random 2-layer, 32-wide causal LM of `family` in eval mode (eager attention: exact in float64)."""
    from transformers import AutoModelForCausalLM

    config = _configs()[family]()
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config).eval()


def tiny_tokenizer(padding_side: str = "right") -> Any:
    """A word-level tokenizer of WORDS that writes BOS before a text (as Llama's does), with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate([*SPECIAL, *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
        padding_side=padding_side,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_decoder(family: str, path: Path, seed: int = 0) -> Path:
    """A tiny decoder and the tokenizer saved together with save_pretrained (what adapter = "hf" loads)."""
    tiny_decoder(family, seed).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path
