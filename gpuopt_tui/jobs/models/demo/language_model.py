"""The demo causal language model: in each prompt one animal hides among made-up words, and the completion says
what it says.

Every prompt is 3-8 filler words with one animal word ("cat", "owl", ...) planted at a random place; its completion
is "<sound> said the <animal>" ("meow said the cat"). So:

- Integrated Gradients of the whole completion's log-probability should put the largest attribution on the animal
  word of the prompt, and so should the rows of the sound and of the animal named again; the row of "said" and
  of "the" (the same after every prompt) have little to explain;
- the rows of a [completion, prompt] matrix (`per_target_token`) add up to the whole completion's scores.

The model is a 2-layer, 64-wide `LlamaForCausalLM` built from a config and trained from scratch on the CPU in
seconds, with the loss on the completion's tokens only (the prompt is context, as in supervised fine-tuning); its
tokenizer is a word-level one over the demo vocabulary that writes BOS before a prompt, as Llama's does. Both are
saved with `save_pretrained`, so the model directory also loads with the `hf` adapter. The data splits are rows of
{"prompt", "completion"}, read through data.text_field and data.target_field as a jsonl file's would be.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gpuopt_tui.core.demo_architectures import config_sizes
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.attribution import CompletionDataSection
from gpuopt_tui.core.profiles.common import DataSection
from gpuopt_tui.jobs.context import StageFn, no_stage
from gpuopt_tui.jobs.data import Row, TextDataset
from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter, load_causal_lm_adapter
from gpuopt_tui.jobs.models.demo.bundle import SPLITS, DemoBundle, save_model_dir
from gpuopt_tui.jobs.models.demo.classifier import filler_words
from gpuopt_tui.jobs.models.demo.train import TrainPlan, train
from gpuopt_tui.jobs.models.hf import quiet_progress_bars

ANIMALS = {"cat": "meow", "dog": "woof", "cow": "moo", "owl": "hoot", "duck": "quack", "bee": "buzz"}
SPECIAL = ("<pad>", "<unk>", "<s>", "</s>")
PAD, UNK, BOS, EOS = 0, 1, 2, 3
LINKS = ("said", "the")
N_FILLER = 60
N_TRAIN, N_TEST = 1200, 200
MIN_WORDS, MAX_WORDS = 3, 8
PLAN = TrainPlan(epochs=4, batch_size=32, lr=3e-3, checkpoint_epochs=(2, 3, 4))
DATA_NAME = "data.json"
PROMPT, COMPLETION = "prompt", "completion"  # the keys of a demo row
# the row keys as a profile names them; used where no [data] section is given (a library call)
DEFAULT_DATA = CompletionDataSection(text_field=PROMPT, target_field=COMPLETION)


def vocabulary() -> list[str]:
    return [*SPECIAL, *ANIMALS, *ANIMALS.values(), *LINKS, *filler_words()[:N_FILLER]]


def make_rows(n: int, rng: random.Random) -> list[dict[str, str]]:
    """`n` rows {"prompt", "completion"}: filler words with one animal planted, and what that animal says."""
    filler = filler_words()[:N_FILLER]
    rows = []
    for _ in range(n):
        words = [rng.choice(filler) for _ in range(rng.randint(MIN_WORDS, MAX_WORDS))]
        animal = rng.choice(list(ANIMALS))
        words.insert(rng.randint(0, len(words)), animal)
        rows.append({PROMPT: " ".join(words), COMPLETION: f"{ANIMALS[animal]} said the {animal}"})
    return rows


def build_tokenizer() -> Any:
    """A word-level tokenizer of the demo vocabulary that writes BOS before a text (as Llama's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(vocabulary())}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    backend.decoder = decoders.WordPiece()  # joins the words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def build_config() -> Any:
    from transformers import LlamaConfig

    # no padding row (pad_token_id None): a zero [PAD] row would make the pad baseline the zero vector, which
    # RMSNorm maps to a spike
    return LlamaConfig(
        vocab_size=len(vocabulary()),
        **config_sizes("causal_lm"),
        pad_token_id=None,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )


def build(root: Path, seed: int, on_step: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Generate the rows, train (`on_step(done, total)` after each step), and save everything under `root`;
    returns the manifest fields."""
    from transformers import LlamaForCausalLM

    quiet_progress_bars()
    rng = random.Random(seed)
    splits = {"train": make_rows(N_TRAIN, rng), "test": make_rows(N_TEST, rng)}
    tokenizer = build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(build_config())

    def loss_fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], ignore_index=-100)

    train_set = _teacher_forcing(tokenizer, splits["train"])
    fields = {"input_ids": "attention_mask", "labels": "attention_mask"}
    checkpoints, seconds = train(model, loss_fn, train_set, fields, PLAN, root / "checkpoints", seed, on_step)
    save_model_dir(model, root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / DATA_NAME).write_text(json.dumps(splits), encoding="utf-8")
    return {
        "kind": "causal_lm",
        "seed": seed,
        "rule": "the completion is the sound of the animal in the prompt, then that animal",
        "signal_tokens": list(ANIMALS),
        "checkpoints": checkpoints,
        "train_seconds": round(seconds, 2),
        "test_accuracy": _exact_completions(model, tokenizer, splits["test"]),
        "torch": torch.__version__,
    }


def _teacher_forcing(tokenizer: Any, rows: Sequence[dict[str, str]]) -> dict[str, torch.Tensor]:
    """[BOS prompt completion] right-padded, with labels -100 except on the completion's tokens."""
    prompts = tokenizer([r[PROMPT] for r in rows])["input_ids"]
    completions = tokenizer([r[COMPLETION] for r in rows], add_special_tokens=False)["input_ids"]
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.full((len(rows), width), PAD)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
        mask[i, : len(p) + len(c)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _exact_completions(model: torch.nn.Module, tokenizer: Any, rows: Sequence[dict[str, str]]) -> float:
    """The share of rows whose every completion token is the model's top choice under teacher forcing."""
    batch = _teacher_forcing(tokenizer, rows)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    predicted, labels = logits[:, :-1].argmax(-1), batch["labels"][:, 1:]
    scored = labels != -100
    return ((predicted == labels) | ~scored).all(1).float().mean().item()


class DemoAdapter(CausalLMAdapter):
    """The demo causal LM with its built-in prompt/completion rows and training checkpoints."""

    def __init__(self, bundle: DemoBundle, device: torch.device, stage: StageFn = no_stage) -> None:
        loaded = load_causal_lm_adapter(bundle.model_dir, device)
        super().__init__("demo causal LM", loaded.model, loaded.tokenizer, device)
        keep = ("rule", "signal_tokens", "test_accuracy")
        self.checkpoints = bundle.checkpoints
        self.info = {k: bundle.manifest[k] for k in keep} | {"model_dir": str(bundle.model_dir)}
        self.bundle = bundle
        self.weights_dir = bundle.model_dir

    def builtin_dataset(self, split: str, data: DataSection | None = None) -> TextDataset:
        """The split's rows, read through `data`'s text_field and target_field (a profile's [data] section)."""
        if split not in SPLITS:
            raise UserError(f'demo data split "{split}": expected one of {", ".join(SPLITS)}')
        rows: list[Row] = [
            (f"demo causal_lm:{split}:{i + 1}", row)
            for i, row in enumerate(json.loads((self.bundle.root / DATA_NAME).read_text(encoding="utf-8"))[split])
        ]
        return self.dataset_from_rows(rows, DEFAULT_DATA if data is None else data)
