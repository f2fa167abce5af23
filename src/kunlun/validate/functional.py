"""The functional battery (seed section 6.2), each check built so that a fake cannot pass it.

Answers that must be right use greedy decoding (temperature 0) and prompts that a 135M
model handles: short explicit instructions, the thing to copy stated plainly. What the
checks look for (codes, names, words) is drawn at random for each run, so no canned answer
can match; the rules are in ``docs/validation.md``.
"""

from __future__ import annotations

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

CHECKS: list[Check] = []

GREEDY = {"temperature": 0}
WORDS = [
    "apple", "banana", "candle", "dragon", "engine", "forest", "guitar", "harbor", "island",
    "jacket", "kettle", "lemon", "marble", "needle", "orange", "pencil", "rabbit", "saddle",
    "tiger", "violin", "window", "yellow", "zebra", "anchor", "bottle", "castle", "dolphin",
    "feather", "garden", "hammer",
]  # fmt: skip
NAMES = ["Alice", "Bruno", "Clara", "Daniel", "Elena", "Felix", "Grace", "Hugo", "Irene",
         "Jonas", "Laura", "Marco", "Nadia", "Oscar"]  # fmt: skip
CHARS_PER_TOKEN_MAX = 8
"""``prompt_tokens`` of the long-text prompt must be at least its characters over this."""


def repeat_prompt(word: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Repeat this word: {word}"}]


def contains(text: str, expected: str) -> bool:
    return expected.lower() in text.lower()


@check(CHECKS, "functional.short_text", "short text")
def short_text(ctx: Context) -> Cell:
    """Three one-line questions with known answers, plus the shape of a chat answer."""
    questions = [
        ("What is the capital of France?", "Paris"),
        ("What is the capital of Japan?", "Tokyo"),
        ("What color is the sky on a clear day?", "blue"),
    ]
    ctx.rng.shuffle(questions)
    wrong = []
    for question, expected in questions:
        answer = ctx.client.chat(
            "short_text",
            [{"role": "user", "content": question}],
            max_tokens=ctx.settings.max_tokens,
            **GREEDY,
        )
        problems = _chat_shape(answer.body)
        if problems:
            return failed("bad answer shape", "; ".join(problems))
        if not contains(answer.text, expected):
            wrong.append(f"{question!r} -> {answer.text!r} (expected {expected!r})")
    right = len(questions) - len(wrong)
    figure = f"{right}/{len(questions)} correct"
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
    code = f"{ctx.rng.choice(WORDS).upper()}-{ctx.rng.randint(1000, 9999)}"
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
    return passed(f"code found, {prompt_tokens} prompt tokens", **figures)


@check(CHECKS, "functional.multi_turn", "5-turn memory")
def multi_turn(ctx: Context) -> Cell:
    """A name given in turn 1 is asked for in turn 5; ``prompt_tokens`` grows each turn."""
    name = ctx.rng.choice(NAMES)
    turns = [
        f"Hello! My name is {name}.",
        "What is two plus two?",
        "Name one color of the rainbow.",
        "What is the opposite of cold?",
        "What is my name?",
    ]
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
    if not contains(answer_text, name):
        return failed("name forgotten", f"turn 1 said {name!r}; turn 5 answered {answer_text!r}")
    return passed(f"recalled; prompt_tokens {shown}")


@check(CHECKS, "functional.concurrency", "20 concurrent requests")
def concurrency(ctx: Context) -> Cell:
    """All requests at once: no errors, and each answer is its own (no crossed streams)."""
    num = ctx.settings.num_concurrent
    words = ctx.rng.sample(WORDS, min(num, len(WORDS)))
    words += ctx.rng.choices(WORDS, k=num - len(words))

    def one(word: str) -> str | None:
        try:
            answer = ctx.client.chat(
                "concurrency", repeat_prompt(word), max_tokens=ctx.settings.max_tokens, **GREEDY
            )
        except CheckFailed as exc:
            return f"error: {exc}"
        return None if contains(answer.text, word) else f"{word!r} -> {answer.text!r}"

    with ThreadPoolExecutor(max_workers=num) as pool:
        results = list(pool.map(one, words))
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
    "markup": '<a href="x">Tom & Jerry</a> 50% off!',
    "unicode": "café, naïve, 中文, €5",
}


@check(CHECKS, "functional.special_chars", "special characters, JSON, code")
def special_chars(ctx: Context) -> Cell:
    """JSON, code, markup and non-ASCII text asked back verbatim must come back intact."""
    broken = []
    for kind, text in SPECIAL_TEXTS.items():
        answer = ctx.client.chat(
            "special_chars",
            [{"role": "user", "content": f"Repeat exactly: {text}"}],
            max_tokens=max(ctx.settings.max_tokens, 48),
            **GREEDY,
        )
        if text not in answer.text:
            broken.append(f"{kind}: sent {text!r}, got {answer.text!r}")
    figure = f"{len(SPECIAL_TEXTS) - len(broken)}/{len(SPECIAL_TEXTS)} intact"
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
    own line."""
    if not batch_runner_installed():
        return skipped("batch runner not installed")
    if ctx.column.pool:
        return skipped("the batch runner cannot target one pool")
    folder = ctx.settings.work_dir / f"batch-{_slug(ctx.column.name)}"
    out_dir = folder / "out"
    shutil.rmtree(folder, ignore_errors=True)  # a leftover results.jsonl would be resumed
    folder.mkdir(parents=True)
    words = ctx.rng.sample(WORDS, ctx.settings.num_batch)
    lines = [
        {"id": f"line-{i}", "messages": repeat_prompt(w), "max_tokens": ctx.settings.max_tokens,
         "temperature": 0}
        for i, w in enumerate(words)
    ]  # fmt: skip
    input_file = folder / "input.jsonl"
    input_file.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    proc = run_cli(
        ["batch", "run", "--endpoint", ctx.column.endpoint, "--model-alias", ctx.column.model,
         "--input-file", str(input_file), "--output-dir", str(out_dir),
         "--batch-size", str(ctx.settings.batch_size), "--task-name", "kunlun-validate"],
        ctx.settings.api_key, timeout_s=ctx.settings.timeout_s * 2,
    )  # fmt: skip
    if proc.returncode != 0:
        return failed(f"exit {proc.returncode}", (proc.stderr or proc.stdout)[-300:])
    return _judge_batch(ctx, out_dir, dict(zip((d["id"] for d in lines), words, strict=True)))


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
