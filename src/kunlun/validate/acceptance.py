"""Acceptance reports: the key checkpoints of a rollout layer, with every figure, written as
JSON (what is signed), Markdown and HTML.

The product documents roll a platform out in five layers, each closed by a signed report
before the next starts. Built so far:

- layer 1, device visibility (:func:`layer1`): every device Ready; each device's memory as the
  vendor tool reported it (its plugin's provenance ``probed``, or ``validated``: declared
  and equal to the tool's figure); the topology matrix;
- layer 2, single-device baseline (:func:`layer2`): one model on one device: its compile time
  under :data:`COMPILE_LIMIT_S`, first-token latency under a limit (default
  :data:`TTFT_LIMIT_MS`), the device's peak utilisation under load, and the platform's
  figures for the device against a fresh reading of its vendor tool (:func:`against_tool`);
- layer 3, multi-device balance (:func:`layer3`): one replica per device of one type under
  concurrent requests: the spread (standard deviation) of the devices' mean utilisation
  under :data:`BALANCE_LIMIT_PCT` points, no request failed or timed out, no replica lost;
- layer 4, mixed-chip scheduling (:func:`layer4`): the device the planner picks for a model
  when it may pick any, why, and why each other device class was not picked;
- layer 5, HA and canaries (:func:`layer5`): on a cluster, every node agrees on one leader; a
  node the operator took down (``--lost-node``) is noticed and every surviving node lists
  the same workloads with all their replicas ready elsewhere; the last canary rollout's
  error rate and p95 latencies within its gates.

A checkpoint that cannot be run where it runs is NOT RUN with the reason, never PASS; a
layer with one is INCOMPLETE, not passed. A report is signed with the operator's Ed25519 key as a detached signature of its JSON
(``REPORT.json.sig``, :mod:`kunlun.offline.signing`); ``kunlun-cli acceptance verify``
checks it, and a changed byte fails it.
"""

from __future__ import annotations

import hashlib
import html
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kunlun.errors import ConfigError, Location
from kunlun.state.store import ROLLOUT_ENDED

PASS, FAIL, NOT_RUN, INCOMPLETE = "PASS", "FAIL", "NOT RUN", "INCOMPLETE"
LAYERS = {1: "device visibility", 2: "single-device baseline", 3: "multi-device balance",
          4: "mixed-chip scheduling", 5: "HA and canaries"}  # fmt: skip
COMPILE_LIMIT_S = 60.0
TTFT_LIMIT_MS = 500.0
USED_SLACK = 0.05
"""How far the platform's memory-used figure may be from a fresh vendor-tool reading (as a
share of the device's memory; at least 512 MiB: the two readings are moments apart)."""
BALANCE_LIMIT_PCT = 15.0
"""The most the devices' mean utilisations may spread (standard deviation, in points)."""
PAGES = {1: ("/ui/devices",), 2: ("/ui/devices", "/ui/metrics"), 3: ("/ui/devices", "/ui/metrics"),
         4: ("/ui/devices", "/ui/workloads"), 5: ("/ui/nodes", "/ui/rollouts")}  # fmt: skip
"""The dashboard pages each layer's report shows."""
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


def against_tool(device: str, platform: dict[str, Any] | None, tool: dict[str, Any] | None,
                 why_not: str | None) -> Checkpoint:  # fmt: skip
    """The platform's figures for ``device`` (``GET /api/v1/devices``) against a fresh
    reading of its vendor tool (its plugin run again on the daemon's machine): memory total
    equal, memory used within :data:`USED_SLACK` of the total (or 512 MiB)."""
    name = "the platform's figures = the vendor tool's"
    if why_not is not None or platform is None or tool is None:
        return Checkpoint(name, NOT_RUN, "not compared", why_not or f"{device}: no reading")
    keys = ("memory_total_mb", "memory_used_mb", "utilization_pct")
    data = {"platform": {k: platform.get(k) for k in keys}, "tool": {k: tool.get(k) for k in keys}}
    total, total_tool = platform.get("memory_total_mb"), tool.get("memory_total_mb")
    used, used_tool = platform.get("memory_used_mb"), tool.get("memory_used_mb")
    figure = f"memory {used}/{total} MiB; the tool's {used_tool}/{total_tool} MiB"
    if total is None or total_tool is None or used is None or used_tool is None:
        return Checkpoint(name, NOT_RUN, figure, "a figure is not reported", data)
    slack, apart = max(512.0, USED_SLACK * float(total_tool)), abs(float(used) - float(used_tool))
    wrong = ([f"total {total} against {total_tool} MiB"] if total != total_tool else []) + (
        [f"used differs by {apart:.0f} MiB (more than {slack:.0f})"] if apart > slack else [])  # fmt: skip
    return Checkpoint(name, FAIL if wrong else PASS, figure,
                      "; ".join(wrong) or f"total equal, used within {slack:.0f} MiB", data)  # fmt: skip


def layer3(
    device_type: str, utilisation: dict[str, list[float]], requests: int, failed: list[str],
    replicas_lost: list[str],
) -> list[Checkpoint]:  # fmt: skip
    """Layer 3 from each device's utilisation samples under load, the requests sent, the
    failed ones (OOM, timeout, error: as each was said) and replicas lost meanwhile."""
    means = {d: sum(s) / len(s) for d, s in utilisation.items() if s}
    name = f"utilisation spread < {BALANCE_LIMIT_PCT:g} points"
    if len(means) < 2:
        spread = Checkpoint(
            name, NOT_RUN, "not reported",
            f"{len(means)} of {len(utilisation)} {device_type} devices report utilisation",
            {"samples": utilisation})  # fmt: skip
    else:
        mean = sum(means.values()) / len(means)
        sd = (sum((m - mean) ** 2 for m in means.values()) / len(means)) ** 0.5
        spread = Checkpoint(
            name, PASS if sd < BALANCE_LIMIT_PCT else FAIL, f"{sd:.1f} points",
            "mean utilisation: " + ", ".join(f"{d} {m:.0f} %" for d, m in sorted(means.items())),
            {"std_dev": sd, "means": means, "samples": utilisation})  # fmt: skip
    errors = Checkpoint(
        "no OOM or timeout", FAIL if failed or replicas_lost else PASS,
        f"{len(failed)} of {requests} requests failed, {len(replicas_lost)} replicas lost",
        "; ".join([*failed[:3], *replicas_lost]),
        {"failed": failed, "replicas_lost": replicas_lost, "requests": requests})  # fmt: skip
    return [spread, errors]


def layer4(
    placement: dict[str, Any] | None, refused: str | None, device_types: list[str]
) -> list[Checkpoint]:
    """Layer 4 from the planner's dry-run placement of a model on any device (or its
    refusal), with ``device_types`` the classes of Ready devices it could choose from."""
    if placement is None:
        return [Checkpoint("the planner's choice", FAIL, "refused", refused or "no placement",
                           {"device_types": device_types}),
                Checkpoint("why not the others", NOT_RUN, "", "no choice was made")]  # fmt: skip
    plan = placement.get("plan") or {}
    engine = (placement.get("engine") or {}).get("chosen")
    choice = Checkpoint(
        "the planner's choice", PASS,
        f"{placement['target_device']} ({plan.get('dtype')}, engine {engine})",
        placement.get("why") or "", {"placement": placement})  # fmt: skip
    rejected = placement.get("rejected") or {}
    chosen = {d.split(":")[0] for d in placement["target_device"].split(",")}
    others = [t for t in device_types if t not in chosen]
    if not others:
        return [choice, Checkpoint(
            "why not the others", NOT_RUN, "one device class",
            f"only {', '.join(device_types)} here: nothing to choose between")]  # fmt: skip
    unsaid = [t for t in others if not any(label.startswith(t) for label in rejected)]
    return [choice, Checkpoint(
        "why not the others", FAIL if unsaid else PASS,
        f"{len(others) - len(unsaid)} of {len(others)} other classes explained",
        "; ".join(f"{k}: {v}" for k, v in rejected.items())
        + (f"; no reason given for {', '.join(unsaid)}" if unsaid else ""),
        {"rejected": rejected, "device_types": device_types})]  # fmt: skip


def layer5(
    leaders: dict[str, str | None], recovery: dict[str, Any] | None,
    rollout: dict[str, Any] | None, no_rollout: str,
) -> list[Checkpoint]:  # fmt: skip
    """Layer 5 from the leader each node names, the recovery seen after a node was taken
    down (:func:`recovered`; None when none was named) and the rollout judged (None:
    ``no_rollout`` says why)."""
    named = set(leaders.values())
    leader = next(iter(named)) if len(named) == 1 else None
    checks = [Checkpoint(
        "one leader every node agrees on", PASS if leader else FAIL,
        f"{len(leaders)} nodes, leader {leader}" if leader else f"{len(leaders)} nodes disagree",
        ", ".join(f"{n} names {v}" for n, v in sorted(leaders.items())), {"leaders": leaders})]  # fmt: skip
    if recovery is None:
        checks.append(Checkpoint(
            "a lost node: workload list complete", NOT_RUN, "no node lost",
            "take one node down (power it off, or kill its daemon) and run layer 5 again "
            "with --lost-node NAME"))  # fmt: skip
    else:
        checks.append(Checkpoint(
            "a lost node: workload list complete", PASS if recovery["ok"] else FAIL,
            recovery["figure"], recovery["detail"], recovery))  # fmt: skip
    checks.append(canary(rollout, no_rollout))
    return checks


def recovered(lost: str, nodes: list[dict[str, Any]], lists: dict[str, Any]) -> dict[str, Any]:
    """Whether the cluster has got over losing node ``lost``: it is no longer a member, every
    node left lists the same workloads, and each RUNNING one has all its replicas ready on
    the nodes left. ``lists``: each node's ``workload list`` (or why it did not answer)."""
    names = [n["name"] for n in nodes]
    problems = [f"{lost} is still a member"] if lost in names else []
    problems += [
        f"{n} did not answer: {rows}" for n, rows in lists.items() if isinstance(rows, str)
    ]
    answered = {n: rows for n, rows in lists.items() if not isinstance(rows, str)}
    seen = {n: sorted(f"{r['workload_id']} {r['state']}" for r in rows)
            for n, rows in answered.items()}  # fmt: skip
    if len({"\n".join(v) for v in seen.values()}) > 1:
        problems.append("the nodes list different workloads: "
                        + "; ".join(f"{n}: {len(v)}" for n, v in seen.items()))  # fmt: skip
    rows: list[dict[str, Any]] = next(iter(answered.values()), [])
    running = {r["workload_id"]: r for r in rows if r["state"] == "RUNNING"}
    ready = dict.fromkeys(running, 0)
    for n in nodes:
        for replica in n.get("replicas") or []:
            if replica.get("ready") and replica.get("workload_id") in ready:
                ready[replica["workload_id"]] += 1
                if n["name"] == lost:
                    problems.append(f"replica {replica['replica_id']} still on {lost}")
    wanted = {w: int(r.get("replicas") or 1) for w, r in running.items()}
    problems += [f"{running[w]['name']}: {ready[w]} of {n} replicas ready"
                 for w, n in wanted.items() if ready[w] < n]  # fmt: skip
    return {
        "ok": not problems and bool(answered),
        "figure": f"{lost} gone; {len(answered)} nodes list the same {len(rows)} workloads; "
        f"{sum(ready.values())} of {sum(wanted.values())} replicas ready",
        "detail": "; ".join(problems),
        "nodes": names, "lists": seen, "ready": ready,
    }  # fmt: skip


def canary(rollout: dict[str, Any] | None, no_rollout: str) -> Checkpoint:
    """The checkpoint of a finished canary rollout: PROMOTED with no gate failed."""
    name = "canary error rate and p95 within limits"
    if rollout is None:
        return Checkpoint(name, NOT_RUN, "no rollout", no_rollout)
    if rollout["state"] not in ROLLOUT_ENDED:
        return Checkpoint(name, NOT_RUN, rollout["state"],
                          f"rollout {rollout['rollout_id']} has not ended yet")  # fmt: skip
    gates = [g for step in rollout.get("history") or [] for g in step.get("gates") or []]
    failed = [g for g in gates if g.get("verdict") == "fail"]
    last = {g["gate"]: g for g in gates}  # each gate as its last step measured it
    detail = f"rollout {rollout['rollout_id']} {rollout['state']}"
    if rollout.get("reason"):
        detail += f": {rollout['reason']}"
    unsure = sorted(g["gate"] for g in last.values() if g.get("verdict") == "inconclusive")
    if unsure:
        detail += f"; too few requests to judge at the last step: {', '.join(unsure)}"
    ok = rollout["state"] == "PROMOTED" and not failed and bool(gates)
    return Checkpoint(name, PASS if ok else FAIL,
                      ", ".join(_gate_text(g) for g in last.values()) or "no gate measured",
                      detail, {"rollout": rollout["rollout_id"], "state": rollout["state"],
                               "gates": gates})  # fmt: skip


def _gate_text(g: dict[str, Any]) -> str:
    rate = g["gate"] == "error_rate"

    def shown(v: float | None) -> str:
        return "-" if v is None else f"{v:.1%}" if rate else f"{v:.0f} ms"

    return f"{g['gate']} {shown(g.get('canary'))} (limit {shown(g.get('limit'))})"


def report(layer: int, subject: dict[str, Any], checks: list[Checkpoint]) -> dict[str, Any]:
    return {
        "layer": layer,
        "title": LAYERS[layer],
        "created": time.time(),
        "subject": subject,
        "verdict": verdict(checks),
        "not_run": [c.name for c in checks if c.status == NOT_RUN],
        "checkpoints": [asdict(c) for c in checks],
    }


def verdict(checks: list[Checkpoint]) -> str:
    """FAIL if a checkpoint failed; PASS if every one passed; else INCOMPLETE (what was run
    passed, but the layer is not proven until the checkpoints in ``not_run`` are)."""
    if any(c.status == FAIL for c in checks):
        return FAIL
    return PASS if all(c.status == PASS for c in checks) else INCOMPLETE


def verdict_text(doc: dict[str, Any]) -> str:
    """``PASS``, or ``INCOMPLETE (1 of 3 checkpoints not run)``."""
    n = len(doc.get("not_run") or [])
    if not n:
        return str(doc["verdict"])
    return f"{doc['verdict']} ({n} of {len(doc['checkpoints'])} checkpoints not run)"


def file_entry(path: Path, root: Path) -> dict[str, str]:
    """A file the report shows: its path from the report's folder and its SHA-256 (the JSON
    is what is signed, so a changed image fails :func:`check_screenshots`)."""
    return {"path": str(path.relative_to(root)),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}  # fmt: skip


def check_screenshots(doc: dict[str, Any], folder: Path) -> None:
    """Every screenshot a (verified) report names is in ``folder`` with its recorded hash."""
    for page, entry in ((doc.get("screenshots") or {}).get("files") or {}).items():
        path = folder / entry["path"]
        try:
            found = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as exc:
            raise ConfigError(
                f"screenshot of {page} missing: {exc}", location=Location(str(path))
            ) from None
        if found != entry["sha256"]:
            raise ConfigError(f"screenshot of {page} changed since the report was signed "
                              f"(sha256 {found[:12]}, signed {entry['sha256'][:12]})",
                              location=Location(str(path)))  # fmt: skip


def write(doc: dict[str, Any], out: Path) -> dict[str, Path]:
    """``acceptance-layerN.json``, ``.md`` and ``.html`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"acceptance-layer{doc['layer']}"
    rows = [(c["name"], c["status"], c["figure"], c["detail"]) for c in doc["checkpoints"]]
    head = f"Layer {doc['layer']}: {doc['title']} — {verdict_text(doc)}"
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(doc["created"]))
    subject = ", ".join(f"{k} {v}" for k, v in doc["subject"].items())
    shots = doc.get("screenshots") or {}
    files = {page: entry["path"] for page, entry in (shots.get("files") or {}).items()}
    md = [f"# {head}", "", f"{when}; {subject}", "", "| checkpoint | status | figure | detail |",
          "|---|---|---|---|",
          *("| " + " | ".join(x.replace("|", "\\|") for x in row) + " |" for row in rows), "",
          "## Screenshots", "", *(f"![{p}]({f})" for p, f in files.items()),
          *([f"{shots['missing']}"] if shots.get("missing") else []), ""]  # fmt: skip
    cells = "".join(f"<tr><td>{html.escape(a)}</td><td>{b}</td><td>{html.escape(c)}</td>"
                    f"<td>{html.escape(d)}</td></tr>" for a, b, c, d in rows)  # fmt: skip
    images = "".join(f"<h3>{html.escape(p)}</h3><img src=\"{html.escape(f)}\" alt=\""
                     f"{html.escape(p)}\" width=640>" for p, f in files.items())  # fmt: skip
    missing = f"<p>{html.escape(shots['missing'])}</p>" if shots.get("missing") else ""
    page = (f"<!doctype html><meta charset=utf-8><link rel=icon href=\"data:,\">"
            f"<title>{html.escape(head)}</title>"
            f"<h1>{html.escape(head)}</h1><p>{html.escape(when)}; {html.escape(subject)}</p>"
            "<table><tr><th>checkpoint</th><th>status</th><th>figure</th><th>detail</th></tr>"
            f"{cells}</table><h2>Screenshots</h2>{images}{missing}")  # fmt: skip
    paths = {"json": stem.with_suffix(".json"), "md": stem.with_suffix(".md"),
             "html": stem.with_suffix(".html")}  # fmt: skip
    paths["json"].write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    paths["md"].write_text("\n".join(md))
    paths["html"].write_text(page)
    return paths
