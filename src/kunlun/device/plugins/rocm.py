"""Shared ROCm parsing for the AMD and Hygon plugins: rocm-smi / hy-smi, rocminfo, topology.

Hygon's DTK is a ROCm derivative, so both families print the same shapes with different keys:

- ``rocm-smi --showid --showmeminfo vram ... --json``: ``{"card0": {key: value}}``; AMD says
  ``GPU use (%)`` and ``VRAM Total Memory (B)``, DTK says ``DCU use (%)`` (``HCU use (%)`` on
  newer parts) and ``vram Total Memory (MiB)``. Key case differs between releases
  (``Card series`` / ``Card Series``), so keys are compared lower-cased.
- ``hy-smi`` (Hygon) in text mode: ``DCU[0]  : vram Total Memory (MiB): 65520`` lines, the
  same keys as the JSON (see :mod:`kunlun.device.plugins.hygon`).
- ``rocminfo``: one ``Agent N`` block per CPU/GPU agent with ``Marketing Name``, ``Uuid``
  (``GPU-<unique id>``), ``Node``, ``BDFID`` (bus << 8 | device << 3 | function) and the first
  memory pool's size in KB. Used for the name, bus id, gfx target and as a memory fallback.
- ``rocm-smi --showtopo --json`` (AMD's documented form, ROCm 5/6): per card
  ``(Topology) Numa Node``, and under ``system`` one entry per pair ``i < j``:
  ``(Topology) Weight between DRM devices i and j``, ``... Hops ...``, ``... Link type ...``
  (``XGMI`` or ``PCIE``). Distances: 0 self, 5 XGMI, PCIe 10 / 20 / 30 for 1 / 2 / 3+ hops,
  50 across NUMA nodes; peer-to-peer when a link is XGMI or within 2 PCIe hops.

Every parser raises :class:`~kunlun.errors.ToolError` naming the command, or returns data; an
odd value becomes a problem on its device (Degraded), never an exception.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from kunlun.device.plugin import Discovery, ProbedDevice
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

#: Arguments of the one query both families run (rocm-smi with ``--json``; hy-smi without).
SMI_QUERY = (
    "--showid",
    "--showmeminfo",
    "vram",
    "--showpower",
    "--showserial",
    "--showuse",
    "--showtemp",
    "--showproductname",
    "--showuniqueid",
)
ROCM_SMI_ARGV = ["rocm-smi", *SMI_QUERY, "--json"]
ROCMINFO_ARGV = ["rocminfo"]

_MIB = 1024 * 1024
_MISSING = {"", "n/a", "na", "none", "unknown", "-"}
_USE_KEYS = ("gpu use (%)", "dcu use (%)", "hcu use (%)")
_HYGON_USE_KEYS = ("dcu use (%)", "hcu use (%)")
_TEMP_KEYS = (
    "temperature (sensor edge) (c)",
    "temperature (sensor junction) (c)",
    "temperature (sensor memory) (c)",
    "temperature (sensor mem) (c)",
)
_POWER_KEYS = (
    "average graphics package power (w)",
    "current socket graphics package power (w)",
)
_CARD_KEY = re.compile(r"^card([0-9]{1,6})$", re.IGNORECASE)
_SMI_LINE = re.compile(r"^\s*(?:GPU|DCU|HCU)\[([0-9]{1,6})\]\s*:\s*(.*)$")
_AGENT = re.compile(r"^\s*Agent\s+([0-9]{1,6})\s*$")
_TOPO_KEY = re.compile(
    r"^\(topology\)\s+(weight|hops|link type)\s+between\s+(?:drm devices|two \w+)\s+"
    r"([0-9]{1,6})\s+and\s+([0-9]{1,6})$",
    re.IGNORECASE,
)

Cards = dict[int, dict[str, str]]


# --- rocm-smi / hy-smi ------------------------------------------------------------------


def parse_smi_json(text: str, command: str) -> Cards:
    """``{card index: {lower-cased key: value}}`` from rocm-smi (or hy-smi) ``--json`` output.

    Text before the JSON object (DTK prints banners such as ``hygon module is loaded``) and
    after it is ignored.
    """
    start = text.find("{")
    if start < 0:
        raise ToolError(f"'{command}' printed no JSON object")
    try:
        data, _ = json.JSONDecoder().raw_decode(text, start)
    except (ValueError, RecursionError) as exc:  # ValueError: also over-long ints
        raise ToolError(f"'{command}' printed invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ToolError(f"'{command}' printed JSON that is not an object of cards")
    cards: Cards = {}
    for key, value in data.items():
        match = _CARD_KEY.match(str(key))
        if match and isinstance(value, dict):
            cards[int(match.group(1))] = _lower_keys(value)
    if not cards:
        raise ToolError(f"'{command}' printed no 'cardN' entries")
    return cards


def parse_smi_lines(text: str, command: str) -> Cards:
    """``{card index: {lower-cased key: value}}`` from ``DCU[0]  : key: value`` text lines."""
    cards: Cards = {}
    for line in text.splitlines():
        match = _SMI_LINE.match(line)
        if not match:
            continue
        key, sep, value = match.group(2).partition(":")
        if not sep or not key.strip():
            continue
        card = cards.setdefault(int(match.group(1)), {})
        card.setdefault(key.strip().lower(), value.strip())
    if not cards:
        raise ToolError(f"'{command}' printed no 'DCU[N] : key: value' lines")
    return cards


def _lower_keys(value: dict[object, object]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in value.items():
        if isinstance(v, str | int | float) and not isinstance(v, bool) and str(k).strip():
            out.setdefault(str(k).strip().lower(), str(v).strip())
    return out


def is_hygon(card: dict[str, str], agent: dict[str, str] | None) -> bool:
    """Whether a card is a Hygon DCU: its vendor, DTK-only keys, or rocminfo's vendor/type."""
    vendor = card.get("card vendor", "").lower()
    if "haiguang" in vendor or "hygon" in vendor:
        return True
    if any(key in card for key in _HYGON_USE_KEYS):
        return True
    if agent is not None:
        if "hygon" in agent.get("vendor name", "").lower():
            return True
        if agent.get("device type", "").upper() == "DCU":
            return True
    return False


# --- rocminfo ---------------------------------------------------------------------------


def parse_rocminfo(text: str) -> list[dict[str, str]]:
    """GPU/DCU agents of ``rocminfo``: the first value of each key in the agent's block."""
    agents: list[dict[str, str]] = []
    current: dict[str, str] | None = None
    for line in text.splitlines():
        if _AGENT.match(line):
            current = {}
            agents.append(current)
            continue
        if current is None:
            continue
        key, sep, value = line.partition(":")
        if sep and key.strip():
            current.setdefault(key.strip().lower(), value.strip())
    return [a for a in agents if a.get("device type", "").upper() in ("GPU", "DCU")]


def match_agent(
    index: int, card: dict[str, str], cards: Cards, agents: list[dict[str, str]]
) -> dict[str, str] | None:
    """The rocminfo agent of a card: same unique id, else same node, else same position."""
    unique = _hex_id(card.get("unique id"))
    if unique:
        for agent in agents:
            if _hex_id(agent.get("uuid")) == unique:
                return agent
    node = card.get("node id")
    if node:
        for agent in agents:
            if agent.get("node") == node:
                return agent
    if len(agents) == len(cards):
        return agents[sorted(cards).index(index)]
    return None


def _hex_id(value: str | None) -> str | None:
    if not value:
        return None
    text = value.strip().lower().removeprefix("gpu-").removeprefix("0x")
    return text if re.fullmatch(r"[0-9a-f]{4,}", text) else None


def bus_id_from_bdfid(value: str | None) -> str | None:
    """``0000:03:00.0`` from rocminfo's ``BDFID`` (bus << 8 | device << 3 | function)."""
    number = _leading_int(value)
    if number is None or not 0 <= number <= 0xFFFF:
        return None
    return f"0000:{number >> 8:02x}:{(number >> 3) & 0x1F:02x}.{number & 0x7}"


def _leading_int(value: str | None) -> int | None:
    match = re.match(r"\s*([0-9]{1,18})(?![0-9])", value or "")
    return int(match.group(1)) if match else None


# --- one card -> one device -------------------------------------------------------------


@dataclass
class CardReader:
    """Reads typed values out of one card's key/value pairs, collecting problems."""

    command: str
    index: int
    card: dict[str, str]
    problems: list[str] = field(default_factory=list)

    def number(self, keys: tuple[str, ...]) -> float | None:
        """The first key present; a value that is not a number is a problem."""
        for key in keys:
            raw = self.card.get(key)
            if raw is None or raw.strip().lower() in _MISSING:
                continue
            try:
                value = float(raw)
            except ValueError:
                value = math.nan
            if math.isfinite(value) and value >= 0:
                return value
            self.problems.append(
                f"'{self.command}': card{self.index} {key!r} is {raw!r}, not a number"
            )
            return None
        return None

    def text(self, *keys: str) -> str | None:
        for key in keys:
            raw = self.card.get(key, "").strip()
            if raw.lower() not in _MISSING:
                return raw
        return None


def card_device(
    device_type: str,
    index: int,
    reader: CardReader,
    agent: dict[str, str] | None,
    dtypes: Callable[[str | None], list[str] | None],
) -> ProbedDevice:
    """A :class:`ProbedDevice` from one card and its rocminfo agent (if any)."""
    agent = agent or {}
    gfx = _gfx_target(agent.get("name")) or _gfx_from_smi(reader.text("gfx version"))
    name = (
        reader.text("marketing name")
        or _clean(agent.get("marketing name"))
        or reader.text("card series", "device name")
        or device_type
    )
    device = ProbedDevice(
        device_type=device_type,
        index=index,
        name=name,
        bus_id=reader.text("pci bus") or bus_id_from_bdfid(agent.get("bdfid")),
        uuid=reader.text("unique id") or _clean(agent.get("uuid")),
        utilization_pct=reader.number(_USE_KEYS),
        temperature_c=reader.number(_TEMP_KEYS),
        power_w=reader.number(_POWER_KEYS),
        supported_dtypes=dtypes(gfx),
    )
    total_b = reader.number(("vram total memory (b)",))
    total_mib = reader.number(("vram total memory (mib)",))
    used_b = reader.number(("vram total used memory (b)",))
    used_mib = reader.number(("vram total used memory (mib)",))
    total = int(total_b // _MIB) if total_b is not None else _int(total_mib)
    if not total:
        total = _pool_mb(agent)
        if total:
            reader.problems.append(
                f"'{reader.command}' gave no VRAM total for card{index}; "
                f"{total} MB is rocminfo's memory pool size"
            )
        else:
            reader.problems.append(f"memory total unknown: '{reader.command}' gave none")
    device.memory_total_mb = total or None
    device.memory_used_mb = int(used_b // _MIB) if used_b is not None else _int(used_mib)
    attributes = {
        "card_series": reader.text("card series"),
        "card_vendor": reader.text("card vendor"),
        "pci_device_id": reader.text("device id"),
        "serial_number": reader.text("serial number"),
        "card_sku": reader.text("card sku"),
        "gfx_target": gfx,
        "compute_units": _clean(agent.get("compute unit")),
    }
    device.attributes = {k: v for k, v in attributes.items() if v}
    device.problems = reader.problems
    return device


def _int(value: float | None) -> int | None:
    return int(value) if value is not None else None


def _clean(value: str | None) -> str | None:
    value = (value or "").strip()
    return value if value.lower() not in _MISSING else None


def _gfx_target(name: str | None) -> str | None:
    match = re.fullmatch(r"\s*(gfx[0-9a-f]{3,5})\s*", name or "", re.IGNORECASE)
    return match.group(1).lower() if match else None


def _gfx_from_smi(value: str | None) -> str | None:
    """rocm-smi prints ``gfx11001`` for gfx1101: the last two digits are one hex digit."""
    match = re.fullmatch(r"gfx([0-9]{2,3})([0-9]{2})", (value or "").strip().lower())
    if not match:
        return None
    return f"gfx{match.group(1)}{int(match.group(2)):x}"


def _pool_mb(agent: dict[str, str]) -> int | None:
    kb = _leading_int(agent.get("size"))
    return kb // 1024 if kb else None


# --- topology ---------------------------------------------------------------------------


def parse_topology_json(
    text: str, command: str, indices: list[int]
) -> tuple[dict[int, list[int]], dict[int, bool]]:
    """Distance rows and peer-to-peer flags for ``indices`` (see the module docstring)."""
    start = text.find("{")
    try:
        data = json.JSONDecoder().raw_decode(text, start)[0] if start >= 0 else None
    except (ValueError, RecursionError) as exc:  # ValueError: also over-long ints
        raise ToolError(f"'{command}' printed invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ToolError(f"'{command}' printed no JSON object")
    numa = {}
    for key, value in data.items():
        match = _CARD_KEY.match(str(key))
        if match and isinstance(value, dict):
            numa[int(match.group(1))] = _lower_keys(value).get("(topology) numa node")
    links: dict[tuple[int, int], dict[str, str]] = {}
    system = data.get("system")
    for key, value in system.items() if isinstance(system, dict) else []:
        match = _TOPO_KEY.match(str(key).strip())
        if match:
            i, j = int(match.group(2)), int(match.group(3))
            links.setdefault((min(i, j), max(i, j)), {})[match.group(1).lower()] = str(value)
    rows: dict[int, list[int]] = {}
    p2p: dict[int, bool] = {}
    for i in indices:
        row = []
        for j in indices:
            row.append(0 if i == j else _distance(links.get((min(i, j), max(i, j))), numa, i, j))
        if any(d < 0 for d in row):
            raise ToolError(f"'{command}' gives no usable link between card{i} and every peer")
        rows[i] = row
        p2p[i] = any(0 < d <= 20 for d in row)
    return rows, p2p


def _distance(link: dict[str, str] | None, numa: dict[int, str | None], i: int, j: int) -> int:
    if not link:
        return -1
    kind = link.get("link type", "").strip().upper()
    if kind == "XGMI":
        return 5
    if kind not in ("PCIE", "PCI"):
        return -1
    if numa.get(i) and numa.get(j) and numa[i] != numa[j]:
        return 50
    hops = _leading_int(link.get("hops"))
    if hops is None:
        return 30
    return 10 if hops <= 1 else 20 if hops == 2 else 30


# --- the whole discovery ----------------------------------------------------------------


@dataclass(frozen=True)
class RocmFamily:
    """What differs between AMD and Hygon in the shared discovery."""

    device_type: str
    claims_hygon: bool  # True: keep Hygon cards; False: keep every other card
    other_type: str  # the plugin that claims the skipped cards
    dtypes: Callable[[str | None], list[str] | None]


def discover_cards(
    tools: ToolRunner,
    family: RocmFamily,
    smi_argv: list[str],
    parse: Callable[[str, str], Cards],
    topo_argv: list[str],
) -> Discovery:
    """Run the smi query, rocminfo and the topology query; keep this family's cards."""
    command = " ".join(smi_argv)
    cards = parse(tools.run(smi_argv), command)
    notes: list[str] = []
    agents: list[dict[str, str]] = []
    if tools.available("rocminfo"):
        try:
            agents = parse_rocminfo(tools.run(ROCMINFO_ARGV))
        except ToolError as exc:
            notes.append(f"rocminfo unavailable, names and bus ids from {smi_argv[0]}: {exc}")
    devices = []
    skipped = 0
    for index in sorted(cards):
        agent = match_agent(index, cards[index], cards, agents)
        if is_hygon(cards[index], agent) != family.claims_hygon:
            skipped += 1
            continue
        reader = CardReader(command, index, cards[index])
        devices.append(card_device(family.device_type, index, reader, agent, family.dtypes))
    if skipped:
        notes.append(f"{skipped} card(s) left to the {family.other_type} plugin")
    if devices:
        notes += _apply_topology(tools, topo_argv, devices)
    return Discovery(devices, notes)


def _apply_topology(tools: ToolRunner, argv: list[str], devices: list[ProbedDevice]) -> list[str]:
    command = " ".join(argv)
    try:
        rows, p2p = parse_topology_json(tools.run(argv), command, [d.index for d in devices])
    except ToolError as exc:
        return [f"topology unknown: {exc.message}"]
    for device in devices:
        device.topology = rows[device.index]
        device.p2p_capable = p2p[device.index]
    return []
