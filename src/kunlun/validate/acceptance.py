"""Acceptance reports: the key checkpoints of a rollout layer, with every figure, written as
JSON (what is signed), Markdown and HTML.

The product documents roll a platform out in five layers, each closed by a signed report
before the next starts. Built so far:

- layer 1, device visibility (:func:`layer1`): every device Ready; each device's memory as the
  vendor tool reported it (its plugin's provenance ``probed``, or ``validated``: declared
  and equal to the tool's figure); the topology matrix;
- layer 2, single-device baseline (:func:`layer2`): one model on one device: its compile time
  under :data:`COMPILE_LIMIT_S`, first-token latency under a limit (default
  :data:`TTFT_LIMIT_MS`), the device's peak utilisation under load.

A checkpoint that cannot be run where it runs is NOT RUN with the reason, never PASS. A
report is signed with the operator's Ed25519 key as a detached signature of its JSON
(``REPORT.json.sig``, :mod:`kunlun.offline.signing`); ``kunlun-cli acceptance verify``
checks it, and a changed byte fails it.
"""

from __future__ import annotations

import html
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PASS, FAIL, NOT_RUN = "PASS", "FAIL", "NOT RUN"
LAYERS = {1: "device visibility", 2: "single-device baseline"}
COMPILE_LIMIT_S = 60.0
TTFT_LIMIT_MS = 500.0
TRUSTED_MEMORY = ("probed", "validated")
"""Provenances of a device's memory that come from its vendor tool."""


@dataclass
class Checkpoint:
    name: str
    status: str
    figure: str
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def layer1(devices: list[dict[str, Any]]) -> list[Checkpoint]:
    """Layer 1 from the platform's device list (``GET /api/v1/devices`` or a replay)."""
    ready = [d for d in devices if d["status"] == "Ready"]
    not_ready = {d["id"]: d["status"] + (f": {'; '.join(d['reasons'])}" if d.get("reasons") else "")
                 for d in devices if d["status"] != "Ready"}  # fmt: skip
    checks = [Checkpoint(
        "every device Ready", PASS if devices and not not_ready else FAIL,
        f"{len(ready)} of {len(devices)} Ready",
        "; ".join(f"{k} {v}" for k, v in not_ready.items()) if not_ready else "",
        {"devices": {d["id"]: d["status"] for d in devices}})]  # fmt: skip
    memory = {d["id"]: {"memory_total_mb": d.get("memory_total_mb"),
                        "provenance": (d.get("provenance") or {}).get("memory_total_mb")}
              for d in devices}  # fmt: skip
    untrusted = [f"{k}: {v['provenance']}" for k, v in memory.items()
                 if v["provenance"] not in TRUSTED_MEMORY]  # fmt: skip
    checks.append(Checkpoint(
        "memory as the vendor tool reports it", FAIL if untrusted or not devices else PASS,
        ", ".join(sorted({f"{v['memory_total_mb']} MiB" for v in memory.values()})),
        "not from the vendor tool: " + ", ".join(untrusted) if untrusted else
        "each device's figure probed, or declared and equal to the probe", {"memory": memory}))  # fmt: skip
    matrix = {d["id"]: d.get("topology_distance") for d in devices}
    known = all(isinstance(v, list) and len(v) == len(devices) for v in matrix.values())
    checks.append(Checkpoint(
        "topology matrix", PASS if known else NOT_RUN,
        f"{len(devices)}x{len(devices)}" if known else "not reported",
        "" if known else "a device's plugin reports no distances", {"topology": matrix}))  # fmt: skip
    return checks


def layer2(
    startup: dict[str, Any], ttft_ms: float | None, ttft_limit_ms: float,
    utilisation: list[float], device: str,
) -> list[Checkpoint]:  # fmt: skip
    """Layer 2 from a replica's start-up record, its measured first-token latency (median),
    and the device utilisation samples taken under load."""
    compile_s = startup.get("compile_time_s")
    load_s = startup.get("load_time_s")
    checks = [Checkpoint(
        f"compile time < {COMPILE_LIMIT_S:g} s",
        NOT_RUN if compile_s is None else PASS if compile_s < COMPILE_LIMIT_S else FAIL,
        "not measured" if compile_s is None else f"{compile_s:.1f} s",
        f"load {load_s} s" if load_s is not None else "", {"startup": startup})]  # fmt: skip
    checks.append(Checkpoint(
        f"first-token latency < {ttft_limit_ms:g} ms",
        NOT_RUN if ttft_ms is None else PASS if ttft_ms < ttft_limit_ms else FAIL,
        "no answer" if ttft_ms is None else f"{ttft_ms:.0f} ms",
        "median of three streamed requests, one at a time", {"ttft_ms": ttft_ms}))  # fmt: skip
    peak = max(utilisation) if utilisation else None
    checks.append(Checkpoint(
        "utilisation peak under load", NOT_RUN if peak is None else PASS,
        "not reported" if peak is None else f"{peak:.0f} %",
        f"{device}'s plugin reports no utilisation" if peak is None
        else f"{len(utilisation)} samples of {device} during four clients' requests",
        {"samples": utilisation}))  # fmt: skip
    return checks


def report(layer: int, subject: dict[str, Any], checks: list[Checkpoint]) -> dict[str, Any]:
    return {
        "layer": layer,
        "title": LAYERS[layer],
        "created": time.time(),
        "subject": subject,
        "verdict": FAIL if any(c.status == FAIL for c in checks) else PASS,
        "checkpoints": [asdict(c) for c in checks],
    }


def write(doc: dict[str, Any], out: Path) -> dict[str, Path]:
    """``acceptance-layerN.json``, ``.md`` and ``.html`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"acceptance-layer{doc['layer']}"
    rows = [(c["name"], c["status"], c["figure"], c["detail"]) for c in doc["checkpoints"]]
    head = f"Layer {doc['layer']}: {doc['title']} — {doc['verdict']}"
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(doc["created"]))
    subject = ", ".join(f"{k} {v}" for k, v in doc["subject"].items())
    md = [f"# {head}", "", f"{when}; {subject}", "", "| checkpoint | status | figure | detail |",
          "|---|---|---|---|", *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows), ""]  # fmt: skip
    cells = "".join(f"<tr><td>{html.escape(a)}</td><td>{b}</td><td>{html.escape(c)}</td>"
                    f"<td>{html.escape(d)}</td></tr>" for a, b, c, d in rows)  # fmt: skip
    page = (f"<!doctype html><meta charset=utf-8><title>{html.escape(head)}</title>"
            f"<h1>{html.escape(head)}</h1><p>{html.escape(when)}; {html.escape(subject)}</p>"
            "<table><tr><th>checkpoint</th><th>status</th><th>figure</th><th>detail</th></tr>"
            f"{cells}</table>")  # fmt: skip
    paths = {"json": stem.with_suffix(".json"), "md": stem.with_suffix(".md"),
             "html": stem.with_suffix(".html")}  # fmt: skip
    paths["json"].write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    paths["md"].write_text("\n".join(md))
    paths["html"].write_text(page)
    return paths
