"""Where make test's time goes: per tier and the slowest tests, from the JUnit XML that make test writes.

    python dev/test_times.py .cache/test-times.xml [--slowest 20]

Prints two Markdown tables (as docs/testing.md shows them): per tier (tests/<tier>/), the number of tests and the
sum of their durations (setup, call and teardown: the work one worker does serially), and the slowest tests. With
two workers the wall time is about half the sum plus the longest file's imbalance; pytest prints the wall time.
Stdlib only.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict


def _cases(path: str) -> list[tuple[str, float]]:
    """(test id, seconds) of every test case in the report."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        out.append((f"{module}.py::{case.get('name')}", float(case.get("time", "0"))))
    return out


def _tier(test_id: str) -> str:
    parts = test_id.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report")
    parser.add_argument("--slowest", type=int, default=20)
    args = parser.parse_args()
    cases = _cases(args.report)
    tiers: dict[str, list[float]] = defaultdict(list)
    for test_id, seconds in cases:
        tiers[_tier(test_id)].append(seconds)
    print("| tier | tests | sum of durations |\n|---|---:|---:|")
    for tier, times in sorted(tiers.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {tier} | {len(times)} | {sum(times) / 60:.1f} min |")
    print(f"| all | {len(cases)} | {sum(t for _, t in cases) / 60:.1f} min |\n")
    print("| test | seconds |\n|---|---:|")
    for test_id, seconds in sorted(cases, key=lambda c: -c[1])[:args.slowest]:
        print(f"| `{test_id}` | {seconds:.1f} |")


if __name__ == "__main__":
    main()
