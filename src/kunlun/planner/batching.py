"""How many sequences one replica decodes together (``max_num_seqs``) when the workload
spec leaves it to the planner.

The rule, per plan, from what the plan reserves and what the device declares:

- **memory**: the KV budget holds ``kv_tokens = kv_cache_memory / kv_bytes_per_token``
  (the whole tensor-parallel group); sequences are assumed to average
  ``context = min(max_model_len, PLANNING_CONTEXT_TOKENS)`` tokens, so
  ``kv_tokens // context`` of them run together without preemption (at least one: the plan
  always holds one full-length sequence).
- **saturation**: the decode estimate of :mod:`kunlun.planner.estimate` at ``b`` sequences is
  the smaller of the declared compute throughput ``C`` and the memory-bound rate
  ``M(b) = b * bandwidth * tp / (weight_bytes + b * context * kv_bytes_per_token)``, which
  rises towards ``A = bandwidth * tp / (context * kv_bytes_per_token)`` (every step then
  reads mostly KV). Its limit is ``L = min(C, A)``; past the smallest ``b`` with
  ``M(b) >= SATURATION * L``, more sequences add latency and almost no throughput:
  ``b = SATURATION * L * weight_bytes / (bandwidth * tp - SATURATION * L * context *
  kv_bytes_per_token)``. Without a bandwidth figure (a CPU declares none by default) the
  estimate does not depend on the batch, so there is no such point.
- **bounds**: at most :data:`MAX_AUTO_BATCH`; a spec's ``max_num_seqs`` (``--max-num-seqs``,
  up to 256) overrides the whole rule.

How many tokens one engine step computes (``max_num_batched_tokens``, the chunked-prefill
budget): every running sequence decodes one token per step and prompts fill the rest in
chunks, so the budget sets how long one step can take. A small budget starts the first tokens
of a burst of requests sooner (the first prompts do not wait for the others' prefills) and
bounds how long a long prompt stalls the streams already decoding; a large one prefills with
fewer, larger steps. The rule:

- **time**: :data:`STEP_TARGET_S` of the declared compute throughput
  (``compute_tokens_per_s``, tokens of this model the device's declared TFLOPS compute per
  second), rounded down to whole KV blocks; a device that declares no compute figure for the
  dtype (a CPU, by default) gets :data:`DEFAULT_STEP_TOKENS`, chosen from the measured
  trade-off in docs/benchmarks.md ("The chunked-prefill budget");
- **bounds**: at least ``max_num_seqs + MIN_PREFILL_CHUNK`` (every sequence decodes in every
  step and a prompt still advances), at most :data:`MAX_STEP_TOKENS` and never more than
  ``max_num_seqs * max_model_len``; a spec's ``max_num_batched_tokens``
  (``--max-num-batched-tokens``) overrides the whole rule.

Each reason is one line of the plan's notes, which ``plan --explain`` prints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kunlun.device.registry import load_plugins
from kunlun.engine.launch import EMBEDDED_ENGINE
from kunlun.planner.capacity import DeviceCapacity
from kunlun.planner.estimate import (
    BLOCK_SIZE,
    MAX_AUTO_BATCH,
    MIB,
    average_context,
    compute_tokens_per_s,
)
from kunlun.planner.model_info import ModelInfo

SATURATION = 0.9
"""The share of its limit at which the decode estimate counts as saturated."""
STEP_TARGET_S = 0.05
"""Declared-compute time one step's tokens may take (real steps run slower than the declared
peak; 50 ms of peak keeps a step of a GPU plan well under the 100-200 ms a reader notices)."""
DEFAULT_STEP_TOKENS = 256
"""The step budget of a device with no compute figure (docs/benchmarks.md)."""
MAX_STEP_TOKENS = 8192
"""The largest step budget the planner gives on its own."""
MIN_PREFILL_CHUNK = 4 * BLOCK_SIZE
"""Prompt tokens a full step still computes, beyond one decode per sequence."""


@dataclass(frozen=True, slots=True)
class BatchSizing:
    """``max_num_seqs`` for one plan and why."""

    max_num_seqs: int
    reason: str


@dataclass(frozen=True, slots=True)
class StepSizing:
    """``max_num_batched_tokens`` for one plan and why."""

    tokens: int
    reason: str


def saturation_batch(
    model: ModelInfo, cap: DeviceCapacity, dtype: str, quantization: str, tp: int, context: int
) -> int | None:
    """Sequences at which the decode estimate on ``tp`` devices like ``cap`` reaches
    :data:`SATURATION` of its limit, or None without a bandwidth figure (see module)."""
    if not cap.bandwidth_gbps:
        return None
    bandwidth = cap.bandwidth_gbps * 1e9 * tp
    kv_per_sequence = context * model.kv_bytes_per_token(dtype)
    limit = bandwidth / kv_per_sequence
    compute = compute_tokens_per_s(model, cap, dtype, quantization, tp)
    if compute is not None:
        limit = min(limit, compute)
    target = SATURATION * limit
    weights = model.weight_bytes(dtype, quantization)
    return max(1, math.ceil(target * weights / (bandwidth - target * kv_per_sequence)))


def size_batch(
    model: ModelInfo,
    cap: DeviceCapacity,
    dtype: str,
    quantization: str,
    tp: int,
    max_model_len: int,
    kv_mb: float,
) -> BatchSizing:
    """``max_num_seqs`` for a replica with ``kv_mb`` MiB of KV over its whole group."""
    context = average_context(max_model_len)
    kv_tokens = int(kv_mb * MIB // model.kv_bytes_per_token(dtype))
    by_memory = max(1, kv_tokens // context)
    knee = saturation_batch(model, cap, dtype, quantization, tp, context)
    seqs = min(by_memory, MAX_AUTO_BATCH, knee or MAX_AUTO_BATCH)
    parts = [
        f"max_num_seqs {seqs}: the KV ({kv_mb:.0f} MiB, {kv_tokens} tokens) holds {by_memory} "
        f"sequences of {context} tokens (the assumed average context)"
    ]
    if knee is None:
        parts.append("no saturation point (no declared memory bandwidth)")
    else:
        parts.append(f"decode reaches {SATURATION:.0%} of its limit at {knee} sequences")
    if seqs == MAX_AUTO_BATCH and MAX_AUTO_BATCH < min(by_memory, knee or by_memory + 1):
        parts.append(f"capped at {MAX_AUTO_BATCH}")
    return BatchSizing(seqs, "; ".join(parts) + " (--max-num-seqs overrides)")


def size_step_tokens(
    model: ModelInfo,
    cap: DeviceCapacity,
    dtype: str,
    quantization: str,
    tp: int,
    max_model_len: int,
    max_num_seqs: int,
) -> StepSizing:
    """``max_num_batched_tokens`` for a replica running ``max_num_seqs`` sequences (see the
    module)."""
    compute = compute_tokens_per_s(model, cap, dtype, quantization, tp)
    if compute is None:
        wanted = DEFAULT_STEP_TOKENS
        why = f"no declared compute figure for {dtype}: the default {DEFAULT_STEP_TOKENS}"
    else:
        wanted = int(compute * STEP_TARGET_S) // BLOCK_SIZE * BLOCK_SIZE
        why = (f"{STEP_TARGET_S * 1000:.0f} ms of the declared compute ({compute:.0f} tokens/s) "
               f"is {wanted} tokens")  # fmt: skip
    floor = max_num_seqs + MIN_PREFILL_CHUNK
    ceiling = min(MAX_STEP_TOKENS, max_num_seqs * max_model_len)
    tokens = min(max(wanted, floor), ceiling)
    if tokens > wanted:
        why += f"; raised to {tokens}: {max_num_seqs} decodes and a {MIN_PREFILL_CHUNK}-token chunk"
    elif tokens < wanted:
        why += f"; capped at {tokens}"
    return StepSizing(
        tokens,
        f"max_num_batched_tokens {tokens} (tokens per step, the chunked-prefill budget): {why}"
        " (--max-num-batched-tokens overrides)",
    )


GRAPH_NOTE = "decode steps captured as graphs"
"""How a plan's note on its captured decode graphs begins."""
GRAPH_SIZES_UP_TO = 512
"""The largest decode batch a plan captures as a device graph; larger steps launch kernels."""


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes captured as graphs for a replica running up to
    ``max_num_seqs`` sequences: 1, 2, 4, 8, every multiple of 16, and ``max_num_seqs``
    itself (each graph holds its own activations: coarser steps past 16 keep that memory
    small; a step runs the smallest captured size that holds it, its extra rows padding)."""
    top = min(max_num_seqs, GRAPH_SIZES_UP_TO)
    sizes = {n for n in (1, 2, 4, 8) if n <= top} | set(range(16, top + 1, 16)) | {top}
    return sorted(sizes)


def graph_capture(
    cap: DeviceCapacity, tp: int, engine: str, max_num_seqs: int
) -> tuple[list[int], str | None]:
    """The decode batch sizes captured as graphs on ``cap``'s devices, and the plan's note
    saying so or why not (None where the device family has no graph capture)."""
    plugin = load_plugins().plugins.get(cap.device_type)
    if plugin is None or plugin.graph_capture is None:
        return [], None
    api, switch = plugin.graph_capture
    if engine not in (EMBEDDED_ENGINE, "auto"):  # auto: set_engine drops them for another
        return [], f"graph capture ({api}) is the embedded engine's; {engine} decides its own"
    if cap.custom_attributes.get(switch) is False:
        return [], f"graph capture ({api}) off: the declaration's {switch} is false"
    if tp > 1:
        return [], f"graph capture ({api}) off: captured decode steps run on one rank, not {tp}"
    sizes = graph_batch_sizes(max_num_seqs)
    return sizes, f"{GRAPH_NOTE} ({api}) for batch sizes {', '.join(map(str, sizes))}"


def without_graphs(notes: list[str], engine: str) -> list[str]:
    """A plan's ``notes`` once ``engine``, not the embedded one, runs it: no captured graphs."""
    kept = [n for n in notes if not n.startswith(GRAPH_NOTE)]
    return [*kept, f"graph capture is the embedded engine's; {engine} decides its own"]
