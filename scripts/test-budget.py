"""Hold the test suite to its time budget: ``python3 scripts/test-budget.py JUNIT SECONDS BUDGET``.

Reads pytest's JUnit XML report of the run that took SECONDS (wall time of the pytest part
of ``.ci/run``), prints the seconds per directory, per work unit (what tests/conftest.py's
``LONGEST_FIRST`` is refreshed from) and per xdist worker (busy, and when its last test
ended: a worker that ends long after the others shows units handed out in a poor order),
and exits 1 when SECONDS is over BUDGET, naming the 25 slowest tests (setup, call and
teardown together): the suite can never again drift toward CI's limit without the run that
crosses the line saying where the time went.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SHOWN = 25


def slowest(report: Path, count: int = SHOWN) -> list[tuple[float, str]]:
    root = ET.parse(report).getroot()
    cases = [
        (float(case.get("time") or 0), f"{case.get('classname', '')}::{case.get('name', '')}")
        for case in root.iter("testcase")
    ]
    return sorted(cases, reverse=True)[:count]


def by_directory(report: Path) -> dict[str, float]:
    """Seconds per test directory (``tests/daemon``, ...), summed over the workers."""
    totals: dict[str, float] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        parts = (case.get("classname") or "").split(".")
        folder = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
        totals[folder] = totals.get(folder, 0.0) + float(case.get("time") or 0)
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def by_unit(report: Path) -> dict[str, float]:
    """Seconds per xdist work unit (the ``@group`` suffix of a test's name, else its file)."""
    totals: dict[str, float] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name") or ""
        unit = name.rsplit("@", 1)[1].rstrip("]") if "@" in name else case.get("classname", "")
        totals[unit] = totals.get(unit, 0.0) + float(case.get("time") or 0)
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def by_worker(report: Path) -> dict[str, tuple[int, float, float]]:
    """Per xdist worker: tests run, seconds busy and when its last test ended (seconds after
    the first test of the run started), from the ``worker`` and ``span`` properties that
    tests/conftest.py writes into each test's report."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        found = {p.get("name"): p.get("value") or "" for p in case.iter("property")}
        if "worker" in found and "-" in found.get("span", ""):
            start, end = (float(part) for part in found["span"].split("-", 1))
            spans.setdefault(found["worker"], []).append((start, end))
    if not spans:
        return {}
    origin = min(start for runs in spans.values() for start, _ in runs)
    return {
        worker: (len(runs), sum(end - start for start, end in runs),
                 max(end for _, end in runs) - origin)
        for worker, runs in sorted(spans.items())
    }  # fmt: skip


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    report, took, budget = Path(argv[0]), float(argv[1]), float(argv[2])
    if not report.is_file():
        print(f"test-budget: no JUnit report at {report}", file=sys.stderr)
        return 2
    print(f"test-budget: the tests took {took:.0f} s of a {budget:.0f} s budget (CI_BUDGET_S)")
    print("test-budget: seconds per directory (the workers together):")
    for folder, seconds in by_directory(report).items():
        print(f"  {seconds:8.1f} s  {folder}")
    print("test-budget: seconds per work unit, 20 s and over (the workers together):")
    for unit, seconds in by_unit(report).items():
        if seconds >= 20:
            print(f"  {seconds:8.1f} s  {unit}")
    workers = by_worker(report)
    if workers:
        print(
            "test-budget: per worker: tests, seconds busy, its last test ended at (s after the first began):"
        )
        for worker, (count, busy, ended) in workers.items():
            print(f"  {worker:>6}  {count:5d} tests  {busy:8.1f} s busy  ended at {ended:8.1f} s")
    if took <= budget:
        return 0
    print(f"test-budget: OVER BUDGET by {took - budget:.0f} s; the {SHOWN} slowest tests:")
    for seconds, name in slowest(report):
        print(f"  {seconds:8.1f} s  {name}")
    print("test-budget: make them faster (docs/testing.md) or pay the time back elsewhere")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
