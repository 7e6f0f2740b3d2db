"""The connector through Spark Connect: a real Connect server, clients driving it in subprocesses.

* the source: a batch read equal, row for row, to Spark's own ``kafka`` format read through the same
  client, and streams into Delta, the ``memory`` sink (read back with SQL) and ``noop``;
* ``lastagent.register(spark)`` with a Connect session;
* both sinks: Kafka → ``lastagent-delta`` (transformer, dead-letter topic, side topic), then that
  table → ``lastagent-kafka`` (through Spark's Delta source), every row exactly once by a read_committed
  consumer and a Delta read (delta-rs);
* a transformer the server cannot import fails at query start with our error, through Connect; one the
  client ships with ``spark.addArtifacts(..., pyfile=True)`` does not reach the writer's tasks (a pyspark 4.2
  limit, xfail) and fails naming the option, the module and that limit;
* recovery: the server SIGKILLed mid-stream and restarted, the client re-runs the same query on
  the same checkpoint and link: every row once, no transaction of the link left open.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from connect_server import ClientRun, finish_client, kill_group, start_client
from support import read_committed

from lastagent.kafka.xa import KafkaXAResource

pytestmark = pytest.mark.connect

SOURCE_ROWS = 20  # 14 plain records, 6 in a committed transaction (and 3 in an aborted one, never read)
SINK_ROWS = 12  # valid orders; one poison record more goes to the dead-letter topic
RELAY_ROWS, RELAY_PER_TRIGGER = 40, 10  # four epochs: the server is killed once the first is committed


def make_topic(kafka_admin: Any, partitions: int = 2, prefix: str = "connect") -> str:
    from kafka.admin import NewTopic

    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    kafka_admin.create_topics([NewTopic(name, partitions, 1)])
    return name


def produce(bootstrap: str, topic: str, records: list[tuple[str, str]], partitions: int = 2) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for i, (key, value) in enumerate(records):
        producer.produce(topic, key=key, value=value, partition=i % partitions)
    assert producer.flush(30) == 0


# --- the source, register() -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def source_run(run_client, kafka_bootstrap, kafka_admin, tmp_path_factory) -> Iterator[tuple[ClientRun, list[list[Any]]]]:
    """One client run of the source scenario over a topic with committed, transactional and aborted
    records; also yields the rows expected (key, value, topic, partition, offset) from the broker."""
    topic = make_topic(kafka_admin)
    produce(kafka_bootstrap, topic, [(f"k{i}", f"plain-{i}") for i in range(14)])
    tx = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"connect-test-{uuid.uuid4().hex[:8]}"})
    tx.init_transactions(30)
    for value_prefix, commit in (("committed", True), ("aborted", False)):
        tx.begin_transaction()
        for i in range(6 if commit else 3):
            tx.produce(topic, key=f"t{i}", value=f"{value_prefix}-{i}", partition=i % 2)
        if commit:
            tx.commit_transaction(30)
        else:
            tx.abort_transaction(30)
    expected = [[k.decode(), v.decode(), topic, p, o] for k, v, p, o in _committed_with_offsets(kafka_bootstrap, topic)]
    assert len(expected) == SOURCE_ROWS
    run = run_client("source", {"bootstrap": kafka_bootstrap, "topic": topic,
                                "workdir": str(tmp_path_factory.mktemp("connect-source"))})
    yield run, sorted(expected)


def _committed_with_offsets(bootstrap: str, topic: str) -> list[tuple[bytes, bytes, int, int]]:
    """(key, value, partition, offset) of every committed record, by an independent read_committed consumer."""
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"verify-{uuid.uuid4().hex}",
                         "isolation.level": "read_committed", "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([topic])
    rows: list[tuple[bytes, bytes, int, int]] = []
    deadline = time.monotonic() + 30
    try:
        while len(rows) < SOURCE_ROWS and time.monotonic() < deadline:
            rows += [(m.key(), m.value(), m.partition(), m.offset()) for m in consumer.consume(100, 0.2) if m.error() is None]
    finally:
        consumer.close()
    return rows


def test_source_scenario_ran(source_run):
    run, _ = source_run
    assert run.code == 0, run.explain()


def test_register_with_a_connect_session(source_run):
    """lastagent.register(spark) works with a Connect session (spark.dataSource.register is in Connect)."""
    run, _ = source_run
    assert "register" in run.result, run.explain()
    assert run.result["register"] is None, run.result["register"]


def test_batch_read_matches_spark_kafka_format(source_run):
    run, expected = source_run
    assert run.result.get("batch") == expected, run.explain()
    assert run.result["kafka_batch"] == run.result["batch"]
    assert run.result["schema"] == run.result["kafka_schema"]


def test_stream_into_delta(source_run):
    """Spark's delta sink fed by the lastagent-kafka source; the table read with delta-rs."""
    from deltalake import DeltaTable

    run, expected = source_run
    assert run.code == 0, run.explain()
    table = DeltaTable(run.result["delta_path"]).to_pyarrow_table().to_pylist()
    assert sorted([r["key"].decode(), r["value"].decode(), r["topic"], r["partition"], r["offset"]] for r in table) == expected


def test_stream_into_memory_sink(source_run):
    run, expected = source_run
    assert run.result.get("memory") == expected, run.explain()


def test_stream_into_noop(source_run):
    run, _ = source_run
    assert run.result.get("noop_rows") == SOURCE_ROWS, run.explain()


# --- both sinks ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sinks_run(run_client, kafka_bootstrap, kafka_admin, tmp_path_factory) -> tuple[ClientRun, dict[str, Any]]:
    """Kafka → lastagent-delta → (the table) → lastagent-kafka, in one client run."""
    work = tmp_path_factory.mktemp("connect-sinks")
    names = {"topic": make_topic(kafka_admin), "dead_topic": make_topic(kafka_admin, 1, "dead"),
             "side_topic": make_topic(kafka_admin, 1, "side"), "out_topic": make_topic(kafka_admin, 2, "out")}
    records = [(str(i), f"order-7-{i}") for i in range(SINK_ROWS)]
    records.insert(5, ("poison", "not-an-order"))
    produce(kafka_bootstrap, names["topic"], records)
    link = uuid.uuid4().hex[:8]
    args = {"bootstrap": kafka_bootstrap, **names, "workdir": str(work),
            "table": str(work / "orders"), "arbitration": str(work / "arbitration"),
            "delta_link": f"connect-delta-{link}", "kafka_link": f"connect-kafka-{link}"}
    return run_client("sinks", args), args


def test_sinks_scenario_ran(sinks_run):
    run, _ = sinks_run
    assert run.code == 0, run.explain()


def test_our_errors_reach_the_connect_client(sinks_run):
    """An OptionError raised in the server's Python worker at query start reaches the Connect client with our text."""
    run, _ = sinks_run
    message = run.result.get("missing_transformer")
    assert message is not None, run.explain()
    assert "option 'transformer': cannot import module 'connect_no_such_rules'" in message, message


ARTIFACT_REASON = ("pyspark 4.2 Connect: a module added with spark.addArtifacts(path, pyfile=True) is importable by the "
                   "driver's Python data source runner but not by the Python data source writer's tasks, so the "
                   "transformer fails there (install the module into the server's Python instead)")


@pytest.mark.xfail(strict=True, reason=ARTIFACT_REASON)
def test_transformer_shipped_as_session_artifact(sinks_run):
    run, _ = sinks_run
    assert run.result.get("artifact_transformer", "not run") is None, run.result.get("artifact_transformer")
    assert run.result["artifact_table"] == sorted([str(i), 1] for i in range(SINK_ROWS)) + [["poison", 1]]


def test_transformer_shipped_as_session_artifact_fails_clearly(sinks_run):
    """Until it works: the task's error names the option and the module (not a bare ModuleNotFoundError)."""
    run, _ = sinks_run
    assert "artifact_transformer" in run.result, run.explain()
    message = run.result["artifact_transformer"]
    if message is not None:
        assert "option 'transformer': cannot import module 'connect_rules'" in message, message
        assert "spark.addArtifacts does not reach a data source's tasks" in message, message


def test_kafka_to_lastagent_delta_exactly_once(sinks_run, kafka_bootstrap):
    """The table read with delta-rs (Spark's Delta source reads it in the next test); side and dead-letter
    topics by an independent read_committed consumer; no branch of the link left open."""
    from deltalake import DeltaTable

    run, args = sinks_run
    assert run.code == 0, run.explain()
    table = DeltaTable(args["table"]).to_pyarrow_table(columns=["key", "value", "amount"]).to_pylist()
    assert sorted((r["key"], r["value"], r["amount"]) for r in table) == sorted(
        (str(i), f"order-7-{i}".encode(), 7000 + i) for i in range(SINK_ROWS))
    side = read_committed(kafka_bootstrap, args["side_topic"], SINK_ROWS)
    side_keys = Counter(json.loads(v)["key"] for _, v in side)
    assert sorted(side_keys) == sorted(str(i) for i in range(SINK_ROWS)) and max(side_keys.values()) == 1, side_keys
    dead = read_committed(kafka_bootstrap, args["dead_topic"], 1)
    assert [(k, v) for k, v in dead] == [(b"poison", b"not-an-order")], dead
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        assert xa.recover(f"lastagent-{args['delta_link']}-") == []


def test_delta_to_lastagent_kafka_exactly_once(sinks_run, kafka_bootstrap):
    """The lastagent-delta table through Spark's Delta streaming source into lastagent-kafka: every row once."""
    run, args = sinks_run
    assert run.code == 0, run.explain()
    rows = read_committed(kafka_bootstrap, args["out_topic"], SINK_ROWS)
    assert Counter(rows) == Counter((str(i).encode(), f"order-7-{i}".encode()) for i in range(SINK_ROWS)), rows
    from deltalake import DeltaTable

    arbitration = DeltaTable(args["arbitration"]).to_pyarrow_table().to_pylist()
    assert arbitration and {r["link"] for r in arbitration} == {args["kafka_link"]}, arbitration
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        assert xa.recover(f"lastagent-{args['kafka_link']}-") == []


# --- lastagent.epoch in foreachBatch ----------------------------------------------------------------

MERGE_KEYS, MERGE_CHANGES, MERGE_PER_TRIGGER = 10, 60, 20  # change i sets key i % 10 to amount i


def test_foreach_batch_epoch_on_the_connect_server(connect_server, kafka_bootstrap, kafka_admin, tmp_path):
    """Two clients at once, each a query whose foreachBatch runs on the Connect server: each block makes an SQL
    MERGE and the events one epoch, on its client's own session (no block refuses the other, neither's settings
    reach the other's table); a second run of each (its own foreachBatch process, so its own run and claim)
    replays the last epoch: Delta skips it, nothing is sent again. Read back with delta-rs and a read_committed
    consumer."""
    from deltalake import DeltaTable

    clients = []
    for n in range(2):
        source, events = make_topic(kafka_admin), make_topic(kafka_admin, 2, "events")
        produce(kafka_bootstrap, source, [(str(i % MERGE_KEYS), json.dumps({"id": i % MERGE_KEYS, "amount": i}))
                                          for i in range(MERGE_CHANGES)])
        args = {"bootstrap": kafka_bootstrap, "topic": source, "events": events,
                "link": f"connect-merge-{n}-{uuid.uuid4().hex[:8]}", "table": str(tmp_path / f"orders-{n}"),
                "checkpoint": str(tmp_path / f"ckpt-{n}"), "per_trigger": MERGE_PER_TRIGGER}
        log = tmp_path / f"client-{n}.log"
        clients.append((args, log, start_client(connect_server, "merge", args, log)))
    for args, log, proc in clients:
        run = finish_client(proc, connect_server, log, 420.0)
        assert run.code == 0, run.explain()
        assert run.result["batches"] == MERGE_CHANGES // MERGE_PER_TRIGGER and run.result["replayed"] == 1, run.result
        table = DeltaTable(args["table"])
        rows = table.to_pyarrow_table().to_pylist()
        assert {r["id"]: r["amount"] for r in rows} == {k: max(i for i in range(MERGE_CHANGES) if i % MERGE_KEYS == k)
                                                         for k in range(MERGE_KEYS)}
        assert len({r["sk"] for r in rows}) == MERGE_KEYS  # identity values from Spark's writer
        history = [json.loads(c["userMetadata"])["lastagent"] for c in table.history() if c.get("userMetadata")]
        assert {h["link"] for h in history} == {args["link"]}, history  # the other client's block never reached it
        merges = sorted(h["epoch"] for h in history if h.get("branches"))
        assert merges == [0, 1, 2], history  # the replayed epoch made no second commit
        claims = [h["claim"]["run"] for h in history if "claim" in h]
        assert len(claims) == 2 and len(set(claims)) == 2 and all(r.startswith("connect-") for r in claims), claims
        sent = read_committed(kafka_bootstrap, args["events"], MERGE_CHANGES)
        assert sorted(json.loads(v)["amount"] for _, v in sent) == list(range(MERGE_CHANGES))
        with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
            assert xa.recover(f"lastagent-{args['link']}-") == []


def test_foreach_batch_epoch_beside_another_query_of_the_same_client_is_refused(run_client, kafka_bootstrap,
                                                                               kafka_admin, tmp_path):
    """On Connect the batch's session is the client's, which its other queries write through too: the block
    refuses by name while the session runs another query, before it writes anything."""
    from deltalake import DeltaTable

    source, events = make_topic(kafka_admin), make_topic(kafka_admin, 2, "events")
    produce(kafka_bootstrap, source, [("1", json.dumps({"id": 1, "amount": 1}))])
    args = {"bootstrap": kafka_bootstrap, "topic": source, "events": events,
            "link": f"connect-beside-{uuid.uuid4().hex[:8]}", "table": str(tmp_path / "orders"),
            "checkpoint": str(tmp_path / "ckpt")}
    run = run_client("merge_beside", args)
    assert run.code == 0, run.explain()
    error = run.result["error"] or ""
    assert "on Spark Connect the block's Delta settings are session-wide" in error and "beside" in error, error
    table = DeltaTable(args["table"])
    assert [c["operation"] for c in table.history()] == ["CREATE TABLE"] and table.to_pyarrow_table().num_rows == 0
    assert read_committed(kafka_bootstrap, events, 1, timeout_s=5) == []


# --- recovery after the server is killed -----------------------------------------------------------


def _committed_epochs(checkpoint: Path) -> int:
    commits = checkpoint / "commits"
    return len([p for p in commits.iterdir() if p.name.isdigit()]) if commits.is_dir() else 0


def test_recovery_after_server_kill(connect_server, kafka_bootstrap, kafka_admin, tmp_path):
    """kill -9 of the Connect server (its JVM and Python workers) after the first epoch, restart on the
    same port, the same query again on the same checkpoint and link: every row once, nothing open."""
    source, out = make_topic(kafka_admin), make_topic(kafka_admin, 2, "relay-out")
    produce(kafka_bootstrap, source, [(str(i), f"r{i}") for i in range(RELAY_ROWS)])
    link = f"connect-relay-{uuid.uuid4().hex[:8]}"
    checkpoint = tmp_path / "ckpt"
    args = {"bootstrap": kafka_bootstrap, "topic": source, "out_topic": out, "link": link, "per_trigger": RELAY_PER_TRIGGER,
            "checkpoint": str(checkpoint), "arbitration": str(tmp_path / "arbitration")}
    epochs = RELAY_ROWS // RELAY_PER_TRIGGER

    first = start_client(connect_server, "relay", args, tmp_path / "first.log")
    try:
        # Once an epoch is committed, kill while a later epoch's branches are open (prepared or being
        # written), or at the latest when all but the last epoch are committed.
        with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
            deadline = time.monotonic() + 180
            while first.poll() is None and time.monotonic() < deadline:
                done = _committed_epochs(checkpoint)
                if done >= epochs - 1 or (done >= 1 and xa.recover(f"lastagent-{link}-")):
                    break
                time.sleep(0.1)
            connect_server.kill()
            done = _committed_epochs(checkpoint)
            open_at_kill = xa.recover(f"lastagent-{link}-")
    finally:
        kill_group(first)  # the client of a dead server (it would retry for minutes)
    log = (tmp_path / "first.log").read_text(errors="replace")
    assert 1 <= done < epochs, (f"the kill did not land mid-stream ({done} of {epochs} epochs committed)\n"
                                f"--- first client ---\n{log[-4000:]}\n{connect_server.tail()}")
    print(f"killed after {done} of {epochs} epochs; branches of the link left open: {len(open_at_kill)}")

    connect_server.start()
    again = finish_client(start_client(connect_server, "relay", args, tmp_path / "again.log"), connect_server,
                          tmp_path / "again.log", 300)
    assert again.code == 0, again.explain()
    rows = read_committed(kafka_bootstrap, out, RELAY_ROWS)
    counts = Counter(v for _, v in rows)
    assert sorted(counts) == sorted(f"r{i}".encode() for i in range(RELAY_ROWS)), f"lost rows ({len(counts)} of {RELAY_ROWS})"
    assert max(counts.values()) == 1, f"duplicates: {[k for k, c in counts.items() if c > 1][:10]}"
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        assert xa.recover(f"lastagent-{link}-") == []
