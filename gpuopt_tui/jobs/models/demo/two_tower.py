"""The demo two-tower news recommender: which of the candidate titles will this reader click?

A small BERT-style encoder (built from a `BertConfig`) turns each title into a vector (masked mean of its last
hidden states). The user vector is a linear map of the mean of the reader's history title vectors; a
candidate's score is dot(user, candidate). Batches hold ``input_ids`` / ``attention_mask``
[N, n_candidates, seq] (the attributed candidate titles), ``history_ids`` / ``history_mask`` [N, history, seq]
and ``labels`` [N] (the clicked candidate); logits are [N, n_candidates].

The user vector does not depend on the candidates, so `encode_context` computes it once per batch and
`logits_from_embeds` reuses it for every interpolation step; `logits` recomputes it from the history.

Synthetic data: six topics with their own words; each reader likes one or two topics, has read four titles
about them, and clicks the one candidate (of four) on a liked topic. Integrated Gradients should rank the
clicked title's topic words highest; 2% of training clicks are moved to a wrong candidate on purpose
(indices in the manifest and `dataset("train").meta["flipped"]`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpuopt_tui.core.demo_architectures import config_sizes
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.common import DataSection
from gpuopt_tui.jobs.context import StageFn, no_stage
from gpuopt_tui.jobs.data import Row, TextDataset, field_value, read_labels
from gpuopt_tui.jobs.models.base import Adapter, Batch
from gpuopt_tui.jobs.models.demo.bundle import DemoBundle, save_splits
from gpuopt_tui.jobs.models.demo.train import TrainPlan, train
from gpuopt_tui.jobs.models.hf import (
    TOKENIZER_STAGE,
    TRANSFORMERS_STAGE,
    WEIGHTS_STAGE,
    prepared_attention_mask,
    quiet_progress_bars,
)

TOPICS = {
    "sports": "match goal team coach league striker season stadium trophy referee",
    "politics": "election senate vote minister policy campaign parliament governor ballot reform",
    "tech": "software chip startup robot cloud app laptop algorithm network battery",
    "food": "recipe chef bakery pasta dessert spice kitchen cheese soup vegan",
    "travel": "airline hotel beach island passport cruise museum resort flight hiking",
    "music": "album concert guitar singer band festival piano lyrics tour orchestra",
}
COMMON = [
    "the",
    "a",
    "new",
    "after",
    "over",
    "why",
    "how",
    "big",
    "top",
    "best",
    "first",
    "report",
    "says",
    "year",
    "week",
    "plans",
    "more",
    "local",
    "world",
    "day",
    "inside",
    "guide",
    "latest",
    "fans",
    "could",
    "will",
    "can",
    "set",
    "to",
    "for",
    "in",
    "on",
    "with",
    "at",
    "record",
    "wins",
    "shows",
    "makes",
    "future",
    "change",
]
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
N_CANDIDATES, N_HISTORY = 4, 4
N_TRAIN, N_TEST = 800, 300
FLIP_FRACTION = 0.02
PLAN = TrainPlan(epochs=4, batch_size=32, lr=3e-3, checkpoint_epochs=(2, 3, 4))
HISTORY_KEY = "history"


class TwoTowerModel(nn.Module):
    """Title encoder shared by both towers; user = Linear(mean of history title vectors)."""

    def __init__(self, config: Any) -> None:
        from transformers import BertModel

        super().__init__()
        self.config = config
        self.encoder = BertModel(config, add_pooling_layer=False)
        self.user_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.get_input_embeddings()

    def encode_titles(
        self,
        attention_mask: Tensor,
        input_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> Any:
        """Title vectors [*lead, hidden] for titles [*lead, seq] (ids or word embeddings [*lead, seq, hidden]);
        with `output_hidden_states`, also the encoder's per-layer states reshaped to [*lead, seq, hidden]."""
        lead, seq = attention_mask.shape[:-1], attention_mask.shape[-1]
        mask = attention_mask.reshape(-1, seq)
        # empty titles (history padding) keep one visible position so attention never sees an all-masked row
        safe = torch.cat([torch.ones_like(mask[:, :1]), mask[:, 1:]], dim=1)
        out = self.encoder(
            input_ids=None if input_ids is None else input_ids.reshape(-1, seq),
            inputs_embeds=None if inputs_embeds is None else inputs_embeds.reshape(-1, seq, inputs_embeds.shape[-1]),
            attention_mask=prepared_attention_mask(safe, self.encoder),
            output_hidden_states=output_hidden_states,
        )
        weights = mask.unsqueeze(-1).to(out.last_hidden_state.dtype)
        pooled = (out.last_hidden_state * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        vectors = pooled.reshape(*lead, -1)
        if not output_hidden_states:
            return vectors
        return vectors, [h.reshape(*lead, seq, h.shape[-1]) for h in out.hidden_states]

    def user_vector(self, history_ids: Tensor, history_mask: Tensor) -> Tensor:
        """[N, hidden] from the history titles [N, H, seq]; empty history slots are left out of the mean."""
        titles = self.encode_titles(history_mask, input_ids=history_ids)
        present = history_mask.amax(-1).unsqueeze(-1).to(titles.dtype)  # [N, H, 1]
        mean = (titles * present).sum(1) / present.sum(1).clamp(min=1.0)
        return self.user_proj(mean)

    def forward(
        self,
        attention_mask: Tensor,
        input_ids: Tensor | None = None,
        history_ids: Tensor | None = None,
        history_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        user: Tensor | None = None,
    ) -> Tensor:
        """Scores [N, C] of candidates [N, C, seq] (ids or embeddings); the user vector is recomputed from
        the history unless given."""
        if user is None:
            if history_ids is None or history_mask is None:
                raise ValueError("give either the user vector or the history")
            user = self.user_vector(history_ids, history_mask)
        candidates = self.encode_titles(attention_mask, input_ids=input_ids, inputs_embeds=inputs_embeds)
        return torch.einsum("nch,nh->nc", candidates, user.to(candidates.dtype))


class TwoTowerAdapter(Adapter):
    """Adapter for `TwoTowerModel`: attributes candidate titles, caches the user vector per batch."""

    input_rank = 2

    def __init__(
        self,
        name: str,
        model: TwoTowerModel,
        tokenizer: Any,
        device: torch.device,
        num_candidates: int = N_CANDIDATES,
        **kw: Any,
    ) -> None:
        super().__init__(name, model, tokenizer, num_candidates, device, **kw)
        self.token_fields = {"input_ids": "attention_mask", "history_ids": "history_mask"}

    def model_inputs(self, batch: Mapping[str, Tensor]) -> dict[str, Any]:
        keys = ("input_ids", "attention_mask", "history_ids", "history_mask")
        return {k: batch[k] for k in keys}

    def encode_context(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {"user": self.model.user_vector(batch["history_ids"], batch["history_mask"])}

    def logits_from_embeds(
        self, inputs_embeds: Tensor, attention_mask: Tensor, context: Mapping[str, Tensor]
    ) -> Tensor:
        if "user" not in context:
            raise ValueError("the two-tower adapter needs encode_context(batch) as the context")
        return self.model(attention_mask, inputs_embeds=inputs_embeds, user=context["user"])

    def hidden_states(self, batch: Mapping[str, Tensor]) -> list[Tensor]:
        _, states = self.model.encode_titles(
            batch["attention_mask"], input_ids=batch["input_ids"], output_hidden_states=True
        )
        return states

    def tokenize_groups(self, groups: Sequence[Sequence[str]], max_length: int) -> tuple[Tensor, Tensor]:
        """Ids and mask [N, G, seq] for N groups of titles (G = the largest group; missing titles are empty)."""
        width = max(len(g) for g in groups)
        flat = [title for g in groups for title in g]
        enc = self.tokenize(flat, max_length)
        seq = enc["input_ids"].shape[1]
        ids = torch.full((len(groups), width, seq), self.special_ids.pad or 0, dtype=torch.long)
        mask = torch.zeros(len(groups), width, seq, dtype=torch.long)
        row = 0
        for n, group in enumerate(groups):
            ids[n, : len(group)] = enc["input_ids"][row : row + len(group)]
            mask[n, : len(group)] = enc["attention_mask"][row : row + len(group)]
            row += len(group)
        return ids, mask

    def dataset_from_rows(self, rows: Sequence[Row], data: DataSection) -> TextDataset:
        """Rows with data.text_field = the candidate titles, "history" = the titles read before, and
        data.label_field = the index of the clicked candidate (optional)."""
        candidates = [_titles(row, data.text_field) for row in rows]
        histories = [_titles(row, HISTORY_KEY) for row in rows]
        count = len(candidates[0])
        for row, group in zip(rows, candidates):
            if len(group) != count:
                raise UserError(f'{row[0]}: "{data.text_field}" has {len(group)} candidates, the first row has {count}')
        ids, mask = self.tokenize_groups(candidates, data.max_length)
        history_ids, history_mask = self.tokenize_groups(histories, data.max_length)
        tensors = {"input_ids": ids, "attention_mask": mask, "history_ids": history_ids, "history_mask": history_mask}
        labels = read_labels(rows, data.label_field, count)
        if labels is not None:
            tensors["labels"] = labels
        origin = rows[0][0].rsplit(":", 1)[0]
        return TextDataset(tensors, candidates, dict(self.token_fields), origin)


def _titles(row: Row, key: str) -> list[str]:
    value = field_value(row, key)
    if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
        raise UserError(f'{row[0]}: "{key}" must be a non-empty list of title strings')
    return value


# --- the demo ------------------------------------------------------------------------------------------------
def vocabulary() -> list[str]:
    topic_words = [w for words in TOPICS.values() for w in words.split()]
    return [*SPECIAL, *topic_words, *COMMON]


def make_title(topic: str, rng: random.Random) -> str:
    words = rng.sample(TOPICS[topic].split(), rng.randint(2, 3)) + rng.sample(COMMON, rng.randint(1, 3))
    rng.shuffle(words)
    return " ".join(words)


def make_impressions(n: int, rng: random.Random) -> list[dict[str, Any]]:
    """Readers with one or two liked topics, four history titles about them, four candidates of which the
    one on a liked topic is clicked."""
    topics = list(TOPICS)
    out = []
    for _ in range(n):
        liked = rng.sample(topics, rng.randint(1, 2))
        history = [make_title(rng.choice(liked), rng) for _ in range(N_HISTORY)]
        others = rng.sample([t for t in topics if t not in liked], N_CANDIDATES - 1)
        clicked = rng.randrange(N_CANDIDATES)
        cand_topics = [*others[:clicked], rng.choice(liked), *others[clicked:]]
        out.append({"history": history, "candidates": [make_title(t, rng) for t in cand_topics], "label": clicked})
    return out


def build_config() -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=len(vocabulary()),
        **config_sizes("two_tower"),
        pad_token_id=0,
    )


def build_tokenizer() -> Any:
    from transformers import BertTokenizer

    return BertTokenizer(vocab={word: i for i, word in enumerate(vocabulary())})


def build(root: Path, seed: int, on_step: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Generate impressions, train (`on_step(done, total)` after each step), save model, checkpoints and data
    under `root`; returns manifest fields."""
    quiet_progress_bars()
    rng = random.Random(seed)
    train_rows, test_rows = make_impressions(N_TRAIN, rng), make_impressions(N_TEST, rng)
    flipped = sorted(rng.sample(range(N_TRAIN), round(N_TRAIN * FLIP_FRACTION)))
    for i in flipped:
        row = train_rows[i]
        row["label"] = rng.choice([c for c in range(N_CANDIDATES) if c != row["label"]])

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TwoTowerModel(build_config())
    adapter = TwoTowerAdapter("demo two-tower", model, build_tokenizer(), torch.device("cpu"))
    data = DataSection(text_field="candidates", label_field="label")
    sets = {
        split: adapter.dataset_from_rows([(f"{split}:{i}", r) for i, r in enumerate(rows)], data)
        for split, rows in (("train", train_rows), ("test", test_rows))
    }

    def loss_fn(batch: Batch) -> Tensor:
        return F.cross_entropy(adapter.logits(batch), batch["labels"])

    checkpoints, seconds = train(
        model, loss_fn, sets["train"].tensors, adapter.token_fields, PLAN, root / "checkpoints", seed, on_step
    )
    with torch.no_grad():
        test_pred = adapter.logits(sets["test"].tensors).argmax(-1)
    model_dir = root / "model"
    model.config.save_pretrained(model_dir)
    adapter.tokenizer.save_pretrained(model_dir)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(model_dir / "model.safetensors"))
    save_splits(root, {split: (ds.tensors, ds.texts) for split, ds in sets.items()})
    return {
        "kind": "two_tower",
        "seed": seed,
        "rule": "the reader clicks the one candidate on a topic of their history",
        "topics": {name: words.split() for name, words in TOPICS.items()},
        "flipped": flipped,
        "checkpoints": checkpoints,
        "train_seconds": round(seconds, 2),
        "test_accuracy": (test_pred == sets["test"].tensors["labels"]).float().mean().item(),
        "torch": torch.__version__,
    }


class DemoAdapter(TwoTowerAdapter):
    """The demo recommender with its built-in impressions and training checkpoints."""

    def __init__(self, bundle: DemoBundle, device: torch.device, stage: StageFn = no_stage) -> None:
        stage(TRANSFORMERS_STAGE)
        from transformers import AutoTokenizer, BertConfig

        stage("building the model (importing its transformers modules: bert)")
        model = TwoTowerModel(BertConfig.from_pretrained(bundle.model_dir))
        stage(TOKENIZER_STAGE)
        tokenizer = AutoTokenizer.from_pretrained(bundle.model_dir, local_files_only=True)
        stage(WEIGHTS_STAGE)
        keep = ("rule", "topics", "flipped", "test_accuracy")
        super().__init__(
            "demo two-tower",
            model,
            tokenizer,
            device,
            checkpoints=bundle.checkpoints,
            info={k: bundle.manifest[k] for k in keep},
        )
        self.load_weights(bundle.model_dir / "model.safetensors")
        self.bundle = bundle
        self.weights_dir = bundle.model_dir

    def builtin_dataset(self, split: str, data: DataSection | None = None) -> TextDataset:
        """The split as tokenized when the demo was built (`data` names no fields of it)."""
        return self.bundle.dataset(split, self.token_fields)
