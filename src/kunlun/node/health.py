"""Health checks that measure progress: a replica that fails them leaves routing until it
passes again.

Every ``interval_s`` the :class:`HealthChecker` first reads each ready local replica's engine
counters (``GET /stats``). A replica in routing whose engine made steps since the previous
check is serving: that is its pass (**serving**), and it gets no synthetic request, which
would share its batches with real ones (a batch's make-up can flip a greedy near-tie) and
add load where there is most. Any other replica gets a tiny generation straight to its
worker (``POST /v1/completions``, prompt ``"ping"``, ``max_tokens: 1``; for a model served
for embeddings ``POST /v1/embeddings`` of ``"ping"``; header
:data:`PROBE_HEADER`), waiting at most ``timeout_s``, then ``/stats`` again. A
:class:`ReplicaHealth` per replica turns each check into a :class:`Verdict` (its ``result``):

- **serving**: see above; no probe sent. Never restores an ejected replica (its in-flight
  requests may still be stepping): only a probe that passes does.
- **pass**: the probe was answered 200 with a choice. It clears the failures and lets an
  ejected replica back into routing.
- **slow**: no answer within ``timeout_s`` but ``/stats`` answered (alive, on a loaded host):
  the probe waits on, up to ``slow_s`` (the liveness answer deadline), and then counts as a
  pass. An idle replica on a busy host answers late: slow, not dead, it stays in routing.
- **error**: the probe was answered with an error (any other status, or a body that is not a
  completion). ``failures`` failed probes in a row (error or stalled) eject the replica.
- **busy**: no answer within ``slow_s`` (or a 429), but ``/stats`` shows the engine's step
  counter (``num_steps``) moved since the previous probe, or work arrived since then (its
  first step may be a long prefill): a full batch makes progress. Counts as a pass.
- **silent**: neither the probe nor ``/stats`` was answered (a stopped process, a wedged event
  loop): ejected at once.
- **stalled**: no answer to the probe within ``slow_s``, and ``/stats`` shows requests unfinished and no step
  since the previous probe, which also saw requests unfinished. A failure like an error:
  ``failures`` in a row (the engine made no step for that many intervals) eject. Not at
  once, because one engine step can outlast an interval: a long prefill, or decode steps of
  2 to 4 s measured on a loaded 2-core machine.

An unanswered probe whose ``/stats`` proves nothing (no step counters: another engine; or
an idle engine that made no step since the previous probe, so the probe never reached it)
counts as an error. The previous probe's ``/stats`` (read after every probe) is what
"moved" compares with; with none (the first probe, or ``/stats`` did not answer then) an
unanswered probe with ``/stats`` answering is busy.

Ejection only sets :attr:`~kunlun.serving.replica.Replica.ejected`: the gateway stops routing
to the replica and the worker keeps running. This is an earlier, reversible layer under the
node agent's liveness supervisor (:mod:`kunlun.node.liveness`), which kills a worker silent
for its answer deadline (15 s) or stalled for its progress deadline (120 s). A stopped worker
is ejected within ``interval_s + timeout_s + min(1, timeout_s)`` of being stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kunlun.node.liveness import EventSink, LivenessConfig
from kunlun.node.liveness import probe as read_stats
from kunlun.serving.faults import PROBE_HEADER
from kunlun.serving.replica import Replica, ReplicaSet

log = logging.getLogger(__name__)

PROBE_BODY = {"prompt": "ping", "max_tokens": 1, "temperature": 0}
EMBED_PROBE_BODY = {"input": "ping"}
"""The probe of a replica serving its model for embeddings (``POST /v1/embeddings``)."""
STALL_MIN_S = 60.0
"""An engine with requests unfinished counts as stalled only after this long without a step:
on a loaded 2-core CI machine single steps took over 10 s, and ejecting them gave 503s."""
Result = Literal["serving", "pass", "slow", "busy", "error", "silent", "stalled"]
RESULTS: tuple[Result, ...] = get_args(Result)
"""Every :attr:`Verdict.result`, in the order of the module docstring."""


@dataclass(frozen=True)
class HealthConfig:
    """How the health checker probes replicas (``kunlun-platform --health-check-*`` flags)."""

    interval_s: float = 5.0
    """Seconds between the starts of two probes of one replica (> 0)."""
    timeout_s: float = 2.0
    """Seconds one probe waits for its generation (> 0; at most ``interval_s`` is used)."""
    failures: int = 2
    """Failed probes in a row (answered with an error, or stalled) that eject a replica
    (>= 1)."""
    slow_s: float = field(default_factory=lambda: LivenessConfig().answer_deadline_s)
    """How long a probe waits once ``/stats`` answered: the liveness answer deadline."""

    def __post_init__(self) -> None:
        for name in ("interval_s", "timeout_s", "failures", "slow_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"HealthConfig.{name} must be > 0, got {value!r}")

    @property
    def probe_timeout_s(self) -> float:
        """How long a probe waits: ``timeout_s``, at most ``interval_s``."""
        return min(self.timeout_s, self.interval_s)

    @property
    def stats_timeout_s(self) -> float:
        """How long a ``/stats`` read waits: 1 s, at most the probe's."""
        return min(1.0, self.probe_timeout_s)


@dataclass(frozen=True)
class Verdict:
    """What one probe says about a replica."""

    result: Result
    eject: str | None = None
    """The reason, when this probe takes the replica out of routing."""
    restore: bool = False
    """Whether this probe lets the (ejected) replica back into routing."""


class ReplicaHealth:
    """One replica's probe history and the verdicts it leads to (times from one monotonic
    clock, passed in: the class never reads the time itself)."""

    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        self.num_failures = 0
        """Probes in a row that counted as failures (reset by a pass or a busy probe)."""
        self.ejected: str | None = None
        """Why the replica is out of routing; None while it is in."""
        self.num_steps: int | None = None
        """The engine's step counter at the previous probe (None: unknown)."""
        self.busy = False
        """Whether the previous probe's ``/stats`` had requests unfinished."""
        self.steps_since = 0.0
        """When ``num_steps`` last moved, or work was first seen."""

    def serving(self, stats: dict[str, Any] | None, now: float) -> Verdict | None:
        """``stats`` read before probing: a ``serving`` pass when the replica is in routing and
        its engine made steps since the previous check; None (nothing recorded) when it needs
        a probe."""
        counters = _counters(stats)
        if self.ejected is not None or counters is None or self.num_steps is None:
            return None
        if counters[0] == self.num_steps:
            return None
        self._record(counters, now)
        return self._good("serving")

    def passed(self, stats: dict[str, Any] | None, now: float, slow: bool = False) -> Verdict:
        """The probe got its token (``slow``: after ``timeout_s``, ``/stats`` answering
        meanwhile); ``stats``: ``/stats`` read after it (None: no answer)."""
        self._record(_counters(stats), now)
        return self._good("slow" if slow else "pass")

    def failed(self, why: str, stats: dict[str, Any] | None, now: float) -> Verdict:
        """The probe was answered with an error, ``why`` (its status and message)."""
        self._record(_counters(stats), now)
        return self._failure("error", f"its health probe was answered {why}")

    def unanswered(self, why: str, stats: dict[str, Any] | None, now: float) -> Verdict:
        """The probe got no answer in time (``why``); ``stats``: ``/stats`` read after it."""
        waited = f"its health probe got no answer within {self.config.probe_timeout_s:g} s"
        if stats is not None:
            waited = f"its health probe got no answer within {self.config.slow_s:g} s"
        if stats is None:
            self._record(None, now)
            self.num_failures += 1
            return self._eject("silent", f"answers no request: {waited} ({why}), nor /stats")
        counters = _counters(stats)
        previous, was_busy, since = self.num_steps, self.busy, self.steps_since
        self._record(counters, now)
        if counters is None:
            return self._failure("error", f"{waited} ({why}) and its engine reports no steps")
        steps, unfinished = counters
        if previous is None or steps != previous:
            return self._good("busy")  # it moved since the previous probe (or nothing to go by)
        if unfinished == 0:
            return self._failure("error", f"{waited} ({why}) and its engine is idle")
        if not was_busy:
            return self._good("busy")  # work arrived since the previous probe: a long step
        if now - since < STALL_MIN_S:
            return self._good("busy")  # one step (a long prefill, a loaded machine) lasts long
        return self._failure(
            "stalled",
            f"its engine made no step in {now - since:.1f} s with {unfinished} request(s) "
            "unfinished (stalled)",
        )

    def _record(self, counters: tuple[int, int] | None, now: float) -> None:
        if counters is None:
            self.num_steps, self.busy = None, False
            return
        steps, unfinished = counters
        if steps != self.num_steps or not self.busy or not unfinished:
            self.steps_since = now
        self.num_steps, self.busy = steps, unfinished > 0

    def _good(self, result: Result) -> Verdict:
        self.num_failures = 0
        restore, self.ejected = self.ejected is not None, None
        return Verdict(result, restore=restore)

    def _failure(self, result: Result, reason: str) -> Verdict:
        self.num_failures += 1
        if self.num_failures < self.config.failures:
            return Verdict(result)
        if self.config.failures > 1:
            reason = f"{self.num_failures} health probes in a row failed; the last: {reason}"
        return self._eject(result, reason)

    def _eject(self, result: Result, reason: str) -> Verdict:
        if self.ejected is not None:
            return Verdict(result)  # already out: the first reason stays
        self.ejected = reason
        return Verdict(result, eject=reason)


def _counters(stats: dict[str, Any] | None) -> tuple[int, int] | None:
    """(``num_steps``, ``num_unfinished_requests``) of a ``/stats`` answer, if it has both."""
    if stats is None:
        return None
    steps, unfinished = stats.get("num_steps"), stats.get("num_unfinished_requests")
    if isinstance(steps, int) and isinstance(unfinished, int):
        return steps, unfinished
    return None


@dataclass
class _Tracked:
    """The checker's state of one local replica."""

    health: ReplicaHealth
    base_url: str
    pid: int | None
    next_probe: float
    task: asyncio.Task[None] | None = None


@dataclass
class _Answer:
    """How a probe's generation went: ``generated``, or else ``why`` and whether the worker
    ``answered`` at all (an error) or not (a timeout, a refused connection, a 429)."""

    generated: bool
    answered: bool
    why: str = ""


class HealthChecker:
    """Probes every ready local replica of ``replicas`` and ejects or restores it; tells
    ``on_event`` (workload_id, ``"ejected"`` or ``"restored"``, message)."""

    def __init__(self, replicas: ReplicaSet, config: HealthConfig, on_event: EventSink) -> None:
        self.replicas, self.config, self.on_event = replicas, config, on_event
        self.num_ejections: Counter[tuple[str, str]] = Counter()
        """Ejections by (model, reason kind: ``error``, ``silent`` or ``stalled``)."""
        self.num_probes: Counter[tuple[str, str]] = Counter()
        """Probes by (model, result: one of :data:`RESULTS`)."""
        self._tracked: dict[str, _Tracked] = {}

    async def run(self, tick_s: float = 0.1) -> None:
        """Run forever: every ``tick_s`` start the probes that are due (each its own task)."""
        async with httpx.AsyncClient(trust_env=False) as client:
            try:
                while True:
                    try:
                        self.tick(client, time.monotonic())
                    except Exception:  # noqa: BLE001 - the checks must go on
                        log.exception("health checker")
                    await asyncio.sleep(tick_s)
            finally:
                for tracked in self._tracked.values():
                    if tracked.task is not None:
                        tracked.task.cancel()

    def tick(self, client: httpx.AsyncClient, now: float) -> None:
        """Forget replicas gone, restarted or no longer ready; start the probes due."""
        local = {r.replica_id: r for r in self.replicas.all() if r.node is None}
        for rid, tracked in list(self._tracked.items()):
            r = local.get(rid)
            if r is None or not r.ready or (r.base_url, r.pid) != (tracked.base_url, tracked.pid):
                self._forget(rid, r)
        for rid, r in local.items():
            if not r.ready or not r.base_url:
                continue
            if rid not in self._tracked:
                self._tracked[rid] = _Tracked(ReplicaHealth(self.config), r.base_url, r.pid, now)
            tracked = self._tracked[rid]
            if tracked.task is None and now >= tracked.next_probe:
                tracked.next_probe = now + self.config.interval_s
                tracked.task = asyncio.create_task(self._probe(r, tracked, client))

    def _forget(self, replica_id: str, replica: Replica | None) -> None:
        tracked = self._tracked.pop(replica_id)
        if tracked.task is not None:
            tracked.task.cancel()
        if replica is not None:
            replica.ejected = None  # a new worker starts in routing

    async def _probe(self, r: Replica, tracked: _Tracked, client: httpx.AsyncClient) -> None:
        """Probe ``r`` once and act on the verdict (unless it was forgotten meanwhile)."""
        try:
            health = tracked.health
            before = await self._stats(client, r)
            verdict = health.serving(before, time.monotonic())
            if verdict is not None:
                if self._tracked.get(r.replica_id) is tracked:
                    self._apply(r, verdict)
                return
            answer, stats, slow = await self._answer(client, r, tracked, before is not None)
            if self._tracked.get(r.replica_id) is not tracked:
                return
            now = time.monotonic()
            if answer.generated:
                verdict = health.passed(stats, now, slow)
            elif answer.answered:
                verdict = health.failed(answer.why, stats, now)
            else:
                verdict = health.unanswered(answer.why, stats, now)
            self._apply(r, verdict)
        except Exception:  # noqa: BLE001 - one bad probe must not end the checks
            log.exception("health probe of replica %s", r.replica_id)
        finally:
            tracked.task = None

    async def _answer(
        self, client: httpx.AsyncClient, r: Replica, tracked: _Tracked, stats_before: bool
    ) -> tuple[_Answer, dict[str, Any] | None, bool]:
        """The probe's answer, ``/stats`` after it (None: not read, or no answer) and whether
        it came late: past ``timeout_s`` the probe goes on only while ``/stats`` answers."""
        probe = asyncio.ensure_future(self._generate(client, r))
        done, _ = await asyncio.wait({probe}, timeout=self.config.probe_timeout_s)
        if done:
            answer = probe.result()
            answered = stats_before or answer.answered  # (else nothing would answer /stats)
            return answer, await self._stats(client, r) if answered else None, False
        stats = await self._stats(client, r)
        if stats is None:  # neither answers: silent
            probe.cancel()
            return (
                _Answer(False, False, f"timed out after {self.config.probe_timeout_s:g} s"),
                None,
                False,
            )
        answer = await probe  # alive: the rest of slow_s
        return answer, await self._stats(client, r), answer.generated

    async def _generate(self, client: httpx.AsyncClient, r: Replica) -> _Answer:
        timeout = max(self.config.slow_s, self.config.probe_timeout_s)
        task = r.task
        path, body = ("/v1/embeddings", EMBED_PROBE_BODY) if task == "embed" else (
            "/v1/completions", PROBE_BODY)  # fmt: skip
        try:
            async with asyncio.timeout(timeout):  # the whole answer, not each read
                response = await client.post(
                    r.base_url + path,
                    json={"model": r.model, **body},
                    headers=[(PROBE_HEADER.encode(), b"1"), *r.key_headers],
                    timeout=timeout,
                )
        except (httpx.HTTPError, TimeoutError) as exc:
            return _Answer(False, False, _error_name(exc))
        if response.status_code == 429:  # full: judged by its progress, as a timeout is
            return _Answer(False, False, f"429: {_message(response)}")
        if response.status_code == 200:
            with contextlib.suppress(ValueError, AttributeError):
                choices = response.json().get("data" if task == "embed" else "choices")
                if isinstance(choices, list) and choices:
                    return _Answer(True, True)
            return _Answer(False, True, f"200 without a completion: {response.text[:200]!r}")
        return _Answer(False, True, f"{response.status_code}: {_message(response)}")

    async def _stats(self, client: httpx.AsyncClient, r: Replica) -> dict[str, Any] | None:
        timeout = self.config.stats_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await read_stats(client, r, timeout)
        except (httpx.HTTPError, ValueError, TimeoutError):
            return None

    def _apply(self, r: Replica, verdict: Verdict) -> None:
        self.num_probes[(r.model, verdict.result)] += 1
        if verdict.eject is not None:
            r.ejected = verdict.eject
            self.num_ejections[(r.model, verdict.result)] += 1
            log.warning("replica %s out of routing: %s", r.replica_id, verdict.eject)
            self._event(r, "ejected", f"replica {r.replica_id} out of routing: {verdict.eject}")
        elif verdict.restore:
            r.ejected = None
            log.warning("replica %s back in routing", r.replica_id)
            self._event(
                r, "restored", f"replica {r.replica_id} back in routing: its health probe passed"
            )

    def _event(self, r: Replica, kind: str, message: str) -> None:
        try:
            self.on_event(r.workload_id, kind, message)
        except Exception:  # noqa: BLE001 - a lost event must not undo the verdict
            log.exception("health event of replica %s", r.replica_id)

    def families(self) -> Iterator[Metric]:
        """``/metrics``: which local replicas are ejected, ejections and probes so far."""
        ejected = GaugeMetricFamily(
            "kunlun_replica_ejected",
            "1 while the health checker keeps this node's replica out of routing (its worker "
            "runs on), 0 when it is in.",
            labels=["model", "replica", "device"],
        )
        for r in self.replicas.all():
            if r.node is None:
                ejected.add_metric([r.model, r.replica_id, r.device], 0 if r.ejected is None else 1)
        yield ejected
        ejections = CounterMetricFamily(
            "kunlun_health_ejections",
            "Replicas taken out of routing by the health checker, by reason: error (failed "
            "probes in a row), silent (no answer, nor /stats), stalled (no engine step).",
            labels=["model", "reason"],
        )
        for (model, reason), count in sorted(self.num_ejections.items()):
            ejections.add_metric([model, reason], count)
        yield ejections
        probes = CounterMetricFamily(
            "kunlun_health_probes",
            "Health checks of this node's replicas, by result: serving (the engine stepped "
            "since the previous check; no probe sent), pass, busy (no answer in time, the "
            "engine progressing), error, silent, stalled.",
            labels=["model", "result"],
        )
        for (model, result), count in sorted(self.num_probes.items()):
            probes.add_metric([model, result], count)
        yield probes


def _error_name(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


def _message(response: httpx.Response) -> str:
    """The error message of an answer (OpenAI shape), or the start of its body."""
    with contextlib.suppress(ValueError, LookupError, TypeError):
        message = response.json()["error"]["message"]
        if isinstance(message, str):
            return message[:300]
    return response.text[:200] or "(empty body)"
