"""The model's shape, read from a Hugging Face ``config.json``.

:class:`ModelConfig` is what the model code, the loader and the runner need to know about a
checkpoint, and nothing else. Both the transformers 4.x spelling (``rope_theta``,
``rope_scaling``, ``torch_dtype``) and the 5.x one (``rope_parameters``, ``dtype``) are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kunlun.errors import Location, ModelError, ModelFileMissing, UnsupportedArchitecture

#: Architectures the engine's model code runs, by their ``architectures[0]`` name.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

#: RoPE scaling types the rotary embedding implements (``None`` is plain RoPE).
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and constants of a Llama-family decoder.

    Sliding-window attention (Mistral's ``sliding_window``, Qwen2's ``use_sliding_window``) is
    not implemented: every layer uses full causal attention, which is exact for any context
    up to the window size and is what transformers' sdpa path does for these models when the
    window is not reached.
    """

    architecture: str
    """``architectures[0]`` of the checkpoint; one of :data:`SUPPORTED_ARCHITECTURES`."""
    hidden_size: int
    """Width of the residual stream (> 0)."""
    num_hidden_layers: int
    """Number of decoder layers (> 0)."""
    num_attention_heads: int
    """Query heads per layer (> 0)."""
    num_key_value_heads: int
    """Key/value heads per layer; divides ``num_attention_heads`` (GQA when smaller)."""
    head_dim: int
    """Width of one head: explicit in the config or ``hidden_size // num_attention_heads``."""
    intermediate_size: int
    """Width of the gated MLP (> 0)."""
    vocab_size: int
    """Rows of the embedding and of the LM head (> 0)."""
    max_position_embeddings: int
    """Longest context the model was trained for (> 0)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: dict[str, Any] | None = None
    """``None`` for plain RoPE, else a dict with ``rope_type`` in :data:`SUPPORTED_ROPE_TYPES`."""
    tie_word_embeddings: bool = False
    """The LM head reuses the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections carry a bias (always true for Qwen2)."""
    o_proj_bias: bool = False
    """The attention output projection carries a bias (Llama and Qwen3 with
    ``attention_bias``; never Qwen2, whose bias is on q/k/v only)."""
    mlp_bias: bool = False
    """The MLP projections carry a bias (Llama's ``mlp_bias``)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id, when the config names one."""
    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence token ids (the config's ``eos_token_id``, an int or a list)."""
    torch_dtype: torch.dtype | None = None
    """The dtype the checkpoint was saved in, when the config says."""

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``model_dir/config.json``.

        Raises :class:`ModelFileMissing` when the file is absent, :class:`ModelError` when it is
        not JSON or a field is missing or out of range, and :class:`UnsupportedArchitecture`
        when the architecture is not one of :data:`SUPPORTED_ARCHITECTURES`.
        """
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelFileMissing(f"model config not found: {path}", location=Location(str(path)))
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelError(f"cannot parse {path}: {exc}", location=Location(str(path))) from exc
        if not isinstance(raw, dict):
            raise ModelError("config.json is not a JSON object", location=Location(str(path)))
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Build from the parsed JSON of a ``config.json``; ``source`` names it in errors."""
        architecture = _architecture(raw, source)
        fields = _Fields(raw, source)
        hidden = fields.positive_int("hidden_size")
        heads = fields.positive_int("num_attention_heads")
        kv_heads = fields.positive_int("num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise ModelError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}",
                location=Location(source, field="num_key_value_heads"),
            )
        head_dim = raw.get("head_dim") or hidden // heads
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        return cls(
            architecture=architecture,
            hidden_size=hidden,
            num_hidden_layers=fields.positive_int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            intermediate_size=fields.positive_int("intermediate_size"),
            vocab_size=fields.positive_int("vocab_size"),
            max_position_embeddings=fields.positive_int("max_position_embeddings", default=2048),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            rope_scaling=_rope_scaling(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or bool(raw.get("attention_bias", False)),
            o_proj_bias=not is_qwen2 and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
            torch_dtype=_DTYPES.get(str(raw.get("dtype") or raw.get("torch_dtype"))),
        )


class _Fields:
    """Typed access to config fields with errors that name the field and the file."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def positive_int(self, name: str, default: int | None = None) -> int:
        value = self.raw.get(name, default)
        if value is None:
            raise ModelError(
                f"required field {name!r} is missing", location=Location(self.source, field=name)
            )
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelError(
                f"{name}={value!r} is not a positive integer",
                location=Location(self.source, field=name),
            )
        return value


def _architecture(raw: dict[str, Any], source: str) -> str:
    names = raw.get("architectures") or []
    name = names[0] if isinstance(names, list) and names else None
    if name not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"architecture {name!r} is not supported; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES),
            location=Location(source, field="architectures"),
        )
    return str(name)


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_type" not in params and params:
        # transformers 5 may key rope parameters by layer type; take full attention's
        params = params.get("full_attention", params)
    return params if isinstance(params, dict) else {}


def _rope_theta(raw: dict[str, Any]) -> float:
    theta = raw.get("rope_theta", _rope_parameters(raw).get("rope_theta", 10000.0))
    return float(theta)


def _rope_scaling(raw: dict[str, Any], source: str) -> dict[str, Any] | None:
    scaling = raw.get("rope_scaling") or _rope_parameters(raw)
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelError(
            f"rope scaling type {rope_type!r} is not supported; supported: "
            + ", ".join(SUPPORTED_ROPE_TYPES),
            location=Location(source, field="rope_scaling"),
        )
    if rope_type == "default":
        return None
    for key in (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ):
        if key not in scaling:
            raise ModelError(
                f"llama3 rope scaling needs {key!r}",
                location=Location(source, field=f"rope_scaling.{key}"),
            )
    return {**scaling, "rope_type": rope_type}


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
