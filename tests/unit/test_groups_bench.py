"""bench/groups_bench.py's state curve: the stream it measures on, and the docs that report it by group size."""

from __future__ import annotations

import importlib.util
import re
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SIZES = ("1", "8", "64", "1,000")


def _bench():
    spec = importlib.util.spec_from_file_location("groups_bench", ROOT / "bench" / "groups_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_curves_stream_has_groups_of_the_size_asked_with_a_days_expiry_kept_by_copies(tmp_path):
    import pyarrow.parquet as pq

    bench = _bench()
    n, distinct = bench.write_stream(tmp_path / "s", total=6400, groups=100, rows_per_file=4000,
                                     expiry_after=bench.DAY_MS, group_expiry=True)
    assert distinct == 6400 and 6400 < n <= 6400 + 64 and len(list((tmp_path / "s").iterdir())) == 2
    rows = pq.read_table(tmp_path / "s").to_pylist()
    by_group = defaultdict(set)
    expiry = {}
    for r in rows:
        by_group[r["GroupId"]].add(r["SequenceNumber"])
        key = (r["GroupId"], r["SequenceNumber"])
        expiry.setdefault(key, r["ExpiryTime"])
        assert expiry[key] == r["ExpiryTime"]  # a copy carries its original's ExpiryTime
    assert len(by_group) == 100 and all(s == set(range(64)) for s in by_group.values())
    originals = {}
    for r in rows:
        originals.setdefault((r["GroupId"], r["SequenceNumber"]), r)
    for r in originals.values():  # a day after the first send's event time
        assert r["ExpiryTime"] == int(r["event_time"].timestamp() * 1000) + bench.DAY_MS
    latest = max(r["ExpiryTime"] for r in rows)
    assert min(r["GroupExpiryTime"] for r in rows) > latest  # never below an ExpiryTime: nothing refused


def test_the_docs_give_the_state_ratio_by_group_size():
    """docs/benchmarks.md has the curve's table, a row per measured size with both ratios; the README gives the
    ratio at each size rather than the large groups' figure alone."""
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    section = doc[doc.index("### State by group size"):]
    section = section[:section.index("\n#", 1)]
    assert "groups_bench.py --curve" in section
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| ([\d,]+) \| [\d,]+ \|.*$", section, re.M)}
    assert tuple(rows) == SIZES
    ratios = {size: re.findall(r"\*\*([\d.]+) ×\*\*", row) for size, row in rows.items()}
    assert all(len(r) == 2 for r in ratios.values()), ratios
    readme = (ROOT / "README.md").read_text()
    assert "132 × and 201 × less state" not in readme
    for size, (plain, with_expiry) in ratios.items():
        assert f"{plain} ×" in readme and f"{with_expiry} ×" in readme, (size, plain, with_expiry)
