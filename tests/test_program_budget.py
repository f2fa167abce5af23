"""``program_seconds`` is the CPU time of the thread compiling a user's program (a busy machine
does not push an ordinary program over it), and at most 4 times as long by the clock."""

from __future__ import annotations

import asyncio
import time

import pytest

from kunlun import budgets
from kunlun.errors import OverBudget


def spin(seconds: float) -> float:
    started = time.thread_time()
    while time.thread_time() - started < seconds:
        pass
    return seconds


def wait(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_cpu_over_the_budget_is_refused_and_waiting_within_four_times_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KUNLUN_BUDGET_PROGRAM_SECONDS", "0.5")

    async def run() -> None:
        assert await budgets.bounded("quick", spin, 0.05) == 0.05
        assert await budgets.bounded("waits", wait, 1.0) == 1.0  # 1 s by the clock, no CPU
        with pytest.raises(OverBudget, match="spins took longer than 0.5 s"):
            await budgets.bounded("spins", spin, 3.0)
        with pytest.raises(OverBudget, match="hangs took longer than 0.5 s"):
            await budgets.bounded("hangs", wait, 3.0)  # over 4 x 0.5 s by the clock

    asyncio.run(run())
