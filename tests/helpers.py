"""Setup and checks shared by the test modules (tests/ is on sys.path: ``from helpers import ...``)."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest
import torch

from yggtree.runtime.model import ModelConfig, Transformer

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def tiny_model(
    vocab: int = 97, hidden: int = 32, layers: int = 2, *, intermediate: int | None = None,
    head_dim: int | None = None, max_pos: int = 512, tied: bool = True, eos: tuple[int, ...] = (),
    seed: int = 0, std: float | None = 0.3, dtype: torch.dtype | None = None,
) -> Transformer:
    """A random Llama-shaped target, 4 query and 2 K/V heads, frozen in eval mode: seeded with
    ``seed``, every parameter then drawn from N(0, ``std``) (``std`` None: the module's own
    initialisation), converted to ``dtype`` when given. ``intermediate`` defaults to 2 x hidden,
    ``head_dim`` to hidden / 4."""
    cfg = ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden, num_layers=layers,
        num_heads=4, num_kv_heads=2, head_dim=head_dim or hidden // 4, max_position_embeddings=max_pos,
        tie_word_embeddings=tied, eos_token_ids=eos,
    )
    torch.manual_seed(seed)
    m = Transformer(cfg)
    if std is not None:
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, std)
    if dtype is not None:
        m = m.to(dtype)
    return m.eval().requires_grad_(False)


def need_kernel_library() -> None:
    """Load yggtree's kernel library, or skip (a test or, at import, a module) where the CPU lacks
    the flags it needs; a library that fails to build fails the test instead of skipping it."""
    from yggtree.runtime.kernels import library_missing, load_library

    if library_missing():  # pragma: no cover - a CPU without AVX2
        pytest.skip(f"this CPU lacks {', '.join(library_missing())}", allow_module_level=True)
    load_library()


def load_script(name: str):
    """scripts/<name>.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def chi_square_p(counts: torch.Tensor, exact: torch.Tensor) -> float:
    """p-value of the observed ``counts`` against the exact distribution ``exact`` (cells with
    an expectation under 5 pooled); asserts first that no impossible cell was ever emitted."""
    from scipy.stats import chisquare

    expected = exact * counts.sum()
    assert counts[exact == 0].sum() == 0, "emitted a sequence the target can never sample"
    keep = expected >= 5  # pool small cells (chi-square validity)
    obs = torch.cat([counts[keep], counts[~keep].sum().reshape(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


def assert_cache_equals_causal(model: Transformer, ref: Transformer, committed: list[int], n_slots: int = 256) -> None:
    """``model``'s K/V cache rows of the ``committed`` sequence equal those of a plain causal
    forward of ``ref`` (the same weights, a fresh cache of ``n_slots``) over it."""
    ref.setup_cache(1, n_slots)
    m = len(committed)
    pos = torch.arange(m)[None]
    mask = (torch.arange(n_slots)[None, :] <= torch.arange(m)[:, None])[None]
    with torch.no_grad():
        ref(torch.tensor([committed]), pos, pos, mask)
    for layer, (got, want) in enumerate(zip(model.layers, ref.layers)):
        for name in ("k", "v"):
            g = getattr(got.self_attn.cache, name)
            w = getattr(want.self_attn.cache, name)
            torch.testing.assert_close(g[:, :m], w[:, :m], rtol=1e-4, atol=1e-5,
                                       msg=lambda s: f"layer {layer} {name}: {s}")  # [B, slot, ...]


def tiny_plan_dir(root: Path, plan: str) -> Path:
    """``root`` with a tiny random checkpoint (model/) and ``plan`` as plan.yaml; its path."""
    from test_compile import save_tiny_checkpoint

    save_tiny_checkpoint(root / "model")
    (root / "plan.yaml").write_text(plan)
    return root / "plan.yaml"


def perturbed(model: Transformer, noise: float = 0.03, seed: int = 1) -> Transformer:
    """``model`` with N(0, ``noise``) added to every weight (seeded), in place: a drafter that
    agrees with the original often, not always (partial acceptances)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for w in model.parameters():
            w.add_(noise * torch.randn_like(w))
    return model


def sweep(*axes, unit) -> list:
    """Every combination of ``axes`` as ``pytest.param``s for ``parametrize``, all but the cases in
    ``unit`` marked slow: the whole grid runs in the full suite, its representative cases in the
    unit run (``-m "not slow"``)."""
    unit = {tuple(u) for u in unit}
    cases = list(itertools.product(*axes))
    assert unit <= set(cases), unit - set(cases)
    return [pytest.param(*c, marks=() if c in unit else pytest.mark.slow) for c in cases]
