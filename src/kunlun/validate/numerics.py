"""Cross-pool numerics: does this target compute the same model as the reference?

Two measurements per column, through ``/v1/completions``:

- **teacher-forced prompt logprobs**: :data:`FIXED_TEXT` sent with ``echo=true,
  logprobs=1, max_tokens=1``; the logprob of every prompt token given the ones before it.
  The cell reports the mean and the max of ``|logprob - reference logprob|`` over the
  tokens and fails above :data:`MEAN_ABS_MAX` or :data:`MAX_ABS_MAX` (measured: fp32 against
  bf16 on CPU, see ``docs/validation.md``), or when the tokens themselves differ.
- **greedy divergence**: :data:`GREEDY_PROMPTS` decoded greedily for
  :data:`GREEDY_TOKENS` tokens with ``logprobs=5``; the first position where the tokens
  differ from the reference's. Lower precision may flip a near tie, so a divergence passes
  when the target's token is one of the reference's top 5 there and at most
  :data:`NEAR_TIE` below the reference's choice; a real difference in the model does not.

The reference column is compared with a second run of itself: its deltas must be tiny
(a server that adds noise, or batches non-deterministically, shows here too).
"""

from __future__ import annotations

from typing import Any

from kunlun.validate.check import Check, Context, check
from kunlun.validate.client import CheckFailed, choice_text
from kunlun.validate.matrix import Cell, failed, passed, skipped

CHECKS: list[Check] = []

FIXED_TEXT = (
    "The first printed books were expensive, but within fifty years presses had spread to "
    "most large towns. Printers learned to cast letters quickly, to mix ink that dried "
    "evenly, and to set a page in an afternoon. As books became cheaper, more people "
    "learned to read, and letters, maps and tables travelled farther than ever before."
)
GREEDY_PROMPTS = (
    "The capital of France is",
    "Once upon a time, there was a little",
    "def fibonacci(n):",
)
GREEDY_TOKENS = 32
MEAN_ABS_MAX = 0.1
"""Largest mean |delta logprob| (nats per token) over :data:`FIXED_TEXT`."""
MAX_ABS_MAX = 0.5
"""Largest |delta logprob| of any single token."""
NEAR_TIE = 0.5
"""How far below the reference's choice (nats) a token may be and still count as a tie."""
MAX_FLIPS = 0.1
"""Largest share of positions where the target may pick another token (at near ties)."""


def measure(ctx: Context) -> dict[str, Any]:
    """This column's prompt logprobs and greedy decodes."""
    answer = ctx.client.completion("numerics", FIXED_TEXT, echo=True, logprobs=1, max_tokens=1,
                                   temperature=0)  # fmt: skip
    num_prompt = int(answer.usage.get("prompt_tokens") or 0)
    lp = answer.choice.get("logprobs") or {}
    tokens, values = lp.get("tokens") or [], lp.get("token_logprobs") or []
    if num_prompt < 2 or len(tokens) < num_prompt or len(values) < num_prompt:
        raise CheckFailed(
            "no prompt logprobs",
            f"echo=true, logprobs=1 gave {len(values)} logprobs for {num_prompt} prompt tokens",
        )
    greedy = []
    for prompt in GREEDY_PROMPTS:
        out = ctx.client.completion("numerics", prompt, max_tokens=GREEDY_TOKENS, logprobs=5,
                                    temperature=0)  # fmt: skip
        glp = out.choice.get("logprobs") or {}
        greedy.append({"num_prompt": int(out.usage.get("prompt_tokens") or 0),
                       "text": choice_text(out.choice), "tokens": list(glp.get("tokens") or []),
                       "top": list(glp.get("top_logprobs") or [])})  # fmt: skip
    return {
        "tokens": tokens[:num_prompt],
        "logprobs": [float(v) for v in values[1:num_prompt]],
        "greedy": greedy,
    }


def _pair(ctx: Context) -> tuple[dict[str, Any], dict[str, Any], str] | Cell:
    """(this column's measurement, what it is compared with, the name of that)."""
    if "numerics" not in ctx.scratch:
        ctx.scratch["numerics"] = measure(ctx)
    if ctx.reference is None:  # the reference itself: against a second run
        if "numerics_again" not in ctx.scratch:
            ctx.scratch["numerics_again"] = measure(ctx)
        return ctx.scratch["numerics_again"], ctx.scratch["numerics"], "its own first run"
    other = ctx.reference.get("numerics")
    if other is None:
        return skipped("the reference column has no measurement")
    return ctx.scratch["numerics"], other, "the reference"


@check(CHECKS, "numerics.prompt_logprobs", "teacher-forced logprobs vs reference")
def prompt_logprobs(ctx: Context) -> Cell:
    pair = _pair(ctx)
    if isinstance(pair, Cell):
        return pair
    mine, ref, against = pair
    if mine["tokens"] != ref["tokens"]:
        at = next((i for i, (a, b) in enumerate(zip(mine["tokens"], ref["tokens"], strict=False))
                   if a != b), min(len(mine["tokens"]), len(ref["tokens"])))  # fmt: skip
        return failed("tokens differ", f"prompt tokens differ from {against} at position {at}")
    deltas = [abs(a - b) for a, b in zip(mine["logprobs"], ref["logprobs"], strict=True)]
    mean, top = sum(deltas) / len(deltas), max(deltas)
    figure = f"mean {mean:.4f} max {top:.3f}"
    metrics = {"mean_abs_delta": round(mean, 5), "max_abs_delta": round(top, 4)}
    if mean > MEAN_ABS_MAX or top > MAX_ABS_MAX:
        worst = deltas.index(top) + 1
        return failed(
            figure,
            f"|delta logprob| against {against} over {len(deltas)} tokens: mean {mean:.4f} "
            f"(limit {MEAN_ABS_MAX}), max {top:.3f} (limit {MAX_ABS_MAX}) at token {worst} "
            f"{mine['tokens'][worst]!r}",
            **metrics,
        )
    return passed(figure, f"against {against}, {len(deltas)} tokens", **metrics)


def first_divergence(mine: list[str], ref: list[str]) -> int | None:
    """The first position where two greedy decodes differ; None if they never do."""
    at = next((i for i, (x, y) in enumerate(zip(mine, ref, strict=False)) if x != y), None)
    if at is None and len(mine) != len(ref):
        return min(len(mine), len(ref))  # one ended where the other went on
    return at


def argmax_along(ctx: Context, prompt: str, ref: dict[str, Any]) -> list[str]:
    """This target's most likely token at each position of the reference's greedy
    continuation of ``prompt``, teacher-forced (``echo`` of prompt + continuation); stops
    where the echoed tokens stop matching the reference's (a different tokenization, or
    the end-of-sequence token, which has no text)."""
    out = ctx.client.completion("numerics", prompt + ref["text"], echo=True, logprobs=5,
                                max_tokens=1, temperature=0)  # fmt: skip
    lp = out.choice.get("logprobs") or {}
    tokens, tops = lp.get("tokens") or [], lp.get("top_logprobs") or []
    choices = []
    for j, token in enumerate(ref["tokens"]):
        i = ref["num_prompt"] + j  # the prompt's tokens, then the continuation's
        if i < 1 or i >= len(tokens) - 1 or tokens[i] != token or not tops[i]:
            break
        choices.append(max(tops[i].items(), key=lambda item: item[1])[0])
    return choices


def flips(ref: dict[str, Any], choices: list[str]) -> list[tuple[int, str, float | None]]:
    """``(position, token, gap)`` wherever the target would have chosen another token than
    the reference; ``gap`` is how far below the reference's choice that token was in the
    reference's own top 5 (None: not among them)."""
    out = []
    for j, choice in enumerate(choices):
        if choice != ref["tokens"][j]:
            top = ref["top"][j] or {}
            chosen, other = top.get(ref["tokens"][j]), top.get(choice)
            out.append((j, choice, None if chosen is None or other is None else chosen - other))
    return out


@check(CHECKS, "numerics.greedy_divergence", "greedy divergence vs reference")
def greedy_divergence(ctx: Context) -> Cell:
    """The first position where greedy decodes diverge (the figure), and a verdict on every
    position: teacher-forced on the reference's decode, this target must pick the
    reference's token except at near ties (at most :data:`NEAR_TIE` nats apart), and at no
    more than :data:`MAX_FLIPS` of the positions."""
    pair = _pair(ctx)
    if isinstance(pair, Cell):
        return pair
    mine, ref, against = pair
    firsts, compared, found = [], 0, []
    for prompt, m, r in zip(GREEDY_PROMPTS, mine["greedy"], ref["greedy"], strict=True):
        at = first_divergence(m["tokens"], r["tokens"])
        firsts.append(GREEDY_TOKENS if at is None else at)
        choices = argmax_along(ctx, prompt, r)
        compared += len(choices)
        found += [(prompt, *flip) for flip in flips(r, choices)]
    first = min(firsts)
    figure = f"first divergence at {first}" if first < GREEDY_TOKENS else "identical"
    figure += f", {compared - len(found)}/{compared} agree"
    shown = [f"{p!r} token {j}: {t!r} ({'not in top 5' if g is None else f'{g:.3f} nats'})"
             for p, j, t, g in found]  # fmt: skip
    detail = (f"against {against}: first divergent token per prompt {firsts} of "
              f"{GREEDY_TOKENS}; teacher-forced flips: {'; '.join(shown) or 'none'}")  # fmt: skip
    metrics = {"first_divergence": float(first), "flips": float(len(found))}
    too_far = [g for *_, g in found if g is None or g > NEAR_TIE]
    if not compared or too_far or len(found) > MAX_FLIPS * compared:
        return failed(figure, detail, **metrics)
    return passed(figure, detail, **metrics)
