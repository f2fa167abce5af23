"""The functional battery (seed section 6.2), each check built so that a fake cannot pass it.

Answers that must be right use greedy decoding (temperature 0) and prompts that a 135M
model handles: short explicit instructions, the thing to copy stated plainly. What the
checks look for (numbers, questions, ids) is drawn at random for each run, so no canned answer
can match; the rules are in ``docs/validation.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kunlun.validate.check import Check, Context, check
from kunlun.validate.client import CheckFailed
from kunlun.validate.matrix import Cell, failed, passed, skipped
from kunlun.validate.relay import PoolRelay

CHECKS: list[Check] = []

GREEDY = {"temperature": 0}
CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Germany": "Berlin", "England": "London",
    "Russia": "Moscow", "China": "Beijing", "Egypt": "Cairo", "Greece": "Athens",
    "Canada": "Ottawa", "Australia": "Canberra", "Austria": "Vienna",
}  # fmt: skip
"""Questions the demo model (SmolLM2-135M-Instruct) answers right under greedy decoding."""
CHARS_PER_TOKEN_MAX = 8
"""``prompt_tokens`` of the long-text prompt must be at least its characters over this."""


def plain_number(ctx: Context) -> str:
    """A random five-digit number with five different digits: a small model copies those
    reliably, where repeats (24424) make it drop one."""
    digits = ctx.rng.sample("0123456789", 5)
    if digits[0] == "0":
        digits[0], digits[1] = digits[1], digits[0]
    return "".join(digits)


def capital_question(country: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"What is the capital of {country}?"}]


def contains(text: str, expected: str) -> bool:
    return expected.lower() in text.lower()


@check(CHECKS, "functional.short_text", "short text")
def short_text(ctx: Context) -> Cell:
    """Three one-line questions with known answers, plus the shape of a chat answer."""
    wrong = []
    countries = ctx.rng.sample(sorted(CAPITALS), 3)
    for country in countries:
        answer = ctx.client.chat(
            "short_text", capital_question(country), max_tokens=ctx.settings.max_tokens, **GREEDY
        )
        problems = _chat_shape(answer.body)
        if problems:
            return failed("bad answer shape", "; ".join(problems))
        if not contains(answer.text, CAPITALS[country]):
            wrong.append(f"capital of {country} -> {answer.text!r}")
    right = len(countries) - len(wrong)
    figure = f"{right}/{len(countries)} correct"
    return failed(figure, "; ".join(wrong)) if wrong else passed(figure)


def _chat_shape(body: dict[str, Any]) -> list[str]:
    problems = []
    if body.get("object") != "chat.completion":
        problems.append(f"object is {body.get('object')!r}, not 'chat.completion'")
    choice = (body.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    if message.get("role") != "assistant":
        problems.append(f"message.role is {message.get('role')!r}")
    if choice.get("finish_reason") not in ("stop", "length"):
        problems.append(f"finish_reason is {choice.get('finish_reason')!r}")
    usage = body.get("usage") or {}
    if not (usage.get("prompt_tokens", 0) > 0 and usage.get("completion_tokens", 0) > 0):
        problems.append(f"usage counts are not positive: {usage}")
    return problems


FILLER = [
    "The river runs slowly past the old mill and the wooden bridge.",
    "Farmers in the valley grow wheat, barley and a few rows of beans.",
    "In spring the hills turn green and the paths fill with walkers.",
    "The town library opens at nine and closes at six on weekdays.",
    "A small bakery on the main street sells bread and honey cakes.",
    "Children play football in the park behind the school every afternoon.",
    "The train to the city leaves twice an hour from the north platform.",
    "Fishermen mend their nets on the quay while gulls circle overhead.",
    "The museum shows old maps, coins and tools found near the lake.",
    "In winter the lake freezes and people skate on it at weekends.",
    "The market sells apples, cheese, eggs and flowers on Saturdays.",
    "An old clock tower stands in the square and rings every hour.",
]


def long_material(ctx: Context, code: str, num_chars: int = 3000) -> str:
    """About ``num_chars`` of filler with the code planted once, in the first fifth."""
    sentences: list[str] = []
    while sum(len(s) + 1 for s in sentences) < num_chars:
        batch = list(FILLER)
        ctx.rng.shuffle(batch)
        sentences.extend(batch)
    text: list[str] = []
    for sentence in sentences:
        if sum(len(s) + 1 for s in text) >= num_chars:
            break
        text.append(sentence)
    text.insert(max(1, len(text) // 6), f"The secret code is {code}.")
    return " ".join(text)


@check(CHECKS, "functional.long_text", "long text (3,000 chars)")
def long_text(ctx: Context) -> Cell:
    """The code planted early in ~3,000 characters must come back, and ``prompt_tokens``
    must cover the material (a server that truncates the prompt loses one or the other)."""
    code = plain_number(ctx)
    material = long_material(ctx, code)
    question = "What is the secret code in the text above? Answer with the code only."
    answer = ctx.client.chat(
        "long_text",
        [{"role": "user", "content": f"{material}\n\n{question}"}],
        max_tokens=ctx.settings.max_tokens,
        **GREEDY,
    )
    prompt_tokens = int(answer.usage.get("prompt_tokens") or 0)
    floor = len(material) // CHARS_PER_TOKEN_MAX
    figures = {"prompt_tokens": float(prompt_tokens), "chars": float(len(material))}
    if prompt_tokens < floor:
        return failed(
            f"prompt_tokens {prompt_tokens} < {floor}",
            f"{len(material)} characters were sent but only {prompt_tokens} prompt tokens "
            f"counted (at most {CHARS_PER_TOKEN_MAX} characters per token): truncated?",
            **figures,
        )
    if not contains(answer.text, code):
        return failed("code missing", f"planted {code!r}; answer {answer.text!r}", **figures)
    if question in answer.text or any(sentence in answer.text for sentence in FILLER):
        return failed("echo", f"the answer repeats the prompt: {answer.text[:200]!r}", **figures)
    return passed(f"code found, {prompt_tokens} prompt tokens", "", **figures)


@check(CHECKS, "functional.multi_turn", "5-turn memory")
def multi_turn(ctx: Context) -> Cell:
    """A number given in turn 1 is asked for in turn 5; ``prompt_tokens`` grows each turn."""
    number = plain_number(ctx)
    turns = [
        f"Remember this number: {number}.",
        *(capital_question(c)[0]["content"] for c in ("France", "Japan", "Germany")),
        "What number did I ask you to remember?",
    ]  # measured: 45/45 numbers recalled by the demo model in fp32 and in bf16
    messages: list[dict[str, Any]] = []
    counts: list[int] = []
    answer_text = ""
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        answer = ctx.client.chat(
            "multi_turn", messages, max_tokens=ctx.settings.max_tokens, **GREEDY
        )
        answer_text = answer.text
        counts.append(int(answer.usage.get("prompt_tokens") or 0))
        messages.append({"role": "assistant", "content": answer_text})
    shown = "/".join(str(c) for c in counts)
    if any(b <= a for a, b in zip(counts, counts[1:], strict=False)):
        return failed(f"prompt_tokens {shown}", "prompt_tokens did not grow every turn")
    if number not in answer_text:
        return failed("number forgotten", f"turn 1 gave {number}; turn 5 answered {answer_text!r}")
    return passed(f"recalled; prompt_tokens {shown}")


@check(CHECKS, "functional.concurrency", "20 concurrent requests")
def concurrency(ctx: Context) -> Cell:
    """All requests at once: no errors, and each answer is its own (no crossed streams)."""
    num = ctx.settings.num_concurrent
    countries = [ctx.rng.choice(sorted(CAPITALS)) for _ in range(num)]

    def one(country: str) -> str | None:
        try:
            answer = ctx.client.chat(
                "concurrency", capital_question(country), max_tokens=ctx.settings.max_tokens,
                **GREEDY,
            )  # fmt: skip
        except CheckFailed as exc:
            return f"error: {exc}"
        if contains(answer.text, CAPITALS[country]):
            return None
        return f"capital of {country} -> {answer.text!r}"

    with ThreadPoolExecutor(max_workers=num) as pool:
        results = list(pool.map(one, countries))
    errors = [r for r in results if r and r.startswith("error:")]
    wrong = [r for r in results if r and not r.startswith("error:")]
    figure = f"{num - len(errors)}/{num} answered, {len(errors)} errors"
    if errors:
        return failed(figure, "; ".join(sorted(set(errors))[:3]), errors=float(len(errors)))
    if wrong:
        return failed(f"{len(wrong)} wrong answers", "; ".join(wrong[:3]), errors=0.0)
    return passed(figure, errors=0.0)


SPECIAL_TEXTS = {
    "json": '{"name": "Kunlun", "ids": [1, 2, 3], "ok": true}',
    "code": "for i in range(3): print(i * 2)",
    "escapes": "print(\"a\\tb\", 'c')",
    "markup": "Tom & Jerry <3 cheese",
}
"""Texts the model is asked to repeat: quotes, braces, brackets, backslashes, ``&``, ``<``."""
ROUND_TRIP = (
    'JSON {"k": "v\\"q", "n": [1, 2.5e-3, null]} code if (a < b && c > d) { s += "\\t"; } '
    "unicode café naïve Zoë 中文 日本語 한국어 €£¥ emoji 🚀👍 math ∑√∞ ≠ ≤ quotes ‘’ “” — …"
)
"""Sent through ``/v1/completions`` with ``echo``: must come back byte for byte."""


@check(CHECKS, "functional.special_chars", "special characters, JSON, code")
def special_chars(ctx: Context) -> Cell:
    """Special characters survive both ways. Out: JSON, code and markup asked back verbatim
    come back intact, spelled by the answer's own token bytes (so they were generated, not
    copied). In: a prompt of JSON, code, CJK, emoji and symbols echoed back (``echo``) is
    byte-for-byte the prompt sent."""
    broken = []
    for kind, text in SPECIAL_TEXTS.items():
        answer = ctx.client.chat(
            "special_chars",
            [{"role": "user", "content": f"Repeat exactly: {text}"}],
            max_tokens=max(ctx.settings.max_tokens, 48),
            logprobs=True,
            **GREEDY,
        )
        if text not in answer.text:
            broken.append(f"{kind}: sent {text!r}, got {answer.text!r}")
        elif answer.spelling() != answer.text:
            broken.append(f"{kind}: the tokens spell {answer.spelling()!r}, not {answer.text!r}")
    echoed = ctx.client.completion("special_chars", ROUND_TRIP, echo=True, max_tokens=1, **GREEDY)
    if not echoed.text.startswith(ROUND_TRIP):
        broken.append(f"echo: sent {ROUND_TRIP!r}, got back {echoed.text[: len(ROUND_TRIP)]!r}")
    total = len(SPECIAL_TEXTS) + 1
    figure = f"{total - len(broken)}/{total} intact"
    return failed(figure, "; ".join(broken)) if broken else passed(figure)


@check(CHECKS, "functional.temperature", "temperature 0.9 varies")
def temperature(ctx: Context) -> Cell:
    """Five samples at temperature 0.9 of one open prompt: at least two must differ."""
    prompt = [{"role": "user", "content": "Write one sentence about the sea."}]
    texts = [
        ctx.client.chat(
            "temperature", prompt, max_tokens=ctx.settings.max_tokens, temperature=0.9
        ).text
        for _ in range(5)
    ]
    distinct = len(set(texts))
    figure = f"{distinct}/5 distinct"
    if distinct < 2:
        return failed(figure, f"all five answers were {texts[0]!r}", distinct=float(distinct))
    return passed(figure, distinct=float(distinct))


@check(CHECKS, "functional.batch", "batch of 10 (batch runner)")
def batch(ctx: Context) -> Cell:
    """Ten lines through ``kunlun-cli batch run``: one result per id, each answering its
    own line. On a pool column the runner is pointed at a :class:`PoolRelay`."""
    if not batch_runner_installed():
        return skipped("batch runner not installed")
    folder = ctx.settings.work_dir / f"batch-{_slug(ctx.column.name)}"
    out_dir = folder / "out"
    shutil.rmtree(folder, ignore_errors=True)  # a leftover results.jsonl would be resumed
    folder.mkdir(parents=True)
    countries = [ctx.rng.choice(sorted(CAPITALS)) for _ in range(ctx.settings.num_batch)]
    expected = {
        f"q{ctx.rng.randrange(10**6):06d}-{i}": CAPITALS[c] for i, c in enumerate(countries)
    }
    lines = [
        {"id": line_id, "messages": capital_question(country),
         "max_tokens": ctx.settings.max_tokens, "temperature": 0}
        for line_id, country in zip(expected, countries, strict=True)
    ]  # fmt: skip
    input_file = folder / "input.jsonl"
    input_file.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    with contextlib.ExitStack() as stack:
        endpoint = ctx.column.endpoint
        if ctx.column.pool:  # the runner takes no pool header: relay through one that adds it
            endpoint = stack.enter_context(PoolRelay(ctx.client))
        proc = run_cli(
            ["batch", "run", "--endpoint", endpoint, "--model-alias", ctx.column.model,
             "--input-file", str(input_file), "--output-dir", str(out_dir),
             "--batch-size", str(ctx.settings.batch_size), "--task-name", "kunlun-validate"],
            ctx.settings.api_key, timeout_s=ctx.settings.timeout_s * 2,
        )  # fmt: skip
    if proc.returncode != 0:
        return failed(f"exit {proc.returncode}", (proc.stderr or proc.stdout)[-300:])
    return _judge_batch(ctx, out_dir, expected)


def _judge_batch(ctx: Context, out_dir: Path, expected: dict[str, str]) -> Cell:
    results_path, summary_path = out_dir / "results.jsonl", out_dir / "summary.json"
    if not results_path.is_file() or not summary_path.is_file():
        return failed("no results", f"{results_path} or {summary_path} was not written")
    seen: dict[str, str] = {}
    for number, line in enumerate(results_path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
            seen[str(record["id"])] = str(record.get("result") or "")
        except (ValueError, KeyError, TypeError) as exc:
            return failed("bad results.jsonl", f"{results_path}:{number}: {exc}")
    for text in seen.values():
        ctx.client.record("batch", text)
    missing = sorted(set(expected) - set(seen))
    wrong = [f"{i}: {seen[i]!r}" for i in expected if i in seen and expected[i] not in seen[i]]
    figure = f"{len(expected) - len(missing) - len(wrong)}/{len(expected)} results"
    if missing or wrong:
        return failed(figure, f"missing {missing}; wrong {wrong[:3]}")
    return passed(figure)


def batch_runner_installed() -> bool:
    """Whether this installation has the ``kunlun-cli batch run`` command."""
    return run_cli(["batch", "run", "--help"], None, timeout_s=60).returncode == 0


def run_cli(
    args: list[str], api_key: str | None, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """``kunlun-cli ARGS`` with this interpreter (so it is this installation's CLI)."""
    env = dict(os.environ)
    env.pop("KUNLUN_API_KEY", None)
    if api_key:
        env["KUNLUN_API_KEY"] = api_key
    return subprocess.run(
        [sys.executable, "-m", "kunlun.cli", *args],
        capture_output=True, text=True, env=env, timeout=timeout_s, check=False,
    )  # fmt: skip


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
