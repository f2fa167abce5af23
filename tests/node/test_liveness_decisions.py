"""The supervisor's verdict on a worker from its probe answers (times passed in)."""

from __future__ import annotations

import pytest

from kunlun.node.liveness import Liveness, LivenessConfig

CONFIG = LivenessConfig(answer_deadline_s=10.0, progress_deadline_s=60.0)


def stats(num_steps: int, unfinished: int) -> dict[str, int]:
    return {"num_steps": num_steps, "num_unfinished_requests": unfinished}


def test_a_worker_that_stops_answering_is_unresponsive_past_the_deadline() -> None:
    liveness = Liveness(CONFIG, now=0.0)
    assert liveness.answered(stats(5, 0), now=1.0) is None
    assert liveness.missed("ReadTimeout", now=9.0) is None
    assert liveness.missed("ReadTimeout", now=11.0) is None  # 10 s since the last answer
    reason = liveness.missed("ReadTimeout", now=11.5)
    assert reason is not None
    assert "answered no health probe for 10.5 s" in reason and "ReadTimeout" in reason
    assert liveness.answered(stats(5, 0), now=12.0) is None  # an answer resets it
    assert liveness.missed("ConnectError", now=20.0) is None


def test_an_engine_with_requests_and_no_step_is_stalled_past_the_progress_deadline() -> None:
    liveness = Liveness(CONFIG, now=0.0)
    assert liveness.answered(stats(10, 2), now=1.0) is None
    assert liveness.answered(stats(11, 2), now=30.0) is None  # a long step, then it moved
    assert liveness.answered(stats(11, 2), now=89.0) is None
    reason = liveness.answered(stats(11, 2), now=91.0)
    assert reason is not None
    assert "no step for 61.0 s with 2 request(s) unfinished" in reason


def test_an_idle_engine_is_never_stalled() -> None:
    liveness = Liveness(CONFIG, now=0.0)
    for now in range(1, 500, 7):
        assert liveness.answered(stats(3, 0), now=float(now)) is None
    assert liveness.answered(stats(3, 1), now=600.0) is None  # work arrived: the clock starts
    assert liveness.answered(stats(3, 1), now=659.0) is None
    assert liveness.answered(stats(3, 1), now=661.0) is not None


def test_answers_without_engine_counters_only_count_as_alive() -> None:
    liveness = Liveness(CONFIG, now=0.0)
    assert liveness.answered({"status": "ok"}, now=500.0) is None
    assert liveness.missed("ReadTimeout", now=505.0) is None


def test_deadlines_must_be_positive() -> None:
    with pytest.raises(ValueError, match="answer_deadline_s must be > 0"):
        LivenessConfig(answer_deadline_s=0)
