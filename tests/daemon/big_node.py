"""A many-GPU node to replay (``KUNLUN_REPLAY_DIR``): the recorded 8 x H100 server of
``tests/fixtures/nodes`` (``detect_output_nvidia_h100.json``), repeated as boards of 8 GPUs
in ``nvidia-smi`` query and ``topo -m`` output, plus this machine's own ``lscpu`` and
``free -m`` for ``cpu:0``.

Inside a board every pair is linked by NVLink (``NV18``, as the recording's 18 active links);
boards on the same CPU socket meet at ``NODE``, the others at ``SYS``. The dashboard test and
``benchmarks/dashboard.py`` use it for the Devices page's heat map and its 64-device load.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nodes"
QUERY = (
    "nvidia-smi_--query-gpu=index,name,pci.bus_id,uuid,memory.total,memory.used,"
    "utilization.gpu,temperature.gpu,power.draw,compute_cap_--format=csv,noheader,nounits.txt"
)
BOARD = 8


def link(i: int, j: int) -> str:
    """The ``topo -m`` word between GPUs ``i`` and ``j``."""
    if i == j:
        return " X "
    if i // BOARD == j // BOARD:
        return "NV18"
    return "NODE" if (i // BOARD) % 2 == (j // BOARD) % 2 else "SYS"


def write_node(folder: Path, gpus: int) -> Path:
    """Write the recordings of ``gpus`` H100s and this host's CPU into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    recorded = json.loads((FIXTURES / "detect_output_nvidia_h100.json").read_text())
    rows = []
    for i in range(gpus):
        gpu = recorded[i % len(recorded)]
        bus = f"0000{i // BOARD:02x}{gpu['appendix']['bdf'][4:]}".upper()
        uuid = gpu["uuid"][:-4] + f"{i:04x}"
        rows.append(f"{i}, {gpu['name']}, {bus}, {uuid}, {gpu['memory']}, "
                    f"{gpu['memory_used']}, {gpu['cores_utilization']}, "
                    f"{gpu['temperature']}, {gpu['power_used']}, {gpu['compute_capability']}")  # fmt: skip
    (folder / QUERY).write_text("\n".join(rows) + "\n")
    head = "\t" + "\t".join(f"GPU{j}" for j in range(gpus)) + "\tCPU Affinity\tNUMA Affinity"
    lines = [head]
    for i in range(gpus):
        socket = (i // BOARD) % 2
        words = "\t".join(link(i, j) for j in range(gpus))
        lines.append(f"GPU{i}\t{words}\t{'0-47' if socket == 0 else '48-95'}\t{socket}")
    lines += ["", "Legend:", "", "  X    = Self", "  NV#  = Connection traversing a bonded set of # NVLinks"]  # fmt: skip
    (folder / "nvidia-smi_topo_-m.txt").write_text("\n".join(lines) + "\n")
    for argv in (["lscpu"], ["free", "-m"]):
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        (folder / ("_".join(argv) + ".txt")).write_text(out)
    return folder
