"""The accuracy row's evaluation set and its reading of an ``echo`` answer, without a server:
the shipped set loads and says its chance, a bad operator file is refused naming the file,
the line and the field (before ``kunlun-cli validate`` sends anything), and a choice's
log-likelihood is the sum over the tokens between the context's end and the prompt's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.validate.test_validate_cli import run

from kunlun.errors import ConfigError
from kunlun.validate.accuracy import (
    MAX_CHOICES,
    MAX_FILE_BYTES,
    MAX_ITEMS,
    SHIPPED,
    chance,
    choice_logprob,
    load_eval,
)


def test_the_shipped_set_loads_with_four_choices_an_item() -> None:
    items = load_eval(SHIPPED)
    assert len(items) == 229 and {len(i.choices) for i in items} == {4}
    assert chance(items) == 0.25
    assert {i.answer for i in items} == {0, 1, 2, 3}  # the answer's place is shuffled


GOOD = {"question": "Q?", "choices": ["a", "b"], "answer": 1}


@pytest.mark.parametrize(
    ("line", "field", "words"),
    [
        ("{not json", None, "not JSON"),
        ("[1, 2]", None, "not a JSON object"),
        (json.dumps({**GOOD, "question": ""}), "question", "question must be a text"),
        (json.dumps({**GOOD, "choices": ["only"]}), "choices", "choices must be 2 to"),
        (json.dumps({**GOOD, "choices": ["x"] * (MAX_CHOICES + 1)}), "choices", "choices"),
        (json.dumps({**GOOD, "choices": ["a", 3]}), "choices", "choices must be"),
        (json.dumps({**GOOD, "answer": 2}), "answer", "answer must be the index"),
        (json.dumps({**GOOD, "answer": True}), "answer", "got True"),
    ],
)
def test_a_bad_item_is_refused_naming_its_line_and_field(
    tmp_path: Path, line: str, field: str | None, words: str
) -> None:
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + line + "\n")
    with pytest.raises(ConfigError, match=words) as caught:
        load_eval(path)
    location = caught.value.location
    assert location is not None and (location.path, location.line) == (str(path), 3)
    assert location.field == field


def test_budgets_of_an_evaluation_file(tmp_path: Path) -> None:
    many = tmp_path / "many.jsonl"
    many.write_text((json.dumps(GOOD) + "\n") * (MAX_ITEMS + 1))
    with pytest.raises(ConfigError, match=f"more than {MAX_ITEMS} items"):
        load_eval(many)
    big = tmp_path / "big.jsonl"
    big.write_bytes(b" " * (MAX_FILE_BYTES + 1))
    with pytest.raises(ConfigError, match="at most"):
        load_eval(big)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="no items"):
        load_eval(empty)


def test_validate_refuses_a_bad_set_before_sending_anything(tmp_path: Path) -> None:
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps({**GOOD, "answer": 5}) + "\n")
    proc = run("--endpoint", "http://127.0.0.1:1", "--model", "m", "--eval", str(path),
               "--out", str(tmp_path / "out"))  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{path}:1 (answer)" in proc.stderr and "unreachable" not in proc.stdout


def test_a_choice_is_the_tokens_after_the_context_and_before_the_generated_one() -> None:
    # "Answer:" then " Paris" (2 tokens), then the generated token at the prompt's end
    answer = {"logprobs": {"tokens": ["Answer", ":", " Par", "is", "\n"],
                           "text_offset": [0, 6, 7, 11, 13],
                           "token_logprobs": [None, -1.0, -2.0, -0.5, -9.0]}}  # fmt: skip
    assert choice_logprob(answer, 7, 13) == -2.5
