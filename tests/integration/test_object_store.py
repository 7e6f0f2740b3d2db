"""Storage that cannot be reached fails at query start, naming the option; nothing is written, no secret shown."""

from __future__ import annotations

import socket
import uuid

import pytest
import s3_server

from lastagent.errors import OptionError
from lastagent.storage import location, require_reachable

pytestmark = [pytest.mark.integration, pytest.mark.objectstore]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_refused_or_missing_storage_is_named(s3):
    bucket = s3.bucket()
    path = f"s3a://{bucket}/t"
    require_reachable(s3.config(), {"path": path, "checkpointLocation": "/tmp/local-is-left-alone"})
    cases = {
        "a wrong secret": (s3.config(aws_secret_access_key="not-the-secret"), path, "cannot reach its store"),
        "a bucket that does not exist": (s3.config(), f"s3a://no-{uuid.uuid4().hex[:8]}/t", "does not exist"),
        "nothing listening": (s3.config(aws_endpoint_url=f"http://127.0.0.1:{_closed_port()}"), path,
                              "cannot reach its store"),
    }
    for what, (config, where, words) in cases.items():
        with pytest.raises(OptionError) as err:
            require_reachable(config, {"path": where})
        text = str(err.value)
        assert text.startswith("option 'path':") and words in text, f"{what}: {text}"
        assert s3_server.SECRET_KEY not in text and "not-the-secret" not in text, f"{what}: a secret in {text}"


def test_the_sinks_refuse_bad_storage_at_query_start_and_write_nothing(spark, s3, kafka_bootstrap, new_topic):
    from pyspark.errors import PySparkException

    bucket = s3.bucket()
    rows = spark.readStream.format("rate").option("rowsPerSecond", "10").load().selectExpr(
        "CAST(value AS STRING) AS key", "CAST(value AS STRING) AS value")
    wrong = s3.options(aws_secret_access_key="not-the-secret")
    link = f"s3-bad-{uuid.uuid4().hex[:8]}"
    checkpoint = f"/tmp/lastagent-s3-bad/{link}"
    sinks = {
        "lastagent-delta": {"path": f"s3a://{bucket}/t", "link": link},
        "lastagent-kafka": {"kafka.bootstrap.servers": kafka_bootstrap, "topic": new_topic(), "link": link,
                            "arbitrationTable": f"s3a://{bucket}/arb"},
    }
    for fmt, options in sinks.items():
        query = (rows.writeStream.format(fmt).options(**wrong, **options)
                 .option("checkpointLocation", f"{checkpoint}-{fmt}").start())
        with pytest.raises(PySparkException) as err:
            query.awaitTermination(120)
        text = str(err.value)
        option = "path" if fmt == "lastagent-delta" else "arbitrationTable"
        assert f"option '{option}'" in text and "cannot reach its store" in text, text[:2000]
        assert "not-the-secret" not in text and s3_server.SECRET_KEY not in text
        query.stop()
    assert not any((s3.data / bucket).iterdir()), "something was written to the bucket"
    with pytest.raises(OptionError, match="option 'path': 'dbfs:/mnt/t': dbfs: paths"):
        location("dbfs:/mnt/t", "path")
