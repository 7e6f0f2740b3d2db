"""Checks the development S3 server (``dev/s3_server.py``) with the clients the project uses, no Spark.

It starts nothing: bring the server up first, with the bucket it writes to::

    python dev/s3_server.py up --bucket lastagent
    .venv/bin/python dev/s3_check.py [--port 39900] [--bucket lastagent]

Checks, each under a fresh prefix ``check-<ns>/`` of the bucket (removed at the end):

(a) pyarrow's ``S3FileSystem`` writes, lists and reads back a file.
(b) delta-rs writes a table twice in append mode and reads back twice the rows, with an ``s3://``
    URI and again with an ``s3a://`` one; the ``s3a://`` table is readable as ``s3://`` too.
(c) conditional put, which delta-rs commits rely on: a signed ``PUT`` with ``If-None-Match: *``
    gives 200 and then 412 on the same key; eight such PUTs racing on a new key give exactly one 200,
    and the object holds the winner's bytes; a delta-rs commit made from a stale snapshot that
    conflicts (the table's metadata changed since) fails with ``CommitFailedError``, and two
    non-conflicting stale appends land as two versions (no commit lost).

Exit status 0 when every check passes. Needs pyarrow and deltalake (the project's venv has both).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable

import pyarrow as pa
import s3_server  # dev/, next to this file
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError
from pyarrow import fs


def check_pyarrow(port: int, bucket: str, prefix: str) -> str:
    s3 = fs.S3FileSystem(access_key=s3_server.ACCESS_KEY, secret_key=s3_server.SECRET_KEY, region=s3_server.REGION,
                         endpoint_override=f"127.0.0.1:{port}", scheme="http")
    path = f"{bucket}/{prefix}/pyarrow/hello.txt"
    payload = b"hello from pyarrow\n"
    with s3.open_output_stream(path) as out:
        out.write(payload)
    listed = [(info.path, info.size) for info in s3.get_file_info(fs.FileSelector(f"{bucket}/{prefix}/pyarrow"))]
    assert listed == [(path, len(payload))], listed
    with s3.open_input_stream(path) as src:
        assert src.read() == payload
    return f"wrote, listed {listed}, read back {len(payload)} bytes"


def _append_twice(uri: str, options: dict[str, str]) -> tuple[int, int]:
    table = pa.table({"id": pa.array([1, 2, 3], pa.int64()), "word": pa.array(["a", "b", "c"])})
    write_deltalake(uri, table, mode="append", storage_options=options)
    write_deltalake(uri, table, mode="append", storage_options=options)
    dt = DeltaTable(uri, storage_options=options)
    rows = dt.to_pyarrow_table().num_rows
    assert (dt.version(), rows) == (1, 2 * table.num_rows), (dt.version(), rows)
    return dt.version(), rows


def check_delta(port: int, bucket: str, prefix: str) -> str:
    options = s3_server.delta_storage_options(port)
    done = []
    for scheme in ("s3", "s3a"):
        uri = f"{scheme}://{bucket}/{prefix}/delta-{scheme}"
        version, rows = _append_twice(uri, options)
        done.append(f"{uri}: version {version}, {rows} rows")
    # The same objects under the other scheme name.
    other = DeltaTable(f"s3://{bucket}/{prefix}/delta-s3a", storage_options=options).to_pyarrow_table().num_rows
    assert other == 6, other
    return "; ".join(done) + "; the s3a:// table read as s3:// has 6 rows"


def check_conditional_put(port: int, bucket: str, prefix: str) -> str:
    key = f"/{bucket}/{prefix}/conditional/once"
    first = s3_server.signed_request("PUT", key, b"first", {"If-None-Match": "*"}, port=port)[0]
    second = s3_server.signed_request("PUT", key, b"second", {"If-None-Match": "*"}, port=port)[0]
    kept = s3_server.signed_request("GET", key, port=port)[2]
    assert (first, second, kept) == (200, 412, b"first"), (first, second, kept)

    race_key = f"/{bucket}/{prefix}/conditional/race"
    writers = 8
    barrier = threading.Barrier(writers)
    statuses: list[int] = [0] * writers

    def put(i: int) -> None:
        barrier.wait()
        statuses[i] = s3_server.signed_request("PUT", race_key, f"writer-{i}".encode(), {"If-None-Match": "*"}, port=port)[0]

    threads = [threading.Thread(target=put, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, status in enumerate(statuses) if status == 200]
    assert len(winners) == 1 and statuses.count(412) == writers - 1, statuses
    stored = s3_server.signed_request("GET", race_key, port=port)[2]
    assert stored == f"writer-{winners[0]}".encode(), (stored, winners)

    options = s3_server.delta_storage_options(port)
    uri = f"s3://{bucket}/{prefix}/delta-race"
    rows = pa.table({"id": pa.array([1], pa.int64())})
    write_deltalake(uri, rows, storage_options=options)  # version 0
    ahead, stale = DeltaTable(uri, storage_options=options), DeltaTable(uri, storage_options=options)
    ahead.alter.set_table_properties({"delta.logRetentionDuration": "interval 31 days"})  # version 1
    try:
        write_deltalake(stale, rows, mode="append")  # tries version 1 from version 0's snapshot
        raise AssertionError("a commit from a stale snapshot over a metadata change succeeded")
    except CommitFailedError as exc:
        conflict = str(exc)
    one, two = DeltaTable(uri, storage_options=options), DeltaTable(uri, storage_options=options)
    write_deltalake(one, rows, mode="append")
    write_deltalake(two, rows, mode="append")  # 412 on version 2, rebased onto version 3
    final = DeltaTable(uri, storage_options=options)
    assert (one.version(), two.version(), final.version(), final.to_pyarrow_table().num_rows) == (2, 3, 3, 3), (
        one.version(), two.version(), final.version())
    return (f"PUT If-None-Match:* gave {first} then {second} (object kept {kept!r}); {writers} racing PUTs: "
            f"{statuses} (one 200, object holds writer-{winners[0]}'s bytes); delta-rs stale commit over a "
            f"metadata change: CommitFailedError({conflict!r}); two stale appends: versions 2 and 3, 3 rows")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=s3_server.DEFAULT_PORT)
    parser.add_argument("--bucket", default="lastagent")
    args = parser.parse_args(argv)
    port, bucket = args.port, args.bucket
    if not s3_server.answers(port):
        print(f"s3-check: nothing answers on {s3_server.endpoint(port)}; run "
              f"`python dev/s3_server.py up --port {port} --bucket {bucket}` first", file=sys.stderr)
        return 2
    if s3_server.signed_request("HEAD", f"/{bucket}", port=port)[0] != 200:
        print(f"s3-check: no bucket {bucket!r}; run `python dev/s3_server.py up --port {port} --bucket {bucket}`",
              file=sys.stderr)
        return 2
    prefix = f"check-{time.time_ns()}"
    print(f"s3-check: {s3_server.endpoint(port)}, s3://{bucket}/{prefix}/")
    checks: list[tuple[str, Callable[[int, str, str], str]]] = [
        ("(a) pyarrow S3FileSystem", check_pyarrow),
        ("(b) delta-rs append x2, s3:// and s3a://", check_delta),
        ("(c) conditional put", check_conditional_put),
    ]
    failed = 0
    for name, check in checks:
        started = time.monotonic()
        try:
            detail = check(port, bucket, prefix)
            print(f"  ok    {name} ({time.monotonic() - started:.1f}s): {detail}")
        except Exception as exc:  # report every check, then fail
            failed += 1
            print(f"  FAIL  {name}: {type(exc).__name__}: {exc}")
    s3 = fs.S3FileSystem(access_key=s3_server.ACCESS_KEY, secret_key=s3_server.SECRET_KEY, region=s3_server.REGION,
                         endpoint_override=f"127.0.0.1:{port}", scheme="http")
    s3.delete_dir(f"{bucket}/{prefix}")
    print(f"s3-check: {len(checks) - failed} of {len(checks)} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
