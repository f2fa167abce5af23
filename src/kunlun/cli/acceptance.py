"""``kunlun-cli acceptance --layer N`` and ``kunlun-cli acceptance verify REPORT``: the
acceptance report of a rollout layer (:mod:`kunlun.validate.acceptance`), run against the
live platform (layer 1 also against a recorded node: ``--replay``), signed with ``--sign``.
Layers 3 to 5 gather their figures in :mod:`kunlun.cli.acceptance_layers`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from kunlun.cli.commands import summary
from kunlun.console import console, err_console, handle_errors
from kunlun.errors import ConfigError, Location
from kunlun.validate import acceptance as layers

app = typer.Typer(help=summary("acceptance"), invoke_without_command=True,
                  no_args_is_help=True)  # fmt: skip


@app.callback()
@handle_errors
def acceptance(
    ctx: typer.Context,
    layer: Annotated[int | None, typer.Option(help="The rollout layer, 1 to 5.")] = None,
    out: Annotated[Path, typer.Option(help="Where the report goes.")] = Path("kunlun-acceptance"),
    sign: Annotated[
        Path | None, typer.Option(help="Sign the report with this Ed25519 private key (PEM).")
    ] = None,  # fmt: skip
    replay: Annotated[Path | None, typer.Option(help="Layer 1 of a recorded node.")] = None,
    config: Annotated[Path | None, typer.Option(help="Its device-plugin-config.yaml.")] = None,
    model: Annotated[str | None, typer.Option(help="Layers 2 to 4: the model.")] = None,
    device: Annotated[
        str | None, typer.Option(help="Layer 2: the device (default: the first Ready one).")
    ] = None,  # fmt: skip
    ttft_ms: Annotated[float, typer.Option(min=1, help="Layer 2's first-token limit.")] = (
        layers.TTFT_LIMIT_MS
    ),
    device_type: Annotated[
        str | None, typer.Option(help="Layer 3: the device type (default: the most devices).")
    ] = None,  # fmt: skip
    lost_node: Annotated[
        str | None, typer.Option(help="Layer 5: the cluster node you took down.")
    ] = None,  # fmt: skip
    rollout: Annotated[
        str | None, typer.Option(help="Layer 5: the canary rollout (default: the newest ended).")
    ] = None,  # fmt: skip
    recovery_s: Annotated[
        float, typer.Option(min=1, help="Layer 5: how long the cluster may take to recover.")
    ] = 600,
    screenshots: Annotated[
        bool, typer.Option(help="Screenshots of the layer's dashboard pages (a local Chromium).")
    ] = True,
) -> None:
    """Run a layer's key checkpoints and write its report (JSON, Markdown, HTML)."""
    if ctx.invoked_subcommand is not None:
        return
    if layer not in layers.LAYERS:
        raise ConfigError(f"no layer {layer}: 1 to 5", location=Location("--layer"))
    if model is None and layer in (2, 3, 4):
        raise ConfigError(f"layer {layer} needs a model: give --model M",
                          location=Location("--model"))  # fmt: skip
    if layer == 1:
        doc = layer_one(replay, config)
    elif layer == 2:
        doc = layer_two(str(model), device, ttft_ms)
    else:
        from kunlun.cli import acceptance_layers as more
        from kunlun.cli.client import DaemonClient

        client = DaemonClient(timeout=120)
        doc = (more.layer_three(client, str(model), device_type) if layer == 3 else
               more.layer_four(client, str(model)) if layer == 4 else
               more.layer_five(client, lost_node, rollout, recovery_s))  # fmt: skip
    doc["screenshots"] = shoot(doc["layer"], replay, out) if screenshots else {
        "files": {}, "missing": "not asked for (--no-screenshots)"}  # fmt: skip
    paths = layers.write(doc, out)
    if sign is not None:
        from kunlun.offline.signing import load_private_key, sign_file

        paths["sig"] = sign_file(load_private_key(sign), paths["json"])
    for check in doc["checkpoints"]:
        console.print(f"{check['status']:<8} {check['name']}: {check['figure']}"
                      + (f" ({check['detail']})" if check["detail"] else ""), markup=False)  # fmt: skip
    console.print(f"layer {doc['layer']} ({doc['title']}): {layers.verdict_text(doc)}; written: "
                  + ", ".join(str(p) for p in paths.values()), markup=False)  # fmt: skip
    raise SystemExit(0 if doc["verdict"] == layers.PASS else 1)  # INCOMPLETE proves nothing


@app.command()
@handle_errors
def verify(
    report: Path,
    public_key: Annotated[list[Path], typer.Option("--public-key", help="Trusted key or folder.")],
) -> None:
    """Check a report against its signature (REPORT.sig); prints the signer and the verdict."""
    from kunlun.offline.signing import TrustedKeys, verify_file

    signer = verify_file(TrustedKeys.from_paths(public_key), report)
    doc = json.loads(report.read_text())
    layers.check_screenshots(doc, report.parent)
    console.print(f"OK {report}: layer {doc['layer']} ({doc['title']}) {layers.verdict_text(doc)}, "
                  f"signed by {signer}", markup=False)  # fmt: skip


def shoot(layer: int, replay: Path | None, out: Path) -> dict[str, Any]:
    """The layer's dashboard pages (:data:`layers.PAGES`) as PNGs beside the report, each
    with its SHA-256 in the (signed) JSON; or why there are none."""
    if replay is not None:
        return {"files": {}, "missing": "a recorded node has no dashboard to take"}
    from kunlun.cli.client import DaemonClient
    from kunlun.validate.screenshots import take

    client = DaemonClient()
    folder = out / f"screenshots-layer{layer}"
    err_console.print(f"screenshots of {', '.join(layers.PAGES[layer])}", markup=False)
    shots = take(client.endpoint, client.api_key, list(layers.PAGES[layer]), folder)
    if shots.missing:
        err_console.print(shots.missing, markup=False)
    return {"files": {page: layers.file_entry(path, out) for page, path in shots.files.items()},
            "missing": shots.missing}  # fmt: skip


def layer_one(replay: Path | None, config: Path | None) -> dict[str, Any]:
    if replay is not None:
        from kunlun.device.inventory import build_inventory

        devices = build_inventory(config=config, replay=replay).to_list()
        subject = {"node": f"replay {replay}"}
    else:
        from kunlun.cli.client import DaemonClient

        client = DaemonClient()
        devices, subject = client.get("/api/v1/devices"), {"node": client.endpoint}
    return layers.report(1, subject, layers.layer1(devices))


def layer_two(model: str, device: str | None, ttft_limit: float) -> dict[str, Any]:
    """Start ``model`` alone on one device, measure it, stop it."""
    from kunlun.cli.adapt_stages import workload_name
    from kunlun.cli.client import DaemonClient

    client = DaemonClient(timeout=120)
    devices = client.get("/api/v1/devices")
    device = device or next((d["id"] for d in devices if d["status"] == "Ready"), None)
    if device is None:
        raise ConfigError("no Ready device", location=Location("--device"))
    name = workload_name("acceptance", model)
    job, row, why = client.run_workload({"model": model, "name": name, "device": device}, 900)
    try:
        if why is not None:
            raise ConfigError(f"{model} did not start on {device}: {why}",
                              location=Location("--model"))  # fmt: skip
        startup = row["replicas"][0]["startup"]
        ttft, samples = measure(client, name, device)
        compared = layers.against_tool(device, *vendor_reading(client, device))
    finally:
        client.post(f"/api/v1/workloads/{job}/stop")
    subject = {"model": model, "device": device, "node": client.endpoint}
    checks = layers.layer2(startup, ttft, ttft_limit, samples, device)
    return layers.report(2, subject, [*checks, compared])


def vendor_reading(
    client: Any, device: str
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, str | None]:
    """The platform's figures for ``device`` and its vendor tool's, read again now by its
    plugin (on this machine: the daemon's, else why not)."""
    from urllib.parse import urlsplit

    host = urlsplit(client.endpoint).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        return None, None, (f"the daemon runs on {host}: run layer 2 on its machine to read "
                            "the vendor tool there")  # fmt: skip
    from kunlun.device.inventory import resolve_replay_dir
    from kunlun.device.registry import discover_all

    platform = next((d for d in client.get("/api/v1/devices") if d["id"] == device), None)
    probed = {p.id: vars(p) for r in discover_all(resolve_replay_dir(None)) for p in r.devices}
    return platform, probed.get(device), None


def measure(client: Any, name: str, device: str) -> tuple[float | None, list[float]]:
    """Median first-token latency of three requests one at a time, and the device's
    utilisation sampled while four clients send eight more."""
    from kunlun.bench.load import Target
    from kunlun.bench.suite import BenchOptions, run
    from kunlun.cli.acceptance_layers import under_load

    target = Target(client.endpoint, name, client.api_key)
    err_console.print(f"measuring {name} on {device}", markup=False)
    one = asyncio.run(run(BenchOptions(target, concurrencies=(1,), num_prompts=3, input_len=16,
                                       output_len=8)))  # fmt: skip
    _, samples = under_load(client, name, [device], 4, 8)
    return one["runs"][0]["ttft_ms"]["p50"], samples[device]
