"""A short kill soak in ``make test-soak``: ``dev/soak.py`` with a few kills over the three example links and the epoch block.

Drivers are SIGKILLed (their whole session: driver, JVM, Python daemons and workers) and executor
Python workers are SIGKILLed at seeded random times while the links run; then every link runs to its
end and the soak verifies with an independent read_committed consumer and Spark's Delta reader that
nothing was lost or duplicated, that no transaction is left open and that ``lastagent status`` is
clean. ``make soak KILLS=300 SEED=...`` runs the long one (``docs/reliability.md``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.soak

ROOT = Path(__file__).resolve().parents[2]
KILLS = 8  # 4 driver kills (one per link, round-robin) and 4 worker kills


@pytest.mark.timeout(3600)  # ~5 min on an idle 2-core machine, ~20 min when other Spark tests share it
def test_short_soak_loses_duplicates_and_leaves_open_nothing(kafka_bootstrap, tmp_path):
    report = tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "dev" / "soak.py"), "--kills", str(KILLS), "--seed", "20251124",
           "--report", str(report), "--bootstrap", kafka_bootstrap, "--workdir", str(tmp_path / "work"),
           # Small sources and short horizons: the whole soak stays within a few minutes on an idle machine.
           "--backlog-epochs", "6", "--initial-horizon", "45", "--run-timeout", "900", "--max-hours", "0.75"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3500, check=False)
    output = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert report.exists(), output
    data = json.loads(report.read_text())
    assert data["status"] == "passed" and proc.returncode == 0, output
    assert data["kills"]["total"] == KILLS, output
    assert data["kills"]["by_kind"]["driver"] > 0 and data["kills"]["by_kind"]["worker"] > 0, output
    assert all(k["driver"] + k["worker"] > 0 for k in data["kills"]["by_link"].values()), data["kills"]
    assert (data["lost"], data["duplicated"], data["unexpected"], data["open_transactions"], data["orphan_files"]) == (0, 0, 0, 0, 0)
    assert data["status_clean"] is True, data["verification"]["status_exit"]
    for link, checks in data["verification"]["links"].items():
        assert checks["source_records"] > 0 and checks["epochs_decided"] > 0, (link, checks)
    dead = data["verification"]["links"]["delta"]["dead_letters"]
    assert dead["expected"] > 0 and dead["seen"] == dead["expected"], dead  # the dead-letter path was exercised
