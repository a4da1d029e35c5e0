"""The demo text classifier: short synthetic reviews where the first opinion word decides.

Every review is 4-10 made-up filler words with two opinion words of opposite polarity planted at random
places; the label is the polarity of the *earlier* one ("superb ... dull" is positive). So:

- Integrated Gradients should put the largest attributions on the two opinion words;
- a bag of words (mean-pooled embeddings, layer 0) cannot tell the classes apart, since both classes have one
  positive and one negative word; the order is only combined into the representation by attention layers,
  which is what a layer probe should find;
- 2% of the training labels are flipped on purpose (indices in the manifest and `dataset("train").meta`), the
  examples TracIn self-influence should rank first.

The model is a 4-layer, 64-wide `BertForSequenceClassification` built from a config and trained from scratch
on the CPU in seconds (6 epochs; checkpoints after epochs 4, 5 and 6, once the order rule is learnt, so that
TracIn's gradients are not dominated by the unsettled early phase); its tokenizer is a `BertTokenizer` over
the demo vocabulary. Both are saved with `save_pretrained`, so the model directory also loads with the `hf`
adapter.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gpuopt_tui.core.demo_architectures import config_sizes
from gpuopt_tui.core.profiles.common import DataSection
from gpuopt_tui.jobs.context import StageFn, no_stage
from gpuopt_tui.jobs.data import TextDataset
from gpuopt_tui.jobs.models.demo.bundle import DemoBundle, save_model_dir, save_splits
from gpuopt_tui.jobs.models.demo.train import TrainPlan, train
from gpuopt_tui.jobs.models.hf import SequenceClassifierAdapter, load_hf_adapter, quiet_progress_bars

POSITIVE = ("great", "superb", "lovely")
NEGATIVE = ("awful", "dull", "boring")
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
LABEL_NAMES = ("negative", "positive")
N_FILLER = 150
N_TRAIN, N_TEST = 1600, 400
FLIP_FRACTION = 0.02
MIN_WORDS, MAX_WORDS = 4, 10
PLAN = TrainPlan(epochs=6, batch_size=32, lr=1e-3, checkpoint_epochs=(4, 5, 6))


def filler_words() -> list[str]:
    """150 pronounceable consonant-vowel-consonant-vowel words, the same for every build."""
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    words = sorted(a + b + c + d for a in consonants for b in vowels for c in consonants for d in vowels)
    return sorted(random.Random(1234).sample(words, N_FILLER))


def vocabulary() -> list[str]:
    return [*SPECIAL, *POSITIVE, *NEGATIVE, *filler_words()]


def make_reviews(n: int, rng: random.Random) -> tuple[list[str], list[int]]:
    """`n` reviews and their labels (1 = positive): the earlier of the two opinion words decides."""
    filler = filler_words()
    texts, labels = [], []
    for _ in range(n):
        words = [rng.choice(filler) for _ in range(rng.randint(MIN_WORDS, MAX_WORDS))]
        first, second = sorted(rng.sample(range(len(words)), 2))
        label = rng.randint(0, 1)
        lead, other = (POSITIVE, NEGATIVE) if label else (NEGATIVE, POSITIVE)
        words[first], words[second] = rng.choice(lead), rng.choice(other)
        texts.append(" ".join(words))
        labels.append(label)
    return texts, labels


def build_tokenizer() -> Any:
    from transformers import BertTokenizer

    return BertTokenizer(vocab={word: i for i, word in enumerate(vocabulary())})


def build_config() -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=len(vocabulary()),
        **config_sizes("classifier"),
        num_labels=2,
        id2label=dict(enumerate(LABEL_NAMES)),
        label2id={name: i for i, name in enumerate(LABEL_NAMES)},
        pad_token_id=0,
    )


def build(root: Path, seed: int, on_step: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Generate the data, train (`on_step(done, total)` after each step), and save everything under `root`;
    returns the manifest fields."""
    from transformers import BertForSequenceClassification

    quiet_progress_bars()
    rng = random.Random(seed)
    train_texts, train_labels = make_reviews(N_TRAIN, rng)
    test_texts, test_labels = make_reviews(N_TEST, rng)
    flipped = sorted(rng.sample(range(N_TRAIN), round(N_TRAIN * FLIP_FRACTION)))
    for i in flipped:
        train_labels[i] = 1 - train_labels[i]

    tokenizer = build_tokenizer()

    def encode(texts: list[str], labels: list[int]) -> dict[str, torch.Tensor]:
        enc = tokenizer(texts, padding=True, return_tensors="pt")
        return {
            "input_ids": enc["input_ids"],
            "attention_mask": enc["attention_mask"],
            "labels": torch.tensor(labels),
        }

    train_set, test_set = encode(train_texts, train_labels), encode(test_texts, test_labels)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BertForSequenceClassification(build_config())

    def loss_fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return F.cross_entropy(logits, batch["labels"])

    fields = {"input_ids": "attention_mask"}
    checkpoints, seconds = train(model, loss_fn, train_set, fields, PLAN, root / "checkpoints", seed, on_step)
    with torch.no_grad():
        test_pred = model(input_ids=test_set["input_ids"], attention_mask=test_set["attention_mask"]).logits
    save_model_dir(model, root / "model")
    tokenizer.save_pretrained(root / "model")
    save_splits(root, {"train": (train_set, train_texts), "test": (test_set, test_texts)})
    return {
        "kind": "classifier",
        "seed": seed,
        "rule": "the earlier of the two opinion words decides the label",
        "positive_tokens": list(POSITIVE),
        "negative_tokens": list(NEGATIVE),
        "signal_tokens": [*POSITIVE, *NEGATIVE],
        "flipped": flipped,
        "checkpoints": checkpoints,
        "train_seconds": round(seconds, 2),
        "test_accuracy": (test_pred.argmax(-1) == test_set["labels"]).float().mean().item(),
        "torch": torch.__version__,
    }


class DemoAdapter(SequenceClassifierAdapter):
    """The demo classifier with its built-in train/test data and training checkpoints."""

    def __init__(self, bundle: DemoBundle, device: torch.device, stage: StageFn = no_stage) -> None:
        hf = load_hf_adapter(bundle.model_dir, device, stage)
        keep = ("rule", "positive_tokens", "negative_tokens", "signal_tokens", "flipped", "test_accuracy")
        super().__init__(
            "demo classifier",
            hf.model,
            hf.tokenizer,
            hf.num_labels,
            device,
            label_names=LABEL_NAMES,
            checkpoints=bundle.checkpoints,
            info={k: bundle.manifest[k] for k in keep} | {"model_dir": str(bundle.model_dir)},
        )
        self.bundle = bundle
        self.weights_dir = bundle.model_dir

    def builtin_dataset(self, split: str, data: DataSection | None = None) -> TextDataset:
        """The split as tokenized when the demo was built (`data` names no fields of it)."""
        return self.bundle.dataset(split, self.token_fields)
