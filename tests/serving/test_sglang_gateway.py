"""SGLang's native routes at the gateway (real gateway, real worker): which model a body
without ``model`` goes to, the sequence limit in SGLang's field names, and the routes the
gateway forwards."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tests import loopback
from tests.serving.conftest import MODEL, GatewayServer

from kunlun.serving.replica import Replica


@pytest.fixture
def two_models(gateway: GatewayServer, worker: object) -> Iterator[GatewayServer]:
    """The gateway with a second served model (a replica of the same worker)."""
    url = gateway.replicas.ready(MODEL)[0].base_url
    gateway.replicas.upsert(Replica("r-other", "w-other", "other", "cpu:0", url, ready=True))
    try:
        yield gateway
    finally:
        gateway.replicas.remove("r-other")


def test_one_served_model_needs_no_model_field(gateway: GatewayServer) -> None:
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    resp = loopback.post(gateway.base_url + "/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["meta_info"]["completion_tokens"] == 2
    info = loopback.get(gateway.base_url + "/get_model_info", timeout=60)
    assert info.status_code == 200 and info.json()["model_path"] == MODEL


def test_several_served_models_need_the_model_field(two_models: GatewayServer) -> None:
    url = two_models.base_url
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}
    error = loopback.post(url + "/generate", json=body, timeout=60).json()["error"]
    assert error["param"] == "model" and "other" in error["message"] and MODEL in error["message"]
    named = loopback.post(url + "/generate", json={**body, "model": MODEL}, timeout=120)
    assert named.status_code == 200, named.text
    for path in ("/get_model_info", "/get_server_info", "/flush_cache"):
        refused = loopback.get(url + path, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    server = loopback.get(url + "/get_server_info", params={"model": MODEL}, timeout=60).json()
    assert sorted(server["served_models"]) == sorted([MODEL, "other"])
    flushed = loopback.post(url + "/flush_cache", params={"model": MODEL}, timeout=60)
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed")


def test_sequence_limit_names_sglang_fields(gateway: GatewayServer) -> None:
    limit = gateway.state.max_sequences_per_request
    many = {"text": ["x"] * (limit + 1), "sampling_params": {"max_new_tokens": 1}}
    error = loopback.post(gateway.base_url + "/generate", json=many, timeout=60).json()["error"]
    assert error["param"] == "text", error
    wide = {"text": ["x"] * 2, "sampling_params": {"max_new_tokens": 1, "n": limit}}
    error = loopback.post(gateway.base_url + "/generate", json=wide, timeout=60).json()["error"]
    assert error["param"] == "sampling_params.n", error
