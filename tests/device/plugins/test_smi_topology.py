"""The shared ``topo -m`` link-matrix parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from mangling import mangled

from kunlun.device.plugins.smi_topology import link_distance, parse_link_matrix
from kunlun.errors import ToolError

FIXTURES = Path(__file__).parents[2] / "fixtures" / "nodes"
WORDS = {0: "X", 5: "NV18", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def topo_text(
    distances: list[list[int]],
    numa: list[str],
    prefix: str = "GPU",
    fast: str = "NV18",
    nics: int = 2,
) -> str:
    """A ``topo -m`` matrix whose links give ``distances``, with NIC columns and a legend."""
    words = {**WORDS, 5: fast}
    n = len(distances)
    labels = [f"{prefix}{i}" for i in range(n)] + [f"NIC{i}" for i in range(nics)]
    lines = ["\t" + "\t".join(labels) + "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"]
    for i, row in enumerate(distances):
        links = [words[d] for d in row] + ["SYS"] * nics
        lines.append(f"{prefix}{i}\t" + "\t".join(links) + f"\t0-51\t{numa[i]}\t\tN/A")
    for k in range(nics):
        lines.append(
            f"NIC{k}\t" + "\t".join(["SYS"] * n + ["X" if j == k else "PIX" for j in range(nics)])
        )
    lines += [
        "",
        "Legend:",
        "",
        "  X    = Self",
        "  NV#  = Connection traversing a bonded set of # NVLinks",
        "",
        "NIC Legend:",
        "",
        "  NIC0: mlx5_0",
        "",
    ]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "name",
    ["nvidia_h100", "nvidia_h200", "metax_c500", "mthreads_s5000", "amd_mi300x", "nvidia_rtx4090d"],
)
def test_recovers_fixture_distances(name: str) -> None:
    fixture = json.loads((FIXTURES / f"topology_output_{name}.json").read_text())[0]
    distances, numa = fixture["devices_distances"], fixture["devices_numa_affinities"]
    matrix = parse_link_matrix(topo_text(distances, numa))
    assert matrix.problems == []
    assert matrix.indices == list(range(len(distances)))
    assert [matrix.row(i) for i in matrix.indices] == distances
    assert [matrix.numa_nodes[i] for i in matrix.indices] == numa
    for i, row in enumerate(distances):
        peers = [d for j, d in enumerate(row) if j != i]
        assert matrix.p2p_capable(i) is any(d in (5, 10, 20) for d in peers)


def test_real_nvidia_layout_with_ansi_header() -> None:
    text = (
        "\x1b[4m\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\x1b[0m\n"
        "GPU0\t X \tPHB\t0-11\t\tN/A\n"
        "GPU1\tPHB\t X \t0-11\t\tN/A\n\nLegend:\n\n  X    = Self\n"
    )
    matrix = parse_link_matrix(text)
    assert matrix.row(0) == [0, 30] and matrix.row(1) == [30, 0]
    assert matrix.p2p_capable(0) is False  # PHB is no peer-to-peer path
    assert matrix.numa_nodes == {}  # N/A


@pytest.mark.parametrize(
    ("word", "distance"),
    [
        ("X", 0),
        ("NV4", 5),
        ("HCCS", 5),
        ("XGMI", 5),
        ("MetaXLink", 5),
        ("MTLink", 5),
        ("PIX", 10),
        ("PXB", 20),
        ("PHB", 30),
        ("NODE", 40),
        ("SYS", 50),
        ("QPI", None),
        ("NV", None),
    ],
)
def test_link_words(word: str, distance: int | None) -> None:
    assert link_distance(word) == distance


def test_other_prefix_and_single_device() -> None:
    npu = parse_link_matrix(
        topo_text([[0, 5], [5, 0]], ["0", "0"], prefix="NPU", fast="HCCS"), "NPU"
    )
    assert npu.row(1) == [5, 0] and npu.p2p_capable(1) is True
    one = parse_link_matrix(topo_text([[0]], ["0"], nics=0))
    assert one.row(0) == [0] and one.p2p_capable(0) is False


def test_bad_rows_become_problems() -> None:
    text = topo_text([[0, 5, 50], [5, 0, 50], [50, 50, 0]], ["0", "0", "1"]).replace(
        "GPU1\tNV18\tX\tSYS", "GPU1\tNV18\tWARP\tSYS"
    )
    cut = "\n".join(line for line in text.splitlines() if not line.startswith("GPU2"))
    matrix = parse_link_matrix(cut)
    assert matrix.row(0) == [0, 5, 50]
    assert matrix.row(1) is None  # unknown word 'WARP'
    assert any("WARP" in p for p in matrix.problems)
    assert any("no usable row" in p and "[2]" in p for p in matrix.problems)


@pytest.mark.parametrize("text", ["", "No devices were found\n", "GPU0 GPU1\n"[:0] + "garbage\n"])
def test_no_header_is_a_tool_error(text: str) -> None:
    with pytest.raises(ToolError, match="no header"):
        parse_link_matrix(text)


SAMPLE = topo_text(
    json.loads((FIXTURES / "topology_output_metax_c500.json").read_text())[0]["devices_distances"],
    ["0"] * 4 + ["1"] * 4,
    fast="MetaXLink",
)


@settings(max_examples=50, deadline=None)
@given(mangled(SAMPLE))
def test_mangled_matrix_is_a_matrix_or_tool_error(text: str) -> None:
    try:
        matrix = parse_link_matrix(text)
    except ToolError:
        return
    for index in matrix.indices:
        row = matrix.row(index)
        assert row is None or all(isinstance(d, int) for d in row)
        assert matrix.p2p_capable(index) in (True, False, None)
