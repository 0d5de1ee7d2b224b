"""Assemble an Engine from user-level names: model path, drafter spec, dtype, tree shape."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import YggError
from .drafters import LMDrafter, check_pair
from .engine import Engine, EngineConfig, TreeParams
from .loading import load_model, load_tokenizer, resolve_model


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to build an engine (the CLI's flags, a plan's fields)."""

    model: str = "default"  # "default" | HF directory | .gguf file
    drafter: str | None = None  # None (plain) | "self" | HF directory | .gguf | EAGLE head dir
    dtype: str = "float32"
    mode: str = "performance"
    max_context: int = 1024
    prefill_chunk: int = 64
    tree: TreeParams = TreeParams()


def load_drafter(spec: EngineSpec, target, tokenizer):
    """The drafter named by ``spec.drafter`` for ``target``; refuses mismatched vocabularies."""
    name = spec.drafter
    if name == "self":
        return LMDrafter(target.shared_copy(), spec.mode)
    if name == "default":
        raise YggError(
            "no trained default drafter ships yet; use --drafter self, a drafter path, "
            "or --no-speculate"
        )
    path = Path(name).expanduser()
    from .eagle import is_eagle_dir, load_eagle  # the feature-conditioned head

    if path.is_dir() and is_eagle_dir(path):
        return load_eagle(path, target, spec.mode, max_depth=spec.tree.draft_depth)
    src = resolve_model(name)
    model = load_model(src, spec.dtype)
    check_pair(target.cfg.vocab_size, model.cfg.vocab_size, tokenizer, load_tokenizer(src), str(path))
    return LMDrafter(model, spec.mode)


def build_engine(spec: EngineSpec):
    """Load the target, its tokenizer and the drafter; build and warm up the engine."""
    if spec.drafter:
        spec.tree.validate()  # impossible trees are refused before anything loads
    src = resolve_model(spec.model)
    target = load_model(src, spec.dtype)
    tokenizer = load_tokenizer(src)
    drafter = load_drafter(spec, target, tokenizer) if spec.drafter else None
    cfg = EngineConfig(
        mode=spec.mode,
        max_context=spec.max_context,
        prefill_chunk=spec.prefill_chunk,
        tree=spec.tree if drafter is not None else None,
    )
    eos = tuple(target.cfg.eos_token_ids) or (
        (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    )
    return Engine(target, cfg, drafter, eos), tokenizer
