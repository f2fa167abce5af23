"""Per-key token buckets on a fake clock: bursts, refill, Retry-After, token settlement."""

from __future__ import annotations

import ipaddress

import pytest
from prometheus_client import CollectorRegistry

from kunlun.protocol.openai_errors import RateLimited
from kunlun.serving.key_limits import KeyLimiter, TokenCharge
from kunlun.serving.scheduler_config import KeyDefaults
from kunlun.state.api_keys import ActiveKey


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(**limits: object) -> ActiveKey:
    fields: dict[str, object] = {"rpm": None, "tpm": None, "allow_ips": None, **limits}
    return ActiveKey("k1", "app", "inference", None, **fields)  # type: ignore[arg-type]


def limiter(clock: Clock, defaults: KeyDefaults | None = None) -> KeyLimiter:
    return KeyLimiter(lambda: defaults or KeyDefaults(), CollectorRegistry(), clock)


def test_rpm_allows_a_burst_then_one_per_interval_with_retry_after() -> None:
    clock = Clock()
    limits = limiter(clock)
    app = key(rpm=6)  # a burst of 6, then one every 10 s
    for _ in range(6):
        limits.take_request(app, 6)
    with pytest.raises(RateLimited) as caught:
        limits.take_request(app, 6)
    assert caught.value.retry_after_s == 10 and "'app'" in caught.value.message
    clock.now += 4
    with pytest.raises(RateLimited) as again:
        limits.take_request(app, 6)
    assert again.value.retry_after_s == 6  # when the next slot frees up
    clock.now += 6
    limits.take_request(app, 6)
    assert limits.limited.labels("app", "k1", "rpm")._value.get() == 2


def test_tpm_admits_while_not_empty_and_settles_to_the_usage() -> None:
    clock = Clock()
    limits = limiter(clock)
    app = key(tpm=600)  # refills 10 tokens a second
    first = TokenCharge(limits, app, 600)
    first.admit(500)
    first.settle(200, b'... "usage": {"prompt_tokens": 20, "total_tokens": 50}}')
    second = TokenCharge(limits, app, 600)
    second.admit(500)  # 550 left before it: admitted
    second.settle(None, b"")  # no answer at all: given back
    refused = TokenCharge(limits, app, 600)
    refused.admit(2000)  # still 550: admitted, the bucket goes below zero
    refused.settle(200, b"data: {}\n\n")  # a stream without usage keeps the estimate
    with pytest.raises(RateLimited) as caught:
        TokenCharge(limits, app, 600).admit(1)
    assert caught.value.retry_after_s == 146  # 1450 missing at 10 a second, plus one token
    clock.now += 146
    TokenCharge(limits, app, 600).admit(1)


def test_error_answers_are_not_charged() -> None:
    limits = limiter(Clock())
    app = key(tpm=100)
    charge = TokenCharge(limits, app, 100)
    charge.admit(10_000)
    charge.settle(400, b'{"error": {}}')
    TokenCharge(limits, app, 100).admit(1)  # the 10,000 were given back


def test_policy_takes_the_keys_own_values_else_the_defaults() -> None:
    defaults = KeyDefaults(rpm=100, tpm=1000, allow_ips=["10.0.0.0/8"])
    limits = limiter(Clock(), defaults)
    inherited = limits.policy(key())
    assert (inherited.rpm, inherited.tpm) == (100, 1000)
    assert inherited.allows("10.2.3.4") and not inherited.allows("127.0.0.1")
    assert inherited.allows("::ffff:10.2.3.4") and not inherited.allows(None)
    own = limits.policy(key(rpm=0, tpm=5, allow_ips=(ipaddress.ip_network("127.0.0.0/8"),)))
    assert (own.rpm, own.tpm) == (None, 5)  # 0: no limit even with a default
    assert own.allows("127.0.0.1") and not own.allows("10.2.3.4")
    assert limiter(Clock()).policy(key()).allows("203.0.113.9")  # no list: any address
