"""OAUTHBEARER: the Java client's OIDC settings and librdkafka's read once; tokens shared and renewed in time."""

from __future__ import annotations

import base64
import json
import pickle
import sys
import types

import pytest

from lastagent.errors import OptionError, TokenError
from lastagent.kafka.config import KafkaConfig, OAuth
from lastagent.kafka.oauth import Token, Tokens, claims, load_provider

pytestmark = pytest.mark.unit

HANDLER = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginCallbackHandler"
JAAS = ('org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required clientId="app" '
        'clientSecret="app-s3cret" scope="kafka" extension_logicalCluster="lkc-1";')
JAVA_OIDC = {"bootstrap.servers": "b:9093", "security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER",
             "sasl.jaas.config": JAAS, "sasl.login.callback.handler.class": HANDLER,
             "sasl.oauthbearer.token.endpoint.url": "https://idp.example/oauth2/token"}


def jwt(payload: dict) -> str:
    def part(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")
    return f"{part({'alg': 'RS256'})}.{part(payload)}.c2ln"


def test_java_oidc_settings_become_one_login_for_every_client():
    config = KafkaConfig.parse(JAVA_OIDC)
    oauth = config.security.oauth
    assert oauth == OAuth(endpoint="https://idp.example/oauth2/token", client_id="app",
                          client_secret=oauth.client_secret, scope="kafka", extensions=(("logicalCluster", "lkc-1"),))
    assert oauth.client_secret.value == "app-s3cret"
    rd = config.librdkafka()
    # librdkafka gets the mechanism only: the tokens come from lastagent's callbacks, never a curl build.
    assert rd["sasl.mechanism"] == "OAUTHBEARER" and not any(k.startswith("sasl.oauthbearer") for k in rd)
    assert "sasl.username" not in rd and set(config) == {"bootstrap.servers"}
    py = config.kafka_python()
    assert py["sasl_mechanism"] == "OAUTHBEARER" and py["sasl_oauth_token_provider"].extensions() == {
        "logicalCluster": "lkc-1"}
    assert callable(config.token_provider()) and set(config.oauth_cb()) == {"oauth_cb"}
    for text in (repr(config), repr(config.security), repr(dict(config))):
        assert "app-s3cret" not in text
    assert pickle.loads(pickle.dumps(config)) == config


def test_shaded_handler_and_kip_1139_and_librdkafka_names_are_read_too():
    shaded = KafkaConfig.parse({**JAVA_OIDC, "sasl.login.callback.handler.class": "kafkashaded." + HANDLER})
    assert shaded.security.oauth.client_id == "app"
    kip = KafkaConfig.parse({"bootstrap.servers": "b:1", "security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER",
                             "sasl.oauthbearer.token.endpoint.url": "https://idp/t",
                             "sasl.oauthbearer.client.credentials.client.id": "a",
                             "sasl.oauthbearer.client.credentials.client.secret": "s"})
    rd = KafkaConfig.parse({"bootstrap.servers": "b:1", "security.protocol": "SASL_SSL", "sasl.mechanisms": "OAUTHBEARER",
                            "sasl.oauthbearer.method": "oidc", "sasl.oauthbearer.token.endpoint.url": "https://idp/t",
                            "sasl.oauthbearer.client.id": "a", "sasl.oauthbearer.client.secret": "s",
                            "sasl.oauthbearer.extensions": "logicalCluster=lkc-1, identityPoolId=pool-2"})
    assert kip.security.oauth.endpoint == rd.security.oauth.endpoint == "https://idp/t"
    assert rd.security.oauth.extensions == (("logicalCluster", "lkc-1"), ("identityPoolId", "pool-2"))


@pytest.mark.parametrize("change,option,says", [
    ({"sasl.oauthbearer.token.endpoint.url": None}, "kafka.sasl.oauthbearer.token.endpoint.url", "is required"),
    ({"sasl.oauthbearer.token.endpoint.url": "file:///tmp/token"}, "kafka.sasl.oauthbearer.token.endpoint.url",
     "http(s)://"),
    ({"sasl.jaas.config": JAAS.replace(' clientSecret="app-s3cret"', "")}, "kafka.sasl.jaas.config", "clientSecret"),
    ({"sasl.oauthbearer.client.id": "other"}, "kafka.sasl.oauthbearer.client.id", "give one of them"),
    ({"sasl.login.callback.handler.class": "com.x.Handler"}, "kafka.sasl.login.callback.handler.class",
     "Java client setting"),
    ({"sasl.jaas.config": JAAS.replace("scope=", "unsecuredLoginStringClaim_sub=")}, "kafka.sasl.jaas.config",
     "unsecuredLoginStringClaim_sub"),
    ({"sasl.oauthbearer.token.provider": "mytokens:msk"}, "kafka.sasl.oauthbearer.token.provider", "not both"),
    ({"sasl.mechanism": "SCRAM-SHA-512"}, "kafka.sasl.mechanism", "which is mechanism OAUTHBEARER"),
    ({"security.protocol": "SSL"}, "kafka.security.protocol", "SASL settings are given"),
    ({"enable.sasl.oauthbearer.unsecure.jwt": "true"}, "kafka.enable.sasl.oauthbearer.unsecure.jwt", "tests only"),
    ({"sasl.login.read.timeout.ms": "soon"}, "kafka.sasl.login.read.timeout.ms", "milliseconds"),
])
def test_what_an_oauth_login_cannot_use_names_the_setting(change, option, says):
    settings = {k: v for k, v in {**JAVA_OIDC, **change}.items() if v is not None}
    with pytest.raises(OptionError, match=f"option '{option}'") as err:
        KafkaConfig.parse(settings)
    assert says in str(err.value) and "app-s3cret" not in str(err.value)


def test_oauth_settings_under_another_mechanism_are_refused():
    with pytest.raises(OptionError, match="option 'kafka.sasl.oauthbearer.token.endpoint.url'.*OAUTHBEARER"):
        KafkaConfig.parse({"bootstrap.servers": "b:1", "security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN",
                           "sasl.username": "u", "sasl.password": "p",
                           "sasl.oauthbearer.token.endpoint.url": "https://idp/t"})


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def provider_module(monkeypatch):
    """A module ``lastagent_test_tokens`` whose ``token()`` returns what the test puts in ``answers``."""
    module = types.ModuleType("lastagent_test_tokens")
    module.answers = []  # type: ignore[attr-defined]
    module.calls = 0  # type: ignore[attr-defined]

    def token():
        module.calls += 1  # type: ignore[attr-defined]
        answer = module.answers.pop(0)  # type: ignore[attr-defined]
        if isinstance(answer, Exception):
            raise answer
        return answer

    module.token = token  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lastagent_test_tokens", module)
    return module


def provided(clock: Clock) -> Tokens:
    return Tokens(OAuth(provider="lastagent_test_tokens:token", extensions=(("e", "1"),)), clock=clock)


def test_a_provided_token_is_shared_until_a_quarter_of_its_life_is_left(provider_module):
    clock = Clock()
    now_ms = int(clock.now * 1000)
    provider_module.answers += [("msk-token-1", now_ms + 900_000), ("msk-token-2", now_ms + 1_800_000)]
    tokens = provided(clock)
    assert tokens.native() == ("msk-token-1", now_ms + 900_000, "lastagent", {"e": "1"})
    clock.now += 600  # 600 of 900 s gone: 1/3 left
    assert tokens.confluent("")[0] == "msk-token-1" and provider_module.calls == 1
    clock.now += 76  # 224 s of 900 left: under a quarter (librdkafka asks again at 80%, 180 s left)
    value, expiry_s, _, _ = tokens.confluent("")
    assert value == "msk-token-2" and expiry_s == (now_ms + 1_800_000) / 1000 and tokens.fetched == 2


def test_a_jwt_from_the_provider_gives_its_own_expiry_and_subject(provider_module):
    clock = Clock()
    provider_module.answers.append(jwt({"sub": "svc-7", "exp": clock.now + 3600}))
    token = provided(clock).current()
    assert token.principal == "svc-7" and token.expiry_ms == int((clock.now + 3600) * 1000)


@pytest.mark.parametrize("answer,says", [
    (RuntimeError("no credentials in the instance profile"), "raised RuntimeError: no credentials"),
    (42, "returned int"),
    ("opaque-token", "without a future expiry"),
    (("opaque-token", 1), "without a future expiry"),
])
def test_a_failing_provider_is_named_and_its_failure_kept(provider_module, answer, says):
    provider_module.answers.append(answer)
    with pytest.raises(TokenError, match="kafka.sasl.oauthbearer.token.provider") as err:
        provided(Clock()).current()
    assert says in str(err.value)


def test_a_provider_that_cannot_be_imported_is_named():
    with pytest.raises(TokenError, match="cannot be loaded.*importable on the driver and on every executor"):
        load_provider("no_such_module_here:token")
    with pytest.raises(TokenError, match="not a function"):
        load_provider("json:__doc__")
    assert load_provider("json.dumps") is json.dumps


def test_claims_of_a_token_that_is_not_a_jwt_are_empty():
    assert claims("aGVsbG8") == {} and claims("a.b.c") == {} and claims(jwt({"sub": "x"})) == {"sub": "x"}
    token = Token("secret-text", 2, "p", {}, 1)
    assert "secret-text" not in repr(token)
