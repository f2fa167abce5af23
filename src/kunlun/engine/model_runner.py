"""The model runner: one forward pass over a batch of sequences with a paged KV cache.

This is the seam between the scheduler side of the engine and the model side. The caller
says, per sequence, which tokens to compute this step and which KV blocks hold its context
(:class:`StepSeq`); the runner turns that into one flat batch, runs the model, and returns
the logits at each sequence's last new position (:class:`StepOutput`). The runner owns the
model, the tokenizer and the KV cache; it keeps no per-sequence state between steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kunlun.engine.attention import AttentionContext, DecodeBatch, PrefillSegment
from kunlun.engine.config import ModelConfig
from kunlun.engine.device import resolve_device
from kunlun.engine.graphs import GraphedDecoder, graphed_decoder
from kunlun.engine.loader import load_weights, stored_quantized_layers
from kunlun.engine.models import build_model, materialize
from kunlun.engine.models.llama import LlamaForCausalLM
from kunlun.engine.models.quant_linear import quantize_linears
from kunlun.engine.native import native_ops
from kunlun.engine.native.decoder import CompiledDecoder, compiled_decoder
from kunlun.engine.outputs import DecodeTime
from kunlun.engine.parallel import SINGLE, TPGroup
from kunlun.engine.preflight import check_max_model_len, raise_if_quantized_split
from kunlun.engine.quant import read_spec, resolve_spec
from kunlun.engine.smooth import smoothed_tensors
from kunlun.engine.step_batch import StepBatch, StepRow
from kunlun.engine.step_profiler import NO_TRACE, StepTrace
from kunlun.engine.tokenizer import Tokenizer
from kunlun.engine.tp_layout import head_split, max_kv_heads_per_rank
from kunlun.errors import ConfigError, EngineError

#: Default KV cache budget when neither ``num_blocks`` nor ``kv_cache_memory_bytes`` is given.
DEFAULT_KV_BUDGET_BYTES = 1 << 30

log = logging.getLogger(__name__)


@dataclass
class StepSeq:
    """What one sequence computes in a step."""

    token_ids: list[int]
    """The sequence's full token list so far (prompt + generated)."""
    num_computed: int
    """Tokens already in the KV cache (prefix-cache hits + earlier chunks)."""
    num_new: int
    """Compute ``token_ids[num_computed : num_computed + num_new]`` this step (>= 1)."""
    block_table: list[int]
    """KV block ids covering positions ``[0, num_computed + num_new)``."""
    want_prompt_logits: bool = False
    """Also return logits for every new position."""


@dataclass
class StepOutput:
    """Result of one step, in the order of the step's sequences."""

    logits: torch.Tensor
    """float32 [len(seqs), vocab]: logits at each sequence's last new position."""
    prompt_logits: list[torch.Tensor | None]
    """Per sequence: float32 [num_new, vocab] when asked for, else ``None``."""
    hidden: list[torch.Tensor] | None = None
    """A pooling step's (:meth:`ModelRunner.hidden_states`): per sequence, the final-norm
    hidden states [num_new, hidden] of its new tokens, in the model's dtype (no logits)."""


class ModelRunner:
    """Loads a model directory and runs steps over it with a paged KV cache."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        max_model_len: int | None = None,
        num_threads: int | None = None,
        group: TPGroup = SINGLE,
        quantization: str = "none",
        group_size: int | None = None,
        decode_path: str | None = None,
        graph_batch_sizes: tuple[int, ...] = (),
    ) -> None:
        """Load config, tokenizer and weights from ``model_dir`` and allocate the KV cache.

        The KV cache holds ``num_blocks`` blocks, or as many as fit in
        ``kv_cache_memory_bytes`` (pass at most one); by default enough for four sequences
        of ``max_model_len`` tokens, within 1 GiB. ``max_model_len`` defaults to the model's
        ``max_position_embeddings`` and may not exceed it. ``num_threads`` sets torch's
        intra-op thread count. ``group`` is this process's rank in a tensor-parallel group:
        the model holds that rank's slices and the KV cache that rank's KV heads.
        ``quantization`` and ``group_size`` are
        :class:`~kunlun.engine.engine_config.EngineConfig`'s (see :func:`resolve_spec`);
        quantized weights run on one rank only for now (a :class:`ConfigError` otherwise).
        ``decode_path`` chooses the decode step (:mod:`kunlun.engine.native`); which one runs,
        and why, is logged and kept in :attr:`decode_status`. ``graph_batch_sizes`` (the
        plan's, on a device whose plugin declares graph capture) runs decode steps on static
        buffers of those batch sizes instead (:mod:`kunlun.engine.graphs`), captured as CUDA
        graphs on a CUDA device and run uncaptured elsewhere (the suite's check on a CPU).
        """
        if num_threads is not None:
            if num_threads < 1:
                raise ConfigError(f"num_threads={num_threads} must be >= 1")
            torch.set_num_threads(num_threads)
        if block_size < 1:
            raise ConfigError(f"block_size={block_size} must be >= 1")
        self.device = resolve_device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.config = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer(model_dir)
        self.group = group
        self.num_kv_heads = max_kv_heads_per_rank(
            self.config.num_attention_heads, self.config.num_key_value_heads, group.size
        )
        """KV heads per rank's cache (the most any rank holds, so every rank has as many blocks)."""
        self.max_model_len = check_max_model_len(max_model_len, self.config)
        self.quant_spec = resolve_spec(model_dir, quantization, group_size, self.config)
        """The weights' quantization (None: floating point)."""
        if self.quant_spec is not None:
            raise_if_quantized_split(self.quant_spec.scheme, group.size)
        quantized_on_cpu = self.quant_spec is not None and self.device.type == "cpu"
        activations = str(dtype).removeprefix("torch.")  # the measured choice is per dtype
        self._native_ops = native_ops(decode_path, activations) if quantized_on_cpu else frozenset()
        """Kunlun's own kernels the quantized layers may run (the library's measured choice)."""
        self.model = self._load_model(Path(model_dir))
        self.num_blocks = self._num_blocks(num_blocks, kv_cache_memory_bytes)
        self._scratch_blocks = 1 if graph_batch_sizes else 0  # padding rows of static steps
        self._allocate_kv_cache()
        self.compiled: CompiledDecoder | GraphedDecoder | None
        self.decode_status, self.compiled = compiled_decoder(self.model, group.size, decode_path)
        if graph_batch_sizes:
            self.decode_status, self.compiled = graphed_decoder(
                self.model, graph_batch_sizes, group.size, self.max_model_len, self.block_size,
                scratch_block=self.num_blocks,
            )  # fmt: skip
        log.info("decode path: %s (%s)", self.decode_status.path, self.decode_status.reason)
        self.decode_time = DecodeTime(self.decode_status.path)
        """The forward time of decode-only steps (the engine adds their wall time)."""
        self.trace: StepTrace = NO_TRACE
        """The current step's trace; the engine sets it when it profiles (a no-op otherwise)."""
        self.step_hook: Callable[[StepBatch], None] | None = None
        """Called with each validated step before it runs: under tensor parallelism, rank 0
        sends it to the other ranks here (:mod:`kunlun.engine.tp_group`)."""

    def _load_model(self, model_dir: Path) -> LlamaForCausalLM:
        with torch.device("meta"):
            model = build_model(self.config, self.max_model_len, self.group)
        materialize(model, self.device, self.dtype)
        model.model.rotary.build(self.dtype)
        if self.quant_spec is not None:
            quantize_linears(
                model, self.quant_spec, self.dtype, self._quantized_modules(model, model_dir)
            )
        load_weights(model, model_dir, smoothed_tensors(model_dir, self.quant_spec),
                     self._native_ops)  # fmt: skip
        if self.quant_spec is not None:
            model.lm_head.quantize_int8()
        return model.eval().requires_grad_(False)

    def _quantized_modules(self, model: LlamaForCausalLM, model_dir: Path) -> set[str] | None:
        """The modules to run quantized: every linear layer (None) for a floating checkpoint
        quantized while loading; for a quantized checkpoint, those holding a layer it stores
        quantized. A layer it stores in floating point stays so (a GGUF import keeps the
        projections llama.cpp left in 5, 6 or 8 bits as bf16), unless it shares a fused
        module with a quantized one (then it is quantized as it loads)."""
        if read_spec(model_dir) is None:
            return None
        modules = set()
        for layer in stored_quantized_layers(model_dir):
            param_name, _ = model.checkpoint_slot(f"{layer}.weight")
            modules.add(param_name.rpartition(".")[0])
        return modules

    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes across all layers (keys and values), on one rank."""
        config = self.config
        per_token = 2 * config.num_hidden_layers * self.num_kv_heads * config.head_dim
        element = torch.empty((), dtype=self.dtype).element_size()
        return per_token * self.block_size * element

    def _num_blocks(self, num_blocks: int | None, memory_bytes: int | None) -> int:
        if num_blocks is not None and memory_bytes is not None:
            raise ConfigError("pass num_blocks or kv_cache_memory_bytes, not both")
        per_block = self.kv_bytes_per_block()
        if memory_bytes is not None:  # the whole group's: each rank holds its share
            num_blocks = memory_bytes // self.group.size // per_block
            if num_blocks < 1:
                raise ConfigError(
                    f"kv_cache_memory_bytes={memory_bytes} is less than one block "
                    f"({per_block} bytes)"
                )
        if num_blocks is None:
            wanted = 4 * -(-self.max_model_len // self.block_size)
            num_blocks = max(1, min(wanted, DEFAULT_KV_BUDGET_BYTES // per_block))
        if num_blocks < 1:
            raise ConfigError(f"num_blocks={num_blocks} must be >= 1")
        return num_blocks

    def _allocate_kv_cache(self) -> None:
        config = self.config
        group = self.group
        split = head_split(
            config.num_attention_heads, config.num_key_value_heads, group.size, group.rank
        )
        shape = (
            2,
            config.num_hidden_layers,
            self.num_blocks + self._scratch_blocks,
            self.block_size,
            split.kv.size,  # this rank's KV heads
            config.head_dim,
        )
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for index, attention in enumerate(self.model.attention_layers()):
            attention.k_cache = self.kv_cache[0, index]
            attention.v_cache = self.kv_cache[1, index]

    @torch.inference_mode()
    def execute(self, seqs: list[StepSeq]) -> StepOutput:
        """Run one step: compute each sequence's new tokens and return their logits.

        Raises :class:`EngineError` naming the sequence and field when a step is malformed
        (empty, past ``max_model_len``, block table too short or holding a bad block id).
        """
        if not seqs:
            raise EngineError("execute() needs at least one sequence")
        for index, seq in enumerate(seqs):
            self._validate(index, seq)
        batch = StepBatch.of(seqs, self.block_size)
        if self.step_hook is not None:
            self.step_hook(batch)
        return self.run(batch)

    @torch.inference_mode()
    def hidden_states(self, seqs: list[StepSeq]) -> list[torch.Tensor]:
        """Run one pooling step (:mod:`kunlun.engine.pooling`): the final-norm hidden states
        of each sequence's new tokens, with no LM head; validated as :meth:`execute`."""
        if not seqs:
            raise EngineError("hidden_states() needs at least one sequence")
        for index, seq in enumerate(seqs):
            self._validate(index, seq)
        batch = StepBatch.of(seqs, self.block_size, pool=True)
        if self.step_hook is not None:
            self.step_hook(batch)
        hidden = self.run(batch).hidden
        assert hidden is not None
        return hidden

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> StepOutput:
        """The forward pass of a validated step; every rank of a tensor-parallel group runs
        it on the same ``batch`` (rank 0's logits are the ones sampled)."""
        if not batch.compiles():
            return self._forward(batch)
        started = time.perf_counter()
        if self.compiled is not None and self.compiled.takes(len(batch.rows)):
            out = self._compiled_step(batch)
            self.decode_time.compiled_s += time.perf_counter() - started
        else:
            out = self._forward(batch)
            self.decode_time.model_s += time.perf_counter() - started
        return out

    def _forward(self, batch: StepBatch) -> StepOutput:
        """The reference path: the model's modules over the flat batch."""
        step = _StepBuilder(self, batch)
        self._end_phase("prepare")
        hidden = self.model(step.input_ids, step.positions, step.context)
        if batch.pool:  # every rank skips the LM head (and its gather) alike
            rows = [hidden] * len(batch.order)
            for position, index in enumerate(batch.order):
                start, count = step.spans[position]
                rows[index] = hidden[start : start + count]
            self._end_phase("forward")
            return StepOutput(logits=hidden.new_empty(0), prompt_logits=[], hidden=rows)
        logits = self.model.compute_logits(hidden.index_select(0, step.last_index)).float()
        order = batch.order
        if order != sorted(order):  # undo the decode-first order
            reordered = torch.empty_like(logits)
            reordered[torch.tensor(order, device=self.device)] = logits
            logits = reordered
        prompt_logits: list[torch.Tensor | None] = [None] * len(order)
        for position, index in enumerate(order):
            if batch.rows[position].want_prompt_logits:
                start, count = step.spans[position]
                rows = hidden[start : start + count]
                prompt_logits[index] = self.model.compute_logits(rows).float()
        self._end_phase("forward")
        return StepOutput(logits=logits, prompt_logits=prompt_logits)

    def _compiled_step(self, batch: StepBatch) -> StepOutput:
        """A step of decodes only, through the compiled decoder (same logits as :meth:`run`)."""
        assert self.compiled is not None
        rows = batch.rows
        self._end_phase("prepare")
        logits = self.compiled.decode(
            [row.new_token_ids[0] for row in rows], [row.num_computed for row in rows],
            [row.block_table for row in rows], self.block_size,
        )  # fmt: skip
        self._end_phase("forward")
        return StepOutput(logits=logits, prompt_logits=[None] * len(rows))

    def _end_phase(self, phase: str) -> None:
        """Mark ``phase`` ended in a traced step, once the device has finished its work
        (queued kernels would otherwise be counted in the next phase)."""
        if self.trace.active:
            if self.device.type != "cpu":
                torch.accelerator.synchronize(self.device)
            self.trace.mark(phase)

    def _validate(self, index: int, seq: StepSeq) -> None:
        where = f"seqs[{index}]"
        context_len = seq.num_computed + seq.num_new
        if seq.num_new < 1 or seq.num_computed < 0:
            raise EngineError(
                f"{where}: num_new={seq.num_new} must be >= 1 and "
                f"num_computed={seq.num_computed} >= 0"
            )
        if context_len > len(seq.token_ids):
            raise EngineError(
                f"{where}: num_computed + num_new = {context_len} exceeds "
                f"len(token_ids) = {len(seq.token_ids)}"
            )
        if context_len > self.max_model_len:
            raise EngineError(
                f"{where}: context length {context_len} exceeds max_model_len={self.max_model_len}"
            )
        needed = -(-context_len // self.block_size)
        if len(seq.block_table) < needed:
            raise EngineError(
                f"{where}: block_table has {len(seq.block_table)} blocks, {needed} needed for "
                f"{context_len} tokens at block_size={self.block_size}"
            )
        used = seq.block_table[:needed]
        if min(used) < 0 or max(used) >= self.num_blocks:
            bad = next(block_id for block_id in used if not 0 <= block_id < self.num_blocks)
            raise EngineError(
                f"{where}: block_table holds block id {bad}, outside [0, {self.num_blocks})"
            )


class _StepBuilder:
    """Flat-batch tensors and attention metadata for one step (decode sequences first)."""

    def __init__(self, runner: ModelRunner, batch: StepBatch) -> None:
        self.device = runner.device
        self.block_size = runner.block_size
        self.spans: list[tuple[int, int]] = []
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        bs = self.block_size
        num_decode = batch.num_decode
        for row in batch.rows[:num_decode]:
            pos = row.num_computed
            self.spans.append((len(ids), 1))
            ids.append(row.new_token_ids[0])
            positions.append(pos)
            slots.append(row.block_table[pos // bs] * bs + pos % bs)
        prefills: list[PrefillSegment] = []
        for row in batch.rows[num_decode:]:
            num_new = len(row.new_token_ids)
            start, end = row.num_computed, row.num_computed + num_new
            self.spans.append((len(ids), num_new))
            table = row.block_table
            segment_table = None
            if row.num_computed > 0:
                segment_table = torch.tensor(table, dtype=torch.long, device=self.device)
            prefills.append(PrefillSegment(len(ids), num_new, row.num_computed, segment_table))
            ids.extend(row.new_token_ids)
            positions.extend(range(start, end))
            slots.extend(table[pos // bs] * bs + pos % bs for pos in range(start, end))
        self.input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        self.positions = torch.tensor(positions, dtype=torch.long, device=self.device)
        self.last_index = torch.tensor(
            [start + count - 1 for start, count in self.spans], dtype=torch.long, device=self.device
        )
        decode = batch.rows[:num_decode]
        self.context = AttentionContext(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            decode=self._decode_batch(decode, runner.dtype) if decode else None,
            prefills=prefills,
        )

    def _decode_batch(self, seqs: list[StepRow], dtype: torch.dtype) -> DecodeBatch:
        bs = self.block_size
        context_lens = [seq.num_computed + 1 for seq in seqs]
        max_blocks = -(-max(context_lens) // bs)
        tables = [
            seq.block_table[:max_blocks] + [0] * (max_blocks - len(seq.block_table[:max_blocks]))
            for seq in seqs
        ]
        block_tables = torch.tensor(tables, dtype=torch.long, device=self.device)
        longest = max(context_lens)
        if min(context_lens) == longest:
            return DecodeBatch(block_tables=block_tables, max_context_len=longest, mask=None)
        lens = torch.tensor(context_lens, dtype=torch.long, device=self.device)
        visible = torch.arange(longest, device=self.device)[None, :] < lens[:, None]
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.device)
        mask.masked_fill_(~visible, float("-inf"))
        return DecodeBatch(block_tables, longest, mask[:, None, None, :])
