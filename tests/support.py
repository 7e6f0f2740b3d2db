"""Helpers shared by the integration and chaos tests (not fixtures)."""

from __future__ import annotations

import time
import uuid

from confluent_kafka import Consumer


def read_committed(bootstrap: str, topic: str, expect: int, timeout_s: float = 30.0,
                   quiet_s: float = 2.0) -> list[tuple[bytes | None, bytes | None]]:
    """(key, value) of every record an independent read_committed consumer sees in topic.

    Reads until ``expect`` records arrived, then ``quiet_s`` longer to catch duplicates; gives
    up after ``timeout_s`` and returns what it has (the caller's assertion shows the gap).
    """
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"verify-{uuid.uuid4().hex}",
                         "isolation.level": "read_committed", "auto.offset.reset": "earliest",
                         "enable.auto.commit": False})
    consumer.subscribe([topic])
    rows: list[tuple[bytes | None, bytes | None]] = []
    deadline = time.monotonic() + timeout_s
    quiet_until: float | None = None
    try:
        while time.monotonic() < deadline:
            for msg in consumer.consume(1000, 0.2):
                if msg.error() is None:
                    rows.append((msg.key(), msg.value()))
            if len(rows) >= expect:
                quiet_until = quiet_until or time.monotonic() + quiet_s
                if time.monotonic() > quiet_until:
                    break
    finally:
        consumer.close()
    return rows
