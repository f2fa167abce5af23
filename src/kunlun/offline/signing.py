"""Ed25519 keys and signatures (the ``cryptography`` package).

``kunlun-cli keys generate --out DIR`` writes ``kunlun-signing.key`` (PKCS#8 PEM, mode 0600)
and ``kunlun-signing.pub`` (SubjectPublicKeyInfo PEM). A key's *fingerprint* is
``SHA256:`` and the hex SHA-256 of its 32 raw public bytes; manifests carry the signer's.
A signature file holds the 64-byte signature in base64 and a newline: ``manifest.sig`` inside
an archive, ``FILE.sig`` next to a signed file (``kunlun-cli keys sign FILE``, e.g. a
``device-plugin-config.yaml`` that ``kunlun-platform --require-signed`` checks).

A *trusted-keys directory* holds public keys (``*.pub``, PEM); anything else in it is ignored.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from kunlun.errors import ConfigError, Location, SignatureError

PRIVATE_FILE = "kunlun-signing.key"
PUBLIC_FILE = "kunlun-signing.pub"


def fingerprint(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "SHA256:" + hashlib.sha256(raw).hexdigest()


def generate_keys(out: Path) -> tuple[Path, Path]:
    """A new key pair in ``out``; refuses to overwrite an existing private key."""
    out.mkdir(parents=True, exist_ok=True)
    private_path, public_path = out / PRIVATE_FILE, out / PUBLIC_FILE
    if private_path.exists():
        raise ConfigError(
            "a signing key already exists here; not overwriting it",
            location=Location(str(private_path)),
        )
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
    public_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private_path, public_path


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except FileNotFoundError:
        raise ConfigError("signing key not found", location=Location(str(path))) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"not an unencrypted PEM private key: {exc}", location=Location(str(path))
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(
            f"the signing key must be Ed25519, this one is {type(key).__name__}",
            location=Location(str(path)),
            hint="kunlun-cli keys generate --out DIR",
        )
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except FileNotFoundError:
        raise ConfigError("public key not found", location=Location(str(path))) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"not a PEM public key: {exc}", location=Location(str(path))) from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(
            f"the public key must be Ed25519, this one is {type(key).__name__}",
            location=Location(str(path)),
        )
    return key


@dataclass(frozen=True)
class TrustedKeys:
    """Public keys a signature may come from, by fingerprint, and where each was read."""

    keys: dict[str, Ed25519PublicKey]
    source: str

    @classmethod
    def from_paths(cls, paths: list[Path]) -> TrustedKeys:
        """Keys from files and trusted-keys directories (their ``*.pub``)."""
        keys: dict[str, Ed25519PublicKey] = {}
        for path in paths:
            files = sorted(path.glob("*.pub")) if path.is_dir() else [path]
            for file in files:
                key = load_public_key(file)
                keys[fingerprint(key)] = key
        source = ", ".join(str(p) for p in paths)
        if not keys:
            raise ConfigError(
                "no trusted public keys (*.pub) found",
                location=Location(source or "--trusted-keys"),
            )
        return cls(keys, source)

    def verify(self, data: bytes, signature_text: bytes, what: str) -> str:
        """The fingerprint of the trusted key that signed ``data``; else :class:`SignatureError`
        naming ``what``."""
        signature = decode_signature(signature_text, what)
        for fp, key in self.keys.items():
            try:
                key.verify(signature, data)
                return fp
            except InvalidSignature:
                continue
        raise SignatureError(
            "the signature does not verify with any trusted key "
            f"({len(self.keys)} trusted: {', '.join(k[:19] + '...' for k in self.keys)}); "
            "signed by an untrusted key, or the bytes were changed",
            location=Location(what),
            hint=f"trusted keys come from {self.source}",
        )


def encode_signature(signature: bytes) -> bytes:
    return base64.b64encode(signature) + b"\n"


def decode_signature(text: bytes, what: str) -> bytes:
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 64:
        raise SignatureError("the signature is not 64 bytes of base64", location=Location(what))
    return raw


def sign(key: Ed25519PrivateKey, data: bytes) -> bytes:
    """The signature file's bytes for ``data`` (Ed25519 is deterministic: same key and bytes,
    same signature)."""
    return encode_signature(key.sign(data))


def signature_path(path: Path) -> Path:
    """Where the detached signature of ``path`` lives: ``path`` + ``.sig``."""
    return path.with_name(path.name + ".sig")


def sign_file(key: Ed25519PrivateKey, path: Path) -> Path:
    out = signature_path(path)
    out.write_bytes(sign(key, path.read_bytes()))
    return out


def verify_file(trusted: TrustedKeys, path: Path) -> str:
    """Check ``path`` against its detached signature ``path.sig``; the signer's fingerprint."""
    sig = signature_path(path)
    if not sig.is_file():
        raise SignatureError(
            f"no detached signature {sig.name} next to it",
            location=Location(str(path)),
            hint=f"sign it on a trusted machine: kunlun-cli keys sign {path} --key KEY",
        )
    return trusted.verify(path.read_bytes(), sig.read_bytes(), str(path))
