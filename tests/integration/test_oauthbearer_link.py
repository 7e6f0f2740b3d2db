"""Links that log in with SASL/OAUTHBEARER on the secured broker, as users of OIDC and of AWS MSK IAM do.

The secured broker validates RS256 JWTs against the JWKS of ``dev/oidc.py``'s token endpoint
(``oidc_endpoint``); the link's principal is the OAuth client, ``User:carol``, with exactly the ACLs
docs/security.md lists. A Kafka → ``lastagent-delta`` query (dead letters to Kafka) and a Delta →
``lastagent-kafka`` query log in with the Java client's OIDC settings, as written for Spark's own
``kafka`` format; the driver and each Python worker fetch their own token. A token function
(``kafka.sasl.oauthbearer.token.provider``, the MSK IAM recipe) logs in every client library lastagent
uses. A client secret the endpoint refuses stops the query at start, naming the setting.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from base64 import b64encode
from collections import Counter

import pytest
from confluent_kafka import Producer
from support import grant_all, link_acls, read_committed

from lastagent.errors import TokenError
from lastagent.kafka.branch import BranchWriter
from lastagent.kafka.config import KafkaConfig
from lastagent.kafka.oauth import claims
from lastagent.kafka.xa import KafkaXAResource
from lastagent.sources.kafka_offsets import OffsetReader
from lastagent.sources.kafka_source_options import KafkaSourceOptions

pytestmark = pytest.mark.integration

HANDLER = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginCallbackHandler"
MODULE = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule"
ROWS, POISON = 120, {7, 99}


def oidc_options(secured_kafka, endpoint, secret: str | None = None) -> dict[str, str]:
    """The ``kafka.*`` options of Spark's ``kafka`` format for an OIDC client-credentials login."""
    return {
        "kafka.bootstrap.servers": secured_kafka.bootstrap,
        "kafka.security.protocol": "SASL_SSL",
        "kafka.sasl.mechanism": "OAUTHBEARER",
        "kafka.sasl.login.callback.handler.class": HANDLER,
        "kafka.sasl.oauthbearer.token.endpoint.url": endpoint.url,
        "kafka.sasl.jaas.config": f'{MODULE} required clientId="{endpoint.client_id}" '
                                  f'clientSecret="{secret or endpoint.client_secret}" scope="kafka";',
        "kafka.ssl.truststore.location": str(secured_kafka.pki["truststore_p12"]),
        "kafka.ssl.truststore.type": "PKCS12",
        "kafka.ssl.truststore.password": "trustpass",
        "kafka.request.timeout.ms": "10000",
        "kafka.default.api.timeout.ms": "20000",
    }


def test_two_links_log_in_with_oidc_client_credentials(secured_kafka, oidc_endpoint, new_secured_topic, grant,
                                                       spark, tmp_path):
    orders, dlq, out = new_secured_topic(2, "orders"), new_secured_topic(1, "dlq"), new_secured_topic(2, "out")
    producer = Producer(secured_kafka.librdkafka_config("admin"))
    for i in range(ROWS):
        producer.produce(orders, key=str(i).encode(), value=(b"poison" if i in POISON else f"order-1-{i}".encode()),
                         partition=i % 2)
    assert producer.flush(30) == 0
    into_delta, out_of_delta = f"oidc-{uuid.uuid4().hex[:8]}", f"oidc-{uuid.uuid4().hex[:8]}"
    grant_all(grant, link_acls(into_delta, read=(orders,), write=(dlq,)), principal=oidc_endpoint.client_id)
    grant_all(grant, link_acls(out_of_delta, write=(out,)), principal=oidc_endpoint.client_id)
    options = oidc_options(secured_kafka, oidc_endpoint)
    issued = oidc_endpoint.requests

    table = str(tmp_path / "orders")
    source = spark.readStream.format("lastagent-kafka").options(**options).option("subscribe", orders)
    (source.option("startingOffsets", "earliest").load()
     .writeStream.format("lastagent-delta").options(**options)
     .option("link", into_delta).option("checkpointLocation", str(tmp_path / "ckpt-in"))
     .option("transformer", "lastagent.examples:enrich").option("deadLetterTopic", dlq)
     .trigger(availableNow=True).start(table).awaitTermination())
    (spark.readStream.format("delta").load(table).selectExpr("key", "CAST(amount AS STRING) AS value")
     .writeStream.format("lastagent-kafka").options(**options).option("topic", out)
     .option("link", out_of_delta).option("checkpointLocation", str(tmp_path / "ckpt-out"))
     .option("arbitrationTable", str(tmp_path / "arb")).trigger(availableNow=True).start().awaitTermination())

    good = [i for i in range(ROWS) if i not in POISON]
    keys = Counter(int(r.key) for r in spark.read.format("delta").load(table).select("key").collect())
    assert sorted(keys) == good and max(keys.values()) == 1, "the table is not exactly once"
    admin = secured_kafka.librdkafka_config("admin")
    dead = read_committed(secured_kafka.bootstrap, dlq, len(POISON), config=admin)
    assert sorted(int(k) for k, _ in dead) == sorted(POISON), "dead letters not exactly once"
    copied = Counter(int(k) for k, _ in read_committed(secured_kafka.bootstrap, out, len(good), config=admin))
    assert sorted(copied) == good and max(copied.values()) == 1, "the sink's topic is not exactly once"
    # The pytest process (the driver) and Spark's Python workers each fetched tokens of their own.
    assert oidc_endpoint.requests - issued >= 2
    with KafkaXAResource({k[len("kafka."):]: v for k, v in options.items()}) as xa:
        for link in (into_delta, out_of_delta):
            assert xa.recover(f"lastagent-{link}-") == [], f"open transactions of {link}"
    for path in tmp_path.rglob("*"):  # tables, checkpoints, arbitration table
        if path.is_file():
            assert oidc_endpoint.client_secret.encode() not in path.read_bytes(), f"the client secret in {path}"


def test_a_refused_client_secret_stops_the_query_at_start_naming_the_setting(secured_kafka, oidc_endpoint, spark,
                                                                             new_secured_topic, tmp_path):
    options = oidc_options(secured_kafka, oidc_endpoint, secret="not-the-secret")
    query = (spark.readStream.format("rate").load().selectExpr("CAST(value AS STRING) AS value")
             .writeStream.format("lastagent-kafka").options(**options).option("topic", new_secured_topic(1, "never"))
             .option("link", f"oidc-{uuid.uuid4().hex[:8]}").option("checkpointLocation", str(tmp_path / "ckpt"))
             .option("arbitrationTable", str(tmp_path / "arb")).start())
    with pytest.raises(Exception) as failed:
        query.awaitTermination(120)
    text = str(failed.value)
    assert "kafka.sasl.oauthbearer.token.endpoint.url) refused client 'carol': invalid_client" in text, text
    assert "(HTTP 401); check clientId and clientSecret (kafka.sasl.jaas.config)" in text, text
    assert "not-the-secret" not in text
    # The source's driver side (confluent-kafka's admin client) says the same when it is built.
    with pytest.raises(TokenError, match="refused client 'carol': invalid_client") as source_failed:
        OffsetReader(KafkaSourceOptions.parse({**options, "subscribe": "never"}))
    assert "not-the-secret" not in str(source_failed.value)


# -- a token function (the AWS MSK IAM recipe), every client library ---------------------------------

_ENDPOINT: dict[str, str] = {}


def token() -> tuple[str, int]:
    """A token function as docs/security.md's MSK recipe has: returns (token, expiry in ms)."""
    request = urllib.request.Request(_ENDPOINT["url"], data=b"grant_type=client_credentials", method="POST",
                                     headers={"Authorization": "Basic " + b64encode(_ENDPOINT["basic"].encode()).decode(),
                                              "Content-Type": "application/x-www-form-urlencoded"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        value = json.loads(answer.read())["access_token"]
    _ENDPOINT["calls"] = str(int(_ENDPOINT.get("calls", "0")) + 1)
    return value, int(claims(value)["exp"] * 1000)


def test_a_token_function_logs_in_the_native_producer_kafka_python_and_confluent_kafka(
        secured_kafka, oidc_endpoint, new_secured_topic, grant, monkeypatch):
    monkeypatch.setitem(_ENDPOINT, "url", oidc_endpoint.url)
    monkeypatch.setitem(_ENDPOINT, "basic", f"{oidc_endpoint.client_id}:{oidc_endpoint.client_secret}")
    topic, link = new_secured_topic(1, "msk"), f"msk-{uuid.uuid4().hex[:8]}"
    grant_all(grant, link_acls(link, read=(topic,), write=(topic,)), principal=oidc_endpoint.client_id)
    settings = {k[len("kafka."):]: v for k, v in oidc_options(secured_kafka, oidc_endpoint).items()
                if "jaas" not in k and "oauthbearer" not in k and "callback" not in k}
    settings["sasl.oauthbearer.token.provider"] = f"{__name__}:token"
    config = KafkaConfig.parse(settings)

    writer = BranchWriter(config, f"lastagent-{link}-1-0-0", 60_000, init_timeout_s=20)  # native librdkafka
    for i in range(10):
        writer.send(topic, str(i).encode(), str(i).encode())
    handle = writer.prepare()
    with KafkaXAResource(config) as xa:  # kafka-python: EndTxn
        assert xa.commit(handle).outcome.name == "COMMITTED"
    source = KafkaSourceOptions.parse({f"kafka.{k}": v for k, v in settings.items()} | {"subscribe": topic})
    reader = OffsetReader(source)  # confluent-kafka's admin client, oauth_cb
    assert reader.latest(reader.partitions()) == {(topic, 0): 11}  # ten records and the commit marker
    assert int(_ENDPOINT["calls"]) >= 1
    assert len(read_committed(secured_kafka.bootstrap, topic, 10, config=secured_kafka.librdkafka_config("admin"))) == 10

