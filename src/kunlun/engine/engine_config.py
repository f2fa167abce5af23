"""The settings of one engine: model, device, KV cache and step limits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kunlun.engine.launch import DEFAULT_MAX_NUM_SEQS
from kunlun.engine.native import wanted_path
from kunlun.engine.quant import make_spec
from kunlun.errors import ConfigError


@dataclass
class EngineConfig:
    """Everything needed to build an :class:`LLMEngine`."""

    model_dir: str | Path
    """A Hugging Face model directory (config.json, safetensors, tokenizer.json)."""
    device: str = "cpu"
    """Torch device string from the device plugin: cpu, cuda:0, npu:0, mlu:0, ..."""
    dtype: torch.dtype = torch.float32
    """Weights and KV dtype (float32, bfloat16, float16)."""
    block_size: int = 16
    """Token slots per KV block (>= 1)."""
    num_blocks: int | None = None
    """KV blocks; None: sized by the runner from ``kv_cache_memory_bytes`` or its default."""
    kv_cache_memory_bytes: int | None = None
    """Memory for the KV cache when ``num_blocks`` is None (> 0)."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output); None: the model's max_position_embeddings."""
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    """Most sequences running in one step (>= 1)."""
    max_num_batched_tokens: int = 1024
    """Token budget of one step, prefill chunks and decodes together (>= 1)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of prompt prefixes already computed."""
    num_threads: int | None = None
    """CPU threads for torch; None leaves torch's default."""
    seed: int = 0
    """Seeds the generator shared by requests that bring no seed of their own."""
    quantization: str = "none"
    """Weight quantization, one of :data:`kunlun.engine.quant.SCHEMES`; a checkpoint already
    quantized (``quant_method`` kunlun) runs in its own scheme whatever this says, unless it
    names a different one (an error)."""
    group_size: int | None = None
    """w4a16 only: 32 or 128; None: the checkpoint's, or 128 when the layers allow, else 32."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (>= 1; one process per rank, see
    :mod:`kunlun.engine.tp_group`); the heads must split as :mod:`kunlun.engine.tp_layout`
    says."""
    distributed_backend: str | None = None
    """``torch.distributed`` backend of the group (gloo, nccl, hccl, ...), from the device
    plugin; needed when ``tensor_parallel_size > 1``."""
    decode_path: str | None = None
    """Which decode step runs: ``auto`` (the compiled one where it builds and the model
    qualifies), ``compiled`` (an error where it cannot), ``python`` (the reference path);
    None: ``$KUNLUN_DECODE_PATH``, else auto (:mod:`kunlun.engine.native`)."""
    chat_template: str | None = None
    """A chat template (jinja2 text) the tokenizer uses instead of the model's own; None:
    the model's (:mod:`kunlun.workload.chat_template`)."""
    graph_batch_sizes: tuple[int, ...] = ()
    """Decode steps on static buffers of these batch sizes, captured as device graphs where
    the device can (:mod:`kunlun.engine.graphs`; the plan sets them on devices whose plugin
    declares graph capture); empty: none. Each size within ``max_num_seqs``."""

    def validate(self) -> EngineConfig:
        """Raise :class:`ConfigError` naming the first bad field and its value."""
        positive = {
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }
        optional = {
            "num_blocks": self.num_blocks,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "max_model_len": self.max_model_len,
            "num_threads": self.num_threads,
        }
        for name, value in [*positive.items(), *optional.items()]:
            if (value is not None or name in positive) and not (
                isinstance(value, int) and not isinstance(value, bool) and value >= 1
            ):
                raise ConfigError(
                    f"engine setting {name}={value!r} is invalid: expected an integer >= 1"
                )
        make_spec(self.quantization, self.group_size)
        wanted_path(self.decode_path)
        sizes = self.graph_batch_sizes
        if any(isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= self.max_num_seqs
               for s in sizes):  # fmt: skip
            raise ConfigError(
                f"engine setting graph_batch_sizes={list(sizes)} is invalid: expected integers "
                f"from 1 to max_num_seqs={self.max_num_seqs}"
            )
        tp = self.tensor_parallel_size
        if not (isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1):
            raise ConfigError(
                f"engine setting tensor_parallel_size={tp!r} is invalid: expected an integer >= 1"
            )
        if tp > 1 and not self.distributed_backend:
            raise ConfigError(
                f"engine setting tensor_parallel_size={tp} needs distributed_backend (the "
                "device plugin's torch.distributed backend, e.g. gloo for cpu)"
            )
        return self
