"""Guided decoding: a request's output held to a JSON schema, a regex, a grammar or a list of
choices, by a token mask applied in the sampler.

A :class:`Guide` (part of :class:`~kunlun.engine.sampling_params.SamplingParams`) says what
the output must match. :class:`GuidedDecoding` (one per engine, built on first use) compiles
it with llguidance (a maintained grammar engine with no torch of its own) over the engine's
tokenizer, checks it at admission (a bad schema, regex or grammar is a 400 naming the field)
and gives each sequence its own matcher. Each step the sampler asks for the masks of the rows
that have a matcher, in one parallel call, and sets every other token's score to -inf after
penalties; after sampling, each matcher consumes its row's token. Once a matcher's grammar is
complete it allows only an end-of-sequence token, so the answer finishes with ``stop``; one
cut short by ``max_tokens`` finishes with ``length`` (and may not parse). Rows without a guide
and batches without any guided row cost nothing: no mask is computed or applied.

Logprobs stay those of the raw model logits (as for every request).
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from kunlun import budgets
from kunlun.errors import Location, OverBudget, RequestError

if TYPE_CHECKING:
    import llguidance
    import torch

    from kunlun.engine.tokenizer import Tokenizer

GuideKind = Literal["json", "regex", "grammar", "choice"]
GUIDE_KINDS: tuple[GuideKind, ...] = get_args(GuideKind)

_COMPILED_CACHE = 256
"""Compiled grammars kept per engine (requests of one endpoint repeat their schema)."""


@dataclass(frozen=True)
class Guide:
    """What a request's output must match.

    ``kind``: ``json`` (``source`` is a JSON schema, as JSON text; ``{"type": "object"}`` for
    any object), ``regex``, ``grammar`` (Lark, or GBNF/EBNF as llama.cpp writes it) or
    ``choice`` (``source`` is a JSON list of strings). ``field`` is the request field it came
    from, named in errors."""

    kind: GuideKind
    source: str
    field: str = "guide"

    def __post_init__(self) -> None:
        """Refuse a guide over its budget (:mod:`kunlun.budgets`) before anything compiles it."""
        size = len(self.source.encode("utf-8", "surrogatepass"))
        if self.kind == "choice":
            budgets.require("choices", self.field, len(json.loads(self.source)))
            budgets.require("choice_bytes", f"{self.field} (all strings)", size, self.field)
        else:
            budget = {"json": "schema_bytes", "regex": "regex_bytes"}.get(
                self.kind, "grammar_bytes"
            )
            budgets.require(budget, self.field, size)

    @staticmethod
    def json_schema(schema: Any, field: str) -> Guide:
        """A guide from a JSON schema given as a mapping (or ``True`` for any JSON value)."""
        if not isinstance(schema, dict | bool):
            raise _refused(field, f"must be a JSON schema object, got {_short(schema)}")
        return Guide("json", json.dumps(schema, sort_keys=True), field)

    @staticmethod
    def choice(options: Any, field: str) -> Guide:
        if not (isinstance(options, list) and options and all(isinstance(o, str) for o in options)):
            raise _refused(field, f"must be a non-empty list of strings, got {_short(options)}")
        return Guide("choice", json.dumps(options), field)


class GuidedDecoding:
    """Compiles guides over one tokenizer and masks the scores of guided rows."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        """Width of the logits rows (may exceed the tokenizer's vocabulary)."""
        self._lock = threading.Lock()
        self._llg: Any = None
        self._lltok: Any = None
        self._executor: Any = None

    def _ready(self) -> Any:
        """The llguidance module, tokenizer and executor, made once (about a second)."""
        with self._lock:
            if self._lltok is None:
                try:
                    import llguidance
                except ImportError as exc:
                    raise RequestError(
                        "guided decoding needs the llguidance package, which is not "
                        f"installed here ({exc})"
                    ) from None
                eos = self._tokenizer.eos_token_id
                if eos is None:
                    eos = min(self._tokenizer.eos_token_ids, default=0)
                self._lltok = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos
                )
                self._executor = llguidance.LLExecutor(num_threads=1)
                self._llg = llguidance
            return self._llg

    def matcher(self, guide: Guide) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence; :class:`RequestError` naming ``guide.field``
        when the schema, regex or grammar cannot be compiled."""
        llg = self._ready()
        grammar = self._compiled(guide)
        matcher = llg.LLMatcher(self._lltok, grammar, log_level=0)
        if matcher.is_error():
            raise _refused(guide.field, f"cannot be used: {matcher.get_error()}")
        return matcher

    @functools.lru_cache(maxsize=_COMPILED_CACHE)  # noqa: B019 - one instance per engine
    def _compiled(self, guide: Guide) -> str:
        llg = self._llg
        try:
            if guide.kind == "json":
                grammar = llg.LLMatcher.grammar_from_json_schema(guide.source)
            elif guide.kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(guide.source)
            elif guide.kind == "choice":
                grammar = llg.grammar_from("choice", guide.source)
            else:
                grammar = llg.grammar_from("grammar", guide.source)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise _refused(guide.field, f"cannot be used: {exc}") from None
        return str(grammar)

    def mask(self, scores: torch.Tensor, matchers: list[tuple[Any, int]]) -> None:
        """Set to -inf, in place, every token of ``scores`` (rows: the batch) that the
        matcher of its row does not allow; ``matchers``: (matcher, row) of the guided rows."""
        import numpy as np  # here, not at the top: the daemon's gateway reads guides
        import torch  # without torch or numpy (0.1-0.2 s of CPU at each daemon start)

        rows, vocab = len(matchers), scores.shape[-1]
        words = (vocab + 31) // 32
        bits = torch.full((rows, words), -1, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, k) for k, (m, _) in enumerate(matchers)], bits.data_ptr(), words * 4, rows
        )
        # bit j of word w allows token 32w + j (little-endian words, as on every host served)
        allowed = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")
        refused = torch.from_numpy(allowed[:, :vocab] == 0).to(scores.device, non_blocking=True)
        index = torch.tensor([row for _, row in matchers], dtype=torch.long, device=scores.device)
        scores[index] = scores[index].masked_fill(refused, float("-inf"))


def guide_gave_up(guide: Guide | None, problem: str) -> OverBudget:
    """The error of a request whose matcher stopped at one of the grammar engine's limits
    during generation (``a{1000000}``): the constraint cannot be held, so the request fails
    rather than ending as if it were satisfied."""
    field = guide.field if guide is not None else "guide"
    reason = problem.strip().splitlines()[0] if problem.strip() else "an internal limit"
    return OverBudget(
        f"{field} asks more than the grammar engine can hold while generating ({reason:.200})",
        location=Location("request", field=field),
        hint="bound the constraint (fewer repetitions, a smaller schema)",
    )


def _refused(field: str, problem: str) -> RequestError:
    """A 400 about the request field ``field`` (it becomes the error's ``param``)."""
    return RequestError(f"{field} {problem}", location=Location("request", field=field))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
