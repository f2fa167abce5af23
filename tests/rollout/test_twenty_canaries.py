"""Twenty good canaries in a row promote: no false rollback (a file of its own, so that the
suite runs it beside the other rollout tests, on its own daemon)."""

from __future__ import annotations

from tests.daemon.conftest import Daemon
from tests.rollout.rollout_load import FAST, Load, create, wait_for


def test_twenty_good_canaries_in_a_row_promote(platform: Daemon) -> None:
    outcomes = []
    for _ in range(20):
        started = create(platform.url, workload="chat", model="smollm2", steps="50",
                         **{**FAST, "min_requests": 30})  # fmt: skip
        with Load(platform.url, "chat", concurrency=4):
            ended = wait_for(platform.url, started["rollout_id"])
        outcomes.append((ended["state"], ended["reason"]))
    assert [state for state, _ in outcomes] == ["PROMOTED"] * 20, outcomes
