"""SASL/OAUTHBEARER on the secured test broker, with tokens from a real client-credentials endpoint.

The endpoint (``dev/oidc.py``, fixture ``oidc_endpoint``) issues RS256 JWTs; the broker checks them
with Kafka's own ``OAuthBearerValidatorCallbackHandler`` against the endpoint's JWKS. A token the
endpoint issued logs in as ``User:<client id>`` and is then held to ACLs like any user; a token
signed by another key, or meant for another audience, is refused at authentication, and the broker's
log says which check failed. Every wait is bounded.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pytest

pytestmark = pytest.mark.integration

WAIT_S = 10.0


def _token_request(endpoint, client_id: str, secret: str, **form: str) -> urllib.request.Request:
    """RFC 6749 section 4.4.2: a form POST, the client in HTTP Basic (section 2.3.1: each part form-urlencoded)."""
    basic = base64.b64encode(f"{urllib.parse.quote_plus(client_id)}:{urllib.parse.quote_plus(secret)}".encode()).decode()
    body = urllib.parse.urlencode({"grant_type": "client_credentials", **form}).encode()
    return urllib.request.Request(endpoint.url, data=body, method="POST", headers={
        "Content-Type": "application/x-www-form-urlencoded", "Authorization": f"Basic {basic}", "Accept": "application/json"})


def _fetch_token(endpoint) -> dict[str, Any]:
    with urllib.request.urlopen(_token_request(endpoint, endpoint.client_id, endpoint.client_secret), timeout=WAIT_S) as answer:
        assert answer.status == 200 and answer.headers["Cache-Control"] == "no-store"
        return json.load(answer)


def _error(request: urllib.request.Request) -> tuple[int, dict[str, Any]]:
    with pytest.raises(urllib.error.HTTPError) as failed:
        urllib.request.urlopen(request, timeout=WAIT_S)
    return failed.value.code, json.load(failed.value)


def _oauth_config(secured_kafka, token: str) -> dict[str, Any]:
    """kafka-python keyword arguments: OAUTHBEARER over the broker's TLS, presenting ``token``."""
    from kafka.net.sasl.oauth import AbstractTokenProvider

    class Token(AbstractTokenProvider):
        def token(self) -> str:
            return token

    tls = {k: v for k, v in secured_kafka.admin_config.items() if not k.startswith("sasl_")}
    return {**tls, "sasl_mechanism": "OAUTHBEARER", "sasl_oauth_token_provider": Token()}


def test_a_token_from_the_endpoint_logs_in_as_its_client_and_acls_apply(secured_kafka, oidc_endpoint, new_secured_topic, grant):
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient
    from kafka.errors import TopicAuthorizationFailedError

    issued = oidc_endpoint.requests
    answer = _fetch_token(oidc_endpoint)
    assert answer["token_type"] == "Bearer" and answer["expires_in"] > 0
    assert oidc_endpoint.requests == issued + 1
    token = answer["access_token"]
    topic = new_secured_topic()

    admin = KafkaAdminClient(client_id="lastagent-tests-oauth", bootstrap_timeout_ms=int(WAIT_S * 1000),
                             **_oauth_config(secured_kafka, token))
    try:
        # Logged in, but User:carol may not describe the topic yet.
        assert topic not in admin.list_topics()
        assert [t["error_code"] for t in admin.describe_topics([topic])] == [TopicAuthorizationFailedError.errno]
        grant(oidc_endpoint.client_id, "TOPIC", topic, ["DESCRIBE", "WRITE"])
        assert topic in admin.list_topics()
        assert [t["error_code"] for t in admin.describe_topics([topic])] == [0]
    finally:
        admin.close()

    producer = KafkaProducer(**_oauth_config(secured_kafka, token), max_block_ms=int(WAIT_S * 1000))
    try:
        sent = producer.send(topic, b"over oauthbearer").get(timeout=WAIT_S)
        assert (sent.topic, sent.offset) == (topic, 0)
    finally:
        producer.close(timeout=WAIT_S)


def _forged(endpoint, tmp_path, problem: str) -> str:
    """A token like the endpoint's, but signed by another key (with the broker's kid) or for another audience."""
    import oidc  # dev/, on sys.path through conftest

    now = int(time.time())
    claims = {"iss": endpoint.issuer, "sub": endpoint.client_id, "aud": endpoint.audience, "iat": now,
              "exp": now + 300, "scope": "kafka"}
    if problem == "another key":
        return oidc.sign(claims, oidc.make_keys(tmp_path / "other"), kid=endpoint.keys["kid"])
    return oidc.sign({**claims, "aud": "another-service"}, endpoint.keys)


@pytest.mark.parametrize("problem, cause", [
    pytest.param("another key", "JWT rejected due to invalid signature", id="another-key"),
    pytest.param("another audience", "Audience (aud) claim [another-service] doesn't contain an acceptable identifier",
                 id="another-audience"),
])
def test_a_forged_token_fails_authentication(secured_kafka, oidc_endpoint, tmp_path, caplog, problem, cause):
    from kafka.admin import KafkaAdminClient
    from kafka.errors import KafkaTimeoutError

    log = secured_kafka.workdir / "server.log"
    offset = log.stat().st_size
    caplog.set_level(logging.WARNING, logger="kafka")
    started = time.monotonic()
    with pytest.raises(KafkaTimeoutError):
        KafkaAdminClient(**_oauth_config(secured_kafka, _forged(oidc_endpoint, tmp_path, problem)), bootstrap_timeout_ms=1500)
    assert time.monotonic() - started < WAIT_S
    # kafka-python reports the SASL failure, or sometimes sees the broker close the connection before
    # it reads the error response (it checks for EOF first); the attempt the bootstrap deadline cuts
    # short times out. The broker's own log names the check that refused the token.
    failures = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Bootstrap connection to")]
    refusals = ("SaslAuthenticationFailedError", "socket disconnected")
    assert any(any(c in f for c in refusals) for f in failures), failures
    assert all(any(c in f for c in refusals) or "time" in f.lower() for f in failures), failures
    with open(log, "rb") as f:
        f.seek(offset)
        written = f.read().decode(errors="replace")
    assert "Could not validate the access token" in written and cause in written, written[-2000:]
    assert "Failed authentication with /127.0.0.1" in written and '{"status":"invalid_token"}' in written


def test_librdkafka_gets_its_own_token_from_the_endpoint(secured_kafka, oidc_endpoint):
    """librdkafka's built-in OIDC client (HTTP Basic, as it sends it) gets a token the broker accepts."""
    from confluent_kafka import Producer

    issued = oidc_endpoint.requests
    errors: list = []
    producer = Producer({
        "bootstrap.servers": secured_kafka.bootstrap, "security.protocol": "SASL_SSL",
        "ssl.ca.location": str(secured_kafka.pki["ca"]), "sasl.mechanisms": "OAUTHBEARER",
        "sasl.oauthbearer.method": "oidc", "sasl.oauthbearer.token.endpoint.url": oidc_endpoint.url,
        "sasl.oauthbearer.client.id": oidc_endpoint.client_id,
        "sasl.oauthbearer.client.secret": oidc_endpoint.client_secret,
        "error_cb": errors.append, "logger": logging.getLogger("librdkafka"),
    })
    producer.list_topics(timeout=WAIT_S)  # raises unless authenticated
    assert errors == [] and oidc_endpoint.requests > issued


def test_the_endpoint_refuses_a_wrong_secret_and_other_grants(oidc_endpoint):
    status, error = _error(_token_request(oidc_endpoint, oidc_endpoint.client_id, "not-the-secret"))
    assert (status, error["error"]) == (401, "invalid_client")
    status, error = _error(_token_request(oidc_endpoint, "nobody", oidc_endpoint.client_secret))
    assert (status, error["error"]) == (401, "invalid_client")
    status, error = _error(_token_request(oidc_endpoint, oidc_endpoint.client_id, oidc_endpoint.client_secret,
                                          grant_type="password"))
    assert (status, error["error"]) == (400, "unsupported_grant_type")
    # Credentials in the body are the other way section 2.3.1 allows.
    body = urllib.parse.urlencode({"grant_type": "client_credentials", "client_id": oidc_endpoint.client_id,
                                   "client_secret": oidc_endpoint.client_secret, "scope": "kafka read"}).encode()
    request = urllib.request.Request(oidc_endpoint.url, data=body, method="POST",
                                     headers={"Content-Type": "application/x-www-form-urlencoded"})
    with urllib.request.urlopen(request, timeout=WAIT_S) as answer:
        assert json.load(answer)["scope"] == "kafka read"
