"""TracIn with Adam-preconditioned training gradients (tracin.optimizer_state = "adam") on tiny random decoders in
float64. The checkpoints come from a real torch.optim.AdamW run (non-default betas and eps), saved as Hugging Face's
Trainer saves them: the weights (a state dict, or a PEFT adapter directory) and optimizer.pt, torch.save of the
optimizer's state_dict, in one directory per checkpoint. The reference applies the formula by hand to gradients of
the naive per-example loop (test_tracin_causal_lm), reading optimizer.pt itself with the parameter order the test
gave the optimizer:

    Γ(g) = m̂/(√v̂+ε), m̂ = (β1·m + (1-β1)·g)/(1-β1^(t+1)), v̂ = (β2·v + (1-β2)·g²)/(1-β2^(t+1))
    score = Σ_c lr_c·<Γ_c(g_train), g_test>,  self-influence = Σ_c lr_c·<Γ_c(g), g>
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lm_cases import tiny_decoder, tiny_tokenizer
from safetensors.torch import save_file
from test_tracin_causal_lm import TEST, TRAIN, dataset, reference_loss, reference_tracin
from test_tracin_support import bert_adapter, max_rel_error, text_dataset

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.tracin import CheckpointSpec
from gpuopt_tui.jobs.data import TextDataset
from gpuopt_tui.jobs.models.base import Adapter, Checkpoint
from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter
from gpuopt_tui.jobs.tracin import Projector, TracInOptions, select_parameters, tracin_scores
from gpuopt_tui.jobs.tracin.adam_state import OPTIMIZER_FILE, load_adam_state
from gpuopt_tui.jobs.tracin.checkpoints import resolve_checkpoints

CPU = torch.device("cpu")
LRS = (0.3, 0.2, 0.1)
BETAS, EPS = (0.8, 0.95), 1e-4
LAST_LINEARS = ["model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight"]


def trainer_groups(model: torch.nn.Module, grouping: str) -> list[dict]:
    """The optimizer's parameter groups: "trainer" as Hugging Face's Trainer makes them (weight decay on all but
    its no-decay parameters, which come second), or "single" (one group, in named_parameters order)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if grouping == "single":
        return [{"params": [p for _, p in trainable], "names": [n for n, _ in trainable]}]
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))  # the Trainer's own rule; it does not read `self`
    first, second = [(n, p) for n, p in trainable if n in decay], [(n, p) for n, p in trainable if n not in decay]
    assert first and second
    return [
        {"params": [p for _, p in part], "names": [n for n, _ in part], "weight_decay": wd}
        for part, wd in ((first, 0.01), (second, 0.0))
    ]


def train_with_adamw(
    adapter: CausalLMAdapter, folder: Path, groups: list[dict], save_weights: Callable[[Path], Path]
) -> tuple[list[Path], list[str]]:
    """Two AdamW steps on the summed completion loss of TRAIN before each checkpoint; each checkpoint directory
    gets the weights (`save_weights(dir)` returns the path to score) and optimizer.pt. Returns the weights paths and
    the parameter names in the optimizer's index order."""
    order = [n for g in groups for n in g.pop("names")]
    opt = torch.optim.AdamW(groups, lr=0.02, betas=BETAS, eps=EPS)
    ds = dataset(adapter, TRAIN)
    paths = []
    for i in range(len(LRS)):
        for _ in range(2):
            opt.zero_grad()
            sum(reference_loss(adapter, ds, k) for k in range(len(ds))).backward()
            opt.step()
        ckpt = folder / f"checkpoint-{2 * i + 2}"
        ckpt.mkdir(parents=True)
        paths.append(save_weights(ckpt))
        torch.save(opt.state_dict(), ckpt / OPTIMIZER_FILE)
    opt.zero_grad(set_to_none=True)
    return paths, order


def state_dict_saver(adapter: Adapter) -> Callable[[Path], Path]:
    def save(folder: Path) -> Path:
        state = {k: v.detach().clone().contiguous() for k, v in adapter.model.state_dict().items()}
        save_file(state, str(folder / "model.safetensors"))
        return folder / "model.safetensors"

    return save


def per_example_gradients(adapter: CausalLMAdapter, ds: TextDataset, names: list[str]) -> list[dict[str, torch.Tensor]]:
    params = dict(adapter.model.named_parameters())
    rows = []
    for i in range(len(ds)):
        adapter.model.zero_grad(set_to_none=True)
        reference_loss(adapter, ds, i).backward()
        rows.append({n: params[n].grad.clone() for n in names})
    adapter.model.zero_grad(set_to_none=True)
    return rows


def gamma_by_hand(file: Path, order: list[str], name: str, g: torch.Tensor) -> torch.Tensor:
    raw = torch.load(file, weights_only=True)
    idx = order.index(name)
    group = next(gr for gr in raw["param_groups"] if idx in gr["params"])
    (b1, b2), eps = group["betas"], group["eps"]
    st = raw["state"][idx]
    t = int(st["step"]) + 1
    m_hat = (b1 * st["exp_avg"] + (1 - b1) * g) / (1 - b1**t)
    v_hat = (b2 * st["exp_avg_sq"] + (1 - b2) * g * g) / (1 - b2**t)
    return m_hat / (v_hat.sqrt() + eps)


def reference_adam_tracin(
    adapter: CausalLMAdapter,
    checkpoints: list[Checkpoint],
    order: list[str],
    train: TextDataset,
    test: TextDataset,
    names: list[str],
    projector: Projector | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [n_test, n_train], self-influence [n_train]) by the formula, per example and parameter."""

    def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
        if projector is None:
            return torch.cat([grads[n].reshape(-1) for n in names])
        return torch.cat([projector.dense(n, grads[n][None])[0] for n in names])

    scores = torch.zeros(len(test), len(train), dtype=torch.float64)
    selfinf = torch.zeros(len(train), dtype=torch.float64)
    for ckpt in checkpoints:
        adapter.load_weights(ckpt.path)
        optimizer_file = ckpt.path.parent / OPTIMIZER_FILE
        g_test = torch.stack([flat(g) for g in per_example_gradients(adapter, test, names)])
        for j, g in enumerate(per_example_gradients(adapter, train, names)):
            gamma = {n: gamma_by_hand(optimizer_file, order, n, g[n]) for n in names}
            scores[:, j] += ckpt.lr * (g_test @ flat(gamma))
            selfinf[j] += ckpt.lr * sum(float((gamma[n] * g[n]).sum()) for n in names)
    return scores, selfinf


@pytest.fixture(
    scope="module",
    params=[("llama", "trainer"), ("gpt2", "trainer"), ("llama", "single")],
    ids=["llama-trainer-groups", "gpt2-trainer-groups", "llama-one-group"],
)
def adam64(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    family, grouping = request.param
    adapter = CausalLMAdapter(family, tiny_decoder(family).double(), tiny_tokenizer(), CPU)
    groups = trainer_groups(adapter.model, grouping)
    paths, order = train_with_adamw(adapter, tmp_path_factory.mktemp("adam"), groups, state_dict_saver(adapter))
    return adapter, [Checkpoint(p, lr) for p, lr in zip(paths, LRS)], order


def adam_options(**kw) -> TracInOptions:
    return TracInOptions(optimizer_state="adam", batch_size=3, **kw)


@pytest.mark.parametrize(("layers", "method"), [("last", "auto"), ("last", "vmap"), ("linears", "closed_form")])
def test_adam_scores_match_the_formula_applied_by_hand(adam64, layers: str, method: str) -> None:
    adapter, checkpoints, order = adam64
    train, test = dataset(adapter, TRAIN), dataset(adapter, TEST)
    if layers == "linears":
        if adapter.name != "llama":
            pytest.skip("gpt2's layers are Conv1D, not nn.Linear")
        names = LAST_LINEARS
    else:
        names = select_parameters(adapter, test.batch([0]), "last", 3)
    result = tracin_scores(adapter, checkpoints, train, test, names, adam_options(method=method))
    scores, selfinf = reference_adam_tracin(adapter, checkpoints, order, train, test, names)
    assert result.matrix is not None
    assert max_rel_error(result.matrix, scores) < 1e-9
    assert max_rel_error(result.self_influence, selfinf) < 1e-9
    assert scores.abs().max() > 1e-3
    plain = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(method=method, batch_size=3))
    assert plain.matrix is not None and max_rel_error(plain.matrix, scores) > 1e-2  # the preconditioning shows
    described = result.stats["optimizer_state"]
    assert described["kind"] == "adam" and "optimizer.pt" in described["description"]
    assert [c["step"] for c in described["checkpoints"]] == [2, 4, 6]
    assert described["checkpoints"][0]["beta1"] == BETAS[0] and described["checkpoints"][0]["eps"] == EPS


def test_projected_adam_scores_are_the_projection_of_the_formula(adam64) -> None:
    adapter, checkpoints, order = adam64
    train, test = dataset(adapter, TRAIN), dataset(adapter, TEST)
    names = select_parameters(adapter, test.batch([0]), "last", 3)
    result = tracin_scores(adapter, checkpoints, train, test, names, adam_options(projection_dim=24, seed=5))
    projector = Projector(24, 5, CPU, torch.float64)
    scores, selfinf = reference_adam_tracin(adapter, checkpoints, order, train, test, names, projector)
    assert result.matrix is not None and max_rel_error(result.matrix, scores) < 1e-9
    _, exact_self = reference_adam_tracin(adapter, checkpoints, order, train, test, names)
    assert max_rel_error(result.self_influence, exact_self) < 1e-9  # <Γ(g), g> is taken before the projection
    assert max_rel_error(selfinf, exact_self) < 1e-9


def test_the_preconditioned_gradient_is_the_step_adamw_takes(adam64) -> None:
    """Γ(g) at a checkpoint is what AdamW (without weight decay) would move the parameter by, divided by -lr."""
    adapter, checkpoints, _ = adam64
    ckpt = checkpoints[1]
    adapter.load_weights(ckpt.path)
    names = [n for n, p in adapter.model.named_parameters() if p.requires_grad]
    state = load_adam_state(ckpt.path.parent / OPTIMIZER_FILE, adapter, names, CPU, torch.float64)
    grads = per_example_gradients(adapter, dataset(adapter, TRAIN), names)[0]
    raw = torch.load(ckpt.path.parent / OPTIMIZER_FILE, weights_only=True)
    params = dict(adapter.model.named_parameters())
    replay = torch.optim.AdamW([params[n] for n in names], lr=1.0, weight_decay=0.0)
    # the saved moments, mapped to names by the engine: a wrong mapping would show as a wrong step below
    replay.load_state_dict(
        {
            "state": {
                i: {"exp_avg": m.clone(), "exp_avg_sq": v.clone(), "step": raw["state"][0]["step"].clone()}
                for i, (m, v) in enumerate(state.moments[n] for n in names)
            },
            "param_groups": [{**replay.state_dict()["param_groups"][0], "betas": BETAS, "eps": EPS}],
        }
    )
    before = {n: params[n].detach().clone() for n in names}
    for n in names:
        params[n].grad = grads[n]
    replay.step()
    for n in names:
        assert torch.allclose(before[n] - params[n].detach(), state.precondition(n, grads[n][None])[0], atol=1e-12)
    adapter.load_weights(ckpt.path)


def test_lora_adam_scores_match_the_formula_applied_by_hand(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(tiny_decoder("llama").double(), config).eval()
    trainer = CausalLMAdapter("llama", model, tiny_tokenizer(), CPU)

    def save(folder: Path) -> Path:
        model.save_pretrained(folder)
        return folder

    folders, order = train_with_adamw(trainer, tmp_path, trainer_groups(model, "single"), save)
    adapter = CausalLMAdapter("llama", tiny_decoder("llama").double(), tiny_tokenizer(), CPU)
    checkpoints = resolve_checkpoints([CheckpointSpec(str(f), lr) for f, lr in zip(folders, LRS)], adapter)
    train, test = dataset(adapter, TRAIN), dataset(adapter, TEST)
    names = select_parameters(adapter, test.batch([0]), "auto")
    assert names == order  # the adapter's trainable parameters, in the order the optimizer had them
    result = tracin_scores(adapter, checkpoints, train, test, names, adam_options())
    scores, selfinf = reference_adam_tracin(adapter, checkpoints, order, train, test, names)
    assert result.matrix is not None and max_rel_error(result.matrix, scores) < 1e-9
    assert max_rel_error(result.self_influence, selfinf) < 1e-9
    assert scores.abs().max() > 1e-4
    # the base model's weights were not optimized: they have no Adam state to precondition with
    with pytest.raises(UserError, match=r"optimizer.pt: no optimizer state for .*lm_head.weight.*tracin.layers"):
        tracin_scores(adapter, checkpoints, train, test, [*names, "base_model.model.lm_head.weight"], adam_options())


def test_the_default_scores_plain_gradients_and_caches_never_mix(adam64, tmp_path: Path) -> None:
    """optimizer.pt beside the checkpoints changes nothing by default; adam and plain training gradients keep
    separate cache entries (a plain run after an adam run on the same cache computes its own)."""
    adapter, checkpoints, _ = adam64
    train, test = dataset(adapter, TRAIN), dataset(adapter, TEST)
    names = select_parameters(adapter, test.batch([0]), "last", 2)
    plain = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(batch_size=3))
    assert plain.stats["optimizer_state"] is None
    reference = reference_tracin(adapter, checkpoints, train, test, names)
    assert plain.matrix is not None and max_rel_error(plain.matrix, reference) < 1e-9
    cached = {}
    for state in ("adam", "off", "adam"):
        opts = TracInOptions(batch_size=3, optimizer_state=state, train_cache=tmp_path)
        cached[state] = tracin_scores(adapter, checkpoints, train, test, names, opts)
    assert cached["off"].stats["cache_blocks"] == {"read": 0, "computed": len(checkpoints)}
    assert cached["adam"].stats["cache_blocks"] == {"read": len(checkpoints), "computed": 0}  # the first adam run's
    assert max_rel_error(cached["off"].matrix, reference) < 1e-2  # bf16 cache
    assert max_rel_error(cached["off"].matrix, cached["adam"].matrix) > 0.1


# --- a spoiled or changed optimizer state: refused, or a cache entry of its own ---------------------------------------
@pytest.fixture
def one_checkpoint(adam64, tmp_path: Path) -> tuple[CausalLMAdapter, Checkpoint, dict]:
    """A copy of the first checkpoint in its own directory, with its optimizer state to spoil."""
    adapter, checkpoints, _ = adam64
    folder = tmp_path / "ckpt"
    folder.mkdir()
    weights = folder / checkpoints[0].path.name
    weights.write_bytes(checkpoints[0].path.read_bytes())
    raw = torch.load(checkpoints[0].path.parent / OPTIMIZER_FILE, weights_only=True)
    return adapter, Checkpoint(weights, 0.1), raw


def score(adapter: CausalLMAdapter, ckpts: list[Checkpoint], **kw) -> None:
    train, test = dataset(adapter, TRAIN[:2]), dataset(adapter, TEST[:1])
    names = select_parameters(adapter, test.batch([0]), "last", 2)
    tracin_scores(adapter, ckpts, train, test, names, adam_options(**kw))


def test_a_changed_optimizer_state_gets_its_own_cache_entry(one_checkpoint, tmp_path: Path) -> None:
    """The cached preconditioned gradients depend on optimizer.pt as well as the weights: rewriting it (the weights
    untouched) computes them again, with the new moments."""
    adapter, ckpt, raw = one_checkpoint
    file = ckpt.path.parent / OPTIMIZER_FILE
    torch.save(raw, file)
    train, test = dataset(adapter, TRAIN), dataset(adapter, TEST)
    names = select_parameters(adapter, test.batch([0]), "last", 2)
    opts = adam_options(train_cache=tmp_path / "cache")
    runs = [tracin_scores(adapter, [ckpt], train, test, names, opts) for _ in range(2)]
    for entry in raw["state"].values():
        entry["exp_avg"] = -entry["exp_avg"]
    torch.save(raw, file)
    changed = tracin_scores(adapter, [ckpt], train, test, names, opts)
    assert [r.stats["cache_blocks"] for r in [*runs, changed]] == [
        {"read": 0, "computed": 1},
        {"read": 1, "computed": 0},
        {"read": 0, "computed": 1},
    ]
    assert max_rel_error(changed.matrix, runs[1].matrix) > 0.1


def test_a_missing_or_shared_optimizer_state_is_refused(one_checkpoint) -> None:
    adapter, ckpt, raw = one_checkpoint
    with pytest.raises(UserError, match=r"checkpoint 0 \(.*model.safetensors\) has no optimizer.pt beside it"):
        score(adapter, [ckpt])
    torch.save(raw, ckpt.path.parent / OPTIMIZER_FILE)
    with pytest.raises(UserError, match=r"checkpoints 0 and 1 share .*optimizer.pt"):
        score(adapter, [ckpt, Checkpoint(ckpt.path, 0.2)])


def test_the_factored_method_is_refused_with_the_alternatives(one_checkpoint) -> None:
    adapter, ckpt, raw = one_checkpoint
    torch.save(raw, ckpt.path.parent / OPTIMIZER_FILE)
    with pytest.raises(UserError, match=r'optimizer_state = "adam" .* method = factored .*closed_form or vmap'):
        score(adapter, [ckpt], method="factored")


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        ("fewer", r"holds \d+ parameter tensors in its param_groups, but the model has \d+ trainable ones"),
        ("shape", r"state\[\d+\]\['exp_avg'\] has shape \(3, 2\), but .* has \("),
        ("sgd", r"state\[\d+\] \(.*\) has no exp_avg and exp_avg_sq: expected the state of an Adam"),
        ("pickle", r"cannot read it as a torch optimizer state with weights_only=True"),
        ("not_a_state", r"expected torch.save\(optimizer.state_dict\(\)\)"),
    ],
)
def test_an_optimizer_state_that_does_not_fit_is_named(one_checkpoint, spoil: str, message: str) -> None:
    adapter, ckpt, raw = one_checkpoint
    file = ckpt.path.parent / OPTIMIZER_FILE
    if spoil == "fewer":
        raw["param_groups"][-1]["params"] = raw["param_groups"][-1]["params"][:-1]
    elif spoil == "shape":
        last = max(raw["state"])
        raw["state"][last] = {**raw["state"][last], "exp_avg": torch.zeros(3, 2, dtype=torch.float64)}
    elif spoil == "sgd":
        raw["state"] = {i: {"momentum_buffer": s["exp_avg"]} for i, s in raw["state"].items()}
    elif spoil == "not_a_state":
        raw = {"weights": torch.zeros(2)}
    if spoil == "pickle":
        file.write_bytes(pickle.dumps(Path("x"), protocol=2))
    else:
        torch.save(raw, file)
    with pytest.raises(UserError, match=message) as caught:
        score(adapter, [ckpt])
    assert str(file) in str(caught.value)


def test_closed_form_gradients_of_one_vector_layers_are_preconditioned_as_vmap_does(tmp_path: Path) -> None:
    """A classifier's pooler and head see one vector per example, where the closed form keeps g a^T factored: with
    Adam it forms them, and must agree with vmap's per-example gradients."""
    adapter = bert_adapter(torch.float64)
    train, test = text_dataset(adapter, 6, 1), text_dataset(adapter, 3, 2)
    opt = torch.optim.AdamW(adapter.model.parameters(), lr=0.01, betas=BETAS, eps=EPS)
    checkpoints = []
    for i, lr in enumerate(LRS[:2]):
        opt.zero_grad()
        adapter.loss_per_example(train.batch(list(range(len(train))))).sum().backward()
        opt.step()
        folder = tmp_path / f"checkpoint-{i + 1}"
        folder.mkdir()
        checkpoints.append(Checkpoint(state_dict_saver(adapter)(folder), lr))
        torch.save(opt.state_dict(), folder / OPTIMIZER_FILE)
    opt.zero_grad(set_to_none=True)
    names = ["bert.pooler.dense.weight", "bert.pooler.dense.bias", "classifier.weight", "classifier.bias"]
    closed = tracin_scores(adapter, checkpoints, train, test, names, adam_options(method="closed_form"))
    vmapped = tracin_scores(adapter, checkpoints, train, test, names, adam_options(method="vmap"))
    assert closed.stats["method"] == "closed_form" and vmapped.stats["method"] == "vmap"
    assert closed.matrix is not None and vmapped.matrix is not None
    assert max_rel_error(closed.matrix, vmapped.matrix) < 1e-9
    assert max_rel_error(closed.self_influence, vmapped.self_influence) < 1e-9
