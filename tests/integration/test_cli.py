"""The `lastagent` command on a real broker and a real arbitration table."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
from support import read_committed

from lastagent.core.arbitration import ArbitrationRecord
from lastagent.delta.arbitration_table import DeltaArbitrationStore
from lastagent.kafka.branch import BranchWriter

pytestmark = pytest.mark.integration


def lastagent(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lastagent.cli", *args], capture_output=True, text=True, timeout=120, check=False)


def test_status_and_recover(kafka_bootstrap, new_topic, tmp_path):
    topic = new_topic()
    link = f"cli-{uuid.uuid4().hex[:8]}"
    arb = str(tmp_path / "arb")
    common = ["--link", link, "--arbitration-table", arb, "--bootstrap-servers", kafka_bootstrap]
    handles = []
    for branch in range(3):
        w = BranchWriter({"bootstrap.servers": kafka_bootstrap}, f"lastagent-{link}-1-{branch}-0", 600_000)
        w.send(topic, f"b{branch}".encode())
        handles.append(w.prepare())
    # Epoch 0 decided with branches 0 and 1; branch 2 belongs to no decision.
    store = DeltaArbitrationStore(arb)
    store.decide(ArbitrationRecord(link, 0, f"{link}:0", tuple(h.to_json() for h in handles[:2])),
                 store.claim(link, "q").generation)

    status = lastagent("status", *common, "--json")
    assert status.returncode == 1, status.stderr
    doc = json.loads(status.stdout)
    assert doc["latest_decided_epoch"] == 0 and doc["arbitration_rows"] == 1
    assert {b["transactional_id"]: b["decision"] for b in doc["in_doubt"]} == {
        f"lastagent-{link}-1-0-0": "commit", f"lastagent-{link}-1-1-0": "commit", f"lastagent-{link}-1-2-0": "rollback"}

    text = lastagent("recover", *common)
    assert text.returncode == 1 and "-> commit (epoch 0 is decided)" in text.stdout
    assert "-> rollback (no decision covers it (presumed abort))" in text.stdout

    applied = lastagent("recover", *common, "--apply", "--json")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert json.loads(applied.stdout)["in_doubt"] == []
    assert sorted(v for _, v in read_committed(kafka_bootstrap, topic, 2)) == [b"b0", b"b1"]
    assert lastagent("status", *common).returncode == 0


def test_bad_link_name_is_a_usage_error(kafka_bootstrap, tmp_path):
    result = lastagent("status", "--link", "no spaces", "--arbitration-table", str(tmp_path),
                       "--bootstrap-servers", kafka_bootstrap)
    assert result.returncode == 2 and "option 'link'" in result.stderr


def test_expired_decided_branch_is_reported_by_epoch_and_branch(kafka_bootstrap, new_topic, tmp_path):
    """A decided branch the broker aborted after its timeout is a hazard: reported, exit 1."""
    import time

    from lastagent.kafka.xa import KafkaXAResource

    topic = new_topic()
    link = f"cli-{uuid.uuid4().hex[:8]}"
    arb = str(tmp_path / "arb")
    w = BranchWriter({"bootstrap.servers": kafka_bootstrap}, f"lastagent-{link}-1-0-0", 1000)
    w.send(topic, b"lost")
    handle = w.prepare()
    store = DeltaArbitrationStore(arb)
    store.decide(ArbitrationRecord(link, 4, f"{link}:4", (handle.to_json(),), confirmed_through=3),
                 store.claim(link, "q").generation)
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        deadline = time.monotonic() + 60
        while xa.recover(handle.transactional_id) and time.monotonic() < deadline:
            time.sleep(0.5)  # the broker aborts it after transaction.timeout.ms
    common = ["--link", link, "--arbitration-table", arb, "--bootstrap-servers", kafka_bootstrap]
    status = lastagent("status", *common, "--json")
    assert status.returncode == 1, status.stderr
    doc = json.loads(status.stdout)
    assert doc["in_doubt"] == []
    assert [(h["epoch"], h["transactional_id"]) for h in doc["hazards"]] == [(4, handle.transactional_id)]
    text = lastagent("status", *common)
    assert f"HAZARD: link '{link}' epoch 4: decided branch {handle.transactional_id}" in text.stdout
    assert "--accept-lost 4" in text.stdout

    # Every start stops on the lost branch, naming it, until an operator accepts the loss.
    from lastagent.errors import DecidedBranchLostError
    from lastagent.sinks.kafka_sink_options import KafkaSinkOptions
    from lastagent.sinks.link_ports import link_committer

    options = KafkaSinkOptions.parse({"kafka.bootstrap.servers": kafka_bootstrap, "link": link,
                                      "arbitrationTable": arb, "checkpointLocation": str(tmp_path / "ckpt")})
    with link_committer(options) as committer, pytest.raises(DecidedBranchLostError, match=handle.transactional_id):
        committer.start(owner="q")
    assert lastagent("recover", *common, "--accept-lost", "3").returncode == 2  # no loss there: nothing changes
    accepted = lastagent("recover", *common, "--accept-lost", "4")
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert "the loss of 1 branch(es), 1 record(s), is accepted" in accepted.stdout
    with link_committer(options) as committer:
        committer.start(owner="q")  # the link goes on
    status = lastagent("status", *common, "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    assert [h["accepted"] for h in json.loads(status.stdout)["hazards"]] == [True]


def test_status_of_a_table_that_is_not_there_fails(kafka_bootstrap, tmp_path):
    """A wrong path must not read as 'in doubt: none'."""
    for flag in ("--arbitration-table", "--table"):
        missing = str(tmp_path / "nowhere")
        result = lastagent("status", "--link", "l", flag, missing, "--bootstrap-servers", kafka_bootstrap)
        assert result.returncode == 2, result.stdout
        assert f"{flag} {missing}: no Delta table there" in result.stderr
        assert not (tmp_path / "nowhere").exists()


def test_status_of_a_link_that_never_ran_there_fails(kafka_bootstrap, tmp_path):
    """A mistyped --link must not read as a healthy link with nothing in doubt."""
    arb = str(tmp_path / "arb")
    store = DeltaArbitrationStore(arb)
    store.decide(ArbitrationRecord("ran", 0, "ran:0", ()), store.claim("ran", "q").generation)
    result = lastagent("status", "--link", "never-ran", "--arbitration-table", arb, "--bootstrap-servers", kafka_bootstrap)
    assert result.returncode == 2, result.stdout
    assert f"link never-ran: no such link is known in --arbitration-table {arb}" in result.stderr
    known = lastagent("status", "--link", "ran", "--arbitration-table", arb, "--bootstrap-servers", kafka_bootstrap)
    assert known.returncode == 0, known.stdout + known.stderr


def test_storage_settings_reach_the_command(kafka_bootstrap):
    """``--storage KEY=VALUE`` is the query's ``storage.*``: a bad one is refused naming it, before any I/O."""
    out = lastagent("status", "--link", "orders", "--table", "s3a://lake/orders", "--bootstrap-servers",
                    kafka_bootstrap, "--storage", "aws_endpoint_url=127.0.0.1:9000")
    assert out.returncode == 2, out
    assert "option 'storage.aws_endpoint_url': '127.0.0.1:9000' is not a URL" in out.stderr, out.stderr
