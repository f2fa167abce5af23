"""Reading the text that vendor ``*-smi`` tools print: reports, tables, values, health words.

Most vendor tools print one of two layouts, copied from ``nvidia-smi``:

- a **report** (``nvidia-smi -q`` style): one block per device, opened by a line such as
  ``GPU 00000000:4F:00.0`` or ``Card 0``, holding indented ``Key : Value`` lines whose
  indentation nests sections (``Memory Usage`` > ``Total``). :func:`parse_report` returns one
  :class:`ReportBlock` per device, its fields keyed by path (``"Memory Usage/Total"``);
- a **table** (``nvidia-smi`` with no argument): two ``|``-separated lines per device, the
  first starting with the device index. :func:`parse_table_rows` returns the cells.

Values carry units (``49152MiB``, ``45.5 W``, ``41C``, ``0 %``) or say they are unknown
(``N/A``, ``[Not Supported]``); the ``parse_*`` helpers turn them into numbers or ``None`` and
raise :class:`ValueError` for a value that is neither. :func:`health_from_word` reduces a
tool's health or state word to :class:`~kunlun.device.plugin.Health`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from kunlun.device.plugin import Health, ProbedDevice

_MISSING = {"", "n/a", "[n/a]", "na", "-", "--", "not supported", "[not supported]", "none"}
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_SIZE = re.compile(r"^([-+]?\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?$", re.IGNORECASE)
_MIB_PER_UNIT = {"B": 1 / 2**20, "K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0**2}

_HEALTH_OK = {"ok", "healthy", "normal", "good", "ready", "active", "pass", "passed"}
_HEALTH_WARNING = {"warning", "warn", "degraded", "minor", "alarm", "throttled"}
_HEALTH_BAD = {
    "critical",
    "error",
    "fault",
    "failed",
    "fail",
    "lost",
    "unhealthy",
    "abnormal",
    "major",
    "offline",
    "unavailable",
    "gpu is lost",
    "gpu requires reset",
}


def dtypes_for_name(table: dict[str, list[str]], name: str) -> list[str] | None:
    """The dtypes of the first model key of ``table`` found in ``name`` (case-insensitive);
    None when no key matches (the operator must declare them)."""
    upper = name.upper()
    return next((list(d) for model, d in table.items() if model in upper), None)


def is_missing(value: str | None) -> bool:
    """Whether the tool says the value is unknown (``N/A``, ``[Not Supported]``, empty...)."""
    return value is None or value.strip().lower() in _MISSING


def parse_float(value: str | None) -> float | None:
    """The first number in ``value`` (units ignored); None when unknown; ValueError if garbage."""
    if is_missing(value):
        return None
    assert value is not None
    match = _NUMBER.search(value)
    if match is None:
        raise ValueError(f"{value.strip()!r} is not a number")
    number = float(match.group())
    if not math.isfinite(number):
        raise ValueError(f"{value.strip()[:40]!r} is out of range")
    return number


def parse_mib(value: str | None, default_unit: str = "MiB") -> int | None:
    """A memory size in MiB from ``24576 MiB``, ``32GiB``, ``17179869184 B`` or a bare number."""
    if is_missing(value):
        return None
    assert value is not None
    match = _SIZE.match(value.strip())
    if match is None:
        raise ValueError(f"{value.strip()!r} is not a memory size")
    unit = (match.group(2) or default_unit)[0].upper()
    size = float(match.group(1)) * _MIB_PER_UNIT[unit]
    if not math.isfinite(size) or size < 0:
        raise ValueError(f"{value.strip()[:40]!r} is out of range")
    return int(round(size))


def set_parsed(device: ProbedDevice, attr: str, raw: str | None, parse: Any) -> None:
    """Set ``device.<attr>`` to ``parse(raw)``; a value that does not parse becomes a problem."""
    try:
        setattr(device, attr, parse(raw))
    except ValueError as exc:
        device.problems.append(f"{attr}: {exc}")


def health_from_word(word: str | None) -> Health:
    """Map a tool's health or state word (``OK``, ``Warning``, ``Critical``...) to Health."""
    if is_missing(word):
        return Health.UNKNOWN
    assert word is not None
    key = word.strip().strip("[]").lower()
    if key in _HEALTH_OK:
        return Health.OK
    if key in _HEALTH_WARNING:
        return Health.WARNING
    if key in _HEALTH_BAD:
        return Health.UNHEALTHY
    return Health.UNKNOWN


@dataclass
class ReportBlock:
    """One device's block of a ``-q`` style report."""

    header: re.Match[str]  # the match of the line that opened the block
    fields: dict[str, str] = field(default_factory=dict)  # "Section/Key" -> raw value
    top: dict[str, str] = field(default_factory=dict)  # fields before the first block

    def get(self, *paths: str) -> str | None:
        """The value of the first of ``paths`` present (case-insensitive), else None."""
        lowered = {k.lower(): v for k, v in self.fields.items()}
        for path in paths:
            value = self.fields.get(path)
            if value is None:
                value = lowered.get(path.lower())
            if value is not None:
                return value
        return None

    def leaf(self, *names: str) -> str | None:
        """The value of the first field whose last path part is one of ``names``, any section."""
        for name in names:
            for path, value in self.fields.items():
                if path.rsplit("/", 1)[-1].lower() == name.lower():
                    return value
        return None


_KEY_VALUE = re.compile(r"^(?P<key>[^:]+?)\s*:\s*(?P<value>.*)$")


def parse_report(text: str, block_start: re.Pattern[str]) -> list[ReportBlock]:
    """Split a ``-q`` style report into device blocks opened by lines matching ``block_start``.

    Lines before the first block (``Driver Version : ...``) are copied into every block's
    :attr:`ReportBlock.top`. The first value wins when a key repeats.
    """
    blocks: list[ReportBlock] = []
    top: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    block_indent = 0
    for raw in text.expandtabs(8).splitlines():
        if not raw.strip():
            continue
        header = block_start.match(raw.strip())
        if header is not None:
            blocks.append(ReportBlock(header=header, top=top))
            stack, block_indent = [], len(raw) - len(raw.lstrip())
            continue
        indent = len(raw) - len(raw.lstrip())
        line = raw.strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        match = _KEY_VALUE.match(line)
        key, value = (match.group("key"), match.group("value").strip()) if match else (line, "")
        if not blocks:
            if value:
                top.setdefault(key, value)
            continue
        if indent < block_indent:
            continue
        path = "/".join([name for _, name in stack] + [key])
        if value:
            blocks[-1].fields.setdefault(path, value)
        else:
            stack.append((indent, key))
    return blocks


def parse_table_rows(text: str) -> list[tuple[list[str], list[str] | None]]:
    """The two-line device rows of an ``nvidia-smi`` style table, as stripped cells.

    A device row is a ``|`` line whose first cell starts with a number (the index); the
    ``|`` line right after it is its second line (None when the table is cut short).
    Header rows (``| GPU  Name ...``) never start with a number, so they are skipped; the
    process table after the devices is not read.
    """
    lines = [line.strip() for line in text.splitlines()]
    rows: list[tuple[list[str], list[str] | None]] = []
    at = 0
    while at < len(lines):
        line = lines[at]
        if "process" in line.lower():  # the process table that follows the devices
            break
        cells = _cells(line)
        if cells and _INDEX.match(cells[0]):
            nxt = _cells(lines[at + 1]) if at + 1 < len(lines) else None
            second = nxt if nxt and not _INDEX.match(nxt[0]) else None
            rows.append((cells, second))
            at += 2 if second is not None else 1
            continue
        at += 1
    return rows


_INDEX = re.compile(r"^\d+(\s|$)")


def _cells(line: str) -> list[str] | None:
    if not line.startswith("|") or line.startswith("|=") or line.startswith("|-"):
        return None
    return [cell.strip() for cell in line.strip("|").split("|")]
