"""What the pre-decision check costs: ``Committer.commit`` with and without it, same broker, same run.

Before an epoch is decided, the driver asks the broker once (DescribeTransactions, one request per
transaction coordinator) whether every prepared branch is still open with enough of its timeout
left. This runs ``sink_bench.commit_overhead`` (decide in the arbitration Delta table, phase 2,
roll back others; BENCH_EPOCHS epochs, default 30) at 1, 4 and 16 branches, alternating the
committer as shipped with one whose check is switched off (the code before the check), three
rounds each, and prints p50/p95 ms (medians over the rounds) as JSON.

Run with `make bench` (or `cd bench && python commit_check.py` with a broker up: `make kafka-up`).
"""

from __future__ import annotations

import json
import statistics
import sys

from common import BOOTSTRAP
from kafka.admin import KafkaAdminClient
from sink_bench import commit_overhead

from lastagent.core.committer import Committer

ROUNDS = 3


def main() -> int:
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    checked = Committer._refuse_unless_decidable
    runs: dict[str, dict[int, list[dict[str, float]]]] = {"with_check": {}, "without_check": {}}
    for _ in range(ROUNDS):
        for name in ("without_check", "with_check"):
            Committer._refuse_unless_decidable = checked if name == "with_check" else (lambda *a, **k: None)
            for n in (1, 4, 16):
                runs[name].setdefault(n, []).append(commit_overhead(n, admin))
    Committer._refuse_unless_decidable = checked
    summary = {name: {n: {k: round(statistics.median(r[k] for r in rs), 1) for k in ("p50_ms", "p95_ms")}
                      for n, rs in by_n.items()} for name, by_n in runs.items()}
    summary["added_p50_ms"] = {n: round(summary["with_check"][n]["p50_ms"] - summary["without_check"][n]["p50_ms"], 1)
                               for n in (1, 4, 16)}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
