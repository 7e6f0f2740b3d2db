"""Reliable groups on real Spark and Kafka: an at-least-once producer, the driver SIGKILLed and restarted.

The producer sends groups (unordered and ordered, with and without termination parameters) and
singletons, re-sends a quarter of its messages, and sends everything shuffled over two partitions,
so groups arrive out of order and across micro-batches. The query (``lastagent-kafka`` → the step →
``lastagent-delta`` with a dead-letter table, processing-time trigger) is killed right after the
Delta commit of an epoch, then restarted. While it runs, short-lived groups make the time rules fire:
t1 (GroupExpiryTime: terminated and removed), t2 (GroupMaxIdleDuration: terminated, state kept for
duplicates), t5 (an ordered group's held message expires) and a singleton's removal at its
ExpiryTime; then a late message, a duplicate of a kept group and a copy of a removed group's
message (expired) arrive.

Checked independently: Spark's Delta reader finds every (group, sequence number) that should be
delivered exactly once, and nothing else; the Delta log's order of commits and rows has every
ordered group in sequence order; the dead-letter table has each refusal once with its rule; the
query's observed metrics count the duplicates, terminations and removals; and Spark's state reader
shows the state of removed groups gone and of terminated-but-kept groups still there.
"""

from __future__ import annotations

import json
import random
import signal
import time
import uuid
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import support

from lastagent.groups.step import kept_groups

pytestmark = pytest.mark.chaos

LONG = 30 * 60 * 1000  # an ExpiryTime far enough never to matter during the test (ms)
SHORT = 30_000  # the time rules of the short-lived groups fire this long after they are sent (ms)


def headers(group: str, seq: int | None, expiry: int, **more: object) -> list[tuple[str, bytes]]:
    out = [("GroupId", group), ("ExpiryTime", str(expiry))]
    if seq is not None:
        out.append(("SequenceNumber", str(seq)))
    out += [(k, str(v)) for k, v in more.items() if v is not None]
    return [(k, v.encode()) for k, v in out]


class Sender:
    """An at-least-once producer: every send also goes to a log, so the test knows what it sent."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import Producer

        self.producer, self.topic, self.n = Producer({"bootstrap.servers": bootstrap}), topic, 0

    def send(self, group: str, seq: int | None, expiry: int, **more: object) -> None:
        value = f"{group}/{'-' if seq is None else seq}".encode()
        self.producer.produce(self.topic, key=group.encode(), value=value, partition=self.n % 2,
                              headers=headers(group, seq, expiry, **more))
        self.n += 1

    def flush(self) -> None:
        assert self.producer.flush(30) == 0


def first_phase(sender: Sender, now: int, rng: random.Random) -> tuple[set[tuple[str, str]], list[str], int]:
    """Groups and singletons with long expiries, shuffled, a quarter re-sent. Returns the (group, seq) pairs
    to deliver, the ordered groups, and the number of re-sent copies (each one a duplicate)."""
    sends: list[tuple[str, int | None, dict]] = []
    deliver: set[tuple[str, str]] = set()
    ordered: list[str] = []
    for g in range(15):
        params = [{}, {"GroupMaxIdleDuration": "PT30M"}, {"GroupExpiryTime": now + 2 * LONG}][g % 3]
        for seq in range(8):
            sends.append((f"u{g}", seq, {"Status": "start" if seq == 0 else "end" if seq == 7 else None, **params}))
            deliver.add((f"u{g}", str(seq)))
    for g in range(5):
        ordered.append(f"o{g}")
        for seq in range(8):
            sends.append((f"o{g}", seq, {"Status": "end" if seq == 7 else None, "Ordered": "true"}))
            deliver.add((f"o{g}", str(seq)))
    for s in range(10):
        sends.append((f"s{s}", None, {}))
        deliver.add((f"s{s}", "-"))
    rng.shuffle(sends)
    resent = rng.sample(sends, len(sends) // 4)
    for r in resent:
        sends.insert(rng.randrange(sends.index(r) + 1, len(sends) + 1), r)
    for group, seq, more in sends:
        sender.send(group, seq, now + LONG, **more)
    # Refused on arrival: both termination parameters; a sequence number that is not one.
    sender.send("bad-params", 0, now + LONG, GroupExpiryTime=now + 2 * LONG, GroupMaxIdleDuration="PT1M")
    sender.producer.produce(sender.topic, value=b"bad-seq", partition=0,
                            headers=[("GroupId", b"bad-seq"), ("SequenceNumber", b"x"), ("ExpiryTime", b"1")])
    sender.flush()
    return deliver, ordered, len(resent)


def second_phase(sender: Sender, now: int) -> set[tuple[str, str]]:
    """Short-lived groups whose time rules fire within SHORT; the (group, seq) pairs to deliver."""
    for seq in range(3):  # t1 at now+SHORT: terminated and removed at once
        sender.send("x-t1", seq, now + SHORT - 5000, GroupExpiryTime=now + SHORT)
    for seq in range(2):  # t2 after 5 s idle: terminated, kept until max(ExpiryTime)
        sender.send("x-t2", seq, now + LONG, GroupMaxIdleDuration="5000")
    sender.send("x-t5", 0, now + LONG, Ordered="true")  # delivered
    sender.send("x-t5", 2, now + SHORT, Ordered="true")  # held for 1, which never comes: t5 at now+SHORT
    sender.send("x-single", None, now + SHORT)  # removed at its ExpiryTime
    sender.flush()
    return {("x-t1", "0"), ("x-t1", "1"), ("x-t1", "2"), ("x-t2", "0"), ("x-t2", "1"), ("x-t5", "0"),
            ("x-single", "-")}


def third_phase(sender: Sender, now: int) -> None:
    sender.send("x-t2", 3, now + LONG)  # late: x-t2 was terminated (t2) and this is no start
    sender.send("x-t2", 1, now + LONG)  # a duplicate: x-t2's state is kept
    sender.send("x-t1", 1, now - 1000)  # x-t1's state is gone; its copy expired (as the original's time said)
    sender.flush()


class Ticks:
    """A live topic's traffic: the step's clock moves with micro-batches that carry rows, so while the test
    waits for a time rule, a singleton goes out every two seconds (each one to be delivered once)."""

    def __init__(self, sender: Sender) -> None:
        self.sender, self.sent, self.last = sender, set(), 0.0

    def __call__(self) -> None:
        if time.monotonic() - self.last >= 2:
            self.last = time.monotonic()
            group = f"tick-{len(self.sent)}"
            self.sender.send(group, None, int(time.time() * 1000) + LONG)
            self.sender.flush()
            self.sent.add((group, "-"))


def wait_for(what: str, check, proc, log: Path, timeout_s: float = 240, tick=None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the driver ended (exit {proc.returncode}) while waiting for {what}; see {log}")
        if check():
            return
        if tick is not None:
            tick()
        time.sleep(1)
    pytest.fail(f"no {what} after {timeout_s} s; see {log}")


def delta_rows_in_commit_order(table: Path) -> list[tuple[str, str]]:
    """(group, seq) of every row, in the order of the Delta log's commits and each file's rows."""
    out = []
    for version in sorted((table / "_delta_log").glob("*.json")):
        for line in version.read_text().splitlines():
            add = json.loads(line).get("add")
            if add:
                for value in pq.read_table(table / add["path"], columns=["value"]).column("value").to_pylist():
                    group, _, seq = value.decode().partition("/")
                    out.append((group, seq))
    return out


def dead_letter_rules(spark, path: Path) -> Counter:
    if not (path / "_delta_log").exists():
        return Counter()
    rows = spark.read.format("delta").load(str(path)).select("value", "reason").collect()
    return Counter((bytes(r.value).decode(), r.reason) for r in rows)


def test_reliable_groups_once_in_order_with_a_killed_driver(spark, kafka_bootstrap, new_topic, tmp_path):
    rng = random.Random(1207)
    topic = new_topic(partitions=2, prefix="groups")
    table, dead, ckpt = tmp_path / "table", tmp_path / "dead", tmp_path / "ckpt"
    stop, metrics, state = tmp_path / "stop", tmp_path / "metrics.jsonl", tmp_path / "crash"
    log = state.with_suffix(".log")
    args = [kafka_bootstrap, topic, str(table), str(ckpt), f"groups-{uuid.uuid4().hex[:6]}", str(dead), str(stop),
            str(metrics)]
    sender = Sender(kafka_bootstrap, topic)
    deliver, ordered, resent = first_phase(sender, int(time.time() * 1000), rng)

    # The driver is killed right after the Delta commit of its third epoch, then restarted.
    state.write_text("0")
    killed = support.start_driver("groups-driver", args, "after_arbitration:3", state)
    assert killed.wait(timeout=300) == -signal.SIGKILL, f"the driver was not killed; see {log}"
    assert Path(str(state) + ".fired").read_text() == "after_arbitration"
    proc = support.start_driver("groups-driver", args, None, state)
    try:
        wait_for("first phase in the table", lambda: len(set(delta_rows_in_commit_order(table))) >= len(deliver),
                 proc, log)
        deliver |= second_phase(sender, int(time.time() * 1000))
        ordered.append("x-t5")
        ticks = Ticks(sender)
        wait_for("t5's refusal in the dead letters",
                 lambda: dead_letter_rules(spark, dead)[("x-t5/2", "t5")] == 1, proc, log,
                 timeout_s=SHORT / 1000 + 120, tick=ticks)
        third_phase(sender, int(time.time() * 1000))
        wait_for("the third phase's refusals", lambda: {("x-t2/3", "late"), ("x-t1/1", "expired")}
                 <= set(dead_letter_rules(spark, dead)), proc, log, tick=ticks)
        wait_for("every tick in the table", lambda: ticks.sent <= set(delta_rows_in_commit_order(table)), proc, log)
        deliver |= ticks.sent
    finally:
        stop.touch()
        code = proc.wait(timeout=120)
    assert code == 0, f"the driver failed; see {log}"

    # Every message to deliver once, in Spark's Delta reader; ordered groups in order in the Delta log.
    got = Counter((bytes(r.value).decode().partition("/")[0], bytes(r.value).decode().partition("/")[2])
                  for r in spark.read.format("delta").load(str(table)).select("value").collect())
    assert set(got) == deliver, f"missing {sorted(deliver - set(got))}, unexpected {sorted(set(got) - deliver)}"
    assert [k for k, n in got.items() if n > 1] == [], "delivered more than once"
    order = delta_rows_in_commit_order(table)
    for group in ordered:
        seqs = [int(s) for g, s in order if g == group]
        assert seqs == sorted(seqs), f"ordered group {group} was delivered as {seqs}"

    # Each refusal once, with its rule.
    assert dead_letter_rules(spark, dead) == Counter({
        ("bad-params/0", "INVALID_GROUP_PARAMETER"): 1, ("bad-seq", "invalid-message"): 1, ("x-t5/2", "t5"): 1,
        ("x-t2/3", "late"): 1, ("x-t1/1", "expired"): 1})

    # The observed metrics: a replayed batch reports what its first run did; the counts add up.
    per_batch: dict[int, dict] = {}
    for line in metrics.read_text().splitlines():
        report = json.loads(line)
        m = report["metrics"].get("lastagent_reliable_groups")
        if m is None:
            continue
        assert per_batch.setdefault(report["batchId"], m) == m, f"batch {report['batchId']} counted differently"
    total = Counter()
    for m in per_batch.values():
        total.update(m)
    assert total["duplicate"] == resent + 1  # every re-sent copy, and x-t2's duplicate
    assert total["refused"] == 5
    # u* and o* end complete (t3.1/t4.1), x-t1 by t1, x-t2 by t2, x-t5 by t5.
    assert total["terminated"] == 15 + 5 + 3
    assert total["removed"] == 2  # x-t1 (t1 removes at once) and x-single at its ExpiryTime

    # Spark's state reader: removed groups are gone; a terminated group kept for duplicates is there.
    assert spark.streams is not None  # the reader needs the session's state store coordinator, made with its stream manager
    keys = set(kept_groups(spark, str(ckpt)))
    assert "x-t1" not in keys and "x-single" not in keys
    assert {"x-t2", "x-t5", "u0", "o0", "s0"} <= keys
