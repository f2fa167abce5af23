"""``kunlun-cli keys generate | sign | verify``: the Ed25519 keys that sign packages, configs and
image digests, and detached signatures (``FILE.sig``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kunlun.cli.commands import summary
from kunlun.console import console, handle_errors

app = typer.Typer(help=summary("keys"), no_args_is_help=True)


@app.command("generate")
@handle_errors
def generate(
    out: Annotated[Path, typer.Option("--out", help="Directory for the key pair.")],
) -> None:
    """Write a new Ed25519 key pair: kunlun-signing.key (private, 0600) and .pub."""
    from kunlun.offline.signing import fingerprint, generate_keys, load_public_key

    private, public = generate_keys(out)
    console.print(f"private key {private} (keep it on the signing machine)")
    console.print(f"public key  {public} (give it to every site that installs)")
    console.print(f"fingerprint {fingerprint(load_public_key(public))}")


@app.command("sign")
@handle_errors
def sign(
    file: Annotated[Path, typer.Argument(help="The file to sign, e.g. device-plugin-config.yaml.")],
    key: Annotated[Path, typer.Option("--key", help="The private key (PEM).")],
) -> None:
    """Write FILE.sig, a detached Ed25519 signature of FILE's exact bytes."""
    from kunlun.errors import ConfigError, Location
    from kunlun.offline.signing import load_private_key, sign_file

    if not file.is_file():
        raise ConfigError("file to sign not found", location=Location(str(file)))
    console.print(f"signature {sign_file(load_private_key(key), file)}")


@app.command("verify")
@handle_errors
def verify(
    file: Annotated[Path, typer.Argument(help="A signed file (its signature is FILE.sig).")],
    public_key: Annotated[
        list[Path], typer.Option("--public-key", help="Trusted public key or directory.")
    ],
) -> None:
    """Check FILE against its detached signature FILE.sig; prints the signer's fingerprint."""
    from kunlun.offline.signing import TrustedKeys, verify_file

    signer = verify_file(TrustedKeys.from_paths(public_key), file)
    console.print(f"OK {file}: signed by {signer}", markup=False)
