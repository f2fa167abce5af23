"""Hold the test suite to its time budget: ``python3 scripts/test-budget.py JUNIT SECONDS BUDGET``.

Reads pytest's JUnit XML report of the run that took SECONDS (wall time of the pytest part
of ``.ci/run``), prints the total and the 25 slowest tests (setup, call and teardown
together), and exits 1, naming them, when SECONDS is over BUDGET: the suite can never again
drift toward CI's limit without the run that crosses the line saying where the time went.
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
    if took <= budget:
        return 0
    print(f"test-budget: OVER BUDGET by {took - budget:.0f} s; the {SHOWN} slowest tests:")
    for seconds, name in slowest(report):
        print(f"  {seconds:8.1f} s  {name}")
    print("test-budget: make them faster (docs/testing.md) or pay the time back elsewhere")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
