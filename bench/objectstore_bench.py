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
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from common import BOOTSTRAP, new_topic
from kafka.admin import KafkaAdminClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dev"))
import s3_server  # noqa: E402  (dev/, stdlib only)

from lastagent.committer import Committer  # noqa: E402
from lastagent.kafka_xa import BranchWriter  # noqa: E402
from lastagent.sinks.kafka_sink_options import KafkaSinkOptions  # noqa: E402

EPOCHS = int(os.environ.get("BENCH_EPOCHS", "30"))
WORK = tempfile.mkdtemp(prefix="lastagent-bench-s3-")


def overhead(arbitration: str, storage: dict[str, str], branches: int, admin: KafkaAdminClient) -> dict[str, float]:
    """p50/p95 ms of Committer.commit per epoch with the arbitration table at ``arbitration``."""
    topic = new_topic(admin, 4)
    link = f"bench-s3-{uuid.uuid4().hex[:6]}"
    options = KafkaSinkOptions.parse({
        "kafka.bootstrap.servers": BOOTSTRAP, "link": link, "checkpointLocation": WORK,
        "arbitrationTable": f"{arbitration}/arb-{link}", "arbitrationCleanupEvery": "1000000", **storage,
    })
    times = []
    with Committer(options) as committer:
        generation = committer.start(owner="bench")[0].generation
        for epoch in range(EPOCHS):
            handles = []
            for b in range(branches):
                w = BranchWriter(options.client_config, options.transactional_id(generation, b, 0),
                                 options.transaction_timeout_ms)
                w.send(topic, b"v", key=str(b).encode())
                handles.append(w.prepare())
            start = time.perf_counter()
            committer.commit(epoch, generation, handles)
            times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return {"p50_ms": round(statistics.median(times), 1), "p95_ms": round(times[int(len(times) * 0.95) - 1], 1)}


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
            overhead(*where, 1, admin)  # warm-up: clients, delta-rs, the server's JVM
        results = {f"{place}/{n}": overhead(*where, n, admin) for n in (1, 4) for place, where in places.items()}
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
