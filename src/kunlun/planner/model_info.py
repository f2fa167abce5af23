"""A model's shape and sizes, from its ``config.json`` alone (weights optional).

:func:`inspect_config` counts parameters the way the Llama/Qwen decoders are built:
embeddings, an untied LM head, attention with grouped-query key/value heads and the q/k/v
biases of Qwen2, Qwen3's per-head q/k RMSNorm, the gated MLP and the RMSNorms. From that
count it derives weight bytes per dtype (and per weight quantization), and the KV-cache bytes
per token. :func:`locate_model` finds a model by catalog alias, local directory, or the name
of a configuration shipped under ``examples/models`` (planning needs no weights).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kunlun.catalog import resolve
from kunlun.errors import Location, ModelError, ModelFileMissing, UnsupportedArchitecture
from kunlun.state.store import StateStore

#: Decoder architectures Kunlun plans for: the ones the embedded engine implements
#: (kept equal to ``kunlun.engine.config.SUPPORTED_ARCHITECTURES``, which needs torch).
ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

#: Bytes per element of each dtype in the vocabulary of :mod:`kunlun.device.dtypes`.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "int4": 0.5,
}

_BIASED = ("LlamaForCausalLM", "Qwen3ForCausalLM")
_TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

#: Weight quantization schemes: bytes per linear weight, and the scale overhead per weight.
#: w8a8: int8 weights with one 16-bit scale per output channel; w4a16: 4-bit weights with
#: one 16-bit scale per group of 128 (the usual GPTQ/AWQ layout).
QUANTIZATION_SCHEMES: tuple[str, ...] = ("none", "w8a8", "w4a16")
_GROUP_SIZE = 128


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
class ModelInfo:
    """What planning needs to know about one model (all counts are whole-model)."""

    name: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    """``max_position_embeddings``: the longest context the model was trained for."""
    tie_word_embeddings: bool
    checkpoint_dtype: str | None
    """The dtype the weights were saved in (``torch_dtype``), when the config says."""
    quantization: CheckpointQuantization | None
    parameters: dict[str, int]
    """Parameter count per part: embedding, lm_head, attention, mlp, norms."""
    num_parameters: int
    """Their sum."""
    linear_parameters: int
    """Parameters in the decoder layers' projection matrices (what w8a8/w4a16 quantize)."""
    linear_out_channels: int
    """Sum of the output rows of those matrices (one per-channel scale each)."""
    path: str | None = None
    """The directory the config came from."""

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Bytes of keys and values one token takes in the KV cache, all layers."""
        return int(2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype])

    def weight_bytes(self, dtype: str, quantization: str = "none") -> int:
        """Bytes of all weights when run in ``dtype`` with weight ``quantization``.

        Quantization covers the projection matrices of the decoder layers; embeddings, the LM
        head, biases and norms stay in ``dtype``.
        """
        element = DTYPE_BYTES[dtype]
        if quantization == "none":
            return int(self.num_parameters * element)
        rest = (self.num_parameters - self.linear_parameters) * element
        if quantization == "w8a8":
            return int(self.linear_parameters * 1 + self.linear_out_channels * 2 + rest)
        if quantization == "w4a16":
            scales = self.linear_parameters / _GROUP_SIZE * 2
            return int(self.linear_parameters * 0.5 + scales + rest)
        raise ValueError(f"unknown quantization {quantization!r}")

    def flops_per_token(self) -> int:
        """Flops of one decoded token: 2 per weight of every matrix multiply (the layers' and
        the LM head's, tied or not; the embedding is a lookup), attention scores excluded."""
        matmul = self.parameters["attention"] + self.parameters["mlp"]
        return 2 * (matmul + self.vocab_size * self.hidden_size)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "architecture": self.architecture,
            "num_parameters": self.num_parameters,
            "parameters": dict(self.parameters),
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_context": self.max_context,
            "tie_word_embeddings": self.tie_word_embeddings,
            "checkpoint_dtype": self.checkpoint_dtype,
            "quantization": None if self.quantization is None else vars(self.quantization),
            "weight_bytes": {d: self.weight_bytes(d) for d in ("fp32", "bf16", "fp16")},
            "kv_bytes_per_token": {d: self.kv_bytes_per_token(d) for d in ("fp32", "bf16")},
        }


def inspect_config(raw: dict[str, Any], name: str, source: str = "config.json") -> ModelInfo:
    """A :class:`ModelInfo` from the parsed ``config.json``; errors name ``source`` and field."""
    names = raw.get("architectures") or []
    architecture = names[0] if isinstance(names, list) and names else None
    if architecture not in ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"architecture {architecture!r} is not supported; supported: "
            + ", ".join(ARCHITECTURES),
            location=Location(source, field="architectures"),
        )
    field = _FieldReader(raw, source)
    hidden = field.positive("hidden_size")
    heads = field.positive("num_attention_heads")
    kv_heads = field.positive("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ModelError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}",
            location=Location(source, field="num_key_value_heads"),
        )
    head_dim = field.positive("head_dim", hidden // heads)
    layers = field.positive("num_hidden_layers")
    inter = field.positive("intermediate_size")
    vocab = field.positive("vocab_size")
    tied = bool(raw.get("tie_word_embeddings", False))
    # Biases as transformers builds them: Qwen2 always has q/k/v biases and no others; Llama
    # and Qwen3 put ``attention_bias`` on q/k/v/o, Llama ``mlp_bias`` on the MLP; Mistral none.
    qwen2 = architecture == "Qwen2ForCausalLM"
    o_bias = architecture in _BIASED and bool(raw.get("attention_bias", False))
    qkv_bias = qwen2 or o_bias
    mlp_bias = architecture == "LlamaForCausalLM" and bool(raw.get("mlp_bias", False))
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    attention = hidden * (q_rows + 2 * kv_rows) + q_rows * hidden
    attention += (q_rows + 2 * kv_rows) * qkv_bias + hidden * o_bias
    if architecture == "Qwen3ForCausalLM":
        attention += 2 * head_dim  # q_norm and k_norm, one weight vector each
    mlp = 3 * hidden * inter + (2 * inter + hidden) * mlp_bias
    parameters = {
        "embedding": vocab * hidden,
        "lm_head": 0 if tied else vocab * hidden,
        "attention": layers * attention,
        "mlp": layers * mlp,
        "norms": layers * 2 * hidden + hidden,
    }
    return ModelInfo(
        name=name,
        architecture=architecture,
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=vocab,
        max_context=field.positive("max_position_embeddings", 2048),
        tie_word_embeddings=tied,
        checkpoint_dtype=_TORCH_DTYPES.get(str(raw.get("torch_dtype") or raw.get("dtype"))),
        quantization=_quantization(raw.get("quantization_config"), source),
        parameters=parameters,
        num_parameters=sum(parameters.values()),
        linear_parameters=layers
        * (hidden * (q_rows + 2 * kv_rows) + q_rows * hidden + 3 * hidden * inter),
        linear_out_channels=layers * (q_rows + 2 * kv_rows + hidden + 2 * inter + hidden),
    )


def inspect_model(model_dir: str | Path, name: str | None = None) -> ModelInfo:
    """Read ``model_dir/config.json`` into a :class:`ModelInfo`."""
    root = Path(model_dir)
    path = root / "config.json"
    if not path.is_file():
        raise ModelFileMissing(
            "no config.json in the model directory", location=Location(str(root))
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot parse config.json: {exc}", location=Location(str(path))) from exc
    if not isinstance(raw, dict):
        raise ModelError("config.json is not a JSON object", location=Location(str(path)))
    info = inspect_config(raw, name or root.name, str(path))
    return ModelInfo(**{**vars(info), "path": str(root)})


class _FieldReader:
    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def positive(self, name: str, default: int | None = None) -> int:
        value = self.raw.get(name)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            problem = "is missing" if value is None else f"={value!r} is not a positive integer"
            raise ModelError(f"{name} {problem}", location=Location(self.source, field=name))
        return value


def _quantization(config: Any, source: str) -> CheckpointQuantization | None:
    if config is None:
        return None
    if not isinstance(config, dict) or not isinstance(config.get("quant_method"), str):
        raise ModelError(
            f"quantization_config must be an object with a quant_method, got {config!r}",
            location=Location(source, field="quantization_config"),
        )
    method = config["quant_method"]
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


# ---- finding a model by name ----


def examples_dirs() -> list[Path]:
    """Where shipped model configurations live: ``examples/models`` of the source tree, then
    of the current directory."""
    tree = Path(__file__).resolve().parents[3] / "examples" / "models"
    return [p for p in (tree, Path.cwd() / "examples" / "models") if p.is_dir()]


def example_names() -> list[str]:
    return sorted(
        {p.name for d in examples_dirs() for p in d.iterdir() if (p / "config.json").is_file()}
    )


def find_example(name: str) -> Path | None:
    """The shipped configuration directory called ``name`` (case-insensitive), or None."""
    for directory in examples_dirs():
        for entry in directory.iterdir():
            if entry.name.lower() == name.lower() and (entry / "config.json").is_file():
                return entry
    return None


def locate_model(store: StateStore | None, name: str) -> tuple[str, Path]:
    """``(name, directory)`` of a model: a catalog alias, a local directory with a
    ``config.json``, or a configuration shipped under ``examples/models`` (no weights).

    Raises the catalog's :class:`ModelError` (listing aliases and shipped names) when none
    matches.
    """
    if store is not None:
        try:
            record = resolve(store, name)
            return record.alias, Path(record.path)
        except ModelFileMissing:
            raise
        except ModelError as exc:
            example = find_example(name)
            if example is None:
                shipped = ", ".join(example_names()) or "none"
                raise ModelError(
                    f"{exc.message}; shipped configurations: {shipped}", hint=exc.hint
                ) from None
            return example.name, example
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path.name, path.resolve()
    example = find_example(name)
    if example is None:
        shipped = ", ".join(example_names()) or "none"
        raise ModelError(
            f"unknown model {name!r}: not a local directory with a config.json; "
            f"shipped configurations: {shipped}"
        )
    return example.name, example
