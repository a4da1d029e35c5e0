"""How well TracIn's factored projection keeps the inner products of LoRA gradients, on the CPU in float64.

A tiny random Llama (tests/lm_cases.py) with a PEFT LoRA adapter (r = 8 on every Linear layer, B random) and 40
random prompt + completion rows: the exact per-example adapter gradients (factored engine, k = 0) against the
projected ones at k x k per adapter matrix (3 projection seeds each): the correlation of the off-diagonal inner
products (training-training pairs), the mean ratio of projected to exact squared norms, and the median |cosine|
between exact gradients. A random projection to D numbers errs on a cosine by about 1/sqrt(D): inner products
survive it when the cosines between gradients are well above that.

    PYTHONPATH=.:tests python benchmarks/tracin_lm_projection_cpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from lm_cases import tiny_decoder, tiny_tokenizer  # noqa: E402

from benchmarks.lm_attribution import dataset  # noqa: E402
from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter  # noqa: E402
from gpuopt_tui.jobs.tracin.factored import FactoredGradients  # noqa: E402

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "big", "red", "rug", "small", "blue", "under", "happy"]


def main() -> None:
    import peft

    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(tiny_decoder("llama").double(), config).eval()
    adapter = CausalLMAdapter("tiny", model, tiny_tokenizer(), torch.device("cpu"))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(1)

    def sentence(n: int) -> str:
        return " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (n,), generator=gen))

    prompts = [sentence(int(torch.randint(4, 12, (1,), generator=gen))) for _ in range(40)]
    batch = dataset(adapter, prompts, [sentence(3) for _ in prompts]).tensors
    exact = FactoredGradients(adapter, names, k_in=0, k_out=0, seed=0, precision="fp32").features(batch)
    gram = exact @ exact.T
    off = ~torch.eye(len(gram), dtype=torch.bool)
    norms = gram.diag().sqrt()
    print(
        f"exact: {exact.shape[1]} numbers per example; median |cosine| {(gram / norms[:, None] / norms)[off].abs().median():.4f}"
    )
    for k in (2, 4, 8):
        corr, ratio = [], []
        for seed in range(3):
            projected = FactoredGradients(adapter, names, k_in=k, k_out=k, seed=seed, precision="fp32").features(batch)
            p = projected @ projected.T
            corr.append(torch.corrcoef(torch.stack([gram[off], p[off]]))[0, 1].item())
            ratio.append((p.diag() / gram.diag()).mean().item())
        print(f"k = {k}: {projected.shape[1]} numbers; 1/sqrt = {projected.shape[1] ** -0.5:.4f}; correlation of "
              f"inner products {', '.join(f'{c:.3f}' for c in corr)}; norm ratio {', '.join(f'{r:.3f}' for r in ratio)}")  # fmt: skip


if __name__ == "__main__":
    main()
