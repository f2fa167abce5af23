"""What the engine hands back: finished outputs, streamed deltas and engine statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from kunlun.engine.sequence import TopLogprobs
from kunlun.errors import KunlunError

FINISH_REASONS = ("stop", "length", "abort")
"""``stop``: a stop string or token, or end of sequence; ``length``: ``max_tokens`` or the
context window; ``abort``: aborted by the client, or failed (then ``error`` says why)."""


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it, if any."""
    logprobs: list[TopLogprobs] | None = None
    """Per output token: {chosen id: logprob, top ids: logprob}; None unless asked for."""
    cumulative_logprob: float | None = None
    """Sum of the chosen tokens' logprobs; None unless logprobs were asked for."""


@dataclass
class RequestOutput:
    """The complete result of one request."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TopLogprobs | None] | None = None
    """One entry per prompt token, the first None; None unless asked for."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    error: KunlunError | None = None
    """Why the request failed (finish_reason is then "abort")."""
    arrival_time: float = 0.0
    """When the request was made (``time.monotonic``, like the times below)."""
    first_scheduled_time: float | None = None
    """When the scheduler first admitted one of its sequences (the end of its queue time)."""
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


@dataclass
class RequestOutputDelta:
    """What one step added to one completion of a request (for streaming)."""

    request_id: str
    index: int
    text: str
    """New text, safe to show (no split characters, no part of a stop string)."""
    token_ids: list[int]
    logprobs: list[TopLogprobs] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: KunlunError | None = None
    final: RequestOutput | None = field(default=None, repr=False)
    """Set on the delta that finishes the whole request: its complete output."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine, cheap to take and safe to read from any thread."""

    num_blocks_total: int
    num_blocks_free: int
    num_blocks_used: int
    num_cached_blocks: int
    num_preemptions: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    num_running: int
    num_waiting: int
    num_unfinished_requests: int
    num_steps: int
    num_generated_tokens: int
    num_failed_steps: int
    decode: DecodeTime
    """Where the time of decode-only steps went."""


DECODE_PARTS = ("compiled", "model", "engine")
"""The parts of a decode step's wall time (:class:`DecodeTime`)."""


@dataclass
class DecodeTime:
    """Where the time of the steps in which every sequence computes one token went, summed
    since the engine started: the step profiler's figure of the overhead on a chip.

    A step's wall time is ``compiled`` (inside the compiled decode step: kernels and loops,
    no Python), ``model`` (the reference path's forward: its modules in Python, launching
    kernels) and the rest, ``engine`` (scheduling, batch tensors, sampling, detokenizing:
    Python). On the compiled path ``engine`` over the whole is the Python share."""

    path: str
    """The decode path that runs: compiled or python (:mod:`kunlun.engine.native`)."""
    steps: int = 0
    wall_s: float = 0.0
    compiled_s: float = 0.0
    model_s: float = 0.0

    @property
    def engine_s(self) -> float:
        return max(0.0, self.wall_s - self.compiled_s - self.model_s)

    def copy(self) -> DecodeTime:
        return DecodeTime(self.path, self.steps, self.wall_s, self.compiled_s, self.model_s)
