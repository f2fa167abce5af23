"""How one request wants its tokens chosen and when it wants generation to stop.

The semantics follow the OpenAI API for ``presence_penalty``/``frequency_penalty`` and the
Hugging Face logits processors for ``repetition_penalty``, ``temperature``, ``top_k``,
``top_p`` and ``min_p``; :mod:`kunlun.engine.sampler` applies them in that order (penalties,
temperature, top-k, top-p, min-p), as ``transformers.generate`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kunlun.engine.guided import Guide
from kunlun.errors import Location, RequestError

_MAX_TOP_LOGPROBS = 20
"""The most top logprobs one position may ask for (the OpenAI API's limit)."""


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request. Call :meth:`validate` before use."""

    n: int = 1
    """Number of completions generated for the prompt (>= 1). They share the prompt's KV."""
    temperature: float = 1.0
    """Divides the logits (>= 0). 0 means greedy: the highest logit wins, no randomness."""
    top_p: float = 1.0
    """Nucleus sampling, in (0, 1]: keep the most likely tokens whose mass reaches top_p."""
    top_k: int | None = None
    """Keep only the k most likely tokens (>= 1); None keeps all."""
    min_p: float = 0.0
    """In [0, 1]: drop tokens less likely than min_p times the most likely one."""
    repetition_penalty: float = 1.0
    """> 0; HF semantics over prompt and output tokens: positive logits of seen tokens are
    divided by it, negative ones multiplied. 1 disables it."""
    presence_penalty: float = 0.0
    """In [-2, 2]; OpenAI semantics: subtracted once from the logit of every token already
    generated (output tokens only)."""
    frequency_penalty: float = 0.0
    """In [-2, 2]; OpenAI semantics: subtracted from a token's logit once per time it was
    generated (output tokens only)."""
    seed: int | None = None
    """Seeds this request's own random generator: the same seed gives the same output,
    whatever else is in the batch. None draws from the engine's shared generator."""
    stop: list[str] = field(default_factory=list)
    """Generation stops before any of these strings; the stop string is never emitted."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation stops after any of these tokens (kept in token ids, not in text)."""
    max_tokens: int | None = None
    """Most output tokens (>= 1); None means as many as the context window allows."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence tokens."""
    min_tokens: int = 0
    """Output tokens before the answer may end: until there are this many, end-of-sequence
    and stop tokens are masked in the sampler and stop strings are not looked for."""
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the answer at the end of its text."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last this many tokens (>= 1); None keeps all of it."""
    logprobs: int | None = None
    """Return the chosen token's logprob and this many top logprobs per output token
    (0..20); None returns none. Logprobs are log_softmax of the raw model logits, before
    penalties and temperature (vLLM's default)."""
    prompt_logprobs: int | None = None
    """Return, for each prompt token after the first, its logprob and this many top ones
    (0..20); None returns none. Requests that ask for them bypass the prefix cache."""
    priority: int = 0
    """Scheduling class: lower values are served first (and preempted last); FIFO within a
    class. Any integer."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the returned text."""
    guide: Guide | None = None
    """What the output must match (a JSON schema, regex, grammar or choice): enforced by a
    token mask in the sampler (:mod:`kunlun.engine.guided`). None: free text."""
    end_text: Callable[[str], int | None] | None = None
    """Where the answer ends by a rule on its text that a grammar cannot say (the serving
    layer's: under ``tool_choice`` required, a tool call that repeats an earlier one):
    called with the text so far after each new piece; an index ends the sequence there,
    the text cut to it, with finish reason ``stop``. None: no such rule."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    def validate(self) -> SamplingParams:
        """Raise :class:`RequestError` naming the first bad field and its value; return self."""
        checks: list[tuple[str, object, bool, str]] = [
            ("n", self.n, _is_int(self.n) and self.n >= 1, "an integer >= 1"),
            ("temperature", self.temperature, _is_num(self.temperature) and self.temperature >= 0,
             "a number >= 0"),
            ("top_p", self.top_p, _is_num(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k, self.top_k is None or (_is_int(self.top_k) and self.top_k >= 1),
             "None or an integer >= 1"),
            ("min_p", self.min_p, _is_num(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty,
             _is_num(self.repetition_penalty) and self.repetition_penalty > 0, "a number > 0"),
            ("presence_penalty", self.presence_penalty,
             _is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", self.frequency_penalty,
             _is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("seed", self.seed, self.seed is None or _is_int(self.seed), "None or an integer"),
            ("stop", self.stop, isinstance(self.stop, list)
             and all(isinstance(s, str) and s for s in self.stop), "a list of non-empty strings"),
            ("stop_token_ids", self.stop_token_ids, isinstance(self.stop_token_ids, list)
             and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             "a list of token ids >= 0"),
            ("max_tokens", self.max_tokens,
             self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
             "None or an integer >= 1"),
            ("logprobs", self.logprobs, _is_count(self.logprobs), f"None or 0..{_MAX_TOP_LOGPROBS}"),
            ("prompt_logprobs", self.prompt_logprobs, _is_count(self.prompt_logprobs),
             f"None or 0..{_MAX_TOP_LOGPROBS}"),
            ("priority", self.priority, _is_int(self.priority), "an integer"),
            ("min_tokens", self.min_tokens, _is_int(self.min_tokens) and self.min_tokens >= 0
             and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
             "an integer >= 0 and at most max_tokens"),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens,
             self.truncate_prompt_tokens is None
             or (_is_int(self.truncate_prompt_tokens) and self.truncate_prompt_tokens >= 1),
             "None or an integer >= 1"),
        ]  # fmt: skip
        for name, value, ok, expected in checks:
            if not ok:
                raise RequestError(
                    f"sampling parameter {name}={value!r} is invalid: expected {expected}"
                )
        if self.min_tokens and self.guide is not None:
            raise RequestError(
                f"min_tokens cannot be combined with {self.guide.field}: a grammar may end "
                "the answer before min_tokens, which masks its end",
                location=Location("request", field="min_tokens"),
            )
        return self

    @property
    def greedy(self) -> bool:
        """True when the highest logit always wins (temperature 0)."""
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        """True when any repetition, presence or frequency penalty is active."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    """A real, finite number (NaN and infinities are not: ``temperature: Infinity`` once
    passed as "any sampling")."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value: object) -> bool:
    return value is None or (_is_int(value) and 0 <= value <= _MAX_TOP_LOGPROBS)  # type: ignore[operator]
