"""Input lines: which run, and which are reported with their line number and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from kunlun.batch.inputs import CHAT_COMPLETIONS, COMPLETIONS, read_inputs
from kunlun.errors import ConfigError


def test_good_and_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(
        "\n".join(
            [
                '{"id": 1, "prompt": "hi", "max_tokens": 4, "temperature": 0}',
                '{"id": "c", "messages": [{"role": "user", "content": "yo"}]}',
                "{not json",
                '{"prompt": "no id"}',
                '{"id": 1, "prompt": "again"}',
                "",
                '{"id": 5, "prompt": "p", "messages": []}',
                '{"id": 6}',
                '{"id": 7, "prompt": "p", "model": "other"}',
                '{"id": 8, "prompt": "p", "stream": true}',
                '{"id": true, "prompt": "p"}',
                "[1, 2]",
                '{"id": 9, "messages": "text"}',
            ]
        )
        + "\n"
    )
    requests, bad = read_inputs(path)
    assert [(r.id, r.line, r.path) for r in requests] == [
        (1, 1, COMPLETIONS),
        ("c", 2, CHAT_COMPLETIONS),
    ]
    assert requests[0].params == {"prompt": "hi", "max_tokens": 4, "temperature": 0}
    found = {b.line: b.message for b in bad}
    assert sorted(found) == [3, 4, 5, 7, 8, 9, 10, 11, 12, 13]
    assert found[3].startswith("not valid JSON")
    assert found[4] == "missing 'id'"
    assert found[5] == "id 1 repeats line 1"
    assert "got both" in found[7] and "got neither" in found[8]
    assert "model_alias" in found[9]
    assert "'stream'" in found[10]
    assert "'id' must be" in found[11]
    assert "JSON object" in found[12]
    assert "'messages' must be" in found[13]
    record = next(b for b in bad if b.line == 5).to_record()
    assert record == {
        "id": 1,
        "line": 5,
        "error": {"code": "input.invalid", "message": "id 1 repeats line 1"},
    }


def test_a_missing_input_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        read_inputs(tmp_path / "nope.jsonl")
    assert "nope.jsonl" in str(caught.value)
