"""Fixtures shared by every test: private data/cache dirs, the `gpu` marker, a tiny saved BERT classifier.

torch and transformers are imported only inside the fixtures and hooks that need them, so UI-only runs stay
fast and torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_words import TINY_WORDS

# Without a GPU the short_attention kernels' tests run in triton's interpreter, which has to be chosen before
# anything imports triton (torch.compile does, in other tests). CUDA needs the /dev/nvidia<N> device nodes.
if not any(Path("/dev").glob("nvidia[0-9]*")):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _private_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Runs, profiles and caches (the demo models among them) go to a fresh directory per test session."""
    base = tmp_path_factory.mktemp("gpuopt-tui")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPUOPT_TUI_HOME", str(base / "home"))
        mp.setenv("GPUOPT_TUI_CACHE_DIR", str(base / "cache"))
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_words() -> list[str]:
    """The words `tiny_bert_dir`'s tokenizer knows (besides its special tokens)."""
    return list(TINY_WORDS)


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer, 32-wide BertForSequenceClassification (3 labels, initializer_range=0.3 so that
    gradients and attributions are far from zero) and its BertTokenizer, saved with save_pretrained."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *TINY_WORDS]
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
        initializer_range=0.3,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BertForSequenceClassification(config).eval()
    path = tmp_path_factory.mktemp("tiny-bert")
    model.save_pretrained(path)
    BertTokenizer(vocab={word: i for i, word in enumerate(vocab)}).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def demo_classifier():
    """The demo classifier's adapter on the CPU, trained once per test session (in the session's cache).
    Shared by every test: to change its weights (checkpoints), load another with `load_demo_adapter`."""
    import torch

    from gpuopt_tui.core.paths import cache_dir
    from gpuopt_tui.jobs.models.demo import load_demo_adapter

    return load_demo_adapter("classifier", torch.device("cpu"), cache_dir())


@pytest.fixture(scope="session")
def demo_two_tower():
    """The demo two-tower recommender's adapter on the CPU, trained once per test session (shared, as above)."""
    import torch

    from gpuopt_tui.core.paths import cache_dir
    from gpuopt_tui.jobs.models.demo import load_demo_adapter

    return load_demo_adapter("two_tower", torch.device("cpu"), cache_dir())


@pytest.fixture(scope="session")
def demo_causal_lm():
    """The demo causal language model's adapter on the CPU, trained once per test session (shared, as above)."""
    import torch

    from gpuopt_tui.core.paths import cache_dir
    from gpuopt_tui.jobs.models.demo import load_demo_adapter

    return load_demo_adapter("causal_lm", torch.device("cpu"), cache_dir())
