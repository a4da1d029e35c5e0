"""Two-tower inputs [batch, n_candidates, seq_len] and the cached context: the user vector computed once per
batch gives the same attributions as recomputing it from the reading history in every forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from captum.attr import IntegratedGradients
from safetensors.torch import load_file
from torch import nn

from gpuopt_tui.core.profiles.attribution import AttributionSection
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.jobs.attribution import IGOptions, integrated_gradients, integrated_gradients_reference
from gpuopt_tui.jobs.attribution.baselines import baseline_embeddings
from gpuopt_tui.jobs.attribution.engine import Settings, attribute_batch
from gpuopt_tui.jobs.attribution.job import run_job
from gpuopt_tui.jobs.context import JobContext
from gpuopt_tui.jobs.data import trim_batch
from gpuopt_tui.jobs.models.demo import load_demo_adapter

PROFILES = Path(__file__).resolve().parents[2] / "profiles"


class NewsRecommender(nn.Module):
    """Candidate titles and history titles share one news encoder (token projection + masked additive
    attention pooling); the user vector is the mean of the history's news vectors."""

    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.query = nn.Linear(dim, 1)
        self.user_proj = nn.Linear(dim, dim)
        for p in self.parameters():
            nn.init.normal_(p, std=0.5)
        self.history_calls = 0

    def news(self, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[N, C, L, H] token embeddings -> [N, C, H] news vectors."""
        h = torch.tanh(self.proj(embeds))
        logits = self.query(h).squeeze(-1).masked_fill(mask == 0, -1e9)
        return (logits.softmax(-1).unsqueeze(-1) * h).sum(-2)

    def user(self, history_ids: torch.Tensor, history_mask: torch.Tensor) -> torch.Tensor:
        self.history_calls += 1
        return torch.tanh(self.user_proj(self.news(self.embed(history_ids), history_mask).mean(1)))

    def cached(self, embeds, mask, context):
        return torch.einsum("nch,nh->nc", self.news(embeds, mask), context["user"])

    def uncached(self, embeds, mask, context):
        user = self.user(context["history_ids"], context["history_mask"])
        return torch.einsum("nch,nh->nc", self.news(embeds, mask), user)


@pytest.fixture
def case():
    model = NewsRecommender().double().eval()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 50, (3, 4, 7), generator=gen)  # 3 users x 4 candidates x 7 tokens
    mask = torch.ones_like(ids)
    mask[:, 1, 5:] = 0
    mask[2, 3, 3:] = 0
    history_ids = torch.randint(1, 50, (3, 5, 7), generator=gen)
    history_mask = torch.ones_like(history_ids)
    history_mask[0, :, 4:] = 0
    with torch.no_grad():
        embeds = model.embed(ids)
    baselines = torch.zeros_like(embeds)
    return model, embeds, baselines, mask, history_ids, history_mask


def test_cached_context_equals_uncached(case) -> None:
    model, embeds, baselines, mask, history_ids, history_mask = case
    history = {"history_ids": history_ids, "history_mask": history_mask}
    settings = {"options": IGOptions(n_steps=24, method="gausslegendre", alpha_batch_size=5), "model": model}
    model.history_calls = 0
    uncached = integrated_gradients(model.uncached, embeds, baselines, mask, context=history, **settings)
    assert model.history_calls == 1 + 5  # the endpoints, then every chunk recomputes the user vector
    model.history_calls = 0
    with torch.no_grad():
        user = model.user(history_ids, history_mask)
    cached = integrated_gradients(model.cached, embeds, baselines, mask, context={"user": user}, **settings)
    assert model.history_calls == 1  # once per batch
    assert cached.attributions.shape == (3, 4, 7, 16)
    scale = cached.attributions.abs().max()
    assert scale > 0.05
    assert (cached.attributions - uncached.attributions).abs().max() < 1e-12 * scale
    assert torch.equal(cached.target, uncached.target)
    assert torch.allclose(cached.deltas, uncached.deltas, rtol=0, atol=1e-12)


def test_only_the_target_candidate_is_attributed_and_matches_captum(case) -> None:
    model, embeds, baselines, mask, history_ids, history_mask = case
    with torch.no_grad():
        user = model.user(history_ids, history_mask)
    target = torch.tensor([0, 1, 3])
    inputs = (model.cached, embeds, baselines, mask, target, IGOptions(n_steps=12, method="riemann_middle"))
    ours = integrated_gradients(*inputs, context={"user": user})
    per_candidate = ours.token_scores().abs().sum(-1)  # [3, 4]
    chosen = torch.zeros_like(per_candidate, dtype=torch.bool)
    chosen[torch.arange(3), target] = True
    assert (per_candidate[~chosen] == 0).all() and (per_candidate[chosen] > 0).all()
    assert (ours.token_scores()[mask == 0] == 0).all()  # masked out of the pooling: no gradient reaches them
    ig = IntegratedGradients(lambda e, m, u: model.cached(e, m, {"user": u}))
    theirs = ig.attribute(
        embeds, baselines, target=target, additional_forward_args=(mask, user), n_steps=12, method="riemann_middle"
    )
    assert (ours.attributions - theirs).abs().max() < 1e-5 * theirs.abs().max()
    reference = integrated_gradients_reference(*inputs, context={"user": user})
    assert (reference.attributions - ours.attributions).abs().max() < 1e-12 * theirs.abs().max()


# --- the demo news recommender -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def demo(demo_cache: Path):
    adapter = load_demo_adapter("two_tower", torch.device("cpu"), demo_cache)
    ds = adapter.builtin_dataset("test").head(12)
    return adapter, ds


@pytest.mark.slow
def test_demo_cached_user_vector_equals_recomputing_it(demo) -> None:
    adapter, ds = demo
    model = adapter.model.double()
    try:
        batch = trim_batch(ds.batch(range(6)), ds.token_fields)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        with torch.no_grad():
            embeds = adapter.word_embeddings()(ids)
            cached_context = adapter.encode_context(batch)
        baselines = baseline_embeddings(adapter, ids, mask, embeds, adapter.special_ids.pad)

        def uncached(e, m, context):
            return model(m, inputs_embeds=e, history_ids=context["history_ids"], history_mask=context["history_mask"])

        history = {"history_ids": batch["history_ids"], "history_mask": batch["history_mask"]}
        settings = {"options": IGOptions(n_steps=16, alpha_batch_size=4), "model": model}
        cached = integrated_gradients(
            adapter.logits_from_embeds, embeds, baselines, mask, context=cached_context, **settings
        )
        recomputed = integrated_gradients(uncached, embeds, baselines, mask, context=history, **settings)
    finally:
        model.float()
    scale = cached.attributions.abs().max()
    assert scale > 1e-3
    assert (cached.attributions - recomputed.attributions).abs().max() < 1e-10 * scale
    assert torch.equal(cached.target, recomputed.target)


@pytest.mark.slow
def test_demo_clicked_title_topic_words_rank_first(demo) -> None:
    adapter, ds = demo
    topic_words = {w for words in adapter.info["topics"].values() for w in words}
    section = AttributionSection(n_steps=24, batch_size=4, use_amp=False)
    settings = Settings.resolve(section, adapter, torch.device("cpu"), len(ds))
    batch = trim_batch(ds.batch(range(len(ds))), ds.token_fields)
    values = attribute_batch(adapter, batch, settings, settings.planner())
    hits = 0
    for i in range(len(ds)):
        target = int(values["target"][i])
        scores = values["token_scores"][i, target]
        tokens = adapter.tokens(batch["input_ids"][i, target].tolist())
        hits += tokens[int(scores.abs().argmax())] in topic_words
        others = torch.arange(values["token_scores"].shape[1]) != target
        assert (values["token_scores"][i, others] == 0).all()
    assert hits >= 0.8 * len(ds)


@pytest.mark.slow
def test_demo_run_writes_nested_candidate_results(demo, demo_cache: Path, tmp_path: Path) -> None:
    profile = load_profile(PROFILES / "demo-attribution-two-tower.toml", ["run.device=cpu", "attribution.n_samples=6"])
    run_job(profile, JobContext(tmp_path, EventWriter(RunDir(tmp_path).events), demo_cache))
    records = [json.loads(line) for line in (RunDir(tmp_path).results / "attributions.jsonl").read_text().splitlines()]
    tensors = load_file(RunDir(tmp_path).results / "attributions.safetensors")
    assert len(records) == 6 and tensors["scores"].shape[:2] == (6, 4)
    for i, r in enumerate(records):
        assert len(r["tokens"]) == len(r["scores"]) == 4
        assert [len(t) for t in r["tokens"]] == tensors["lengths"][i].tolist()
        assert all(candidate == r["target"] for (candidate, _), _, _ in r["top"])
