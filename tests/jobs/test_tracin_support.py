"""Tiny real models, datasets and checkpoints for the TracIn tests, plus the naive reference.

The reference differentiates one example at a time with `loss.backward()` and sums lr * <g_train, g_test>
over the checkpoints: nothing shared with the engine but the adapter's loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

from gpuopt_tui.jobs.data import TextDataset
from gpuopt_tui.jobs.models.base import Adapter, Batch, Checkpoint
from gpuopt_tui.jobs.models.demo.train import TrainPlan
from gpuopt_tui.jobs.models.demo.train import train as train_model
from gpuopt_tui.jobs.models.hf import SequenceClassifierAdapter

VOCAB = 60
CPU = torch.device("cpu")
LRS = (0.5, 0.3, 0.1)


class VmapSafeBert(SequenceClassifierAdapter):
    """Passes the padding mask as a ready [N, 1, 1, S] boolean mask: Hugging Face's 2-D mask handling looks
    at the mask's values (`.all()`), which torch.func.vmap cannot trace."""

    def model_inputs(self, batch: Batch) -> dict[str, Tensor]:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"].bool()[:, None, None, :]}


def bert_adapter(
    dtype: torch.dtype = torch.float32,
    num_labels: int = 3,
    seed: int = 0,
    init_std: float = 0.3,  # large, so that gradients are far from zero
    device: torch.device = CPU,
) -> Adapter:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=num_labels,
        initializer_range=init_std,
    )
    model = BertForSequenceClassification(config).to(dtype)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(words)})
    return VmapSafeBert("tiny-bert", model, tokenizer, num_labels, device)


def text_dataset(adapter: Adapter, n: int, seed: int, seq: int = 10) -> TextDataset:
    """Random token sequences of varied length ([CLS] ... [SEP], right-padded) with random labels."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (n, seq), generator=gen)
    lengths = torch.randint(4, seq + 1, (n,), generator=gen)
    mask = (torch.arange(seq)[None] < lengths[:, None]).long()
    ids[:, 0] = 2
    ids[torch.arange(n), lengths - 1] = 3
    ids = ids * mask
    labels = torch.randint(0, adapter.num_labels, (n,), generator=gen)
    texts = [" ".join(f"w{int(t) - 5}" for t in row[1 : int(length) - 1]) for row, length in zip(ids, lengths)]
    tensors = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return TextDataset(tensors, texts, dict(adapter.token_fields), f"random-{seed}")


def save_checkpoints(
    adapter: Adapter, folder: Path, lrs: Sequence[float] = LRS, scale: float = 0.1
) -> list[Checkpoint]:
    """Perturbed copies of the model's weights as safetensors files, one per learning rate."""
    gen = torch.Generator().manual_seed(123)
    state = {k: v.detach().cpu().clone() for k, v in adapter.model.state_dict().items()}
    out = []
    for i, lr in enumerate(lrs):
        noisy = {
            k: (v + scale * torch.randn(v.shape, generator=gen, dtype=v.dtype) if v.is_floating_point() else v)
            for k, v in state.items()
        }
        path = folder / f"ckpt{i}.safetensors"
        save_file({k: v.contiguous() for k, v in noisy.items()}, str(path))
        out.append(Checkpoint(path, lr))
    return out


def trained_bert(
    folder: Path, device: torch.device = CPU, n_train: int = 96, n_test: int = 8
) -> tuple[Adapter, list[Checkpoint], TextDataset, TextDataset]:
    """A tiny BERT with the default initialisation trained on a task it learns in seconds (token w0 at position
    1 means label 1, token w1 label 0), three checkpoints saved during training with their learning rates,
    and the training and test sets."""
    adapter = bert_adapter(torch.float32, num_labels=2, init_std=0.02, device=device)
    train, test = labelled_by_token(adapter, n_train, seed=21), labelled_by_token(adapter, n_test, seed=22)
    plan = TrainPlan(epochs=6, batch_size=16, lr=3e-3, checkpoint_epochs=(2, 4, 6))
    tensors = {k: v.to(device) for k, v in train.tensors.items()}
    records, _ = train_model(
        adapter.model,
        lambda batch: adapter.loss_per_example(batch).mean(),
        tensors,
        adapter.token_fields,
        plan,
        folder / "trained",
        seed=0,
    )
    return adapter, [Checkpoint(folder / r["file"], r["lr"]) for r in records], train, test


def labelled_by_token(adapter: Adapter, n: int, seed: int) -> TextDataset:
    ds = text_dataset(adapter, n, seed)
    ids, labels = ds.tensors["input_ids"], ds.tensors["labels"]
    ids[(ids == 5) | (ids == 6)] = 7
    ids[:, 1] = torch.where(labels == 1, 5, 6)
    return ds


def naive_gradients(adapter: Adapter, ds: TextDataset, names: Sequence[str]) -> Tensor:
    """[N, P] flattened gradients, one loss.backward() per example."""
    params = dict(adapter.model.named_parameters())
    rows = []
    for i in range(len(ds)):
        adapter.model.zero_grad(set_to_none=True)
        adapter.loss_per_example(ds.batch([i])).sum().backward()
        rows.append(torch.cat([_grad_or_zero(params[n]).reshape(-1) for n in names]))
    adapter.model.zero_grad(set_to_none=True)
    return torch.stack(rows)


def _grad_or_zero(p: nn.Parameter) -> Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def naive_tracin(
    adapter: Adapter, checkpoints: Sequence[Checkpoint], train: TextDataset, test: TextDataset, names: Sequence[str]
) -> tuple[Tensor, Tensor]:
    """Reference [n_test, n_train] scores and [n_train] self-influence."""
    scores = torch.zeros(len(test), len(train), dtype=torch.float64)
    selfinf = torch.zeros(len(train), dtype=torch.float64)
    for ckpt in checkpoints:
        adapter.load_weights(ckpt.path)
        g_train = naive_gradients(adapter, train, names).double()
        g_test = naive_gradients(adapter, test, names).double()
        scores += ckpt.lr * g_test @ g_train.T
        selfinf += ckpt.lr * g_train.square().sum(1)
    return scores, selfinf


def max_rel_error(values: Tensor, reference: Tensor) -> float:
    """Largest |difference| relative to the reference's largest magnitude."""
    return float((values.double() - reference.double()).abs().max() / reference.double().abs().max())


# --- a knowledge-graph link scorer trained with binary cross-entropy (as ConvE is) -----------------------------
class LinkScorer(nn.Module):
    """Scores every entity as the tail of (head, relation): 1-N scoring like ConvE, on a small MLP."""

    def __init__(self, n_entities: int, n_relations: int, dim: int = 8) -> None:
        super().__init__()
        self.entities = nn.Embedding(n_entities, dim)
        self.relations = nn.Embedding(n_relations, dim)
        self.hidden = nn.Linear(2 * dim, dim)
        self.decoder = nn.Linear(dim, n_entities)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = torch.cat([self.entities(input_ids[..., 0]), self.relations(input_ids[..., 1])], -1)
        return self.decoder(torch.relu(self.hidden(x)))


class LinkAdapter(Adapter):
    """Batches: input_ids [N, 2] = (head, relation), labels [N] = tail, entity_ids [N, 2] = (head, tail)."""

    smoothing = 0.1

    def model_inputs(self, batch: Batch) -> dict[str, Tensor]:
        return {"input_ids": batch["input_ids"]}

    def loss_from_logits(self, logits: Tensor, labels: Tensor) -> Tensor:
        n = logits.shape[-1]
        hot = torch.zeros_like(logits).scatter(-1, labels[..., None], 1.0)  # F.one_hot is not vmap-safe
        target = hot * (1 - self.smoothing) + self.smoothing / n
        return F.binary_cross_entropy_with_logits(logits, target, reduction="none").mean(-1)

    def classifier_head(self) -> tuple[str, nn.Linear]:
        return "decoder", self.model.decoder


def link_adapter(dtype: torch.dtype = torch.float64, n_entities: int = 12, n_relations: int = 3) -> LinkAdapter:
    torch.manual_seed(1)
    model = LinkScorer(n_entities, n_relations).to(dtype)
    no_tokens = SimpleNamespace(
        pad_token_id=None, mask_token_id=None, cls_token_id=None, sep_token_id=None, unk_token_id=None
    )
    return LinkAdapter("link-scorer", model, no_tokens, n_entities, torch.device("cpu"))


def triples(adapter: LinkAdapter, n: int, seed: int) -> TextDataset:
    gen = torch.Generator().manual_seed(seed)
    n_ent, n_rel = adapter.model.entities.num_embeddings, adapter.model.relations.num_embeddings
    head = torch.randint(0, n_ent, (n,), generator=gen)
    rel = torch.randint(0, n_rel, (n,), generator=gen)
    tail = torch.randint(0, n_ent, (n,), generator=gen)
    tensors = {
        "input_ids": torch.stack([head, rel], 1),
        "attention_mask": torch.ones(n, 2, dtype=torch.long),
        "labels": tail,
        "entity_ids": torch.stack([head, tail], 1),
    }
    texts = [f"e{h} r{r} e{t}" for h, r, t in zip(head.tolist(), rel.tolist(), tail.tolist())]
    return TextDataset(tensors, texts, dict(adapter.token_fields), f"triples-{seed}")


def assert_top_proponents(records: list[dict[str, Any]], matrix: Tensor) -> None:
    """Each record's two proponents are the top two of its row of `matrix` (the engine's scores), to 1e-4."""
    for i, record in enumerate(records):
        top = matrix[i].argsort(descending=True)[:2].tolist()
        assert [n["index"] for n in record["proponents"]] == top
        got = torch.tensor([n["score"] for n in record["proponents"]], dtype=torch.float64)
        assert max_rel_error(got, matrix[i, top]) < 1e-4
