"""lastagent.reliable_groups on real Kafka and real Spark, micro-batch by micro-batch: the time rules and the
parameter refusals as the step applies them, where a batch boundary or Spark's timers decide what the rules see.

A query reads a topic with ``lastagent-kafka`` (headers on), runs the step and writes to Spark's memory sink on
a short processing-time trigger; the test sends messages as a producer would and waits (bounded) for each
micro-batch by a marker message of its own. Spark's state server logs what the operator does to the state
store; a healthy run logs no warning, so the tests also read its log.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from lastagent import reliable_groups
from lastagent.groups.step import REFUSED_REASON, REFUSED_RULE, ROCKSDB

pytestmark = pytest.mark.integration

PROVIDER = "spark.sql.streaming.stateStore.providerClass"
#: The JVM side of the step's state calls (Spark 4.x): where a state call that Spark finds wrong is logged.
STATE_SERVER = "org.apache.spark.sql.execution.python.streaming.TransformWithStateInPySparkStateServer"
FAR = 30 * 60 * 1000  # an ExpiryTime that never passes during a test (ms after now)


@pytest.fixture
def rocksdb(spark) -> Iterator[None]:
    """The session's state store is RocksDB for one test, then as it was."""
    old = spark.conf.get(PROVIDER, None)
    spark.conf.set(PROVIDER, ROCKSDB)
    yield
    if old is None:
        spark.conf.unset(PROVIDER)
    else:
        spark.conf.set(PROVIDER, old)


@pytest.fixture
def state_server_log(spark) -> Iterator[Callable[[], str]]:
    """What Spark's state server logs at WARN and above during the test (an appender on its logger)."""
    jvm = spark.sparkContext._jvm
    log4j = jvm.org.apache.logging.log4j
    writer = jvm.java.io.StringWriter()
    layout = log4j.core.layout.PatternLayout.newBuilder().withPattern("%p %c: %m%n").build()
    appender = log4j.core.appender.WriterAppender.createAppender(layout, None, writer, f"test-{uuid.uuid4().hex}",
                                                                  False, True)
    appender.start()
    logger = log4j.LogManager.getLogger(STATE_SERVER)
    old_level = logger.getLevel()
    log4j.core.config.Configurator.setLevel(STATE_SERVER, log4j.Level.WARN)
    logger.addAppender(appender)
    yield lambda: str(writer.toString())
    logger.removeAppender(appender)
    log4j.core.config.Configurator.setLevel(STATE_SERVER, old_level)
    appender.stop()


def warnings(log: str) -> list[str]:
    """The warnings of the state server's log but one: Spark logs "No more data to read from the socket" once as
    a query starts (its Python runner that reads the processor's state schemas closes the socket)."""
    return [line for line in log.splitlines() if line.startswith("WARN") and "No more data to read" not in line]


class Groups:
    """A topic, a producer of WS-Reliability headers, and the step's query into a memory sink."""

    def __init__(self, spark, bootstrap: str, topic: str, tmp_path) -> None:
        from confluent_kafka import Producer

        self.spark, self.topic = spark, topic
        self.producer = Producer({"bootstrap.servers": bootstrap})
        self.name = f"groups_{uuid.uuid4().hex[:8]}"
        df = (spark.readStream.format("lastagent-kafka")
              .options(**{"kafka.bootstrap.servers": bootstrap, "subscribe": topic, "startingOffsets": "earliest",
                          "includeHeaders": "true"}).load())
        self.query = (reliable_groups(df).writeStream.format("memory").queryName(self.name)
                      .option("checkpointLocation", str(tmp_path / f"ckpt-{self.name}"))
                      .trigger(processingTime="500 milliseconds").start())

    def send(self, group: str, seq: int | None, expiry: int, value: str | None = None, **more: object) -> None:
        headers = [("GroupId", group), ("ExpiryTime", str(expiry)), *([] if seq is None else [("SequenceNumber",
                                                                                               str(seq))]),
                   *((k, str(v)) for k, v in more.items())]
        self.producer.produce(self.topic, value=(value or f"{group}/{seq}").encode(),
                              headers=[(k, v.encode()) for k, v in headers])
        assert self.producer.flush(30) == 0

    def rows(self) -> list[tuple[str, str | None, str | None]]:
        """(value, refused rule, reason) of every row the step output so far."""
        return [(bytes(r.value).decode(), r[REFUSED_RULE], r[REFUSED_REASON])
                for r in self.spark.table(self.name).collect()]

    def wait_for(self, what: str, check: Callable[[list], bool], timeout_s: float = 90,
                 tick: Callable[[], None] | None = None) -> list:
        """Polls the output until ``check`` holds (``tick`` between polls); fails after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.query.exception() is not None:
                pytest.fail(f"the query failed while waiting for {what}: {self.query.exception()}")
            rows = self.rows()
            if check(rows):
                return rows
            if tick is not None:
                tick()
            time.sleep(0.5)
        pytest.fail(f"no {what} after {timeout_s} s; the output: {self.rows()}")

    def batch(self, label: str) -> list:
        """Sends a marker singleton after what was sent, and waits for the micro-batch that carries it."""
        marker = f"marker-{label}"
        self.send(marker, None, now_ms() + FAR, value=marker)
        return self.wait_for(f"the micro-batch of {marker}", lambda rows: any(v == marker for v, _, _ in rows))

    def stop(self) -> None:
        self.query.stop()


def now_ms() -> int:
    return int(time.time() * 1000)


@pytest.fixture
def groups(spark, rocksdb, kafka_bootstrap, new_topic, tmp_path) -> Iterator[Groups]:
    g = Groups(spark, kafka_bootstrap, new_topic(prefix="reliable"), tmp_path)
    try:
        yield g
    finally:
        g.stop()


def test_a_held_message_expiring_before_its_groups_expiry_is_refused_t5(groups, state_server_log):
    """An ordered group with a GroupExpiryTime: message 2 is held (1 never comes), and its ExpiryTime passes
    before the group's. No micro-batch runs between the two times, so Spark's timer fires after both: the rules
    must still name t5 ("in an ordered group, a message expires before delivery"), whose event came first."""
    held_s, group_s = 12, 18  # the held message expires, then the group, this long after they are sent
    groups.batch("warm")  # the query and its Python workers are up: the next micro-batch is quick
    t0 = now_ms()
    groups.send("o", 0, t0 + group_s * 1000, GroupExpiryTime=t0 + group_s * 1000, Ordered="true")
    groups.send("o", 2, t0 + held_s * 1000, GroupExpiryTime=t0 + group_s * 1000, Ordered="true")
    rows = groups.batch("sent")
    assert ("o/0", None, None) in rows
    assert not any(v == "o/2" for v, _, _ in rows), f"o/2 must be held, not {rows}; was the machine too slow?"
    # Nothing arrives until both times passed: no micro-batch, no timer.
    time.sleep(max(0.0, (t0 + group_s * 1000 + 1000 - now_ms()) / 1000))
    ticks = iter(range(1000))  # the clock moves with micro-batches that carry rows: a singleton per poll

    def tick() -> None:
        k = next(ticks)
        groups.send(f"tick-{k}", None, now_ms() + FAR, value=f"tick-{k}")

    rows = groups.wait_for("o/2's refusal", lambda rows: any(v == "o/2" for v, _, _ in rows), tick=tick)
    refused = [(rule, reason) for v, rule, reason in rows if v == "o/2"]
    assert len(refused) == 1 and refused[0][0] == "t5", refused
    assert "terminated (t5)" in refused[0][1]
    assert warnings(state_server_log()) == []


def test_copies_of_a_refused_message_are_refused_whatever_arrives_between(groups, state_server_log):
    """Message 1 of each group carries a GroupExpiryTime below its own ExpiryTime: INVALID_GROUP_PARAMETER. In
    group b it arrives before 2 (whose value the group then uses) and a copy after it, each in its own
    micro-batch; in group c, 2 comes first. Every copy of either message 1 must be refused alike."""
    t0 = now_ms()
    group_expiry = t0 + 2 * FAR
    low = t0 + FAR // 2  # message 1's own GroupExpiryTime, below its ExpiryTime (t0 + FAR)
    groups.send("b", 0, t0 + FAR, GroupExpiryTime=group_expiry)
    groups.send("b", 1, t0 + FAR, GroupExpiryTime=low)
    groups.send("c", 0, t0 + FAR, GroupExpiryTime=group_expiry)
    groups.send("c", 2, t0 + FAR, GroupExpiryTime=group_expiry)
    groups.batch("first")
    groups.send("b", 2, t0 + FAR, GroupExpiryTime=group_expiry)
    groups.send("c", 1, t0 + FAR, GroupExpiryTime=low)
    groups.batch("second")
    groups.send("b", 1, t0 + FAR, GroupExpiryTime=low)  # the producer's retry: the same message again
    groups.send("c", 1, t0 + FAR, GroupExpiryTime=low)
    rows = groups.batch("third")
    out = sorted(((v, rule) for v, rule, _ in rows if not v.startswith("marker-")), key=lambda r: (r[0], r[1] or ""))
    assert out == [("b/0", None), ("b/1", "INVALID_GROUP_PARAMETER"), ("b/1", "INVALID_GROUP_PARAMETER"),
                   ("b/2", None), ("c/0", None), ("c/1", "INVALID_GROUP_PARAMETER"),
                   ("c/1", "INVALID_GROUP_PARAMETER"), ("c/2", None)], out
    assert warnings(state_server_log()) == []
