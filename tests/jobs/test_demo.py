"""The built-in demo models: training, caching, and the facts the engines use as oracles.

The oracle checks here use small independent computations (a plain Riemann IG loop, last-layer gradient
norms, a logistic probe) so that the demo's promises are verified apart from the engines.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.paths import cache_dir
from gpuopt_tui.core.profiles.common import DataSection, ModelSection
from gpuopt_tui.jobs.data import load_dataset
from gpuopt_tui.jobs.models import Adapter, load_adapter
from gpuopt_tui.jobs.models.demo import BUILD_STAGE, classifier, demo_bundle, load_demo_adapter, two_tower
from gpuopt_tui.jobs.models.demo.cache import MANIFEST, ensure_built, read_manifest
from gpuopt_tui.jobs.models.hf import load_hf_adapter

CPU = torch.device("cpu")


def rule_label(text: str) -> int:
    """The demo classifier's labelling rule, recomputed from the text: the first opinion word decides."""
    for word in text.split():
        if word in classifier.POSITIVE:
            return 1
        if word in classifier.NEGATIVE:
            return 0
    raise AssertionError(f"no opinion word in {text!r}")


# --- classifier ------------------------------------------------------------------------------------------------
def test_classifier_trains_and_records_its_oracles(demo_classifier: Adapter) -> None:
    bundle = demo_bundle("classifier", cache_dir())
    manifest = bundle.manifest
    print(f"demo classifier: {manifest['train_seconds']} s training, test accuracy {manifest['test_accuracy']:.3f}")
    assert manifest["test_accuracy"] >= 0.95

    test = demo_classifier.builtin_dataset("test")
    assert len(test) == classifier.N_TEST
    assert test.labels.tolist() == [rule_label(t) for t in test.texts]
    with torch.no_grad():
        accuracy = (demo_classifier.logits(test.tensors).argmax(-1) == test.labels).float().mean().item()
    assert accuracy == pytest.approx(manifest["test_accuracy"])

    train = demo_classifier.builtin_dataset("train")
    flipped = train.meta["flipped"]
    assert flipped == demo_classifier.info["flipped"] == sorted(set(flipped))
    assert len(flipped) == round(classifier.N_TRAIN * classifier.FLIP_FRACTION)
    disagree = [i for i, t in enumerate(train.texts) if rule_label(t) != train.labels[i]]
    assert disagree == flipped

    checkpoints = demo_classifier.checkpoints
    assert len(checkpoints) >= 3 and all(c.path.is_file() for c in checkpoints)
    lrs = [c.lr for c in checkpoints]
    assert all(lr > 0 for lr in lrs) and lrs == sorted(lrs, reverse=True)
    assert demo_classifier.label_names == ["negative", "positive"]


def test_cache_is_reused_and_loads_as_a_plain_hf_model(demo_classifier: Adapter) -> None:
    again = demo_bundle("classifier", cache_dir())
    assert not again.built_now
    other = load_demo_adapter("classifier", CPU, cache_dir())
    for (name, a), (_, b) in zip(demo_classifier.model.state_dict().items(), other.model.state_dict().items()):
        assert torch.equal(a, b), name
    hf = load_hf_adapter(again.model_dir, CPU)
    batch = demo_classifier.builtin_dataset("test").batch(range(8))
    with torch.no_grad():
        torch.testing.assert_close(hf.logits(batch), demo_classifier.logits(batch))
    via_profile = load_dataset(DataSection(source="demo", split="train"), demo_classifier)
    assert len(via_profile) == classifier.N_TRAIN


def test_incomplete_cache_is_detected(demo_classifier: Adapter, tmp_path: Path) -> None:
    bundle = demo_bundle("classifier", cache_dir())
    version = bundle.manifest["version"]
    damages = {
        "manifest cut short": lambda root: (root / MANIFEST).write_text('{"version": 1, "fi'),
        "manifest missing": lambda root: (root / MANIFEST).unlink(),
        "checkpoint missing": lambda root: next((root / "checkpoints").iterdir()).unlink(),
        "weights truncated": lambda root: (root / "model" / "model.safetensors").write_bytes(b"\0" * 16),
    }
    for what, damage in damages.items():
        copy = tmp_path / what.replace(" ", "-")
        shutil.copytree(bundle.root, copy)
        assert read_manifest(copy, version) is not None
        damage(copy)
        assert read_manifest(copy, version) is None, what
    assert read_manifest(bundle.root, version + 1) is None


def test_a_builder_waiting_for_another_says_so(tmp_path: Path) -> None:
    root = tmp_path / "demo" / "toy-v1"
    building, waiting = threading.Event(), threading.Event()

    def slow(tmp: Path) -> dict:  # holds the lock until the second builder says that it waits
        building.set()
        assert waiting.wait(30)
        (tmp / "weights.bin").write_bytes(b"w")
        return {}

    def never(tmp: Path) -> dict:
        raise AssertionError("built twice")

    first = threading.Thread(target=lambda: ensure_built(root, 1, slow))
    first.start()
    assert building.wait(30)
    manifest, built = ensure_built(root, 1, never, on_wait=waiting.set)
    first.join()
    assert waiting.is_set() and not built and manifest["files"] == {"weights.bin": 1}


def test_ensure_built_rebuilds_and_serialises_builders(tmp_path: Path) -> None:
    root = tmp_path / "demo" / "toy-v1"
    calls: list[int] = []

    def build(tmp: Path) -> dict:
        calls.append(1)
        threading.Event().wait(0.2)  # long enough for the other builders to queue on the lock
        (tmp / "weights.bin").write_bytes(b"w" * 100)
        return {"answer": 42}

    results = []
    threads = [threading.Thread(target=lambda: results.append(ensure_built(root, 1, build))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert sorted(built for _, built in results) == [False, False, True]
    assert all(m["answer"] == 42 and m["files"] == {"weights.bin": 100} for m, _ in results)

    (root / MANIFEST).write_text("{garbage")
    manifest, built = ensure_built(root, 1, build)
    assert built and len(calls) == 2 and json.loads((root / MANIFEST).read_text()) == manifest
    assert [p.name for p in root.parent.iterdir() if p.name.startswith(".toy-v1.") and p.is_dir()] == []

    def failing(tmp: Path) -> dict:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("interrupted")

    (root / MANIFEST).unlink()
    with pytest.raises(RuntimeError, match="interrupted"):
        ensure_built(root, 1, failing)
    assert read_manifest(root, 1) is None  # nothing half-built was put in place
    assert [p.name for p in root.parent.iterdir() if p.is_dir() and p.name != "toy-v1"] == []


def test_unknown_demo_kind() -> None:
    with pytest.raises(UserError, match='demo model "regressor"'):
        demo_bundle("regressor", cache_dir())


def test_bad_demo_split(demo_classifier: Adapter) -> None:
    with pytest.raises(UserError, match='split "dev"'):
        demo_classifier.builtin_dataset("dev")


def test_integrated_gradients_put_the_opinion_words_on_top(demo_classifier: Adapter) -> None:
    adapter = demo_classifier
    batch = adapter.builtin_dataset("test").batch(range(64))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    emb = adapter.word_embeddings()
    x = emb(ids).detach()
    structural = (ids == adapter.special_ids.cls) | (ids == adapter.special_ids.sep)
    base = torch.where(structural.unsqueeze(-1), x, emb(torch.full_like(ids, adapter.special_ids.pad)).detach())
    with torch.no_grad():
        target = adapter.logits(batch).argmax(-1, keepdim=True)
    steps, grads = 32, torch.zeros_like(x)
    for k in range(steps):
        point = (base + (k + 0.5) / steps * (x - base)).requires_grad_()
        out = adapter.logits_from_embeds(point, mask, {}).gather(1, target).sum()
        grads += torch.autograd.grad(out, point)[0] / steps
    attributions = ((x - base) * grads).sum(-1) * mask
    top = ids.gather(1, attributions.abs().argmax(1, keepdim=True)).squeeze(1)
    opinion = set(adapter.tokenizer.convert_tokens_to_ids(adapter.info["signal_tokens"]))
    share = sum(int(t) in opinion for t in top) / len(top)
    print(f"IG: the top token is an opinion word in {share:.0%} of 64 test reviews")
    assert share >= 0.9


def test_last_layer_self_influence_ranks_the_flipped_labels_first() -> None:
    adapter = load_demo_adapter("classifier", CPU, cache_dir())  # its own copy: weights are swapped below
    train = adapter.builtin_dataset("train")
    bert, pooler, head = adapter.model.bert, adapter.model.bert.pooler, adapter.model.classifier
    params = {f"pooler.{n}": p for n, p in pooler.named_parameters()} | {
        f"head.{n}": p for n, p in head.named_parameters()
    }

    def loss(p: dict, cls: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        pooled = torch.tanh(F.linear(cls, p["pooler.dense.weight"], p["pooler.dense.bias"]))
        return F.cross_entropy(F.linear(pooled, p["head.weight"], p["head.bias"]), label)

    per_example = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))
    self_influence = torch.zeros(len(train))
    for checkpoint in adapter.checkpoints:
        adapter.load_weights(checkpoint.path)
        with torch.no_grad():
            cls = bert(input_ids=train.tensors["input_ids"], attention_mask=train.tensors["attention_mask"])[0][:, 0]
            frozen = {n: v.detach() for n, v in params.items()}
        grads = per_example(frozen, cls, train.labels)
        self_influence += checkpoint.lr * sum(g.flatten(1).square().sum(1) for g in grads.values())
    flipped = set(train.meta["flipped"])
    top = set(self_influence.topk(2 * len(flipped)).indices.tolist())
    found = len(flipped & top) / len(flipped)
    print(f"TracIn (pooler + classifier): {found:.0%} of the flipped labels among the top {2 * len(flipped)}")
    assert found >= 0.8


def test_the_order_signal_appears_after_the_embeddings(demo_classifier: Adapter) -> None:
    """Mean-pooled embeddings carry no label information (both classes hold one word of each polarity);
    attention layers combine the order, so a linear probe goes from chance to near perfect."""

    def features(split: str) -> tuple[list[torch.Tensor], torch.Tensor]:
        ds = demo_classifier.builtin_dataset(split)
        with torch.no_grad():
            states = demo_classifier.hidden_states(ds.tensors)
        m = ds.tensors["attention_mask"].unsqueeze(-1).float()
        return [(h * m).sum(1) / m.sum(1) for h in states], ds.labels

    (train_x, train_y), (test_x, test_y) = features("train"), features("test")
    accuracies = []
    for layer_train, layer_test in zip(train_x, test_x):
        mu, sd = layer_train.mean(0), layer_train.std(0) + 1e-6
        probe = torch.nn.Linear(layer_train.shape[1], 2)
        optimizer = torch.optim.Adam(probe.parameters(), lr=1e-2)
        for _ in range(200):
            optimizer.zero_grad()
            F.cross_entropy(probe((layer_train - mu) / sd), train_y).backward()
            optimizer.step()
        with torch.no_grad():
            accuracies.append((probe((layer_test - mu) / sd).argmax(-1) == test_y).float().mean().item())
    print("linear probe accuracy per layer:", [round(a, 3) for a in accuracies])
    assert len(accuracies) == 5
    assert accuracies[0] < 0.65
    assert min(accuracies[2:]) > 0.95


def test_load_adapter_builds_the_demo(demo_classifier: Adapter) -> None:
    adapter = load_adapter(ModelSection(adapter="demo", demo="classifier"), CPU, cache_dir())
    assert adapter.name == "demo classifier" and adapter.num_labels == 2


# --- two-tower -----------------------------------------------------------------------------------------------------
def test_two_tower_trains(demo_two_tower: Adapter) -> None:
    manifest = demo_bundle("two_tower", cache_dir()).manifest
    print(f"demo two-tower: {manifest['train_seconds']} s training, test accuracy {manifest['test_accuracy']:.3f}")
    assert manifest["test_accuracy"] >= 0.85  # chance is 1 / 4
    train = demo_two_tower.builtin_dataset("train")
    assert train.tensors["input_ids"].shape[:2] == (two_tower.N_TRAIN, two_tower.N_CANDIDATES)
    assert train.tensors["history_ids"].shape[:2] == (two_tower.N_TRAIN, two_tower.N_HISTORY)
    assert len(train.meta["flipped"]) == round(two_tower.N_TRAIN * two_tower.FLIP_FRACTION)
    assert len(demo_two_tower.checkpoints) >= 3
    assert demo_two_tower.input_rank == 2


def test_two_tower_cached_user_vector_gives_the_uncached_logits(demo_two_tower: Adapter) -> None:
    adapter = demo_two_tower
    batch = adapter.builtin_dataset("test").batch(range(16))
    with torch.no_grad():
        uncached = adapter.logits(batch)  # user vector recomputed from the history inside the forward
        context = adapter.encode_context(batch)
        embeds = adapter.word_embeddings()(batch["input_ids"])
        cached = adapter.logits_from_embeds(embeds, batch["attention_mask"], context)
        functional = adapter.functional_logits(dict(adapter.model.named_parameters()), batch)
    assert context["user"].shape == (16, 64)
    assert uncached.shape == (16, two_tower.N_CANDIDATES)
    torch.testing.assert_close(cached, uncached)
    torch.testing.assert_close(functional, uncached)
    other_history = {
        **batch,
        "history_ids": batch["history_ids"].roll(1, 0),
        "history_mask": batch["history_mask"].roll(1, 0),
    }
    with torch.no_grad():
        assert not torch.allclose(adapter.logits(other_history), uncached)  # the history matters


def test_two_tower_per_example_gradients_and_hidden_states(demo_two_tower: Adapter) -> None:
    adapter = demo_two_tower
    batch = adapter.builtin_dataset("train").batch(range(3))
    chosen = ("user_proj.weight", "encoder.encoder.layer.0.attention.self.query.weight")
    params = {n: p.detach() for n, p in adapter.model.named_parameters() if n in chosen}

    def one(p, example):
        return adapter.functional_loss(p, {k: v.unsqueeze(0) for k, v in example.items()})[0]

    grads = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0))(params, batch)
    named = dict(adapter.model.named_parameters())
    for i in range(3):
        adapter.model.zero_grad()
        adapter.loss_per_example({k: v[i : i + 1] for k, v in batch.items()})[0].backward()
        for n in chosen:
            torch.testing.assert_close(grads[n][i], named[n].grad, rtol=1e-4, atol=1e-6)
    adapter.model.zero_grad()
    with torch.no_grad():
        states = adapter.hidden_states(batch)
    assert len(states) == 3
    assert all(s.shape == (*batch["input_ids"].shape, 64) for s in states)


def test_two_tower_reads_jsonl_impressions(demo_two_tower: Adapter, tmp_path: Path) -> None:
    rows = [
        {
            "history": ["team wins the match", "coach says"],
            "candidates": ["new chip", "the goal", "soup", "hotel"],
            "label": 1,
        },
        {"history": ["album of the year"], "candidates": ["band tour", "vote", "robot", "beach"], "label": 0},
    ]
    path = tmp_path / "impressions.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    section = DataSection(source="jsonl", path=str(path), text_field="candidates")
    ds = load_dataset(section, demo_two_tower)
    assert ds.tensors["input_ids"].shape[:2] == (2, 4)
    assert ds.tensors["history_mask"].shape[:2] == (2, 2)
    assert ds.tensors["history_mask"][1, 1].sum() == 0  # the second reader has one title: the slot is empty
    with torch.no_grad():
        assert demo_two_tower.logits(ds.tensors).argmax(-1).tolist() == [1, 0]
    rows[1]["candidates"] = ["band tour", "vote"]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(UserError, match=r'impressions\.jsonl:2: "candidates" has 2 candidates, the first row has 4'):
        load_dataset(section, demo_two_tower)
    path.write_text(json.dumps({"candidates": ["a"], "label": 0}))
    with pytest.raises(UserError, match=r'impressions\.jsonl:1: missing key "history"'):
        load_dataset(section, demo_two_tower)


def test_demo_weights_depend_only_on_the_seed(demo_classifier, tmp_path) -> None:
    """Dropout draws from torch's global generator: whatever ran before must not change the demo."""
    import torch
    from safetensors.torch import load_file

    from gpuopt_tui.jobs.models.demo import demo_bundle

    torch.manual_seed(12345)
    torch.rand(1000)
    said: list[tuple[str, int | None, int | None, str]] = []

    def stage(name: str, done: int | None = None, total: int | None = None, unit: str = "steps") -> None:
        said.append((name, done, total, unit))

    again = demo_bundle("classifier", tmp_path, stage=stage)
    # the build is a stage of the run, counted in training steps from its start to its last step
    assert said[0][0] == BUILD_STAGE and said[0][1] is None
    steps = said[1:]
    assert {s[0] for s in steps} == {BUILD_STAGE} and {s[3] for s in steps} == {"training steps"}
    assert [s[1] for s in steps] == list(range(1, len(steps) + 1)) and {s[2] for s in steps} == {len(steps)}
    ours, theirs = load_file(str(demo_classifier.checkpoints[-1].path)), load_file(str(again.checkpoints[-1].path))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
