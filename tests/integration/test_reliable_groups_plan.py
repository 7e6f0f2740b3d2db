"""lastagent.reliable_groups at query start, on real Spark: what it refuses before any query runs, each error naming
the setting, argument or column; and a batch run with every field taken from columns (headers_column=None)."""

from __future__ import annotations

import pytest

from lastagent import reliable_groups
from lastagent.errors import LastAgentError, OptionError
from lastagent.reliable import REFUSED_RULE, ROCKSDB

pytestmark = pytest.mark.integration

PROVIDER = "spark.sql.streaming.stateStore.providerClass"
HDFS = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"


@pytest.fixture
def provider(spark):
    """Sets the session's state store provider for one test, then puts the old value back."""
    old = spark.conf.get(PROVIDER, None)

    def set_(value: str) -> None:
        spark.conf.set(PROVIDER, value)

    yield set_
    if old is None:
        spark.conf.unset(PROVIDER)
    else:
        spark.conf.set(PROVIDER, old)


def orders(spark):
    return spark.createDataFrame(
        [("g1", 0, 4102444800000, b"a"), ("g1", 1, 4102444800000, b"b"), ("g1", 1, 4102444800000, b"b"),
         ("g2", None, 4102444800000, b"c")],
        "order_id string, step long, expires long, value binary")


def test_the_hdfs_state_store_is_refused_naming_the_setting(spark, provider):
    provider(HDFS)
    with pytest.raises(LastAgentError, match=f"{PROVIDER}={HDFS}.*Set it to {ROCKSDB}"):
        reliable_groups(orders(spark), columns={"GroupId": "order_id"}, headers_column=None)


def test_missing_columns_and_an_inputs_own_watermark_are_refused(spark, provider):
    provider(ROCKSDB)
    df = orders(spark)
    with pytest.raises(OptionError, match="headers_column.*no column 'headers'.*includeHeaders=true"):
        reliable_groups(df)
    with pytest.raises(OptionError, match="column 'nope', which the input does not have"):
        reliable_groups(df, columns={"GroupId": "nope"}, headers_column=None)
    watermarked = (spark.readStream.format("rate").load().selectExpr("CAST(value AS STRING) AS g", "timestamp")
                   .withWatermark("timestamp", "1 minute"))  # a plan only: no query starts
    with pytest.raises(OptionError, match=r"watermark on \['timestamp'\]"):
        reliable_groups(watermarked, columns={"GroupId": "g"}, headers_column=None)


def test_every_field_from_columns(spark, provider):
    provider(ROCKSDB)
    assert spark.streams is not None  # Spark's state stores need the session's coordinator, made with its stream manager
    out = reliable_groups(orders(spark), headers_column=None,
                          columns={"GroupId": "order_id", "SequenceNumber": "step", "ExpiryTime": "expires"})
    rows = sorted((r.order_id, r.step, r[REFUSED_RULE]) for r in out.collect())
    assert rows == [("g1", 0, None), ("g1", 1, None), ("g2", None, None)]  # g1/1 once; g2 a singleton
