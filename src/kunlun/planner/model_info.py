"""A model's shape and sizes, from its ``config.json`` alone (weights optional).

The file is read and checked by :mod:`kunlun.hf_config`, as the engine reads it, and without
torch. :func:`inspect_config` counts parameters the way the Llama/Qwen decoders are built:
embeddings, an untied LM head, attention with grouped-query key/value heads and the q/k/v
biases of Qwen2, Qwen3's per-head q/k RMSNorm, the gated MLP and the RMSNorms. From that
count it derives weight bytes per dtype (and per weight quantization), and the KV-cache bytes
per token. :func:`locate_model` finds a model by catalog alias, local directory, or the name
of a configuration shipped under ``examples/models`` (planning needs no weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kunlun.catalog import resolve
from kunlun.device.dtypes import TORCH_NAMES
from kunlun.engine.quant import DEFAULT_GROUP_SIZE
from kunlun.engine.schemes import INT8_SCHEMES, SCHEMES
from kunlun.errors import UnknownModel
from kunlun.hf_config import SUPPORTED_ARCHITECTURES, CheckpointQuantization, HFConfig
from kunlun.state.store import StateStore

#: Decoder architectures Kunlun plans for: the ones the embedded engine implements.
ARCHITECTURES: tuple[str, ...] = SUPPORTED_ARCHITECTURES

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

#: transformers' dtype names -> the dtype vocabulary of :mod:`kunlun.device.dtypes`.
_DTYPE_NAMES = {torch_name: ours for ours, torch_name in TORCH_NAMES.items()}


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

        Quantization (one of :data:`~kunlun.engine.quant.SCHEMES`, whose module owns the
        format) covers the projection matrices of the decoder layers: w8a8 and w8a16 store
        int8 weights with one float32 scale per output channel, w4a16 4-bit weights with a
        float32 scale and minimum per group (of 128 when the platform quantizes). Embeddings,
        the LM head, biases and norms stay in ``dtype``.
        """
        element = DTYPE_BYTES[dtype]
        if quantization == "none":
            return int(self.num_parameters * element)
        rest = (self.num_parameters - self.linear_parameters) * element
        if quantization in INT8_SCHEMES:
            return int(self.linear_parameters * 1 + self.linear_out_channels * 4 + rest)
        if quantization == "w4a16":
            scales = self.linear_parameters / DEFAULT_GROUP_SIZE * 2 * 4
            return int(self.linear_parameters * 0.5 + scales + rest)
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {SCHEMES}")

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
    return _info(HFConfig.from_dict(raw, source=source), name)


def inspect_model(model_dir: str | Path, name: str | None = None) -> ModelInfo:
    """Read ``model_dir/config.json`` into a :class:`ModelInfo`."""
    root = Path(model_dir)
    return _info(HFConfig.from_dir(root), name or root.name, str(root))


def _info(config: HFConfig, name: str, path: str | None = None) -> ModelInfo:
    """Count the parameters of ``config``'s decoder as transformers builds it."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    layers, head_dim = config.num_hidden_layers, config.head_dim
    q_rows = config.num_attention_heads * head_dim
    kv_rows = config.num_key_value_heads * head_dim
    attention = hidden * (q_rows + 2 * kv_rows) + q_rows * hidden
    attention += (q_rows + 2 * kv_rows) * config.attention_bias + hidden * config.o_proj_bias
    if config.qk_norm:
        attention += 2 * head_dim  # q_norm and k_norm, one weight vector each
    mlp = 3 * hidden * inter + (2 * inter + hidden) * config.mlp_bias
    tied = config.tie_word_embeddings
    parameters = {
        "embedding": vocab * hidden,
        "lm_head": 0 if tied else vocab * hidden,
        "attention": layers * attention,
        "mlp": layers * mlp,
        "norms": layers * 2 * hidden + hidden,
    }
    return ModelInfo(
        name=name,
        architecture=config.architecture,
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=vocab,
        max_context=config.max_position_embeddings,
        tie_word_embeddings=tied,
        checkpoint_dtype=_DTYPE_NAMES.get(config.dtype or ""),
        quantization=config.quantization,
        parameters=parameters,
        num_parameters=sum(parameters.values()),
        linear_parameters=layers
        * (hidden * (q_rows + 2 * kv_rows) + q_rows * hidden + 3 * hidden * inter),
        linear_out_channels=layers * (q_rows + 2 * kv_rows + hidden + 2 * inter + hidden),
        path=path,
    )


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

    Raises :class:`UnknownModel` (listing aliases and shipped names) when none matches.
    """
    if store is not None:
        try:
            record = resolve(store, name)
            return record.alias, Path(record.path)
        except UnknownModel as exc:
            example = find_example(name)
            if example is None:
                shipped = ", ".join(example_names()) or "none"
                raise UnknownModel(
                    f"{exc.message}; shipped configurations: {shipped}", hint=exc.hint
                ) from None
            return example.name, example
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path.name, path.resolve()
    example = find_example(name)
    if example is None:
        shipped = ", ".join(example_names()) or "none"
        raise UnknownModel(
            f"unknown model {name!r}: not a local directory with a config.json; "
            f"shipped configurations: {shipped}"
        )
    return example.name, example
