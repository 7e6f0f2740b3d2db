"""Links on a secured broker (SASL_SSL, SCRAM-SHA-512, ACLs on): every client the connector opens
authenticates with the user's Java-style ``kafka.*`` settings.

The link's principal (alice) gets exactly the ACLs docs/security.md lists. Against that broker: the
source, both sinks, a driver SIGKILLed with a decided epoch open and restarted, ``lastagent
status/recover`` with ``--command-config``; each missing ACL, a wrong password, an untrusted
certificate and an unreachable listener give a clear error within the timeout; and nothing the
runs wrote (tables, checkpoints, topics, logs) holds the password or the JAAS text.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import kafka_broker
import pytest
import support
from confluent_kafka import Producer
from support import grant_all, link_acls

from lastagent.errors import BranchError, KafkaProtocolError, OptionError
from lastagent.kafka.branch import BranchWriter
from lastagent.kafka.xa import KafkaXAResource

pytestmark = pytest.mark.integration

USER = "alice"
PASSWORD = kafka_broker.USERS[USER]
#: What must never be written anywhere: the password, and the JAAS text that carries it.
SECRETS = (PASSWORD.encode(), b"ScramLoginModule")
ROWS, POISON = 200, {17, 151}
#: What every refused login says, whichever way the client saw it (refusal, or the broker's close after it).
REFUSED_LOGIN = "check the username and password in kafka.sasl.jaas.config"
#: Bound of every failing connection in these tests: the admin's request timeout plus slack.
TIMEOUT_MS = 5000


def properties(path: Path, secured_kafka, password: str = PASSWORD) -> Path:
    """A client.properties of the Java-style settings a Spark user has (as Kafka's --command-config)."""
    opts = secured_kafka.kafka_options(USER, password)
    path.write_text("".join(f"{k[len('kafka.'):]}={v}\n" for k, v in opts.items() if k != "kafka.bootstrap.servers"))
    return path


def client(secured_kafka, **extra: str) -> dict[str, str]:
    """alice's settings as the connector receives them (``kafka.`` prefix removed)."""
    opts = {k[len("kafka."):]: v for k, v in secured_kafka.kafka_options(USER).items()}
    # A failing call gives up after TIMEOUT_MS of retrying (kafka.default.api.timeout.ms), as the Java client.
    return {**opts, "request.timeout.ms": str(TIMEOUT_MS), "default.api.timeout.ms": str(TIMEOUT_MS), **extra}


def as_admin(secured_kafka) -> dict[str, str]:
    return secured_kafka.librdkafka_config(kafka_broker.ADMIN)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lastagent.cli", *args], capture_output=True, text=True, timeout=180, check=False)


def assert_no_secret(roots: list[Path], topics: list[str], secured_kafka, skip: Path, also_skip: Path | None = None) -> int:
    """Greps every file under roots (but skip) and every record (key, value, headers) of topics for
    the secrets; returns how many files and records were searched."""
    searched = 0
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file() and path not in (skip, also_skip):
                data = path.read_bytes()
                searched += 1
                for secret in SECRETS:
                    assert secret not in data, f"{secret!r} written to {path}"
    from confluent_kafka import Consumer

    for topic in topics:
        consumer = Consumer({**as_admin(secured_kafka), "group.id": f"grep-{uuid.uuid4().hex}",
                             "auto.offset.reset": "earliest", "enable.partition.eof": True})
        consumer.subscribe([topic])
        deadline, eof = time.monotonic() + 30, 0
        try:
            while time.monotonic() < deadline and eof < 1:
                for msg in consumer.consume(500, 1.0):
                    if msg.error() is not None:
                        eof += 1
                        continue
                    searched += 1
                    blob = (msg.key() or b"") + (msg.value() or b"") + b"".join(
                        (v or b"") for _, v in (msg.headers() or []))
                    for secret in SECRETS:
                        assert secret not in blob, f"{secret!r} in a record of {topic}"
        finally:
            consumer.close()
    return searched


@pytest.fixture(autouse=True)
def alice_starts_without_acls(secured_admin):
    """ACLs outlive a test on the session's broker: each test starts with none for alice."""
    from kafka.admin import ACLFilter, ACLOperation, ACLPermissionType, ACLResourcePatternType, ResourcePatternFilter
    from kafka.admin import ResourceType as RT

    every = ACLFilter(f"User:{USER}", None, ACLOperation.ANY, ACLPermissionType.ANY,
                      ResourcePatternFilter(RT.ANY, None, ACLResourcePatternType.ANY))
    secured_admin.delete_acls([every])
    deadline = time.monotonic() + 10
    while secured_admin.describe_acls(every)[0]:
        assert time.monotonic() < deadline, "alice's ACLs were not removed within 10 s"
        time.sleep(0.05)


@pytest.fixture
def orders(secured_kafka, new_secured_topic) -> str:
    topic = new_secured_topic(partitions=2, prefix="orders")
    producer = Producer(as_admin(secured_kafka))
    for i in range(ROWS):
        value = f"poison-{i}" if i in POISON else f"order-1-{i}"
        producer.produce(topic, key=str(i).encode(), value=value.encode(), partition=i % 2)
    assert producer.flush(30) == 0
    return topic


def test_kafka_to_delta_killed_restarted_and_recovered_on_a_secured_broker(secured_kafka, new_secured_topic, grant,
                                                                          orders, spark, tmp_path):
    """Source and lastagent-delta with Kafka side outputs, as alice with least privilege: killed after
    epoch 0 is decided (its branches open), `lastagent status` shows them, the restart finishes them."""
    dlq, side = new_secured_topic(prefix="dlq"), new_secured_topic(prefix="side")
    link = f"sec-{uuid.uuid4().hex[:8]}"
    grant_all(grant, link_acls(link, read=(orders,), write=(dlq, side)))
    props = properties(tmp_path / "client.properties", secured_kafka)
    table, state = tmp_path / "table", tmp_path / "crash"
    args = [secured_kafka.bootstrap, orders, str(table), str(tmp_path / "ckpt"), link, dlq, side, "100"]
    code = support.run_driver("delta-driver", args, "after_arbitration:1", state, kafka_config=props)
    assert code == -signal.SIGKILL, f"not killed at after_arbitration (exit {code}); see {state}.log"

    command = ["--link", link, "--table", str(table), "--bootstrap-servers", secured_kafka.bootstrap,
               "--command-config", str(props)]
    status = cli("status", *command, "--json")
    assert status.returncode == 1, status.stderr
    in_doubt = json.loads(status.stdout)["in_doubt"]
    assert in_doubt and {b["decision"] for b in in_doubt} == {"commit"}, in_doubt

    assert support.run_driver("delta-driver", args, None, state, kafka_config=props) == 0, f"see {state}.log"
    assert cli("status", *command).returncode == 0
    recover = cli("recover", *command)
    assert recover.returncode == 0 and "in doubt: none" in recover.stdout, recover.stdout + recover.stderr
    wrong = properties(tmp_path / "wrong.properties", secured_kafka, password="not-the-password")
    refused = cli("status", *command[:-1], str(wrong), "--kafka", f"request.timeout.ms={TIMEOUT_MS}")
    assert refused.returncode == 2 and REFUSED_LOGIN in refused.stderr.splitlines()[-1], refused.stderr
    assert "not-the-password" not in refused.stdout + refused.stderr

    good = [i for i in range(ROWS) if i not in POISON]
    counts = Counter(int(r.key) for r in spark.read.format("delta").load(str(table)).select("key").collect())
    assert sorted(counts) == good and max(counts.values()) == 1, "table not exactly once"
    admin = as_admin(secured_kafka)
    dead = support.read_committed(secured_kafka.bootstrap, dlq, len(POISON), config=admin)
    assert Counter(k for k, _ in dead) == Counter(str(i).encode() for i in POISON), "dead letters not exactly once"
    follow = support.read_committed(secured_kafka.bootstrap, side, len(good), config=admin)
    assert sorted(int(json.loads(v)["key"]) for _, v in follow) == good, "side topic not exactly once"

    searched = assert_no_secret([tmp_path], [orders, dlq, side], secured_kafka, skip=props, also_skip=wrong)
    assert searched > 50  # tables, checkpoint, driver logs and every record were read
    print(f"secret grep: {searched} files and records searched, none holds the password or the JAAS text")


def test_delta_to_kafka_killed_after_the_decision_on_a_secured_broker(secured_kafka, new_secured_topic, grant, spark,
                                                                     tmp_path):
    """lastagent-kafka as alice: killed after epoch 1 is decided, restarted; every row once, nothing open."""
    topic = new_secured_topic(partitions=2, prefix="out")
    link = f"sec-{uuid.uuid4().hex[:8]}"
    grant_all(grant, link_acls(link, write=(topic,)))
    source = str(tmp_path / "source")
    for f in range(3):
        (spark.range(f * 50, (f + 1) * 50, numPartitions=1)
         .selectExpr("CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value")
         .write.format("delta").mode("append").save(source))
    props = properties(tmp_path / "client.properties", secured_kafka)
    arbitration, state = tmp_path / "arb", tmp_path / "crash"
    args = [secured_kafka.bootstrap, source, str(tmp_path / "ckpt"), str(arbitration), link, topic]
    code = support.run_driver("sink-driver", args, "after_arbitration:2", state, kafka_config=props)
    assert code == -signal.SIGKILL, f"not killed at after_arbitration (exit {code}); see {state}.log"
    assert support.run_driver("sink-driver", args, None, state, kafka_config=props) == 0, f"see {state}.log"

    rows = support.read_committed(secured_kafka.bootstrap, topic, 150, config=as_admin(secured_kafka))
    counts = Counter(v for _, v in rows)
    assert sorted(counts) == sorted(str(i).encode() for i in range(150)) and max(counts.values()) == 1
    recover = cli("recover", "--link", link, "--arbitration-table", str(arbitration), "--bootstrap-servers",
                  secured_kafka.bootstrap, "--command-config", str(props))
    assert recover.returncode == 0 and "in doubt: none" in recover.stdout, recover.stdout + recover.stderr
    assert assert_no_secret([tmp_path], [topic], secured_kafka, skip=props) > 10


# -- least privilege: each missing ACL is named ------------------------------------------------------


def _branch(config: dict[str, str], link: str, topic: str) -> None:
    writer = BranchWriter(config, f"lastagent-{link}-1-0-0", 60_000, init_timeout_s=TIMEOUT_MS / 1000)
    writer.send(topic, b"v", b"k")
    writer.prepare(30)


@pytest.mark.parametrize("missing, says", [
    ("TRANSACTIONAL_ID", "Write and Describe on TransactionalId, prefixed 'lastagent-<link>-'"),
    ("CLUSTER", "DescribeConfigs on the Cluster"),
    ("TOPIC", "Describe on the Topic, and Write to produce"),
])
def test_each_missing_acl_is_named(missing, says, secured_kafka, new_secured_topic, grant):
    """The sink's calls as alice with every ACL of the link but one: the call that needs it fails fast,
    naming it; nothing is left open."""
    topic = new_secured_topic()
    link = f"acl-{uuid.uuid4().hex[:8]}"
    grant_all(grant, [acl for acl in link_acls(link, write=(topic,)) if acl[0] != missing])
    started = time.monotonic()
    with KafkaXAResource(client(secured_kafka)) as xa, pytest.raises((KafkaProtocolError, BranchError)) as err:
        # What a query start and an epoch do, in order: broker limits, recovery, a branch.
        xa.broker_max_timeout_ms()
        xa.recover(f"lastagent-{link}-")
        _branch(client(secured_kafka), link, topic)
    assert says in str(err.value), err.value
    assert time.monotonic() - started < TIMEOUT_MS / 1000 + 10
    with KafkaXAResource(as_admin(secured_kafka)) as admin_xa:
        assert admin_xa.recover(f"lastagent-{link}-") == []


@pytest.mark.parametrize("granted, says", [
    ([("TOPIC", "{topic}", ["DESCRIBE"], "LITERAL"), ("GROUP", "lastagent-source-", ["READ"], "PREFIXED")],
     "the principal needs Describe on the Topic, and Write to produce or Read to consume"),
    ([("TOPIC", "{topic}", ["READ", "DESCRIBE"], "LITERAL")],
     "the principal needs Read on the consumer Group: kafka.group.id, else prefixed by the source's groupIdPrefix"),
])
def test_a_source_without_read_names_what_it_needs(granted, says, secured_kafka, orders, grant, spark):
    grant_all(grant, [(rtype, name.format(topic=orders), ops, pattern) for rtype, name, ops, pattern in granted])
    reader = spark.read.format("lastagent-kafka").options(**secured_kafka.kafka_options(USER)).option("subscribe", orders)
    with pytest.raises(Exception) as err:
        reader.load().collect()
    assert says in str(err.value)


def test_a_source_without_group_read_fails_even_with_nothing_to_read(secured_kafka, new_secured_topic, grant, spark):
    """The consumer group is checked at query start: the outcome does not hang on whether a task's client
    heard the group coordinator's refusal before its range ended (here there is no range at all)."""
    empty = new_secured_topic(partitions=1, prefix="empty")
    grant_all(grant, [("TOPIC", empty, ["READ", "DESCRIBE"], "LITERAL")])
    reader = spark.read.format("lastagent-kafka").options(**secured_kafka.kafka_options(USER)).option("subscribe", empty)
    with pytest.raises(Exception) as err:
        reader.load().collect()
    assert "the principal needs Read on the consumer Group: kafka.group.id" in str(err.value)


# -- login, TLS and reachability: clear, bounded, nothing written --------------------------------------


def _bounded(fn: Callable[[], object], *errors: type[BaseException]) -> str:
    started = time.monotonic()
    with pytest.raises(errors) as err:
        fn()
    assert time.monotonic() - started < TIMEOUT_MS / 1000 + 15, "not bounded by the timeout"
    return str(err.value)


def test_a_wrong_password_is_named_by_every_client(secured_kafka, orders, spark):
    wrong = client(secured_kafka, **{"sasl.jaas.config": client(secured_kafka)["sasl.jaas.config"].replace(
        PASSWORD, "not-the-password")})
    said = _bounded(lambda: KafkaXAResource(wrong).transaction_protocol(), KafkaProtocolError)
    assert REFUSED_LOGIN in said and "not-the-password" not in said
    said = _bounded(lambda: BranchWriter(wrong, "lastagent-pw-1-0-0", 60_000, init_timeout_s=TIMEOUT_MS / 1000),
                    BranchError)
    assert REFUSED_LOGIN in said and "not-the-password" not in said
    opts = {f"kafka.{k}": v for k, v in wrong.items() if k != "request.timeout.ms"}
    reader = (spark.read.format("lastagent-kafka").options(**opts).option("subscribe", orders)
              .option("kafka.default.api.timeout.ms", str(TIMEOUT_MS)))
    said = _bounded(lambda: reader.load().collect(), Exception)
    assert REFUSED_LOGIN in said and "not-the-password" not in said


def test_an_untrusted_certificate_and_an_unreachable_listener_are_named(secured_kafka):
    untrusted = client(secured_kafka, **{"ssl.truststore.location": str(secured_kafka.pki["other_truststore_p12"])})
    said = _bounded(lambda: KafkaXAResource(untrusted).transaction_protocol(), KafkaProtocolError)
    assert "TLS handshake failed (CERTIFICATE_VERIFY_FAILED)" in said
    said = _bounded(lambda: BranchWriter(untrusted, "lastagent-tls-1-0-0", 60_000, init_timeout_s=TIMEOUT_MS / 1000),
                    BranchError)
    assert "TLS handshake failed" in said or "certificate verify failed" in said
    unreachable = client(secured_kafka, **{"bootstrap.servers": f"127.0.0.1:{_closed_port()}"})
    said = _bounded(lambda: KafkaXAResource(unreachable).transaction_protocol(), KafkaProtocolError)
    assert "Connection refused" in said and "kafka.bootstrap.servers" in said


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("store, settings, says", [
    ("truststore_jks", {"ssl.truststore.type": "JKS"}, "keytool -importkeystore"),
    ("truststore_jks", {"ssl.truststore.type": "PKCS12"}, "Java-only format"),
    ("truststore_p12", {"ssl.truststore.password": "wrong"}, "wrong password"),
])
def test_stores_that_cannot_be_read_are_named_at_start(store, settings, says, secured_kafka):
    config = client(secured_kafka, **{"ssl.truststore.location": str(secured_kafka.pki[store]), **settings})
    said = _bounded(lambda: KafkaXAResource(config).transaction_protocol(), OptionError)
    assert "kafka.ssl.truststore" in said and says in said


def test_pem_trust_and_a_pkcs12_client_certificate_work_in_both_libraries(secured_kafka, new_secured_topic, grant):
    """The other drop-in forms: a PEM trust store and a PKCS12 key store (the broker requests client
    certificates and checks any it gets against its CA)."""
    topic = new_secured_topic()
    link = f"pem-{uuid.uuid4().hex[:8]}"
    grant_all(grant, link_acls(link, write=(topic,)))
    config = client(secured_kafka, **{"ssl.truststore.location": str(secured_kafka.pki["ca"]),
                                      "ssl.truststore.type": "PEM", "ssl.keystore.location":
                                      str(secured_kafka.pki["client_p12"]), "ssl.keystore.type": "PKCS12",
                                      "ssl.keystore.password": "keypass"})
    config.pop("ssl.truststore.password")
    with KafkaXAResource(config) as xa:
        assert xa.transaction_protocol() in (1, 2)
        writer = BranchWriter(config, f"lastagent-{link}-1-0-0", 60_000, init_timeout_s=TIMEOUT_MS / 1000)
        writer.send(topic, b"v", b"k")
        handle = writer.prepare(30)
        writer.release()
        assert xa.commit(handle).outcome.value == "committed"
    assert support.read_committed(secured_kafka.bootstrap, topic, 1, config=as_admin(secured_kafka)) == [(b"k", b"v")]
