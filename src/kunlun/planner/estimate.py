"""Memory need and estimated throughput of a model on a device.

Two throughput figures, both tokens/s of a tensor-parallel group of ``tp`` identical devices:

- :func:`compute_tokens_per_s`, the *declared compute throughput*: what the profile's
  normalized compute figure for the workload's compute dtype (int8 TOPS for w8a8, else the
  activation dtype's TFLOPS) processes, ``compute(dtype) * tp / flops_per_token`` with
  ``flops_per_token = 2 * matmul weights``. Prefill runs near it; the ``performance``
  scorer ranks by it.
- :func:`tokens_per_s`, the *decode estimate*: a roofline of steady-state decoding with
  ``batch`` sequences running, each with ``PLANNING_CONTEXT_TOKENS`` of context on average.
  One decode step reads every weight once and the KV of every running sequence, so the
  memory-bound rate is ``batch * bandwidth * tp / (weight_bytes + batch * context *
  kv_bytes_per_token)``; the estimate is the smaller of that and the compute throughput.
  Without a declared ``memory_bandwidth_gbps`` only the compute bound is known; with neither
  figure there is no estimate (``None``). The ``roofline`` scorer ranks by it.

Decode is usually memory-bound, so the decode estimate follows a device's bandwidth; the two
rankings disagree when one device has more compute and another more bandwidth (the reasons of
a placement say so).
"""

from __future__ import annotations

from dataclasses import dataclass

from kunlun.engine import schemes
from kunlun.planner.capacity import DeviceCapacity
from kunlun.planner.model_info import ModelInfo

#: Average context (tokens) of a decoding sequence assumed by the throughput estimate.
PLANNING_CONTEXT_TOKENS = 1024
#: The most sequences the planner puts in one replica's batch on its own
#: (:mod:`kunlun.planner.batching`); a spec's ``max_num_seqs`` may ask for more.
MAX_AUTO_BATCH = 64
#: Token slots per KV block (the embedded engine's default).
BLOCK_SIZE = 16
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class MemoryNeed:
    """Per-device memory, MiB, of one replica on a group of ``tp`` devices."""

    weights_mb: float
    min_kv_mb: float
    """KV for one sequence of ``max_model_len`` tokens (the least that makes the workload
    usable)."""
    wanted_kv_mb: float
    """KV for ``batch`` sequences of ``max_model_len`` tokens (more is never used); with the
    batch left to the planner, for :data:`MAX_AUTO_BATCH` sequences of the average context."""


def average_context(max_model_len: int) -> int:
    """Tokens a running sequence is assumed to hold on average."""
    return min(max_model_len, PLANNING_CONTEXT_TOKENS)


def compute_dtype(dtype: str, quantization: str) -> str:
    """The dtype whose compute figure applies: int8 for w8a8, else the activation dtype."""
    return schemes.compute_dtype(quantization, dtype)


def memory_need(
    model: ModelInfo,
    dtype: str,
    quantization: str,
    tp: int,
    max_model_len: int,
    batch: int | None,
    kv_cache_memory_mb: int | None = None,
) -> MemoryNeed:
    """What one replica needs on each of its ``tp`` devices (KV in ``dtype``). A given
    ``kv_cache_memory_mb`` (per replica) is both the least and the most KV it takes."""
    weights = model.weight_bytes(dtype, quantization) / tp / MIB
    if kv_cache_memory_mb is not None:
        return MemoryNeed(weights, kv_cache_memory_mb / tp, kv_cache_memory_mb / tp)
    blocks = -(-max_model_len // BLOCK_SIZE)
    one_sequence = blocks * BLOCK_SIZE * model.kv_bytes_per_token(dtype)
    if batch is None:
        auto = MAX_AUTO_BATCH * average_context(max_model_len) * model.kv_bytes_per_token(dtype)
        wanted = max(one_sequence, auto)
    else:
        wanted = one_sequence * batch
    return MemoryNeed(weights, one_sequence / tp / MIB, wanted / tp / MIB)


def compute_tokens_per_s(
    model: ModelInfo, device: DeviceCapacity, dtype: str, quantization: str, tp: int
) -> float | None:
    """Declared compute throughput of ``model`` on ``tp`` devices like ``device``, or None
    when the device declares no compute figure for the dtype (see module)."""
    compute = device.compute.get(compute_dtype(dtype, quantization))
    return compute * 1e12 * tp / model.flops_per_token() if compute else None


def tokens_per_s(
    model: ModelInfo,
    device: DeviceCapacity,
    dtype: str,
    quantization: str,
    tp: int,
    batch: int,
    max_model_len: int,
) -> float | None:
    """Estimated decode tokens/s of ``model`` on ``tp`` devices like ``device`` (see module)."""
    compute = compute_tokens_per_s(model, device, dtype, quantization, tp)
    rates = [] if compute is None else [compute]
    if device.bandwidth_gbps:
        context = average_context(max_model_len)
        step_bytes = model.weight_bytes(dtype, quantization) + batch * context * (
            model.kv_bytes_per_token(dtype)
        )
        rates.append(batch * device.bandwidth_gbps * 1e9 * tp / step_bytes)
    return min(rates) if rates else None
