"""The journal: durable lines keyed by id; a torn last line is cut off, nothing else."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kunlun.batch.journal import Journal, JournalCorrupt


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def test_append_is_durable_and_refuses_a_repeated_id(tmp_path: Path) -> None:
    path = tmp_path / "out" / "results.jsonl"
    journal = Journal.open(path, "id")
    assert journal.ids == set() and path.exists()

    async def write() -> list[bool]:
        return [
            await journal.append({"id": 1, "result": "a"}),
            await journal.append({"id": "x", "result": "b"}),
            await journal.append({"id": 1, "result": "again"}),
        ]

    assert asyncio.run(write()) == [True, True, False]
    journal.close()
    assert [json.loads(line) for line in lines(path)] == [
        {"id": 1, "result": "a"},
        {"id": "x", "result": "b"},
    ]
    reopened = Journal.open(path, "id")
    assert reopened.ids == {"1", "x"} and reopened.num_discarded == 0
    assert reopened.records()[1]["result"] == "b"
    reopened.close()


@pytest.mark.parametrize(
    "torn",
    [b'{"id": 3, "result": "hal', b'{"id": 3, "result": "whole"}', b'{"id": 3, "res\n'],
    ids=["cut-mid-line", "no-newline", "invalid-json-with-newline"],
)
def test_a_torn_last_line_is_discarded(tmp_path: Path, torn: bytes) -> None:
    path = tmp_path / "results.jsonl"
    good = b'{"id": 1}\n{"id": 2}\n'
    path.write_bytes(good + torn)
    journal = Journal.open(path, "id")
    assert journal.ids == {"1", "2"}
    assert journal.num_discarded == 1
    assert path.read_bytes() == good  # truncated to the last complete line
    asyncio.run(journal.append({"id": 3, "result": "rerun"}))
    journal.close()
    assert [json.loads(line)["id"] for line in lines(path)] == [1, 2, 3]


def test_a_bad_line_before_the_last_is_an_error_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    path.write_bytes(b'{"id": 1}\nnot json\n{"id": 3}\n')
    with pytest.raises(JournalCorrupt) as caught:
        Journal.open(path, "id")
    assert f"{path}:2" in str(caught.value)
    assert path.read_bytes() == b'{"id": 1}\nnot json\n{"id": 3}\n'  # left as it was


def test_a_line_without_the_key_counts_as_bad(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"custom_id": "a"}\n{"other": 1}\n')
    journal = Journal.open(path, "custom_id")  # the last line lacks the key: torn
    assert journal.ids == {"a"} and journal.num_discarded == 1
    journal.close()
