"""Pool names (``kunlun.serving.pools``): one parse for the gateway's ``X-Kunlun-Pool`` and
for ``kunlun-cli validate``, and the names a replica answers to."""

from __future__ import annotations

import pytest

from kunlun.errors import ConfigError, RequestError
from kunlun.serving.pools import Pool, columns_of, names_of, parse_pool, pool_name
from kunlun.serving.replica import Replica
from kunlun.serving.routing import POOL_HEADER, pool_header
from kunlun.validate.target import parse_target, pools_of


def test_names_are_made_and_parsed_by_one_pair() -> None:
    for device_type, engine in [("cpu", None), ("cpu", "llama.cpp"), ("ascend", "vllm")]:
        assert parse_pool(pool_name(device_type, engine)) == Pool(device_type, engine)
    assert parse_pool(" cpu/kunlun ") == Pool("cpu", "kunlun")


@pytest.mark.parametrize("bad", ["/llama.cpp", "cpu/", "cpu/llama.cpp/x", "cpu /kunlun", "/"])
def test_a_malformed_pool_header_is_a_400_naming_the_header_and_value(bad: str) -> None:
    with pytest.raises(ValueError, match="DEVICE_TYPE/ENGINE"):
        parse_pool(bad)
    with pytest.raises(RequestError) as caught:
        pool_header(bad)
    assert caught.value.http_status == 400 and caught.value.location is not None
    assert caught.value.location.field == POOL_HEADER and repr(bad) in caught.value.message


def test_the_header_is_spelled_canonically() -> None:
    assert pool_header(" cpu ") == "cpu" and pool_header("cpu/llama.cpp") == "cpu/llama.cpp"
    assert pool_header("") == ""  # names no pool: refused later as serving nothing (404)


def test_a_replica_answers_to_its_device_type_and_to_its_engine_pool() -> None:
    kunlun = Replica("r0", "w0", "m", "cpu:0", "http://127.0.0.1:1")
    llama = Replica("r1", "w1", "m", "node-b/cpu:0", "http://127.0.0.1:2", engine="llama.cpp")
    assert kunlun.pools == names_of("cpu", "kunlun") == {"cpu", "cpu/kunlun"}
    assert llama.pools == {"cpu", "cpu/llama.cpp"}
    assert "cpu/llama.cpp" not in kunlun.pools and "cpu/kunlun" not in llama.pools


def test_validate_columns_split_a_device_type_only_where_engines_differ() -> None:
    assert columns_of([("cpu", "kunlun"), ("cuda", "vllm")]) == ["cpu", "cuda"]
    assert columns_of([("cpu", "kunlun"), ("cpu", "llama.cpp"), ("cuda", "vllm")]) == [
        "cpu/kunlun",
        "cpu/llama.cpp",
        "cuda",
    ]
    workloads = [
        {"name": "m", "state": "RUNNING", "target_device": "cpu:0", "engine": "kunlun"},
        {"name": "m", "state": "RUNNING", "target_device": "cpu:0", "engine": "llama.cpp"},
        {"name": "m", "state": "RUNNING", "target_device": "ascend:1"},  # no engine: kunlun
        {"name": "m", "state": "STOPPED", "target_device": "cuda:0", "engine": "vllm"},
    ]
    assert pools_of(workloads, "m") == ["ascend", "cpu/kunlun", "cpu/llama.cpp"]


def test_a_target_pool_is_parsed_by_the_same_function() -> None:
    column = parse_target("l=http://127.0.0.1:8470,pool= cpu/llama.cpp", "m")
    assert column.pool == "cpu/llama.cpp"
    with pytest.raises(ConfigError, match="not a pool"):
        parse_target("l=http://127.0.0.1:8470,pool=cpu/", "m")
