"""One real daemon for the rollout tests, serving the tiny model as ``chat`` on cpu:0 (the
rollouts' mechanics, not the answers, are what they check)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tests.daemons import PATIENT, Daemon, Daemons, Profile

SPEC = """\
model: {model}
name: chat
max_num_seqs: 4
max_model_len: 1024
kv_cache_memory_mb: 16
"""


ROLLOUT = Profile("rollout-home", (SPEC.format(model="{tiny}"),), files=(PATIENT,))


@pytest.fixture(scope="module")
def platform(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    """A daemon whose workload ``chat`` (the tiny model) is RUNNING."""
    with Daemons(request).serve(ROLLOUT) as daemon:
        wait_serving(daemon, str(daemon.job))
        yield daemon


def wait_serving(daemon: Daemon, workload_id: str, timeout_s: float = 600) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        described = daemon.describe(workload_id)
        if described["state"] == "RUNNING":
            return
        assert described["state"] not in ("FAILED", "STOPPED"), described
        time.sleep(0.5)
    raise AssertionError(f"{workload_id} not RUNNING within {timeout_s} s")
