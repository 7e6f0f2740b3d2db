"""A produce/consume round trip through ``lastagent._native`` alone (no pyarrow, no Spark): for checking a wheel
of another CPU under emulation (docs/install.md, "Checking the aarch64 wheel"), e.g.::

    qemu-aarch64-static -L <arm64 sysroot> <sysroot>/usr/bin/python3.11 dev/wheels/roundtrip.py <unzipped wheel> \\
        127.0.0.1:39092 <topic with 1 partition>

The branch producer writes three records in a transaction and aborts it (committing is EndTxn from Python, not
the native module); a consumer with isolation.level=read_uncommitted then reads them back, and one with
read_committed reads none. Prints the versions and the rows read; exits 1 on any mismatch.
"""

from __future__ import annotations

import sys
import uuid


def main() -> int:
    wheel_dir, bootstrap, topic = sys.argv[1:4]
    sys.path.insert(0, wheel_dir)
    import platform

    from lastagent import _native as n

    print(platform.machine(), n.__file__, "librdkafka", n.librdkafka_version(), n.openssl_version()[0])
    producer = n.BranchProducer([("bootstrap.servers", bootstrap), ("transactional.id", f"roundtrip-{uuid.uuid4().hex}"),
                                 ("delivery.report.only.error", "true")])
    for step in (lambda: producer.init_transactions(60000), producer.begin_transaction):
        err = step()
        assert err is None, err
    for i in range(3):
        err = producer.produce(topic, f"row-{i}".encode(), f"k{i}".encode(), 0, None, i)
        assert err is None, err
    assert producer.flush(60000) == 0, "records still queued"
    failures, _, errors = producer.reports()
    assert not failures and not errors, (failures, errors)
    assert producer.abort_transaction(60000) is None
    producer.release()

    seen = {}
    for isolation in ("read_uncommitted", "read_committed"):
        consumer = n.RangeConsumer([("bootstrap.servers", bootstrap), ("group.id", "roundtrip"),
                                    ("enable.auto.commit", "false"), ("isolation.level", isolation)])
        low, high = consumer.watermarks(topic, 0, 60000)
        consumer.assign(topic, 0, low)
        rows = waits = 0
        # The range ends with the abort marker, a control record no consumer returns: the range is read when
        # "done" comes, or once nothing more arrives (lastagent's source decides that from the position).
        while waits < 3:
            batch, _next, status, error = consumer.next_batch(high, 1000, 1000, False)
            assert error is None, error
            rows += len(batch) if batch is not None else 0
            if status == "done":
                break
            waits += status == "wait"
        consumer.close()
        seen[isolation] = rows
        print(isolation, "rows", rows, "offsets", low, high)
    ok = seen == {"read_uncommitted": 3, "read_committed": 0}
    print("round trip", "ok" if ok else f"MISMATCH {seen}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
