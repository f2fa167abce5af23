"""The Devices page's heat map: each device type's link matrix, cells coloured by link class.

The inventory gives each device its row of the distance matrix (``topology``: 0 self, 5 a
fast device link, 10 ``PIX`` ... 50 ``SYS``, the scale of
:mod:`kunlun.device.plugins.smi_topology`; a declared row may use any distances). The rows of
one device type, in index order, form its matrix; a type whose rows do not form a square
matrix (a device without a row, a row of another length) is listed with the reason instead.
Each cell carries a CSS class for its link class, so the page needs no inline style
(the dashboard's CSP forbids them).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from kunlun.device.plugins.smi_topology import FAST_LINK_DISTANCE, LINK_DISTANCES

_WORDS = {
    "PIX": "at most one PCIe bridge",
    "PXB": "several PCIe bridges",
    "PHB": "through a PCIe host bridge",
    "NODE": "host bridges within a NUMA node",
    "SYS": "across NUMA nodes",
}
CLASSES: tuple[tuple[int, str, str], ...] = (
    (0, "link-self", "the device itself"),
    (FAST_LINK_DISTANCE, "link-fast", "fast device link (NVLink, HCCS, XGMI, ...)"),
    *(
        (d, "link-" + w.lower(), f"{w}: {_WORDS.get(w, w)}")
        for w, d in sorted(LINK_DISTANCES.items(), key=lambda kv: kv[1])
        if d > FAST_LINK_DISTANCE
    ),
)
"""Link classes by the largest distance each covers: (distance, CSS class, legend)."""


@dataclass
class Matrix:
    """One device type's matrix: labels, rows of (distance, class), or why there is none."""

    device_type: str
    labels: list[str]
    rows: list[list[tuple[int, str]]] = field(default_factory=list)
    problem: str | None = None


def link_class(distance: int) -> str:
    """The CSS class of a distance: the first class whose distance covers it."""
    for bound, css, _ in CLASSES:
        if distance <= bound:
            return css
    return CLASSES[-1][1]


def matrices(devices: list[dict[str, Any]]) -> list[Matrix]:
    """Each device type's matrix, for the types with more than one device."""
    by_type: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for device in devices:
        by_type[str(device.get("type"))].append(device)
    out = []
    for device_type, group in sorted(by_type.items()):
        if len(group) < 2:
            continue
        group.sort(key=lambda d: int(d.get("index") or 0))
        matrix = Matrix(device_type, [str(d["id"]) for d in group])
        rows: list[Any] = [d.get("topology") for d in group]
        bad = next((d for d, r in zip(group, rows, strict=True)
                    if not isinstance(r, list) or len(r) != len(group)), None)  # fmt: skip
        if bad is not None:
            matrix.problem = f"{bad['id']} has no row of {len(group)} distances"
        else:
            matrix.rows = [[(int(v), link_class(int(v))) for v in row] for row in rows]
        out.append(matrix)
    return out
