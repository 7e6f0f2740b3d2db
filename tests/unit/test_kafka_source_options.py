"""Source options and batch planning: parsed once, errors name the option; pure planning rules."""

from __future__ import annotations

import itertools

import pytest

from lastagent.errors import DataLossError, OptionError
from lastagent.sources.kafka_offsets import check_loss, from_json, hold_back, plan_ranges, rate_limit, to_json
from lastagent.sources.kafka_source_options import KafkaSourceOptions

pytestmark = pytest.mark.unit

BASE = {"kafka.bootstrap.servers": "h:9092", "subscribe": "a,b"}


def parse(**extra: str) -> KafkaSourceOptions:
    return KafkaSourceOptions.parse({**BASE, **extra})


def test_defaults_follow_sparks_kafka_source():
    o = parse()
    assert o.subscribe == ("a", "b") and o.starting == "latest" and o.fail_on_data_loss
    assert not o.include_headers and o.max_offsets_per_trigger is None and o.read_committed
    assert o.client_config == {"bootstrap.servers": "h:9092", "isolation.level": "read_committed"}


def test_kafka_settings_pass_through_and_names_are_case_insensitive():
    o = KafkaSourceOptions.parse({"KAFKA.BOOTSTRAP.SERVERS": "h:1", "SubscribePattern": "t-.*",
                                  "kafka.fetch.min.bytes": "10", "kafka.isolation.level": "read_uncommitted",
                                  "STARTINGOFFSETS": "Earliest", "maxOffsetsPerTrigger": "7"})
    assert o.pattern == "t-.*" and o.starting == "earliest" and o.max_offsets_per_trigger == 7
    assert o.client_config["fetch.min.bytes"] == "10" and not o.read_committed


@pytest.mark.parametrize("extra, option, words", [
    ({"subscribe": ""}, "subscribe", "exactly one of subscribe, subscribePattern, assign (got none)"),
    ({"assign": '{"a":[0]}'}, "subscribe", "got subscribe and assign"),
    ({"startingOffsets": "first"}, "startingOffsets", "earliest, latest, group"),
    ({"startingOffsets": '{"a":{"0":'}, "startingOffsets", "not valid JSON"),
    ({"startingOffsets": '{"a":{"0":-3}}'}, "startingOffsets", "-2 (earliest) or -1 (latest)"),
    ({"startingOffsets": "group"}, "startingOffsets", "needs 'kafka.group.id'"),
    ({"maxOffsetsPerTrigger": "many"}, "maxOffsetsPerTrigger", "not an integer"),
    ({"minPartitions": "0"}, "minPartitions", "too small"),
    ({"failOnDataLoss": "yes"}, "failOnDataLoss", "true or false"),
    ({"includeHeaders": "1"}, "includeHeaders", "true or false"),
    ({"maxOffsetPerTrigger": "5"}, "maxOffsetPerTrigger", "unknown option"),
    ({"kafka.auto.offset.reset": "earliest"}, "kafka.auto.offset.reset", "startingOffsets"),
    ({"kafka.enable.auto.commit": "true"}, "kafka.enable.auto.commit", "kafka.group.id"),
    ({"kafka.isolation.level": "serializable"}, "kafka.isolation.level", "read_committed or read_uncommitted"),
    ({"startingOffsetsByTimestampStrategy": "earliest"}, "startingOffsetsByTimestampStrategy", "error or latest"),
    ({"kafka.bootstrap.servers": " "}, "kafka.bootstrap.servers", "is required"),
])
def test_bad_options_name_the_option_and_the_choices(extra, option, words):
    with pytest.raises(OptionError) as e:
        parse(**extra)
    assert e.value.option == option and words in str(e.value)
    assert str(e.value).startswith(f"option '{option}': ")


def test_assign_and_pattern_are_checked():
    assert parse(subscribe="", assign='{"a":[1,0,1]}').assign == {"a": (0, 1)}
    for bad in ('["a"]', '{"a":[]}', '{"a":[-1]}', '{"a":["0"]}'):
        with pytest.raises(OptionError, match="assign"):
            parse(subscribe="", assign=bad)
    with pytest.raises(OptionError, match="subscribePattern.*not a valid regular expression"):
        parse(subscribe="", subscribePattern="t-(")


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(OptionError) as e:
        parse(startingOffset="earliest")
    assert "startingOffsets" in str(e.value) and "kafka.* consumer settings" in str(e.value)


def test_offsets_json_round_trip_is_sorted():
    offsets = {("b", 1): 5, ("a", 10): 3, ("a", 2): 0}
    assert from_json(to_json(offsets)) == offsets
    assert list(to_json(offsets)) == ["a", "b"] and list(to_json(offsets)["a"]) == ["2", "10"]


def test_rate_limit_is_proportional_bounded_and_spark_like():
    start = {("t", 0): 0, ("t", 1): 0, ("t", 2): 90}
    latest = {("t", 0): 100, ("t", 1): 10, ("t", 2): 90}
    end = rate_limit(start, latest, 11)
    # 110 offsets behind, 11 allowed: partition 0 gets 10, partition 1 gets 1 (share < 1 rounds up).
    assert end == {("t", 0): 10, ("t", 1): 1, ("t", 2): 90}
    assert rate_limit(start, latest, 1000) == latest


@pytest.mark.parametrize("sizes, limit", list(itertools.product(
    [(0, 0), (1, 0), (7, 3), (100, 1, 1), (5, 5, 5, 5)], [1, 2, 3, 10, 50])))
def test_rate_limit_never_exceeds_latest_and_always_progresses(sizes, limit):
    start = {("t", i): 10 for i in range(len(sizes))}
    latest = {("t", i): 10 + s for i, s in enumerate(sizes)}
    end = rate_limit(start, latest, limit)
    assert all(start[tp] <= end[tp] <= latest[tp] for tp in latest)
    if sum(sizes):
        assert sum(end[tp] - start[tp] for tp in end) > 0


def test_plan_ranges_skips_empty_and_splits_under_min_partitions():
    start = {("t", 0): 0, ("t", 1): 5, ("t", 2): 3}
    end = {("t", 0): 100, ("t", 1): 5, ("t", 2): 13}
    assert [(r.partition, r.start, r.until) for r in plan_ranges(start, end, None)] == [(0, 0, 100), (2, 3, 13)]
    ranges = plan_ranges(start, end, 11)
    assert len(ranges) >= 11
    for p in (0, 2):
        pieces = sorted((r.start, r.until) for r in ranges if r.partition == p)
        # The pieces tile the partition's range exactly: no gap, no overlap.
        assert pieces[0][0] == start[("t", p)] and pieces[-1][1] == end[("t", p)]
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))


def test_check_loss_fails_or_skips_naming_topic_partition_offsets():
    start = {("t", 0): 5, ("t", 1): 7, ("gone", 0): 3}
    earliest = {("t", 0): 9, ("t", 1): 0}
    with pytest.raises(DataLossError, match=r"t-0 at offsets \[5, 9\)"):
        check_loss(start, earliest, fail=True)
    assert check_loss(start, earliest, fail=False) == {("t", 0): 9, ("t", 1): 7}
    with pytest.raises(DataLossError, match="gone-0 is gone"):
        check_loss({("gone", 0): 3}, {}, fail=True)


def test_docs_options_md_is_generated_from_the_tables():
    from pathlib import Path

    from lastagent.options_doc import render

    doc = Path(__file__).resolve().parents[2] / "docs" / "options.md"
    assert doc.read_text() == render(), "docs/options.md is stale: run python -m lastagent.options_doc > docs/options.md"


def test_batch_reads_default_to_earliest_and_take_ending_options():
    o = KafkaSourceOptions.parse(BASE, batch=True)
    assert o.batch and o.starting == "earliest" and o.ending == "latest"
    o = KafkaSourceOptions.parse({**BASE, "endingOffsets": '{"a":{"0":5,"1":-1}}', "endingTimestamp": "7"}, batch=True)
    assert o.ending == {"a": {0: 5, 1: -1}} and o.ending_timestamp == 7


@pytest.mark.parametrize("extra, batch, option, words", [
    ({"endingOffsets": "latest"}, False, "endingOffsets", "batch reads (spark.read) only"),
    ({"endingTimestamp": "1"}, False, "endingTimestamp", "trigger(availableNow=True)"),
    ({"startingOffsets": "latest"}, True, "startingOffsets", "not allowed in a batch read"),
    ({"startingOffsets": '{"a":{"0":-1}}'}, True, "startingOffsets", "not allowed in a batch read"),
    ({"endingOffsets": "earliest"}, True, "endingOffsets", "give latest or JSON"),
    ({"endingOffsets": '{"a":{"0":-2}}'}, True, "endingOffsets", "earliest (-2) would read nothing"),
    ({"endingOffsets": '{"a":'}, True, "endingOffsets", "not valid JSON"),
    ({"endingOffsetsByTimestamp": '{"a":[1]}'}, True, "endingOffsetsByTimestamp", "must map partition numbers"),
    ({"endingTimestamp": "soon"}, True, "endingTimestamp", "not an integer"),
])
def test_ending_options_are_checked_for_the_kind_of_read(extra, batch, option, words):
    with pytest.raises(OptionError) as e:
        KafkaSourceOptions.parse({**BASE, **extra}, batch=batch)
    assert e.value.option == option and words in str(e.value)


def test_task_consumer_settings_defaults_user_settings_and_fixed_ones():
    """lastagent's defaults (bounded prefetch, no 1 s fetch backoff once the queue is full) give way to
    the user's kafka.* settings; what a range read depends on does not."""
    from lastagent.sources.kafka_source import consumer_settings

    ours = consumer_settings({"bootstrap.servers": "b:9092"}, "lastagent-source")
    assert ours["fetch.queue.backoff.ms"] == "10" and ours["queued.max.messages.kbytes"] == "16384"
    assert ours["fetch.wait.max.ms"] == "50" and ours["group.id"].startswith("lastagent-source-")
    theirs = consumer_settings({"fetch.queue.backoff.ms": "1000", "group.id": "mine", "auto.offset.reset": "earliest",
                                "enable.auto.commit": "true", "enable.partition.eof": "false"}, "lastagent-source")
    assert theirs["fetch.queue.backoff.ms"] == "1000" and theirs["group.id"] == "mine"
    assert (theirs["auto.offset.reset"], theirs["enable.auto.commit"], theirs["enable.partition.eof"]) == (
        "error", "false", "true")


def test_min_offsets_per_trigger_and_max_trigger_delay_as_sparks_kafka_source():
    o = parse()
    assert o.min_offsets_per_trigger is None and o.max_trigger_delay_ms == 15 * 60_000  # Spark's default: 15m
    o = parse(minOffsetsPerTrigger="100", maxTriggerDelay="30s")
    assert o.min_offsets_per_trigger == 100 and o.max_trigger_delay_ms == 30_000
    assert parse(maxTriggerDelay="500ms").max_trigger_delay_ms == 500
    assert parse(maxTriggerDelay="2h").max_trigger_delay_ms == 7_200_000
    assert parse(maxTriggerDelay=" ").max_trigger_delay_ms == 15 * 60_000
    with pytest.raises(OptionError, match="option 'maxTriggerDelay': 'soon' is not a duration; .*500ms, 30s, 15m"):
        parse(maxTriggerDelay="soon")
    with pytest.raises(OptionError, match="option 'minOffsetsPerTrigger'.*>= 1"):
        parse(minOffsetsPerTrigger="0")


def test_hold_back_waits_for_min_rows_until_the_delay_passes():
    start, latest = {("t", 0): 10, ("t", 1): 0}, {("t", 0): 14, ("t", 1): 3}  # 7 new offsets
    assert hold_back(start, latest, 8, 1_000, last_batch_ms=5_000, now_ms=5_500)  # too few, too soon
    assert not hold_back(start, latest, 7, 1_000, last_batch_ms=5_000, now_ms=5_500)  # enough
    assert not hold_back(start, latest, 8, 1_000, last_batch_ms=5_000, now_ms=6_000)  # waited long enough
    assert not hold_back(start, latest, 8, 1_000, last_batch_ms=0, now_ms=5_500)  # a query's first trigger runs
    # a partition the start lacks counts from 0, as in Spark; a latest behind the start counts nothing
    assert not hold_back({("t", 0): 10}, {("t", 0): 10, ("t", 1): 8}, 8, 1_000, 5_000, 5_500)
    assert hold_back({("t", 0): 10}, {("t", 0): 9}, 1, 1_000, 5_000, 5_500)

