"""Hypothesis strategies that damage vendor-tool output, for the parsers' robustness tests.

:func:`mangled` turns a good sample into a bad one: empty, truncated, lines deleted,
duplicated or shuffled, random bytes inserted or alone, numbers replaced by garbage.
:func:`assert_survives` runs a plugin on a replay directory holding the damaged files and
checks the contract of ``DevicePlugin.discover``: devices or a ToolError, nothing else.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from hypothesis import strategies as st

from kunlun.device.plugin import DevicePlugin, Discovery, ProbedDevice
from kunlun.device.tools import ToolRunner, replay_file_name
from kunlun.errors import ToolError

GARBAGE = ["", "abc", "-1", "N/A", "[N/A]", "1e999", "9" * 400, "nan", "0x", "%", "|", ":", "MiB"]


def _drop(lines: list[str], picks: list[int]) -> str:
    gone = {p % len(lines) for p in picks} if lines else set()
    return "".join(line for i, line in enumerate(lines) if i not in gone)


def _repeat(lines: list[str], picks: list[int]) -> str:
    out = list(lines)
    for p in picks:
        if out:
            at = p % len(out)
            out.insert(at, out[at])
    return "".join(out)


def _garble_numbers(text: str, word: str, every: int) -> str:
    count = iter(range(1_000_000))
    return re.sub(r"\d+", lambda m: word if next(count) % every == 0 else m.group(), text)


def mangled(text: str) -> st.SearchStrategy[str]:
    """Damaged variants of ``text``."""
    lines = text.splitlines(keepends=True)
    picks = st.lists(st.integers(0, 10_000), min_size=1, max_size=6)
    raw = st.binary(max_size=300).map(lambda b: b.decode("latin-1"))
    return st.one_of(
        st.just(""),
        st.integers(0, len(text)).map(lambda n: text[:n]),
        picks.map(lambda p: _drop(lines, p)),
        picks.map(lambda p: _repeat(lines, p)),
        st.permutations(lines).map("".join),
        raw,
        st.tuples(st.integers(0, len(text)), raw).map(lambda t: text[: t[0]] + t[1] + text[t[0] :]),
        st.tuples(st.sampled_from(GARBAGE), st.integers(1, 5)).map(
            lambda t: _garble_numbers(text, t[0], t[1])
        ),
    )


def replay_case(samples: dict[str, str]) -> st.SearchStrategy[dict[str, str]]:
    """The samples with one file damaged (or, sometimes, one file missing)."""
    names = sorted(samples)

    def damage(name: str) -> st.SearchStrategy[dict[str, str]]:
        missing = st.just({k: v for k, v in samples.items() if k != name})
        changed = mangled(samples[name]).map(lambda bad: {**samples, name: bad})
        return st.one_of(changed, missing) if len(names) > 1 else changed

    return st.sampled_from(names).flatmap(damage)


def assert_survives(plugin: DevicePlugin, files: dict[str, str]) -> Discovery | None:
    """Run ``plugin`` on a replay directory of ``files``: devices or ToolError, never else."""
    with tempfile.TemporaryDirectory() as tmp:
        for command, text in files.items():
            path = Path(tmp) / replay_file_name(command.split(" "))
            path.write_text(text, encoding="utf-8")
        try:
            result = plugin.discover(ToolRunner(replay_dir=Path(tmp)))
        except ToolError as exc:
            assert exc.message
            return None
    assert isinstance(result, Discovery)
    for device in result.devices:
        assert isinstance(device, ProbedDevice)
        assert device.device_type == plugin.device_type
        assert isinstance(device.name, str) and device.name
        assert device.topology is None or all(isinstance(d, int) for d in device.topology)
    return result
