"""``kunlun-cli acceptance --layer N`` and ``kunlun-cli acceptance verify REPORT``: the
acceptance report of a rollout layer (:mod:`kunlun.validate.acceptance`), run against the
live platform (layer 1 also against a recorded node: ``--replay``), signed with ``--sign``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from kunlun.cli.commands import summary
from kunlun.console import console, err_console, handle_errors
from kunlun.errors import ConfigError, Location
from kunlun.validate import acceptance as layers

app = typer.Typer(help=summary("acceptance"), invoke_without_command=True,
                  no_args_is_help=True)  # fmt: skip
NOT_BUILT = "layers 3 (multi-device balance), 4 (mixed-chip scheduling) and 5 (HA and canaries)"


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
    model: Annotated[str | None, typer.Option(help="Layer 2: the model to start.")] = None,
    device: Annotated[
        str | None, typer.Option(help="Layer 2: the device (default: the first Ready one).")
    ] = None,  # fmt: skip
    ttft_ms: Annotated[float, typer.Option(min=1, help="Layer 2's first-token limit.")] = (
        layers.TTFT_LIMIT_MS
    ),
) -> None:
    """Run a layer's key checkpoints and write its report (JSON, Markdown, HTML)."""
    if ctx.invoked_subcommand is not None:
        return
    if layer not in layers.LAYERS:
        raise ConfigError(f"layer {layer} is not built yet ({NOT_BUILT} are to come)"
                          if layer in (3, 4, 5) else f"no layer {layer}: 1 to 5",
                          location=Location("--layer"))  # fmt: skip
    if layer == 1:
        doc = layer_one(replay, config)
    else:
        if model is None:
            raise ConfigError(
                "layer 2 starts a model: give --model M", location=Location("--model")
            )
        doc = layer_two(model, device, ttft_ms)
    paths = layers.write(doc, out)
    if sign is not None:
        from kunlun.offline.signing import load_private_key, sign_file

        paths["sig"] = sign_file(load_private_key(sign), paths["json"])
    for check in doc["checkpoints"]:
        console.print(f"{check['status']:<8} {check['name']}: {check['figure']}"
                      + (f" ({check['detail']})" if check["detail"] else ""), markup=False)  # fmt: skip
    console.print(f"layer {doc['layer']} ({doc['title']}): {doc['verdict']}; written: "
                  + ", ".join(str(p) for p in paths.values()), markup=False)  # fmt: skip
    raise SystemExit(0 if doc["verdict"] == layers.PASS else 1)


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
    console.print(f"OK {report}: layer {doc['layer']} ({doc['title']}) {doc['verdict']}, "
                  f"signed by {signer}", markup=False)  # fmt: skip


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
    from kunlun.cli.adapt import workload_name
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
    finally:
        client.post(f"/api/v1/workloads/{job}/stop")
    subject = {"model": model, "device": device, "node": client.endpoint}
    return layers.report(2, subject, layers.layer2(startup, ttft, ttft_limit, samples, device))


def measure(client: Any, name: str, device: str) -> tuple[float | None, list[float]]:
    """Median first-token latency of three requests one at a time, and the device's
    utilisation sampled while four clients send eight more."""
    from kunlun.bench.load import Target
    from kunlun.bench.suite import BenchOptions, run

    target = Target(client.endpoint, name, None)
    err_console.print(f"measuring {name} on {device}", markup=False)
    one = asyncio.run(run(BenchOptions(target, concurrencies=(1,), num_prompts=3, input_len=16,
                                       output_len=8)))  # fmt: skip
    ttft = one["runs"][0]["ttft_ms"]["p50"]
    samples: list[float] = []
    failed: list[Exception] = []
    done = threading.Event()

    def sample() -> None:
        try:
            while not done.is_set():
                for d in client.get("/api/v1/devices"):
                    if d["id"] == device and d.get("utilization_pct") is not None:
                        samples.append(float(d["utilization_pct"]))
                time.sleep(0.25)
        except Exception as exc:  # raised in the command's thread once the load is done
            failed.append(exc)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        asyncio.run(run(BenchOptions(target, concurrencies=(4,), num_prompts=8, input_len=16,
                                     output_len=16)))  # fmt: skip
    finally:
        done.set()
        sampler.join(10)
    if failed:
        raise failed[0]
    return ttft, samples
