"""Mangled vendor-tool output for the ascend, amd and hygon property tests, and a strict check.

:func:`mangled` adds to :func:`mangling.mangled` (empty, truncated, lines deleted, duplicated or
shuffled, random bytes inserted, numbers replaced by garbage) a missing column (a table cell,
a whitespace column, or one JSON key of every card) and raw bytes that are not UTF-8.
:func:`check_outcome` runs a plugin on a replay directory and asserts the contract: a
:class:`ToolError` naming the command, or well-formed devices (unique indices, numbers finite,
a missing memory total explained by a problem, a device with problems not Ready), never
another exception.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from hypothesis import strategies as st
from mangling import mangled as damaged

from kunlun.device.plugin import DevicePlugin, Discovery, Health
from kunlun.device.profile import from_probe
from kunlun.device.tools import ToolRunner, replay_file_name
from kunlun.errors import ToolError


def mangled(text: str) -> st.SearchStrategy[bytes]:
    """One damaged version of ``text`` as bytes: the shared damage of :mod:`mangling`, a
    missing column, or random bytes (not valid UTF-8 either)."""
    return st.one_of(
        damaged(text).map(str.encode),
        st.integers(0, 6).map(lambda k: _drop_column(text, k).encode()),
        st.binary(max_size=2000),
    )


def _drop_column(text: str, k: int) -> str:
    """``text`` without its k-th column: JSON key of every card, table cell, or token."""
    start = text.find("{")
    if start >= 0:
        try:
            data = json.loads(text[start:])
        except ValueError:
            data = None
        if isinstance(data, dict):
            for card in data.values():
                if isinstance(card, dict) and card:
                    card.pop(sorted(card)[k % len(card)])
            return json.dumps(data, indent=2)
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("|"):
            cells = line.split("|")
            if len(cells) > k + 1:
                del cells[k + 1]
            out.append("|".join(cells))
        else:
            tokens = re.split(r"(\s{2,})", line)
            words = [t for t in tokens if t.strip()]
            if len(words) > k:
                tokens.remove(words[k])
            out.append("".join(tokens))
    return "\n".join(out) + "\n"


def write_outputs(directory: Path, outputs: dict[str, bytes | str]) -> Path:
    """A replay directory from ``{"npu-smi info": output}``."""
    directory.mkdir(parents=True, exist_ok=True)
    for command, out in outputs.items():
        data = out.encode() if isinstance(out, str) else out
        (directory / replay_file_name(command.split(" "))).write_bytes(data)
    return directory


def check_outcome(
    plugin: DevicePlugin, replay_dir: Path, tools: tuple[str, ...]
) -> Discovery | None:
    """Run ``plugin`` on ``replay_dir``; assert the robustness contract (module docstring)."""
    try:
        found = plugin.discover(ToolRunner(replay_dir=replay_dir))
    except ToolError as exc:
        assert any(f"'{tool}" in exc.message for tool in tools), exc.message
        return None
    assert isinstance(found, Discovery)
    indices = [d.index for d in found.devices]
    assert len(indices) == len(set(indices)), f"duplicate indices {indices}"
    for device in found.devices:
        assert device.device_type == plugin.device_type
        assert isinstance(device.index, int) and device.index >= 0
        assert isinstance(device.name, str) and device.name
        assert isinstance(device.health, Health)
        for value in (device.memory_total_mb, device.memory_used_mb):
            assert value is None or (isinstance(value, int) and value >= 0)
        for value in (device.utilization_pct, device.temperature_c, device.power_w):
            assert value is None or (isinstance(value, float) and math.isfinite(value))
        if device.memory_total_mb is None:
            assert device.problems, f"{device.id} has no memory total and no problem saying so"
        if device.topology is not None:
            assert len(device.topology) == len(found.devices)
            assert device.topology[sorted(indices).index(device.index)] == 0
        assert all(isinstance(p, str) and p for p in device.problems)
        profile = from_probe(plugin, device)
        if device.problems:
            assert profile.status.value != "Ready"
    return found
