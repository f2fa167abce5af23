"""Accuracy on a multiple-choice evaluation set, scored by log-likelihood.

Each item is a question and its choices. As lm-evaluation-harness scores such a task (its
``acc``), the context ``Question: Q\\nAnswer:`` is followed by each choice (`` C``) in turn,
and the choice whose tokens the model gives the highest total log-probability is its answer;
the tokens are read back with ``/v1/completions``' ``echo=true, logprobs=1`` (the prompt's
own logprobs), the choice's tokens being those at or after the context's end
(``text_offset``). All the choices of an item go in one request, a list of prompts, so the
engine scores them as one batch.

The set is the one Kunlun ships (:data:`SHIPPED`: 229 items of common facts written by
``scripts/make-eval-set.py``, four choices each, chance 25 %) or the operator's own
(``kunlun-cli validate --eval FILE``): JSON lines of ``question``, ``choices`` (2 to
:data:`MAX_CHOICES` texts) and ``answer`` (the right choice's index), checked line by line
and within :data:`MAX_ITEMS` items and :data:`MAX_FILE_BYTES`.

The row ``accuracy.multiple_choice``: the reference column passes when it scores above
chance by more than three standard errors (a model that has learnt nothing of the set does
not); another column passes when it scores at most ``accuracy_points`` (default 5) points
below the reference. An engine without ``echo`` cannot be scored this way: the row is SKIP
there, naming it.
"""

from __future__ import annotations

import contextvars
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kunlun.errors import ConfigError, Location
from kunlun.validate.check import Check, Context, check
from kunlun.validate.client import CheckFailed, error_message, json_of
from kunlun.validate.matrix import Cell, failed, passed

CHECKS: list[Check] = []
SHIPPED = Path(__file__).with_name("data") / "general-mc.jsonl"
MAX_ITEMS = 2000
MAX_CHOICES = 8
MAX_FILE_BYTES = 4 << 20
MAX_TEXT = 2000
"""Characters of one question or choice at most."""
CONTEXT = "Question: {question}\nAnswer:"
SCRATCH = "accuracy"
IN_FLIGHT = 4
"""Items scored at once."""


@dataclass(frozen=True, slots=True)
class Item:
    question: str
    choices: tuple[str, ...]
    answer: int


def load_eval(path: Path) -> list[Item]:
    """The items of the evaluation file ``path``; a :class:`ConfigError` naming the file,
    the line and the field of the first bad one."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigError(f"{size} bytes; an evaluation set holds at most "
                              f"{MAX_FILE_BYTES} bytes", location=Location(str(path)))  # fmt: skip
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the evaluation set: {exc}",
                          location=Location(str(path))) from None  # fmt: skip
    items: list[Item] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(items) == MAX_ITEMS:
            raise ConfigError(f"more than {MAX_ITEMS} items",
                              location=Location(str(path), number))  # fmt: skip
        items.append(_item(line, str(path), number))
    if not items:
        raise ConfigError("no items", location=Location(str(path)))
    return items


def _item(line: str, path: str, number: int) -> Item:
    try:
        raw = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"not JSON: {exc}", location=Location(path, number)) from None
    if not isinstance(raw, dict):
        raise ConfigError("not a JSON object", location=Location(path, number))
    question, choices, answer = raw.get("question"), raw.get("choices"), raw.get("answer")
    if not isinstance(question, str) or not question.strip() or len(question) > MAX_TEXT:
        raise ConfigError(f"question must be a text of 1 to {MAX_TEXT} characters, got "
                          f"{question!r:.60}", location=Location(path, number, field="question"))  # fmt: skip
    if (not isinstance(choices, list) or not 2 <= len(choices) <= MAX_CHOICES
            or not all(isinstance(c, str) and c.strip() and len(c) <= MAX_TEXT
                       for c in choices)):  # fmt: skip
        raise ConfigError(f"choices must be 2 to {MAX_CHOICES} texts of 1 to {MAX_TEXT} "
                          f"characters, got {choices!r:.80}",
                          location=Location(path, number, field="choices"))  # fmt: skip
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise ConfigError(f"answer must be the index of a choice (0 to {len(choices) - 1}), got "
                          f"{answer!r}", location=Location(path, number, field="answer"))  # fmt: skip
    return Item(question, tuple(choices), answer)


def chance(items: list[Item]) -> float:
    """The accuracy of answering each item at random."""
    return sum(1 / len(i.choices) for i in items) / len(items)


def choice_logprob(choice: dict[str, Any], start: int, end: int) -> float:
    """The summed logprob of the echoed prompt's tokens that start at a character in
    ``[start, end)``: the choice's, after the context and before the generated token."""
    lp = choice.get("logprobs") or {}
    offsets, values = lp.get("text_offset") or [], lp.get("token_logprobs") or []
    picked = [v for o, v in zip(offsets, values, strict=False)
              if start <= o < end and v is not None]  # fmt: skip
    if not picked:
        raise CheckFailed("no choice logprobs", "echo=true, logprobs=1 returned no logprob for "
                                                "a choice's tokens (text_offset)")  # fmt: skip
    return float(sum(picked))


def is_right(ctx: Context, item: Item) -> bool:
    """Whether the column's most likely choice of ``item`` is the right one."""
    context = CONTEXT.format(question=item.question)
    prompts = [f"{context} {c}" for c in item.choices]
    resp = ctx.client.request("POST", "/v1/completions", {
        "model": ctx.column.model, "prompt": prompts, "echo": True, "logprobs": 1,
        "max_tokens": 1, "temperature": 0})  # fmt: skip
    data = json_of(resp)
    if resp.status_code != 200:
        raise CheckFailed(f"HTTP {resp.status_code}", error_message(data, resp))
    choices = sorted(data.get("choices") or [], key=lambda c: int(c.get("index", 0)))
    if len(choices) != len(prompts):
        raise CheckFailed("wrong number of choices",
                          f"{len(prompts)} prompts, {len(choices)} choices answered")  # fmt: skip
    totals = [choice_logprob(c, len(context), len(p))
              for c, p in zip(choices, prompts, strict=True)]  # fmt: skip
    return max(range(len(totals)), key=totals.__getitem__) == item.answer


def score(ctx: Context, items: list[Item]) -> list[bool]:
    """:func:`is_right` of every item, :data:`IN_FLIGHT` requests at a time (the engine
    batches them), each in a copy of this thread's context (what the battery notes of an
    engine's lacks is kept there); the first failure stops the row, the items not yet sent
    are not."""
    pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="accuracy")
    try:
        futures = [pool.submit(contextvars.copy_context().run, is_right, ctx, item)
                   for item in items]  # fmt: skip
        return [future.result() for future in futures]
    finally:
        pool.shutdown(cancel_futures=True)


@check(CHECKS, "accuracy.multiple_choice", "multiple-choice accuracy vs reference")
def multiple_choice(ctx: Context) -> Cell:
    settings = ctx.settings
    path = settings.eval_file or SHIPPED
    items = load_eval(path)
    right = score(ctx, items)
    accuracy, by_chance, n = sum(right) / len(right), chance(items), len(right)
    ctx.scratch[SCRATCH] = accuracy
    figure = f"{accuracy:.1%} (chance {by_chance:.0%})"
    metrics = {"accuracy": round(accuracy, 4), "chance": round(by_chance, 4), "items": n}
    where = f"{sum(right)} of {n} items of {path.name}"
    if ctx.reference is None:
        floor = by_chance + 3 * math.sqrt(by_chance * (1 - by_chance) / n)
        if accuracy <= floor:
            return failed(figure, f"{where}: not above chance (at most {floor:.1%} is within "
                                  "three standard errors of it)", **metrics)  # fmt: skip
        return passed(figure, f"{where}; above chance", **metrics)
    reference = ctx.reference.get(SCRATCH)
    if reference is None:
        return failed(figure, f"{where}; the reference column has no accuracy", **metrics)
    metrics["reference_accuracy"] = round(reference, 4)
    gap = (reference - accuracy) * 100
    said = f"{where}; the reference {reference:.1%} ({gap:+.1f} points below it)"
    if gap > settings.accuracy_points:
        return failed(figure, f"{said}: more than {settings.accuracy_points:g} points",
                      **metrics)  # fmt: skip
    return passed(figure, said, **metrics)
