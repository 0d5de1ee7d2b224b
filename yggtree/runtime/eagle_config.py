"""An EAGLE head's configuration and files: the architecture record (``config.json``), the checks
that a head fits its target, and the draft-vocabulary map's checks. The network and the drafter
that run it are in :mod:`yggtree.runtime.eagle`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import YggError
from .model import ModelConfig, RopeScaling

__all__ = ["EagleConfig", "is_eagle_dir", "check_vocab_map", "CONFIG_FILE", "WEIGHTS_FILE"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class EagleConfig:
    """Architecture of an EAGLE head and the target it was made for."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    target_layers: tuple[int, ...]  # target decoder layers whose outputs are the features
    vocab_size: int  # the target's vocabulary (tokens are target ids)
    draft_vocab_size: int  # V_d: rows of the drafter's LM head
    target_hidden_size: int
    target_num_layers: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    shares_embedding: bool = True  # use the target's embed_tokens (not stored with the head)
    input_norm: bool = False  # RMSNorm the embedding and the feature before fc (EAGLE-3 style)
    num_layers: int = 1  # decoder layers of the head (a config file without the field: 1)

    def __post_init__(self) -> None:
        n = self.num_layers
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"num_layers must be an integer >= 1, got {n!r}")

    def layer_config(self) -> ModelConfig:
        """One decoder layer (each of the ``num_layers`` is alike) as a 1-layer :class:`ModelConfig`."""
        return ModelConfig(
            vocab_size=self.draft_vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
        )

    def to_json(self) -> dict:
        """The config.json content. ``num_layers`` is written only when it is not 1, so a one-layer
        head's config (and with it the drafter identity that profiles are keyed on: shapes, not
        weights) is byte-identical to those written before the field existed."""
        return {
            "kind": "eagle",
            "hidden_size": self.hidden_size,
            "target_hidden_size": self.target_hidden_size,
            "target_layers": list(self.target_layers),
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": asdict(self.rope_scaling),
            "shares_embedding": self.shares_embedding,
            "input_norm": self.input_norm,
            **({"num_layers": self.num_layers} if self.num_layers != 1 else {}),
            "target": {
                "vocab_size": self.vocab_size,
                "hidden_size": self.target_hidden_size,
                "num_layers": self.target_num_layers,
            },
        }

    @staticmethod
    def from_json(d: dict, where: Path) -> "EagleConfig":
        if not isinstance(d, dict) or d.get("kind") != "eagle":
            raise YggError(f"{where} is not an EAGLE drafter config (expected \"kind\": \"eagle\")")
        try:
            tgt = d["target"]
            if int(tgt["vocab_size"]) != int(d["vocab_size"]) or int(tgt["hidden_size"]) != int(
                d["target_hidden_size"]
            ):
                raise YggError(
                    f"{where}: the target fingerprint {tgt} disagrees with vocab_size "
                    f"{d['vocab_size']} / target_hidden_size {d['target_hidden_size']}"
                )
            return EagleConfig(
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_heads=int(d["num_heads"]),
                num_kv_heads=int(d["num_kv_heads"]),
                head_dim=int(d["head_dim"]),
                target_layers=tuple(int(i) for i in d["target_layers"]),
                vocab_size=int(d["vocab_size"]),
                draft_vocab_size=int(d["draft_vocab_size"]),
                target_hidden_size=int(d["target_hidden_size"]),
                target_num_layers=int(tgt["num_layers"]),
                rms_norm_eps=float(d["rms_norm_eps"]),
                rope_theta=float(d["rope_theta"]),
                rope_scaling=RopeScaling(**d.get("rope_scaling", {})),
                shares_embedding=bool(d["shares_embedding"]),
                input_norm=bool(d.get("input_norm", False)),
                num_layers=d.get("num_layers", 1),
            )
        except KeyError as e:
            raise YggError(f"{where}: missing key {e}") from None
        except (TypeError, ValueError) as e:
            raise YggError(f"{where}: bad value: {e}") from None

    def check_target(self, target: ModelConfig, where: Path) -> None:
        """Refuse a target this head was not made for (naming ``where``)."""
        if self.hidden_size != target.hidden_size or self.target_hidden_size != target.hidden_size:
            raise YggError(
                f"{where}: hidden size {self.hidden_size} (target hidden size "
                f"{self.target_hidden_size}) does not match the target's hidden size "
                f"{target.hidden_size}"
            )
        if self.vocab_size != target.vocab_size:
            raise YggError(
                f"{where}: made for a target vocabulary of {self.vocab_size}, "
                f"the target has {target.vocab_size}"
            )
        if self.target_num_layers != target.num_layers:
            raise YggError(
                f"{where}: made for a target with {self.target_num_layers} layers, "
                f"the target has {target.num_layers}"
            )
        if not self.target_layers:
            raise YggError(f"{where}: target_layers is empty")
        for i in self.target_layers:
            if not 0 <= i < target.num_layers:
                raise YggError(
                    f"{where}: target layer index {i} is out of range "
                    f"(the target has {target.num_layers} layers: 0..{target.num_layers - 1})"
                )
        if len(set(self.target_layers)) != len(self.target_layers):
            raise YggError(f"{where}: target_layers {list(self.target_layers)} has duplicates")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise YggError(
                f"{where}: draft_vocab_size {self.draft_vocab_size} is outside 1..{self.vocab_size}"
            )


def check_vocab_map(vmap: torch.Tensor, v_d: int, vocab: int, where: Path) -> None:
    if vmap.dim() != 1 or vmap.shape[0] != v_d:
        raise YggError(
            f"{where}: draft_vocab has shape {list(vmap.shape)}, expected [{v_d}] "
            f"(draft_vocab_size)"
        )
    if vmap.dtype.is_floating_point or vmap.dtype == torch.bool:
        raise YggError(f"{where}: draft_vocab has dtype {vmap.dtype}, expected an integer type")
    if v_d and (int(vmap.min()) < 0 or int(vmap.max()) >= vocab):
        raise YggError(
            f"{where}: draft_vocab maps to target ids {int(vmap.min())}..{int(vmap.max())}, "
            f"outside the target vocabulary 0..{vocab - 1}"
        )
    if torch.unique(vmap).shape[0] != v_d:
        raise YggError(f"{where}: draft_vocab maps two draft ids to the same target id")


def is_eagle_dir(path: str | Path) -> bool:
    """True if ``path`` is a directory holding an EAGLE head (config.json with kind "eagle")."""
    p = Path(path) / CONFIG_FILE
    try:
        return p.is_file() and json.loads(p.read_text()).get("kind") == "eagle"
    except (OSError, ValueError, AttributeError):
        return False
