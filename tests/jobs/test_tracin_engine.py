"""The TracIn engine's machinery: parameter choice, checkpoint order, out-of-memory halving, resume, filters,
top-k merging and memory clean-up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_tracin_support import (
    bert_adapter,
    link_adapter,
    max_rel_error,
    save_checkpoints,
    text_dataset,
    triples,
)
from torch import Tensor, nn

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.tracin import FILTER_CHOICES
from gpuopt_tui.jobs.context import JobCancelled
from gpuopt_tui.jobs.models.base import Adapter
from gpuopt_tui.jobs.tracin import (
    FILTERS,
    GradientComputer,
    MemoryStore,
    Reporter,
    TracInOptions,
    get_filter,
    modules_in_call_order,
    select_parameters,
    tracin_scores,
)
from gpuopt_tui.jobs.tracin.microbatch import Cleanup

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    adapter = bert_adapter(torch.float64)
    checkpoints = save_checkpoints(adapter, tmp_path_factory.mktemp("ckpt"))
    train, test = text_dataset(adapter, 13, seed=11), text_dataset(adapter, 4, seed=12)
    names = select_parameters(adapter, test.batch([0]), "last", 2)
    return adapter, checkpoints, train, test, names


class Recorder(Reporter):
    """Keeps events and progress; raises JobCancelled at the `cancel_at`-th micro-batch."""

    def __init__(self, cancel_at: int | None = None) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.progress_calls: list[tuple[int, int, str]] = []
        self.cancel_at = cancel_at
        self.checks = 0

    def progress(self, done: int, total: int, stage: str) -> None:
        self.progress_calls.append((done, total, stage))

    def event(self, type: str, **fields: Any) -> None:
        self.events.append((type, fields))

    def check_cancelled(self) -> None:
        self.checks += 1
        if self.cancel_at is not None and self.checks >= self.cancel_at:
            raise JobCancelled


def count_loads(monkeypatch: pytest.MonkeyPatch, adapter: Adapter) -> list[Path]:
    """Checkpoint files read (every load reads its file once, prefetched or not)."""
    loads: list[Path] = []
    original = adapter.read_weights

    def spy(path: Path) -> dict[str, Tensor]:
        loads.append(path)
        return original(path)

    monkeypatch.setattr(adapter, "read_weights", spy)
    return loads


# --- parameters ------------------------------------------------------------------------------------------------
class HeadFirst(nn.Module):
    """Registers its head before its trunk: "last" must follow the call order, not the registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 3)
        self.trunk = nn.Linear(5, 4)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.trunk(input_ids.double())))


class HeadFirstAdapter(Adapter):
    def model_inputs(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"input_ids": batch["input_ids"]}


def test_last_layers_follow_the_forward_call_order() -> None:
    model = HeadFirst().double()
    tokens = type(
        "NoTokens", (), dict.fromkeys(("pad_token_id", "mask_token_id", "cls_token_id", "sep_token_id", "unk_token_id"))
    )
    adapter = HeadFirstAdapter("head-first", model, tokens, 3, torch.device("cpu"))
    batch = {"input_ids": torch.randn(2, 5)}
    assert modules_in_call_order(adapter, batch) == ["trunk", "head"]
    assert select_parameters(adapter, batch, "last", 1) == ["head.weight", "head.bias"]


def test_parameter_choices(setup) -> None:
    adapter, _, _, test, _ = setup
    batch = test.batch([0])
    order = modules_in_call_order(adapter, batch)
    assert order[-2:] == ["bert.pooler.dense", "classifier"]
    assert order[0] == "bert.embeddings.word_embeddings"
    assert len(select_parameters(adapter, batch, "all")) == len(list(adapter.model.parameters()))
    named = select_parameters(adapter, batch, "names", names=["classifier", "bert.pooler.dense.bias"])
    assert named == ["bert.pooler.dense.bias", "classifier.weight", "classifier.bias"]
    with pytest.raises(UserError, match="did you mean.*classifier"):
        select_parameters(adapter, batch, "names", names=["clasifier"])
    with pytest.raises(UserError, match="n_last_layers = 999"):
        select_parameters(adapter, batch, "last", 999)


def test_method_choice_and_its_errors(setup) -> None:
    adapter, _, _, test, names = setup
    assert GradientComputer(adapter, names).method == "closed_form"
    everything = select_parameters(adapter, test.batch([0]), "all")
    assert GradientComputer(adapter, everything).method == "vmap"
    with pytest.raises(UserError, match="closed_form needs every chosen parameter"):
        GradientComputer(adapter, everything, method="closed_form")
    with pytest.raises(UserError, match="gradient_checkpointing needs the closed-form"):
        GradientComputer(adapter, everything, gradient_checkpointing=True)


# --- order of work, out of memory, resume ------------------------------------------------------------------------
def test_each_checkpoint_is_loaded_once_and_test_gradients_computed_once_per_checkpoint(
    setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter, checkpoints, train, test, names = setup
    loads = count_loads(monkeypatch, adapter)
    sizes: list[int] = []
    original = GradientComputer.features

    def spy(self: GradientComputer, batch: dict[str, Tensor]) -> Any:
        sizes.append(len(batch["labels"]))
        return original(self, batch)

    monkeypatch.setattr(GradientComputer, "features", spy)
    reporter = Recorder()
    tracin_scores(
        adapter, checkpoints, train, test, names, TracInOptions(batch_size=8, shard_size=5), reporter=reporter
    )
    assert loads == [c.path for c in checkpoints]
    assert sum(sizes) == len(checkpoints) * (len(train) + len(test))
    assert reporter.progress_calls[-1] == (39, 39, "checkpoint 3/3")


def test_auto_micro_batches_and_test_gradients_after_the_first_training_batch(
    setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU "auto" takes 8192 tokens per micro-batch: all 13 training rows at once. The test examples'
    gradients come after the first training micro-batch of each checkpoint (their forward then overlaps it)."""
    adapter, checkpoints, train, test, names = setup
    calls: list[int] = []
    original = GradientComputer.features

    def spy(self: GradientComputer, batch: dict[str, Tensor]) -> Any:
        calls.append(len(batch["labels"]))
        return original(self, batch)

    monkeypatch.setattr(GradientComputer, "features", spy)
    result = tracin_scores(adapter, checkpoints, train, test, names)
    assert calls == [len(train), len(test)] * len(checkpoints)
    assert result.stats["final_batch_size"] == len(train)


def test_out_of_memory_halves_the_micro_batch_and_retries(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    adapter, checkpoints, train, test, names = setup
    reference = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(batch_size=8))
    original = GradientComputer.features

    def small_memory(self: GradientComputer, batch: dict[str, Tensor]) -> Any:
        if len(batch["labels"]) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(self, batch)

    monkeypatch.setattr(GradientComputer, "features", small_memory)
    reporter = Recorder()
    result = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(batch_size=8), reporter=reporter)
    halvings = [(e["batch_size"], e["retry_batch_size"]) for kind, e in reporter.events if kind == "oom_retry"]
    # The first training micro-batch comes first (13 rows: two of 7 and 6). The ceiling is kept in tokens, so
    # the shorter test examples may be retried once more.
    assert halvings[:2] == [(7, 3), (3, 1)]
    assert all(retry == size // 2 for size, retry in halvings)
    assert result.stats["final_batch_size"] == 1 and result.stats["oom_retries"] == len(halvings)
    assert max_rel_error(result.matrix, reference.matrix) < 1e-12
    assert max_rel_error(result.self_influence, reference.self_influence) < 1e-12

    monkeypatch.setattr(GradientComputer, "features", lambda self, batch: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(UserError, match="out of memory with one example"):
        tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(batch_size=1))


def test_resume_after_cancel_gives_identical_results(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    adapter, checkpoints, train, test, names = setup
    options = TracInOptions(batch_size=3, shard_size=5)  # blocks of 5, 5, 3 examples
    whole = tracin_scores(adapter, checkpoints, train, test, names, options)
    store = MemoryStore()
    # Micro-batches per checkpoint: 2 + 2 + 1; cancel in checkpoint 2's second block.
    with pytest.raises(JobCancelled):
        tracin_scores(adapter, checkpoints, train, test, names, options, store=store, reporter=Recorder(cancel_at=8))
    assert sorted(store.shards) == [
        "tracin_c000_b00001.safetensors",
        "tracin_c000_b00002.safetensors",
        "tracin_c001_b00000.safetensors",
    ]
    loads = count_loads(monkeypatch, adapter)
    resumed = tracin_scores(adapter, checkpoints, train, test, names, options, store=store)
    assert loads == [c.path for c in checkpoints[1:]]
    assert torch.equal(resumed.matrix, whole.matrix)
    assert torch.equal(resumed.self_influence, whole.self_influence)
    assert torch.equal(resumed.proponents.rows, whole.proponents.rows)
    assert sorted(store.shards) == [f"tracin_c002_b0000{j}.safetensors" for j in range(3)]


# --- outputs ---------------------------------------------------------------------------------------------------
def test_top_k_merged_across_blocks_equals_a_global_top_k(setup) -> None:
    adapter, checkpoints, train, test, names = setup
    result = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(batch_size=2, shard_size=3, top_k=4))
    full = result.matrix
    top = full.topk(4, dim=1)
    assert torch.equal(result.proponents.rows, result.train_rows[top.indices])
    assert torch.equal(result.proponents.scores, top.values)
    bottom = full.topk(4, dim=1, largest=False)
    assert torch.equal(result.opponents.rows, result.train_rows[bottom.indices])
    assert torch.equal(result.opponents.scores, bottom.values)


def test_same_label_filter_scores_only_matching_pairs(setup) -> None:
    adapter, checkpoints, train, test, names = setup
    test_labels = test.labels.clone()
    test_labels[:] = torch.tensor([0, 1, 0, 1])  # no test example has label 2
    test = test.subset(range(len(test)))
    test.tensors["labels"] = test_labels
    full = tracin_scores(adapter, checkpoints, train, test, names)
    filtered = tracin_scores(adapter, checkpoints, train, test, names, pair_filter=get_filter("same_label"))
    kept = train.labels != 2
    assert torch.equal(filtered.train_rows, torch.arange(len(train))[kept])
    same = test_labels[:, None] == train.labels[None, filtered.train_rows]
    assert torch.equal(filtered.matrix.isnan(), ~same)
    assert max_rel_error(filtered.matrix[same], full.matrix[:, kept][same]) < 1e-12
    for i in range(len(test)):
        rows = filtered.proponents.rows[i][filtered.proponents.rows[i] >= 0]
        assert len(rows) == min(10, int(same[i].sum()))
        assert (train.labels[rows] == test_labels[i]).all()
        assert (train.labels[filtered.opponents.rows[i][filtered.opponents.rows[i] >= 0]] == test_labels[i]).all()


def test_shared_entity_filter_on_knowledge_graph_triples(tmp_path: Path) -> None:
    adapter = link_adapter()
    checkpoints = save_checkpoints(adapter, tmp_path, lrs=(0.1,))
    train, test = triples(adapter, 30, seed=5), triples(adapter, 3, seed=6)
    names = select_parameters(adapter, test.batch([0]), "last", 1)
    result = tracin_scores(adapter, checkpoints, train, test, names, pair_filter=get_filter("shared_entity"))
    ents_test, ents_train = test.tensors["entity_ids"], train.tensors["entity_ids"][result.train_rows]
    shares = (ents_test[:, :, None, None] == ents_train[None, None, :, :]).any(-1).any(1)
    assert torch.equal(~result.matrix.isnan(), shares)
    assert len(result.train_rows) < len(train)
    with pytest.raises(UserError, match='needs "entity_ids" on the test examples'):
        get_filter("shared_entity").example_keys(text_dataset(bert_adapter(), 2, 1).tensors, "test")


def test_filter_registry_matches_the_profile_choices() -> None:
    assert set(FILTER_CHOICES) == {"none", *FILTERS}
    assert get_filter("none") is None


def test_cleanup_runs_every_n_examples() -> None:
    cleanup = Cleanup(4, torch.device("cpu"))
    for _ in range(5):
        cleanup.step(2)
    assert cleanup.runs == 2
    never = Cleanup(0, torch.device("cpu"))
    never.step(10_000)
    assert never.runs == 0


def test_self_influence_only_and_matrix_off(setup) -> None:
    adapter, checkpoints, train, test, names = setup
    options = TracInOptions(keep_matrix=False, cleanup_every=5, batch_size=5)
    result = tracin_scores(adapter, checkpoints, train, test, names, options)
    assert result.matrix is None and result.self_influence.shape == (len(train),)
    assert result.stats["cleanups"] == 6  # micro-batches of 5, 5, 3 per checkpoint; a clean-up once 5 are done
