"""Many queries starting at once against a fresh cluster: no process dies in librdkafka.

On a cluster whose ``__consumer_offsets`` does not exist yet, the group coordinator answers
``NOT_COORDINATOR`` for a while. librdkafka's admin client (2.16.x, librdkafka#5040) crashes its
process on that answer to an OffsetFetch (``rdk:main: segfault at 58``, in ``rd_kafka_cgrp_op``):
the source used one at every query start, and Spark saw the source's Python runner die
(``EOFException`` in ``PythonStreamingSourceRunner.init``); 28 of 30 plain processes doing the
source's start crashed so, and 2 of 3 two-query starts. Its DescribeGroups on the same admin client
aborted 2 of 8 starts in CI (``Assertion `eonce->refcnt > 0' failed``, -6), so the source asks group
coordinators through kafka-python only. Each test here takes a cluster of its own,
never used before.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import kafka_broker
import pytest
import support
from support import free_ports, read_committed, replicated_topic

pytestmark = pytest.mark.kafka_cluster

#: What a source does at query start (KafkaStreamReader: partitions, the group access check) and what
#: startingOffsets=group reads, in a process of its own, as Spark's source runner does.
SOURCE_START = """
import sys
from lastagent.sources.kafka_offsets import OffsetReader
from lastagent.sources.kafka_source_options import KafkaSourceOptions
bootstrap, topic, group = sys.argv[1:]
reader = OffsetReader(KafkaSourceOptions.parse({"kafka.bootstrap.servers": bootstrap, "subscribe": topic,
                                                "kafka.group.id": group}))
tps = reader.partitions(must_exist=True)
reader.require_group_access()
print(len(tps), reader.group_offsets(tps))
"""


@pytest.fixture
def fresh_cluster(tmp_path):
    cluster = kafka_broker.Cluster(free_ports(2 * kafka_broker.CLUSTER_NODES), tmp_path / "fresh")
    cluster.up()
    yield cluster
    cluster.down()


def test_eight_source_starts_at_once_on_a_fresh_cluster_all_live(fresh_cluster):
    topic = replicated_topic(fresh_cluster, 2, "fresh")
    procs = [subprocess.Popen([sys.executable, "-c", SOURCE_START, fresh_cluster.bootstrap, topic, f"g-{i}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(8)]
    results = [(p.wait(timeout=180), *p.communicate()) for p in procs]
    died = [(code, err.strip().splitlines()[-1:] if err else "") for code, _, err in results if code != 0]
    assert died == [], f"source starts that failed (-11, -6: librdkafka killed the process): {died}"
    assert all(out.startswith("2 {}") for _, out, _ in results)  # two partitions, no group offsets yet


def test_two_queries_start_at_once_on_a_fresh_cluster_and_copy_everything(fresh_cluster, tmp_path):
    from confluent_kafka import Producer

    sources = [replicated_topic(fresh_cluster, 2, "source") for _ in range(2)]
    copies = [replicated_topic(fresh_cluster, 2, "copy") for _ in range(2)]
    producer = Producer({"bootstrap.servers": fresh_cluster.bootstrap})
    for topic in sources:
        for i in range(200):
            producer.produce(topic, key=str(i).encode(), value=str(i).encode(), partition=i % 2)
    assert producer.flush(60) == 0
    drivers = []
    for n, (source, copy) in enumerate(zip(sources, copies)):
        state = tmp_path / f"driver-{n}"
        drivers.append((support.start_driver(
            "kafka-driver", [fresh_cluster.bootstrap, source, str(tmp_path / f"ckpt-{n}"), str(tmp_path / f"arb-{n}"),
                             f"fresh-{n}-{uuid.uuid4().hex[:6]}", copy, "100"], None, state), state))
    for proc, state in drivers:
        code = proc.wait(timeout=600)
        log = Path(f"{state}.log")
        assert code == 0, f"a query failed at start (exit {code}); see {log}"
    for copy in copies:
        counts = Counter(int(k) for k, _ in read_committed(fresh_cluster.bootstrap, copy, 200, 120))
        assert sorted(counts) == list(range(200)) and max(counts.values()) == 1
