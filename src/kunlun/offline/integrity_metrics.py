"""The integrity metrics of ``/metrics``, from the counts of a
:class:`~kunlun.offline.integrity.ModelGuard`.

``kunlun_integrity_ok{kind,name}`` (1 intact, 0 changed at the last check; ``kind``
``package``, ``platform`` or ``conversion``), ``kunlun_integrity_failures_total{kind,name}``,
``kunlun_integrity_checks_total`` (sweeps run) and
``kunlun_integrity_last_check_timestamp_seconds``. Kept apart from the checks, which know
nothing of Prometheus; the daemon adds :meth:`~kunlun.offline.integrity.ModelGuard.families`
to the sources of its ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


def integrity_families(
    status: dict[tuple[str, str], bool],
    failures: dict[tuple[str, str], int],
    checks: int,
    last_check: float,
) -> Iterator[Metric]:
    """The families: ``status`` and ``failures`` by (kind, name), the sweeps run
    (``checks``) and when the last one ran (``last_check``, Unix time; 0: never)."""
    ok = GaugeMetricFamily(
        "kunlun_integrity_ok",
        "1 when the installed files of a package or the platform match their signed "
        "hashes at the last check (kind conversion: the weights derived from the package "
        "match their seal), 0 when not.",
        labels=["kind", "name"],
    )
    for (kind, name), good in sorted(status.items()):
        ok.add_metric([kind, name], 1.0 if good else 0.0)
    yield ok
    failed = CounterMetricFamily(
        "kunlun_integrity_failures",
        "Integrity checks that found a package, its derived weights or the platform changed.",
        labels=["kind", "name"],
    )
    for (kind, name), count in sorted(failures.items()):
        failed.add_metric([kind, name], count)
    yield failed
    yield CounterMetricFamily(
        "kunlun_integrity_checks", "Integrity sweeps run (start and every interval).",
        checks,
    )  # fmt: skip
    yield GaugeMetricFamily(
        "kunlun_integrity_last_check_timestamp_seconds",
        "When the last integrity sweep ran (Unix time; 0: never).",
        last_check,
    )
