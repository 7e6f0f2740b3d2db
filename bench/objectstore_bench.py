"""Benchmark: the per-epoch commit cost (decide + phase 2) with the arbitration table on a local disk and on an
S3-compatible server, in one run.

The epoch's commit is what the driver does between Spark's ``commit(messages)`` call and its return:
the decision (a Delta commit to the arbitration table: read the snapshot, put-if-absent of the next
``_delta_log`` entry) and phase 2 (``EndTxn`` of every prepared branch). The branches are real
transactional producers on the local broker, prepared before the clock starts; only the arbitration
table's place differs. The server is s3proxy (``dev/s3_server.py``) on 127.0.0.1 with its filesystem
backend, so the figure is the protocol's cost per object-store round trip, not a cloud region's latency.

Run with ``make bench`` (or ``python bench/objectstore_bench.py``; needs the broker up and
``make setup``'s s3proxy jar). BENCH_EPOCHS (default 30) epochs per place and branch count.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from common import BOOTSTRAP
from kafka.admin import KafkaAdminClient
from sink_bench import EPOCHS, WORK, commit_overhead

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dev"))
import s3_server  # dev/, stdlib only


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = Path(WORK) / "s3"
    bucket = "bench"
    s3_server.up(port, workdir, buckets=[bucket])
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    try:
        storage = {f"storage.{k}": v for k, v in s3_server.delta_storage_options(port).items()}
        places = {"local": (WORK, {}), "s3": (f"s3a://{bucket}/t", storage)}
        for where in places.values():
            commit_overhead(1, admin, *where)  # warm-up: clients, delta-rs, the server's JVM
        results = {f"{place}/{n}": commit_overhead(n, admin, *where) for n in (1, 4) for place, where in places.items()}
    finally:
        admin.close()
        s3_server.down(port, workdir)
    summary = {"epochs": EPOCHS, "server": "s3proxy 4.1.0, filesystem backend, 127.0.0.1",
               "commit_overhead_ms": results,
               "ratio_p50_s3_vs_local": {n: round(results[f"s3/{n}"]["p50_ms"] / results[f"local/{n}"]["p50_ms"], 2)
                                         for n in (1, 4)},
               "loadavg": os.getloadavg()}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
