"""TLS between cluster members: certificates from ``kunlun-cli cluster certs``, a node with
another CA's certificate refused by etcd, the peer port refusing callers without the
cluster's certificate, and plain HTTP refused unless ``--insecure-cluster``."""

from __future__ import annotations

import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from tests.cluster.etcd_cluster import EtcdCluster
from tests.cluster.platform_nodes import ClusterNodeProc, make_node
from tests.daemons import BIN, refused

from kunlun.state.certs import MemberTLS


def test_cluster_certs_command(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    proc = subprocess.run(
        [str(BIN / "kunlun-cli"), "cluster", "certs", "--out", str(out), "--name", "node-a",
         "--name", "etcd-0", "--host", "10.0.0.7", "--host", "node-a.example"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for name in ("ca.key", "node-a.key", "etcd-0.key"):
        assert (out / name).stat().st_mode & 0o777 == 0o600
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((out / "node-a.crt").read_bytes())
    public = ca.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"node-a", "localhost", "node-a.example"} <= set(sans.get_values_for_type(x509.DNSName))
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.0.0.7"}
    # a second run reuses the CA and keeps existing members; a missing member is named
    again = subprocess.run([str(BIN / "kunlun-cli"), "cluster", "certs", "--out", str(out),
                            "--name", "node-b"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert again.returncode == 0 and "node-b.crt" in again.stdout and "ca.crt" not in again.stdout
    x509.load_pem_x509_certificate((out / "node-b.crt").read_bytes()).verify_directly_issued_by(ca)
    with pytest.raises(Exception, match="node-z.crt is missing"):
        MemberTLS.from_dir(out, "node-z")


def _refused(node: ClusterNodeProc, *args: str) -> str:
    proc = refused(node.home, "--peer-port", str(node.peer_port), "--node-name", node.name,
                   *args, port=node.port, env=node.env())  # fmt: skip
    assert proc.returncode != 0, proc.stdout
    return proc.stdout + proc.stderr


def test_plain_http_between_members_needs_insecure_cluster(tmp_path: Path) -> None:
    node = make_node(tmp_path, "node-a", ["http://127.0.0.1:1"], None)
    out = _refused(node, "--cluster-etcd", "http://127.0.0.1:1")
    assert "--cluster-certs" in out and "--insecure-cluster" in out, out
    out = _refused(node, "--cluster-etcd", "http://127.0.0.1:1", "--cluster-certs", str(tmp_path))
    assert "ca.crt" in out and "missing" in out, out
    out = _refused(node, "--cluster-etcd", "http://127.0.0.1:1", "--insecure-cluster")
    assert "--cluster-files" in out, out
    out = _refused(node, "--node-name", "x", "--insecure-cluster")
    assert "--cluster-etcd" in out, out


@pytest.fixture(scope="module")
def lone_node(
    etcd3: EtcdCluster, etcd_certs: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterNodeProc]:
    node = make_node(tmp_path_factory.mktemp("lone"), "node-a", etcd3.endpoints, etcd_certs)
    node.launch()
    yield node
    node.stop_all()


def test_a_node_with_another_cas_certificate_is_refused(
    etcd3: EtcdCluster, etcd_certs: Path, tmp_path: Path
) -> None:
    intruder = make_node(tmp_path, "node-x", etcd3.endpoints, etcd_certs / "other")
    out = _refused(intruder, *intruder.args)
    assert "certificate" in out.lower() and "etcd" in out.lower(), out
    print(out)
    plain = make_node(tmp_path, "node-a", etcd3.endpoints, etcd_certs)
    https = [e.replace("https://", "http://") for e in etcd3.endpoints]
    out = _refused(plain, "--cluster-etcd", ",".join(https), "--cluster-certs", str(etcd_certs),
                   "--cluster-files", str(tmp_path))  # fmt: skip
    assert "plain HTTP" in out, out


def test_the_peer_port_takes_only_the_clusters_certificates(
    lone_node: ClusterNodeProc, etcd_certs: Path
) -> None:
    url = f"https://127.0.0.1:{lone_node.peer_port}/cluster/health"
    own = MemberTLS.from_dir(etcd_certs, "node-b").client_context()
    resp = httpx.get(url, verify=own, timeout=10)
    assert resp.status_code == 200 and resp.json() == {"node": "node-a"}
    foreign = MemberTLS.from_dir(etcd_certs / "other", "node-x")
    context = ssl.create_default_context(cafile=str(etcd_certs / "ca.crt"))
    context.load_cert_chain(str(foreign.cert), str(foreign.key))
    with pytest.raises(httpx.TransportError):
        httpx.get(url, verify=context, timeout=10).raise_for_status()
    anonymous = ssl.create_default_context(cafile=str(etcd_certs / "ca.crt"))
    with pytest.raises(httpx.TransportError):
        httpx.get(url, verify=anonymous, timeout=10).raise_for_status()
    with pytest.raises(httpx.TransportError):
        httpx.get(url.replace("https", "http"), timeout=10).raise_for_status()
    status = lone_node.api("/api/v1/cluster")
    assert status["is_leader"] is True and status["leader"] == "node-a", status
