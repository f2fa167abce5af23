"""The device link matrix of ``nvidia-smi topo -m`` and of the tools that copy its layout.

``nvidia-smi topo -m`` (NVIDIA System Management Interface documentation, "topo" subcommand;
the layout is unchanged from driver R450 to R570) prints one header line of column labels, one
row per device with one link word per column, then the CPU and NUMA affinity::

            GPU0    GPU1    NIC0    CPU Affinity    NUMA Affinity   GPU NUMA ID
    GPU0     X      NV18    PXB     0-51,104-155    0               N/A
    GPU1    NV18     X      SYS     52-103          1               N/A

    Legend:
      X    = Self
      ...

Other vendors' tools print the same layout with their own row labels (``NPU0`` for
``npu-smi``, ``MLU0``, ...) and link names (``HCCS``, ``XGMI``, ``MetaXLink``, ``MTLink``).
:func:`parse_link_matrix` keeps the rows and columns of one label prefix (NICs are dropped)
and turns each link word into a distance: 0 self, 5 a fast device link, 10 ``PIX``, 20
``PXB``, 30 ``PHB``, 40 ``NODE``, 50 ``SYS``. A device can copy peer-to-peer when one of its
links is a fast link, ``PIX`` or ``PXB``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kunlun.device.plugin import ProbedDevice
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

#: Distance of a link word; fast device links are matched by :data:`FAST_LINK`.
LINK_DISTANCES: dict[str, int] = {"X": 0, "PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SYS": 50}
FAST_LINK_DISTANCE = 5
#: NVLink (NV#), Huawei HCCS (and HCCS_SW, SIO), AMD XGMI, MetaX MetaXLink, Moore Threads
#: MTLink, Cambricon MLU-Link: each a direct high-speed device link.
FAST_LINK = re.compile(
    r"^(NV\d+|NVLINK\d*|HCCS(_SW)?\d*|SIO|XGMI\d*|METAXLINK\d*|MX\d+|MTLINK\d*|MLU-?LINK\d*)$",
    re.IGNORECASE,
)
#: Links over which peer-to-peer copies work (besides the fast links).
P2P_LINKS = {"PIX", "PXB"}
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_LABEL = re.compile(r"^([A-Za-z]+)(\d+)$")


def link_distance(word: str) -> int | None:
    """The distance of one link word, or None when the word is not a known link."""
    upper = word.upper()
    if upper in LINK_DISTANCES:
        return LINK_DISTANCES[upper]
    if FAST_LINK.match(word):
        return FAST_LINK_DISTANCE
    return None


@dataclass
class LinkMatrix:
    """Link words and distances between the devices of one label prefix, by device index."""

    indices: list[int]  # device index of each row/column, e.g. 3 for GPU3
    links: dict[int, list[str]]  # raw link words of each parsed row, in ``indices`` order
    numa_nodes: dict[int, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def row(self, index: int) -> list[int] | None:
        """Distances from device ``index`` to every device, or None if its row is unusable."""
        words = self.links.get(index)
        if words is None:
            return None
        distances = [link_distance(w) for w in words]
        if any(d is None for d in distances):
            return None
        return [d for d in distances if d is not None]

    def p2p_capable(self, index: int) -> bool | None:
        """Whether device ``index`` has a peer-to-peer path to another device (None: unknown)."""
        words = self.links.get(index)
        if words is None:
            return None
        peers = [w for i, w in zip(self.indices, words, strict=True) if i != index]
        return any(w.upper() in P2P_LINKS or FAST_LINK.match(w) for w in peers)


def parse_link_matrix(text: str, prefix: str = "GPU", command: str = "topo -m") -> LinkMatrix:
    """Parse a ``topo -m`` matrix, keeping the devices labelled ``prefix<N>``.

    Raises :class:`ToolError` when there is no header with such labels. A row that does not
    parse is left out and named in :attr:`LinkMatrix.problems`; so is an unknown link word.
    """
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    header_at, labels = _find_header(lines, prefix)
    if header_at is None:
        raise ToolError(f"'{command}' output has no header of {prefix}<N> columns")
    columns = [_LABEL.match(label) for label in labels]
    keep = [pos for pos, m in enumerate(columns) if m is not None and m.group(1).upper() == prefix]
    indices = [int(columns[pos].group(2)) for pos in keep]  # type: ignore[union-attr]
    matrix = LinkMatrix(indices=indices, links={})
    for line in lines[header_at + 1 :]:
        tokens = line.split()
        if not tokens:
            if matrix.links:
                break
            continue
        if tokens[0].rstrip(":").lower() == "legend":
            break
        match = _LABEL.match(tokens[0])
        if match is None or match.group(1).upper() != prefix:
            continue
        _add_row(matrix, int(match.group(2)), tokens[1:], len(labels), keep, command)
    missing = [i for i in indices if i not in matrix.links]
    if missing:
        matrix.problems.append(f"'{command}' has no usable row for {prefix} {missing}")
    return matrix


def _find_header(lines: list[str], prefix: str) -> tuple[int | None, list[str]]:
    for at, line in enumerate(lines):
        tokens = line.split()
        labels = []
        for token in tokens:
            if not _LABEL.match(token):
                break
            labels.append(token)
        if labels and any(label.upper().startswith(prefix) for label in labels):
            return at, labels
    return None, []


def _add_row(
    matrix: LinkMatrix, index: int, values: list[str], num_columns: int, keep: list[int], cmd: str
) -> None:
    if len(values) < num_columns:
        matrix.problems.append(
            f"'{cmd}' row for device {index} has {len(values)} links for {num_columns} columns"
        )
        return
    if index in matrix.links:
        matrix.problems.append(f"'{cmd}' lists device {index} twice; the first row is kept")
        return
    words = [values[pos] for pos in keep]
    unknown = [w for w in words if link_distance(w) is None]
    if unknown:
        matrix.problems.append(f"'{cmd}' row for device {index} has unknown link(s) {unknown}")
    if index in matrix.indices and words[matrix.indices.index(index)].upper() != "X":
        matrix.problems.append(f"'{cmd}' row for device {index} does not mark itself X")
    matrix.links[index] = words
    rest = values[num_columns:]
    if len(rest) >= 2 and rest[1] not in ("N/A", "-"):
        matrix.numa_nodes[index] = rest[1]


def attach_topology(
    devices: list[ProbedDevice], tools: ToolRunner, argv: list[str], prefix: str = "GPU"
) -> list[str]:
    """Run the ``topo -m`` command ``argv`` and give each device its distance row, its
    peer-to-peer capability and its NUMA node. Returns notes for the operator.

    The topology is optional: when the command fails or its devices are not the ones
    discovered, the devices keep ``topology=None`` (unknown) and a note says why.
    """
    command = " ".join(argv)
    try:
        matrix = parse_link_matrix(tools.run(argv), prefix, command)
    except ToolError as exc:
        return [f"topology unknown: {exc.message}"]
    notes = list(matrix.problems)
    found = sorted(d.index for d in devices)
    if sorted(matrix.indices) != found:
        notes.append(
            f"topology unknown: '{command}' lists {prefix} {sorted(matrix.indices)} but the "
            f"tool found devices {found}"
        )
        return notes
    order = [matrix.indices.index(i) for i in found]
    for device in devices:
        row = matrix.row(device.index)
        if row is not None:
            device.topology = [row[pos] for pos in order]
        device.p2p_capable = matrix.p2p_capable(device.index)
        if device.index in matrix.numa_nodes:
            device.attributes["numa_node"] = matrix.numa_nodes[device.index]
    return notes
