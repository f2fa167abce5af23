"""Replica choice (round-robin, load-aware, threshold, thermal, pools) and priority
precedence, on real :class:`Replica` objects behind a real :class:`Admission`."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from kunlun.errors import RequestError
from kunlun.serving.admission import Admission, Ticket
from kunlun.serving.replica import Replica, ReplicaSet
from kunlun.serving.routing import DeviceLoad, DeviceSamples, Router, resolve_priority
from kunlun.serving.scheduler_config import SchedulerConfig, SchedulerConfigSource

MODEL = "m"


def node(
    devices: list[str], policy: str = "load-aware", **config: object
) -> tuple[Admission, list[Replica], DeviceSamples]:
    """An admission over one ready replica (``max_num_seqs`` 8) per device."""
    source = SchedulerConfigSource()
    source.apply(SchedulerConfig.model_validate({"policy": policy, **config}))
    samples = DeviceSamples()
    replicas = ReplicaSet()
    made = []
    for i, device in enumerate(devices):
        made.append(Replica(f"r{i}", "w", MODEL, device, "", ready=True, max_num_seqs=8))
        replicas.upsert(made[-1])
    return Admission(replicas, Router(source, samples)), made, samples


def admit(admission: Admission, num: int, tokens: int = 300, pool: str | None = None) -> list[str]:
    """Admit ``num`` requests (they stay in flight); the replica id each went to."""
    chosen = []
    for _ in range(num):
        replica = admission.try_admit(Ticket(MODEL, "normal", pool, tokens))
        assert replica is not None
        chosen.append(replica.replica_id)
    return chosen


def saturate(replica: Replica, in_flight: int = 7, tokens_each: int = 600) -> None:
    replica.in_flight = in_flight
    replica.outstanding_tokens = in_flight * tokens_each


def test_load_aware_sends_new_requests_away_from_a_saturated_replica() -> None:
    admission, replicas, _ = node(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    saturate(replicas[0])  # 7 of 8 slots busy: it still has room, but the most work
    chosen = admit(admission, 12)
    assert "r0" not in chosen
    assert Counter(chosen) == {"r1": 4, "r2": 4, "r3": 4}  # equal work spreads evenly
    assert [r.in_flight for r in replicas] == [7, 4, 4, 4]


def test_round_robin_takes_turns_and_skips_full_replicas() -> None:
    admission, replicas, _ = node(["cpu:0", "cpu:1", "cpu:2", "cpu:3"], policy="round-robin")
    saturate(replicas[0])
    chosen = admit(admission, 8)
    assert Counter(chosen) == {"r0": 1, "r1": 3, "r2": 2, "r3": 2}  # r0's last slot, then full
    assert replicas[0].in_flight == 8
    assert "r0" not in admit(admission, 6)


def test_a_device_above_the_threshold_gets_nothing_while_another_is_below() -> None:
    admission, replicas, samples = node(["cuda:0", "cuda:1", "cuda:2"])
    now = time.time()
    samples["cuda:0"] = DeviceLoad(90.0, 60.0, now)  # busy device, but no outstanding work here
    samples["cuda:1"] = DeviceLoad(50.0, 60.0, now)
    samples["cuda:2"] = DeviceLoad(65.0, 60.0, now)
    replicas[1].outstanding_tokens = replicas[2].outstanding_tokens = 5000
    assert set(admit(admission, 4)) == {"r1", "r2"}
    # once no device is below the threshold, least outstanding work wins again
    samples["cuda:1"] = DeviceLoad(95.0, 60.0, now)
    samples["cuda:2"] = DeviceLoad(80.0, 60.0, now)
    assert admit(admission, 1) == ["r0"]


def test_threshold_without_samples_uses_occupancy_and_ignores_stale_samples() -> None:
    admission, replicas, samples = node(["cpu:0", "cpu:1"], min_gpu_utilization_threshold=0.5)
    replicas[0].in_flight, replicas[0].outstanding_tokens = 5, 100  # 5/8 = 62 % > 50 %
    replicas[1].in_flight, replicas[1].outstanding_tokens = 1, 2000  # 12 % <= 50 %
    assert admit(admission, 1) == ["r1"]
    samples["cpu:1"] = DeviceLoad(99.0, None, time.time() - 60)  # older than 10 s: ignored
    assert admit(admission, 1) == ["r1"]


def test_a_device_hot_for_30_s_gets_half_its_weight_until_it_cools() -> None:
    admission, replicas, samples = node(["npu:0", "npu:1"], min_gpu_utilization_threshold=1.0)
    replicas[0].outstanding_tokens, replicas[1].outstanding_tokens = 100, 300
    now = time.time()
    samples["npu:0"] = DeviceLoad(40.0, 90.0, now - 20)
    samples["npu:0"] = DeviceLoad(40.0, 91.0, now)  # hot for 20 s only
    chosen = admit(admission, 1, tokens=300)
    assert chosen == ["r0"]  # (100+300) < (300+300): hot for less than 30 s is not derated
    replicas[0].in_flight, replicas[0].outstanding_tokens = 0, 100
    samples["npu:0"] = DeviceLoad(40.0, 92.0, now + 11)  # hot for 31 s in a row now
    assert admit(admission, 1, tokens=300) == ["r1"]  # (100+300)/0.5 = 800 > 600
    replicas[1].in_flight, replicas[1].outstanding_tokens = 0, 300
    samples["npu:0"] = DeviceLoad(40.0, 70.0, now + 12)  # cooled
    assert admit(admission, 1, tokens=300) == ["r0"]


def test_a_brief_cool_spell_restarts_the_thermal_clock() -> None:
    samples = DeviceSamples()  # 85 C for 30 s halves the weight

    def factor_after(temperature_c: float | None, ts: float) -> float:
        samples["npu:0"] = DeviceLoad(None, temperature_c, ts)
        return samples.views["npu:0"].weight_factor

    assert factor_after(90.0, 100.0) == 1.0
    assert factor_after(80.0, 110.0) == 1.0  # cooled: the clock restarts
    assert factor_after(90.0, 120.0) == 1.0
    assert factor_after(90.0, 145.0) == 1.0  # 25 s
    assert factor_after(90.0, 150.0) == 0.5  # 30 s in a row
    samples.update({"npu:0": DeviceLoad(None, None, 151.0)})  # unknown: not hot
    assert samples.views["npu:0"].weight_factor == 1.0


def test_pool_restricts_the_choice_to_its_device_type() -> None:
    admission, replicas, _ = node(["cpu:0", "cuda:0", "cuda:1"])
    assert set(admit(admission, 4, pool="cuda")) == {"r1", "r2"}
    assert admit(admission, 2, pool="cpu") == ["r0", "r0"]
    replicas[1].in_flight = replicas[2].in_flight = 8
    assert admission.try_admit(Ticket(MODEL, "normal", "cuda", 10)) is None


@pytest.mark.parametrize(
    ("header", "key", "workload", "expected"),
    [
        ("low", "high", "normal", "low"),  # the header wins
        (" HIGH ", None, "low", "high"),
        (None, "high", "low", "high"),  # then the key
        (None, None, "low", "low"),  # then the workload
    ],
)
def test_priority_precedence_header_then_key_then_workload(
    header: str | None, key: str | None, workload: str, expected: str
) -> None:
    assert resolve_priority(header, key, workload) == expected


def test_invalid_priority_header_names_the_header_and_value() -> None:
    with pytest.raises(RequestError) as caught:
        resolve_priority("urgent", "high", "normal")
    assert caught.value.http_status == 400
    assert "X-Kunlun-Priority" in caught.value.message and "'urgent'" in caught.value.message
    assert caught.value.location is not None
    assert caught.value.location.field == "X-Kunlun-Priority"
