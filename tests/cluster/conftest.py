"""Real etcd clusters for the cluster tests (skipped where etcd is not installed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.cluster.etcd_cluster import ETCD, EtcdCluster
from tests.daemons import prune

from kunlun.state.certs import make_certs

ETCD_MEMBERS = ["etcd-0", "etcd-1", "etcd-2"]
NODES = ["node-a", "node-b", "node-c"]


@pytest.fixture(scope="module")
def etcd_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One CA with etcd-0..2 and node-a..c; ``other/``: a foreign CA with node-x."""
    certs = tmp_path_factory.mktemp("certs")
    make_certs(certs, [*ETCD_MEMBERS, *NODES])
    make_certs(certs / "other", ["node-x"])
    return certs


def _running(cluster: EtcdCluster) -> Iterator[EtcdCluster]:
    if ETCD is None:
        pytest.skip("etcd is not installed")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        prune(cluster.root)


@pytest.fixture(scope="module")
def etcd3(tmp_path_factory: pytest.TempPathFactory, etcd_certs: Path) -> Iterator[EtcdCluster]:
    """Three members with TLS (client and peer certificates required)."""
    yield from _running(EtcdCluster(tmp_path_factory.mktemp("etcd3"), 3, etcd_certs))


@pytest.fixture
def etcd3_own(tmp_path: Path, etcd_certs: Path) -> Iterator[EtcdCluster]:
    """Three members with TLS for one test alone (to kill members of)."""
    yield from _running(EtcdCluster(tmp_path / "etcd", 3, etcd_certs))


@pytest.fixture(scope="module")
def etcd1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One member, plain http."""
    yield from _running(EtcdCluster(tmp_path_factory.mktemp("etcd1"), 1))
