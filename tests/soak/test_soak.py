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


def test_a_stopped_soak_finishes_the_decided_branches_and_leaves_the_others(kafka_bootstrap, new_topic, tmp_path):
    """An interruption stops the running driver like a driver kill; the pause before a resume may outlast the
    branches' transaction timeout, so the soak commits what a kept decision names (and nothing else) first."""
    import types
    import uuid

    sys.path.insert(0, str(ROOT / "dev"))
    import soak

    from lastagent.core.arbitration import ArbitrationRecord
    from lastagent.delta.arbitration_table import DeltaArbitrationStore
    from lastagent.kafka.branch import BranchWriter
    from lastagent.kafka.xa import KafkaXAResource

    topic, link, arb = new_topic(), f"soak-{uuid.uuid4().hex[:6]}", str(tmp_path / "arb")
    handles = []
    for branch in range(3):
        w = BranchWriter({"bootstrap.servers": kafka_bootstrap}, f"lastagent-{link}-1-{branch}-0", 600_000)
        w.send(topic, f"b{branch}".encode())
        handles.append(w.prepare())
    store = DeltaArbitrationStore(arb)
    store.decide(ArbitrationRecord(link, 0, f"{link}:0", tuple(h.to_json() for h in handles[:2])),
                 store.claim(link, "q").generation)  # branch 2: no decision names it
    runner = types.SimpleNamespace(bootstrap=kafka_bootstrap, _where=lambda _link: ["--arbitration-table", arb])
    stopped = soak.Link("kafka", link, [kafka_bootstrap, "", "", arb], tmp_path / "arb" / "_delta_log", 1)
    assert soak.Soak.finish_decided(runner, stopped) == [h.transactional_id for h in handles[:2]]
    assert soak.Soak.finish_decided(runner, stopped) == []  # nothing decided is left open
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        assert [t.transactional_id for t in xa.recover(f"lastagent-{link}-")] == [handles[2].transactional_id]
        xa.rollback(handles[2])
