"""XIDs and the link's naming scheme: round trips, XA size limits, names identical to the sink's."""

from __future__ import annotations

import random

import pytest

from lastagent.core.xid import (
    FORMAT_ID,
    MAX_EPOCH,
    MAX_LINK_LENGTH,
    MAXBQUALSIZE,
    MAXGTRIDSIZE,
    Xid,
    check_link,
    gxid_text,
    id_prefix,
    parse_transactional_id,
    transactional_id,
)
from lastagent.errors import OptionError
from lastagent.sinks.kafka_sink_options import KafkaSinkOptions

pytestmark = pytest.mark.unit

LINK_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"


def _links(rng: random.Random, n: int) -> list[str]:
    out = ["a", "-", "orders-to-kafka", "x" * MAX_LINK_LENGTH, "1.2_3-4"]
    out += ["".join(rng.choice(LINK_CHARS) for _ in range(rng.randint(1, MAX_LINK_LENGTH))) for _ in range(n)]
    return out


def _sink_options(link: str) -> KafkaSinkOptions:
    return KafkaSinkOptions.parse({"kafka.bootstrap.servers": "h:9092", "link": link, "arbitrationTable": "/arb",
                                   "checkpointLocation": "/ckpt"})


def test_constants():
    assert MAXGTRIDSIZE == 64 and MAXBQUALSIZE == 64
    assert -(2**31) <= FORMAT_ID < 2**31 and FORMAT_ID != -1
    assert MAX_LINK_LENGTH + 1 + len(str(MAX_EPOCH)) == MAXGTRIDSIZE


def test_text_round_trip_over_many_generated_xids():
    rng = random.Random(20240601)
    seen = 0
    for _ in range(3000):
        xid = Xid(rng.choice([FORMAT_ID, 0, 1, 2**31 - 1, -(2**31), -2, rng.randint(-(2**31), 2**31 - 1)]),
                  rng.randbytes(rng.randint(1, MAXGTRIDSIZE)), rng.randbytes(rng.randint(0, MAXBQUALSIZE)))
        if xid.format_id == -1:
            continue
        text = xid.to_text()
        assert Xid.from_text(text) == xid
        assert Xid.from_text(text).to_text() == text
        seen += 1
    assert seen > 2900


def test_epoch_xids_round_trip_and_fit():
    rng = random.Random(7)
    for link in _links(rng, 300):
        for epoch in (0, 1, rng.randint(0, MAX_EPOCH), MAX_EPOCH):
            xid = Xid.from_text(gxid_text(link, epoch))
            assert (xid.format_id, xid.gtrid, xid.bqual) == (FORMAT_ID, f"{link}:{epoch}".encode(), b"")
            assert len(xid.gtrid) <= MAXGTRIDSIZE and xid.to_text() == gxid_text(link, epoch)


def test_text_form_is_readable_and_stable():
    assert gxid_text("orders", 7) == f"{FORMAT_ID}:{b'orders:7'.hex()}:"
    assert Xid.from_text(gxid_text("orders", 7)) == Xid(FORMAT_ID, b"orders:7", b"")


@pytest.mark.parametrize("kwargs, match", [
    ({"gtrid": b"g" * 65, "bqual": b""}, "gtrid is 65 bytes; it must be 1 to 64 bytes"),
    ({"gtrid": b"", "bqual": b""}, "gtrid is 0 bytes; it must be 1 to 64"),
    ({"gtrid": b"g", "bqual": b"b" * 65}, "bqual is 65 bytes; it must be 0 to 64 bytes"),
    ({"gtrid": "g", "bqual": b""}, "gtrid must be bytes"),
])
def test_size_limits_name_the_part_and_the_limit(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Xid(FORMAT_ID, **kwargs)


def test_limits_are_inclusive_and_format_id_checked():
    Xid(FORMAT_ID, b"g" * 64, b"b" * 64)
    for bad in (-1, 2**31, -(2**31) - 1):
        with pytest.raises(ValueError, match="format_id"):
            Xid(bad, b"g", b"")
    with pytest.raises(ValueError, match="epoch"):
        gxid_text("l", -1)
    with pytest.raises(ValueError, match="epoch"):
        gxid_text("l", MAX_EPOCH + 1)
    with pytest.raises(ValueError, match="gtrid is 65 bytes"):
        gxid_text("x" * (MAX_LINK_LENGTH + 1), MAX_EPOCH)


@pytest.mark.parametrize("text", ["", "1:ab", "1:ab:cd:ef", "x:ab:", "01:ab:", "+1:ab:", "-0:ab:", "1:AB:",
                                  "1:a:", "1: ab:", "1::", "1:ab:c", "-1:ab:", f"{2**31}:ab:"])
def test_from_text_accepts_only_canonical_text(text):
    with pytest.raises(ValueError):
        Xid.from_text(text)


def test_names_are_byte_identical_to_the_sinks():
    rng = random.Random(11)
    for link in _links(rng, 200):
        opts = _sink_options(link)
        assert id_prefix(link) == opts.id_prefix == f"lastagent-{link}-"
        for partition in (0, 1, 9, 10, rng.randint(0, 100_000)):
            for attempt in (0, 1, rng.randint(2, 50)):
                generation = rng.choice((0, 1, rng.randint(2, 10**9)))
                tid = transactional_id(link, generation, partition, attempt)
                assert tid == opts.transactional_id(generation, partition, attempt)
                assert tid == f"lastagent-{link}-{generation}-{partition}-{attempt}"
                assert tid.startswith(id_prefix(link))
                assert parse_transactional_id(link, tid) == (generation, partition, attempt)


def test_parse_refuses_other_links_and_foreign_ids():
    # Link "a"'s prefix also prefixes link "a-1"'s ids: parsing tells them apart.
    other = transactional_id("a-1", 3, 2, 0)
    assert other.startswith(id_prefix("a"))
    assert parse_transactional_id("a", other) is None
    assert parse_transactional_id("a-1", other) == (3, 2, 0)
    for tid in ["lastagent-a-", "lastagent-a-1", "lastagent-a-1-", "lastagent-a-1-0", "lastagent-a--1-0-0",
                "lastagent-a-01-0-0", "lastagent-a-1-0-x", "lastagent-b-1-0-0", "other-a-1-0-0", "lastagent-a-1-0-0-0",
                "lastagent-a-+1-0-0"]:
        assert parse_transactional_id("a", tid) is None, tid


def test_check_link_accepts_valid_names():
    rng = random.Random(3)
    for link in _links(rng, 200):
        assert check_link(link) == link


@pytest.mark.parametrize("link, match", [
    ("", "is empty; give a stable name of 1 to 44"),
    ("has space", "'has space' has characters not allowed.*use only letters, digits"),
    ("a/b", "not allowed in a link name \\('/'\\)"),
    ("a:b", "not allowed"),  # ':' separates link and epoch in the gtrid
    ("ünïcode", "not allowed"),
    ("x" * (MAX_LINK_LENGTH + 1), "is 45 characters; at most 44 fit.*within 64 bytes"),
    ("orders\n", "not allowed"),
])
def test_check_link_errors_name_the_option(link, match):
    with pytest.raises(OptionError, match=match) as info:
        check_link(link)
    assert info.value.option == "link"
    assert str(info.value).startswith("option 'link': ")


def test_every_valid_link_fits_the_gtrid_at_the_largest_epoch():
    longest = check_link("L" * MAX_LINK_LENGTH)
    assert len(Xid.from_text(gxid_text(longest, MAX_EPOCH)).gtrid) == MAXGTRIDSIZE
