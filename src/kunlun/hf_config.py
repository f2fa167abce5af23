"""A Hugging Face ``config.json``, read and checked once for the planner and the engine.

:class:`HFConfig` is every field Kunlun takes from a checkpoint's ``config.json``: the decoder
shape, RoPE, biases, special token ids, the saved dtype and the checkpoint's weight
quantization. The planner (:mod:`kunlun.planner.model_info`) counts parameters and bytes from
it without torch; the engine's :class:`~kunlun.engine.config.ModelConfig` extends it with
what needs torch or the engine's model code. This module imports neither torch nor anything
that does, so planning stays torch-free.

Both the transformers 4.x spelling (``rope_theta``, ``rope_scaling``, ``torch_dtype``) and the
5.x one (``rope_parameters``, ``dtype``) are read. Every error is a :class:`ModelError` whose
location names the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from kunlun.errors import Location, ModelError, ModelFileMissing, UnsupportedArchitecture

#: Decoder architectures Kunlun runs and plans for, by their ``architectures[0]`` name.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

#: Architectures whose ``attention_bias`` puts a bias on q/k/v *and* o (Qwen2's is fixed on
#: q/k/v only; Mistral has none).
_BIASED = ("LlamaForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class CheckpointQuantization:
    """How the checkpoint's weights are already quantized (its ``quantization_config``)."""

    method: str
    """``quant_method``: gptq, awq, fp8, compressed-tensors, bitsandbytes, ..."""
    bits: int | None
    """Weight bits, when the config says."""
    scheme: str
    """The nearest Kunlun scheme: w8a8, w4a16, fp8, or ``other``."""


@dataclass(frozen=True)
class HFConfig:
    """Shape and constants of a Llama-family decoder, as its ``config.json`` states them.

    Biases follow what transformers builds for each architecture, whatever the config's flags
    say about architectures that ignore them.
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
    """Longest context the model was trained for (> 0; 2048 when the config is silent)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: dict[str, Any] | None = None
    """``None`` for plain RoPE (``rope_type`` ``default``), else the scaling parameters with
    ``rope_type`` always set."""
    tie_word_embeddings: bool = False
    """The LM head reuses the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections carry a bias (always for Qwen2; Llama and Qwen3 with
    ``attention_bias``)."""
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
    dtype: str | None = None
    """The dtype the checkpoint was saved in, in transformers' spelling (``bfloat16``), when
    the config says (``dtype``, else ``torch_dtype``)."""
    quantization: CheckpointQuantization | None = None
    """The checkpoint's weight quantization, when it has a ``quantization_config``."""

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Self:
        """Read ``model_dir/config.json``.

        Raises :class:`ModelFileMissing` when the file is absent, :class:`ModelError` when it is
        not a JSON object or a field is missing or out of range, and
        :class:`UnsupportedArchitecture` when the architecture is not one of
        :data:`SUPPORTED_ARCHITECTURES`.
        """
        root = Path(model_dir)
        path = root / "config.json"
        if not path.is_file():
            raise ModelFileMissing(
                "no config.json in the model directory", location=Location(str(root))
            )
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelError(
                f"cannot parse config.json: {exc}", location=Location(str(path))
            ) from exc
        if not isinstance(raw, dict):
            raise ModelError("config.json is not a JSON object", location=Location(str(path)))
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> Self:
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
        # Biases as transformers builds them: Qwen2 always has q/k/v biases and no others;
        # Llama and Qwen3 put ``attention_bias`` on q/k/v/o, Llama ``mlp_bias`` on the MLP;
        # Mistral none.
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        o_bias = architecture in _BIASED and bool(raw.get("attention_bias", False))
        return cls(
            architecture=architecture,
            hidden_size=hidden,
            num_hidden_layers=fields.positive_int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=fields.positive_int("head_dim", default=hidden // heads),
            intermediate_size=fields.positive_int("intermediate_size"),
            vocab_size=fields.positive_int("vocab_size"),
            max_position_embeddings=fields.positive_int("max_position_embeddings", default=2048),
            rms_norm_eps=fields.number("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(fields),
            rope_scaling=_rope_scaling(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or o_bias,
            o_proj_bias=o_bias,
            mlp_bias=architecture == "LlamaForCausalLM" and bool(raw.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            bos_token_id=fields.token_id("bos_token_id"),
            eos_token_ids=fields.token_ids("eos_token_id"),
            dtype=_dtype(raw),
            quantization=_quantization(raw.get("quantization_config"), source),
        )


class _Fields:
    """Typed access to config fields with errors that name the field and the file.

    A field set to ``null`` counts as absent, as transformers treats it.
    """

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def _error(self, name: str, problem: str) -> ModelError:
        return ModelError(problem, location=Location(self.source, field=name))

    def positive_int(self, name: str, default: int | None = None) -> int:
        value = self.raw.get(name)
        if value is None:
            value = default
        if value is None:
            raise self._error(name, f"required field {name!r} is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self._error(name, f"{name}={value!r} is not a positive integer")
        return value

    def number(self, name: str, default: float, within: dict[str, Any] | None = None) -> float:
        value = (self.raw if within is None else within).get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._error(name, f"{name}={value!r} is not a number")
        return float(value)

    def token_id(self, name: str) -> int | None:
        value = self.raw.get(name)
        if value is not None and not _is_int(value):
            raise self._error(name, f"{name}={value!r} is not a token id")
        return value

    def token_ids(self, name: str) -> tuple[int, ...]:
        """A token id or a list of them (``eos_token_id`` may be either); absent is ()."""
        value = self.raw.get(name)
        values = [] if value is None else value if isinstance(value, list) else [value]
        if not all(_is_int(v) for v in values):
            raise self._error(name, f"{name}={value!r} is not a token id or a list of them")
        return tuple(values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


def _dtype(raw: dict[str, Any]) -> str | None:
    value = raw.get("dtype") or raw.get("torch_dtype")
    return value if isinstance(value, str) else None


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's ``rope_parameters``; keyed by layer type, full attention's."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_type" not in params and params:
        params = params.get("full_attention", params)
    return params if isinstance(params, dict) else {}


def _rope_theta(fields: _Fields) -> float:
    if fields.raw.get("rope_theta") is not None:
        return fields.number("rope_theta", 10000.0)
    return fields.number("rope_theta", 10000.0, within=_rope_parameters(fields.raw))


def _rope_scaling(raw: dict[str, Any], source: str) -> dict[str, Any] | None:
    """The RoPE scaling parameters with ``rope_type`` set, or None for plain RoPE. Which
    types are supported is for the engine to say (the planner does not care)."""
    scaling = raw.get("rope_scaling") or _rope_parameters(raw)
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise ModelError(
            f"rope_scaling={scaling!r} is not an object",
            location=Location(source, field="rope_scaling"),
        )
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return None if rope_type == "default" else {**scaling, "rope_type": rope_type}


def _quantization(config: Any, source: str) -> CheckpointQuantization | None:
    if config is None:
        return None
    if not isinstance(config, dict) or not isinstance(config.get("quant_method"), str):
        raise ModelError(
            f"quantization_config must be an object with a quant_method, got {config!r}",
            location=Location(source, field="quantization_config"),
        )
    method = config["quant_method"]
    if method == "kunlun":  # kunlun.engine.quant's format names its scheme
        scheme = config.get("scheme")
        bits = config.get("bits")
        return CheckpointQuantization(
            method,
            bits if isinstance(bits, int) else None,
            scheme if isinstance(scheme, str) else "other",
        )
    bits = config.get("bits") or config.get("w_bit")
    if method == "bitsandbytes":
        bits = 4 if config.get("load_in_4bit") else 8 if config.get("load_in_8bit") else None
    if method == "fp8":
        bits = 8
    if method == "compressed-tensors":
        bits, activations = _compressed_tensors_bits(config)
        scheme = "w8a8" if bits == 8 and activations == 8 else "w4a16" if bits == 4 else "other"
        return CheckpointQuantization(method, bits, scheme)
    bits = int(bits) if isinstance(bits, int) else None
    scheme = (
        "fp8" if method == "fp8" else "w4a16" if bits == 4 else "w8a8" if bits == 8 else "other"
    )
    return CheckpointQuantization(method, bits, scheme)


def _compressed_tensors_bits(config: dict[str, Any]) -> tuple[int | None, int | None]:
    """Weight and input-activation bits of the first config group of compressed-tensors."""
    groups = config.get("config_groups")
    group = next(iter(groups.values()), None) if isinstance(groups, dict) and groups else None
    if not isinstance(group, dict):
        return None, None
    weights = group.get("weights") or {}
    inputs = group.get("input_activations") or {}
    return weights.get("num_bits"), inputs.get("num_bits") if isinstance(inputs, dict) else None
