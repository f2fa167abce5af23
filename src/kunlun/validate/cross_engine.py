"""Cross-engine numerics: the numerics comparison without ``echo``, so it runs on any engine.

:mod:`~kunlun.validate.numerics` teacher-forces with ``echo=true``, which external engines
such as llama.cpp do not have (a 400, and those rows are SKIP there). This check needs only
greedy decoding with ``logprobs=5`` on ``/v1/completions``:

1. each of :data:`~kunlun.validate.numerics.GREEDY_PROMPTS` is decoded greedily for
   :data:`~kunlun.validate.numerics.GREEDY_TOKENS` tokens, on this column and on the
   reference; the first position where the two decodes differ is the figure;
2. this column is then walked along the reference's decode. Where both chose the same token
   after the same text, the logprobs each gave it are compared (mean and max of
   ``|delta|``, limits :data:`~kunlun.validate.numerics.MEAN_ABS_MAX` and
   :data:`~kunlun.validate.numerics.MAX_ABS_MAX`). At a position where this column chose
   another token, the prompt plus the reference's text up to there is sent again as a new
   prompt (``max_tokens`` the rest, ``logprobs=5``): its first token is this column's choice
   after exactly the reference's text. If that still differs from the reference's token, it
   is a flip, judged as in :mod:`~kunlun.validate.numerics`, from both sides: it passes when
   the reference had it among its top 5 at most :data:`~kunlun.validate.numerics.NEAR_TIE`
   below its own choice, and this column had the reference's token among its top 5 at most
   as far below (a near tie); flips may be at most
   :data:`~kunlun.validate.numerics.MAX_FLIPS` of the positions compared. The walk then goes
   on from the text with the reference's token (teacher forcing, one request per flip);
   a flip that is not a near tie fails the row, and that prompt's walk stops there (a broken
   column costs one re-sent prompt per greedy prompt, not :data:`MAX_RESENDS`).

A re-sent prompt that the target tokenizes into another number of tokens than the
reference's prompt plus continuation (a token boundary the text does not keep) ends that
prompt's walk there; the positions before it still count. Answers in either logprobs shape
are read: the legacy completions one (``tokens``, ``token_logprobs``, ``top_logprobs``),
and the chat-like ``content`` list llama-server answers ``/v1/completions`` with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kunlun.validate.check import Check, Context, check
from kunlun.validate.client import CheckFailed
from kunlun.validate.matrix import Cell, failed, passed
from kunlun.validate.numerics import (
    GREEDY_PROMPTS,
    GREEDY_TOKENS,
    MAX_ABS_MAX,
    MAX_FLIPS,
    MEAN_ABS_MAX,
    NEAR_TIE,
    first_divergence,
)

CHECKS: list[Check] = []
SCRATCH = "numerics_no_echo"
MAX_RESENDS = 8
"""Re-sent prompts per greedy prompt at most (a flip costs one or two): a walk cut there says
so in the detail, and the positions compared before it are judged."""


END = "(end of text)"
"""How the end-of-sequence token is spelled here: engines name it differently in logprobs
(``<|im_end|>`` from the embedded engine, an empty string from llama-server)."""


@dataclass
class Decode:
    """A greedy continuation: its tokens, the logprob of each, and the top logprobs there."""

    num_prompt: int
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[str, float]] = field(default_factory=list)
    end: str | None = None
    """How this answer spelled the end-of-sequence token, when it ended on it."""

    def spelled(self, ends: set[str]) -> Decode:
        """This decode with every spelling in ``ends`` of the end token written :data:`END`."""
        return Decode(self.num_prompt, [END if t in ends else t for t in self.tokens],
                      self.logprobs, [{END if k in ends else k: v for k, v in top.items()}
                                      for top in self.top])  # fmt: skip


def end_spellings(*decodes: Decode) -> set[str]:
    """The spellings of the end token seen in ``decodes``, and the empty string (no text
    token is empty)."""
    return {""} | {d.end for d in decodes if d.end is not None}


def read_decode(answer: dict[str, Any], choice: dict[str, Any]) -> Decode:
    """The :class:`Decode` in a completion answer, whichever logprobs shape it has."""
    decode = Decode(int((answer.get("usage") or {}).get("prompt_tokens") or 0))
    lp = choice.get("logprobs") or {}
    if isinstance(lp.get("content"), list):  # llama-server: entries as in chat completions
        for entry in lp["content"]:
            decode.tokens.append(str(entry.get("token")))
            decode.logprobs.append(float(entry.get("logprob")))
            decode.top.append({str(t.get("token")): float(t.get("logprob"))
                               for t in entry.get("top_logprobs") or []})  # fmt: skip
        return _mark_end(decode, choice)
    tops = lp.get("top_logprobs") or []
    for i, (token, value) in enumerate(
        zip(lp.get("tokens") or [], lp.get("token_logprobs") or [], strict=False)
    ):
        decode.tokens.append(str(token))
        decode.logprobs.append(float(value))
        decode.top.append({str(k): float(v) for k, v in (tops[i] if i < len(tops) else {}).items()})
    return _mark_end(decode, choice)


def _mark_end(decode: Decode, choice: dict[str, Any]) -> Decode:
    """Note the end token: an answer that stopped and whose last token is not in its text."""
    text = str(choice.get("text") or "")
    if (choice.get("finish_reason") == "stop" and decode.tokens
            and "".join(decode.tokens[:-1]) == text != "".join(decode.tokens)):  # fmt: skip
        decode.end = decode.tokens[-1]
    elif choice.get("finish_reason") == "stop" and decode.tokens and decode.tokens[-1] == "":
        decode.end = ""
    return decode


def greedy(ctx: Context, prompt: str, max_tokens: int, judge: bool = False) -> Decode:
    """This column's greedy continuation of ``prompt`` with ``logprobs=5`` (``judge``: its
    text goes to the garbage detector; a re-sent prompt's continuation is a fragment)."""
    send = ctx.client.completion if judge else ctx.client.continuation
    out = send("numerics", prompt, max_tokens=max_tokens, logprobs=5, temperature=0)
    return read_decode(out.body, out.choice)


def measure(ctx: Context) -> list[Decode]:
    """This column's greedy decodes of every prompt (each with logprobs, or the check fails)."""
    decodes = [greedy(ctx, prompt, GREEDY_TOKENS, judge=True) for prompt in GREEDY_PROMPTS]
    for prompt, decode in zip(GREEDY_PROMPTS, decodes, strict=True):
        if not decode.tokens or len(decode.top) != len(decode.tokens):
            raise CheckFailed("no logprobs", f"logprobs=5 gave none for {prompt!r}")
    return decodes


@dataclass
class Walk:
    """What walking one column along the reference's decodes found."""

    deltas: list[float] = field(default_factory=list)
    """|delta logprob| wherever both chose the same token after the same text."""
    flips: list[tuple[str, int, str, float | None]] = field(default_factory=list)
    """``(prompt, position, token, gap)`` (:func:`flip_gap`)."""
    cut: list[str] = field(default_factory=list)
    """Why a prompt's walk ended before its end."""

    @property
    def compared(self) -> int:
        return len(self.deltas) + len(self.flips)


def walk(ctx: Context, prompt: str, mine: Decode, ref: Decode, found: Walk, ends: set[str]) -> None:
    """Compare ``mine`` with ``ref`` position by position, re-sending the prompt with the
    reference's text at each disagreement (module docstring). Both are spelled with ``ends``
    (:func:`end_spellings`), as are the re-sent prompts' answers."""

    def resend(at: int) -> Decode:
        again = greedy(ctx, prompt + "".join(ref.tokens[:at]), GREEDY_TOKENS - at)
        return again.spelled(ends | end_spellings(again))

    decode, start = mine, 0  # decode[i] is this column's choice at reference position start+i
    resends = 0
    while start < len(ref.tokens):
        i = 0
        while start + i < len(ref.tokens) and i < len(decode.tokens):
            j = start + i
            if decode.tokens[i] != ref.tokens[j]:
                break
            found.deltas.append(abs(decode.logprobs[i] - ref.logprobs[j]))
            i += 1
        j = start + i
        if j >= len(ref.tokens):
            return
        if resends == MAX_RESENDS:
            found.cut.append(f"{prompt!r}: {MAX_RESENDS} re-sent prompts")
            return
        resends += 1
        if i > 0 or decode is mine:  # a disagreement seen in a decode: ask after ref's text
            decode, start = resend(j), j
            if decode.num_prompt != ref.num_prompt + j:
                found.cut.append(f"{prompt!r}: re-sent at token {j}, {decode.num_prompt} "
                                 f"prompt tokens, not {ref.num_prompt + j}")  # fmt: skip
                return
            continue
        # the first token after exactly the reference's text differs: a flip
        flip = (prompt, j, *flip_gap(decode, ref, j))
        found.flips.append(flip)
        if j + 1 == len(ref.tokens):
            return
        if flip[3] is None or flip[3] > NEAR_TIE:  # not a near tie: the row fails already
            found.cut.append(f"{prompt!r}: stopped at the flip at token {j}, not a near tie")
            return
        decode, start = resend(j + 1), j + 1
        if decode.num_prompt != ref.num_prompt + start:
            found.cut.append(f"{prompt!r}: re-sent at token {start}, {decode.num_prompt} "
                             f"prompt tokens, not {ref.num_prompt + start}")  # fmt: skip
            return


def flip_gap(decode: Decode, ref: Decode, j: int) -> tuple[str, float | None]:
    """This column's other choice at the reference's position ``j`` (``decode`` starts
    there), and how near a tie it is: the larger of the two gaps, in the reference's top 5
    and in this column's, between the two tokens (None: either lacks the other's token)."""
    if not decode.tokens:
        return END, None
    choice, wanted = decode.tokens[0], ref.tokens[j]
    gaps = [(top.get(a), top.get(b)) for top, a, b in ((ref.top[j], wanted, choice),
                                                      (decode.top[0], choice, wanted))]  # fmt: skip
    if any(x is None or y is None for x, y in gaps):
        return choice, None
    return choice, max(x - y for x, y in gaps)  # type: ignore[operator]


@check(CHECKS, "numerics.cross_engine", "greedy logprobs vs reference (no echo)")
def cross_engine(ctx: Context) -> Cell:
    """The verdict of :func:`walk` over every greedy prompt (module docstring)."""
    if SCRATCH not in ctx.scratch:
        ctx.scratch[SCRATCH] = measure(ctx)
    mine: list[Decode] = ctx.scratch[SCRATCH]
    against = "the reference"
    if ctx.reference is None:  # the reference itself: against a second run
        ref, against = measure(ctx), "its own second run"
    elif SCRATCH in ctx.reference:
        ref = ctx.reference[SCRATCH]
    else:
        raise CheckFailed("no reference", "the reference column has no measurement")
    found, firsts = Walk(), []
    ends = end_spellings(*mine, *ref)
    for prompt, m, r in zip(GREEDY_PROMPTS, mine, ref, strict=True):
        m, r = m.spelled(ends), r.spelled(ends)
        at = first_divergence(m.tokens, r.tokens)
        firsts.append(GREEDY_TOKENS if at is None else at)
        walk(ctx, prompt, m, r, found, ends)
    return _verdict(found, firsts, against)


def _verdict(found: Walk, firsts: list[int], against: str) -> Cell:
    if not found.deltas:
        return failed("nothing compared", f"against {against}: {'; '.join(found.cut)}")
    mean, top = sum(found.deltas) / len(found.deltas), max(found.deltas)
    first = min(firsts)
    figure = (f"mean {mean:.4f} max {top:.3f}, "
              f"{'identical' if first >= GREEDY_TOKENS else f'first divergence at {first}'}, "
              f"{found.compared - len(found.flips)}/{found.compared} agree")  # fmt: skip
    shown = [f"{p!r} token {j}: {t!r} ({'not in top 5' if g is None else f'{g:.3f} nats'})"
             for p, j, t, g in found.flips]  # fmt: skip
    detail = (f"against {against}: |delta logprob| over {len(found.deltas)} tokens chosen alike "
              f"mean {mean:.4f} (limit {MEAN_ABS_MAX}), max {top:.3f} (limit {MAX_ABS_MAX}); "
              f"first divergent token per prompt {firsts} of {GREEDY_TOKENS}; flips after the "
              f"reference's text: {'; '.join(shown) or 'none'}"
              + (f"; walk cut short: {'; '.join(found.cut)}" if found.cut else ""))  # fmt: skip
    metrics = {"mean_abs_delta": round(mean, 5), "max_abs_delta": round(top, 4),
               "first_divergence": float(first), "flips": float(len(found.flips))}  # fmt: skip
    too_far = [g for *_, g in found.flips if g is None or g > NEAR_TIE]
    if (mean > MEAN_ABS_MAX or top > MAX_ABS_MAX or too_far
            or len(found.flips) > MAX_FLIPS * found.compared):  # fmt: skip
        return failed(figure, detail, **metrics)
    return passed(figure, detail, **metrics)
