"""The cluster's certificates: one CA, one certificate per member, TLS contexts from them.

``kunlun-cli cluster certs --out DIR --name node-a --name etcd-0 ...`` writes ``ca.crt`` and
``ca.key`` (the CA, ECDSA P-256; keep ``ca.key`` off the nodes once the certificates are made)
and, for each name, ``NAME.crt`` and ``NAME.key``: a certificate signed by the CA for both
server and client use, whose subject alternative names are the name itself, ``localhost``,
``127.0.0.1`` and every ``--host``. etcd members and platform nodes use the same layout: each
one is given ``ca.crt`` and its own pair. Private keys are written 0600.

A member trusts exactly the CA in ``ca.crt``: a certificate from another CA is refused by
etcd, by platform nodes (their peer port requires a client certificate) and by clients.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kunlun.errors import ConfigError, Location

CA_CERT, CA_KEY = "ca.crt", "ca.key"
DEFAULT_DAYS = 825
DEFAULT_HOSTS = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class MemberTLS:
    """What one member (etcd or platform node) needs: the CA and its own pair."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def from_dir(cls, directory: Path, name: str, flag: str = "--cluster-certs") -> MemberTLS:
        """``DIR/ca.crt``, ``DIR/NAME.crt``, ``DIR/NAME.key``; a missing one is an error
        naming it."""
        member = cls(directory / CA_CERT, directory / f"{name}.crt", directory / f"{name}.key")
        for path in (member.ca, member.cert, member.key):
            if not path.is_file():
                raise ConfigError(
                    f"cluster certificate file {path.name} is missing",
                    location=Location(f"{flag} {directory}"),
                    hint=f"make them with `kunlun-cli cluster certs --out {directory} "
                    f"--name {name}` (names: the node names and etcd members)",
                )
        return member

    def client_context(self) -> ssl.SSLContext:
        """For connections this member opens: verifies the peer against the CA, presents
        the member's certificate."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca))
        context.load_cert_chain(str(self.cert), str(self.key))
        return context

    def server_context(self) -> ssl.SSLContext:
        """For connections this member accepts: a client certificate from the CA is required."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.ca))
        context.load_cert_chain(str(self.cert), str(self.key))
        context.verify_mode = ssl.CERT_REQUIRED
        return context


def make_certs(
    out: Path, names: list[str], hosts: list[str] | tuple[str, ...] = (), days: int = DEFAULT_DAYS
) -> list[Path]:
    """A CA in ``out`` (made once, reused after) and a certificate for each of ``names``;
    returns the files written. An existing member certificate is kept."""
    if not names:
        raise ConfigError("name at least one member", location=Location("--name"))
    for name in names:
        if not name or "/" in name or name.startswith("."):
            raise ConfigError(f"invalid member name {name!r}", location=Location("--name"))
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    ca_cert_path, ca_key_path = out / CA_CERT, out / CA_KEY
    if ca_cert_path.exists() and ca_key_path.exists():
        ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
        loaded = serialization.load_pem_private_key(ca_key_path.read_bytes(), None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ConfigError("the CA key is not an EC key", location=Location(str(ca_key_path)))
        ca_key = loaded
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kunlun-cluster-ca")])
        ca_cert = (
            _builder(subject, subject, ca_key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                critical=True,
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write_key(ca_key_path, ca_key)
        ca_cert_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        written += [ca_cert_path, ca_key_path]
    sans: list[x509.GeneralName] = []
    for host in dict.fromkeys([*DEFAULT_HOSTS, *hosts]):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    for name in names:
        cert_path, key_path = out / f"{name}.crt", out / f"{name}.key"
        if cert_path.exists() and key_path.exists():
            continue
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        names_here = [x509.DNSName(name), *[s for s in sans if s.value != name]]
        cert = (
            _builder(subject, ca_cert.subject, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names_here), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write_key(key_path, key)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        written += [cert_path, key_path]
    return written


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, days: int
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
