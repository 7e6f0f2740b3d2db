"""One Kafka configuration for every client: Java and librdkafka forms, translated once; secrets never shown."""

from __future__ import annotations

import pickle

import pytest

from lastagent.errors import OptionError
from lastagent.kafka.config import KafkaConfig
from lastagent.sinks.kafka_sink_options import KafkaSinkOptions

pytestmark = pytest.mark.unit

SECRET = "s3cr\"et;pw"
SCRAM = ('org.apache.kafka.common.security.scram.ScramLoginModule required username="alice" '
         'password="s3cr\\"et;pw";')
JAVA = {"bootstrap.servers": "b:9093", "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.jaas.config": SCRAM, "linger.ms": "5"}


def test_java_scram_reaches_both_libraries():
    config = KafkaConfig.parse(JAVA)
    rd = config.librdkafka()
    assert rd["security.protocol"] == "SASL_SSL" and rd["sasl.mechanism"] == "SCRAM-SHA-512"
    assert rd["sasl.username"] == "alice" and rd["sasl.password"] == SECRET and rd["linger.ms"] == "5"
    assert "sasl.jaas.config" not in rd
    py = config.kafka_python(timeout_ms=5000)
    assert py["bootstrap_servers"] == ["b:9093"] and py["security_protocol"] == "SASL_SSL"
    assert (py["sasl_mechanism"], py["sasl_plain_username"], py["sasl_plain_password"]) == ("SCRAM-SHA-512", "alice",
                                                                                            SECRET)
    assert py["ssl_context"].check_hostname and py["request_timeout_ms"] == py["bootstrap_timeout_ms"] == 5000


def test_librdkafka_names_work_too():
    config = KafkaConfig.parse({"bootstrap.servers": "b:1", "security.protocol": "sasl_plaintext",
                                "sasl.mechanisms": "PLAIN", "sasl.username": "u", "sasl.password": "p"})
    assert config.kafka_python()["sasl_plain_password"] == "p"
    assert config.librdkafka()["sasl.mechanism"] == "PLAIN"


@pytest.mark.parametrize("module", ["org.apache.kafka.common.security.plain.PlainLoginModule",
                                    "kafkashaded.org.apache.kafka.common.security.plain.PlainLoginModule"])
def test_plain_login_module_means_plain(module):
    config = KafkaConfig.parse({"bootstrap.servers": "b:1", "security.protocol": "SASL_SSL",
                                "sasl.jaas.config": f"{module} required username=bob password=pw;"})
    assert config.librdkafka()["sasl.mechanism"] == "PLAIN" and config.security.username == "bob"


@pytest.mark.parametrize("settings,option,says", [
    ({**JAVA, "sasl.jaas.config": "com.sun.security.auth.module.Krb5LoginModule required useKeyTab=true;"},
     "kafka.sasl.jaas.config", "Kerberos (GSSAPI) is not supported"),
    ({**JAVA, "sasl.jaas.config": "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required;"},
     "kafka.sasl.mechanism", "which is mechanism OAUTHBEARER"),
    ({**JAVA, "sasl.jaas.config": "software.amazon.msk.auth.iam.IAMLoginModule required;"},
     "kafka.sasl.jaas.config", "kafka.sasl.oauthbearer.token.provider"),
    ({**JAVA, "sasl.mechanism": "AWS_MSK_IAM"}, "kafka.sasl.mechanism", "MSKAuthTokenProvider.generate_auth_token"),
    ({**JAVA, "sasl.mechanism": "GSSAPI"}, "kafka.sasl.mechanism", "ScramLoginModule: set kafka.sasl.mechanism"),
    ({**JAVA, "sasl.jaas.config": "PlainLoginModule username=x"}, "kafka.sasl.jaas.config", "is not a JAAS entry"),
    ({k: v for k, v in JAVA.items() if k != "sasl.mechanism"}, "kafka.sasl.mechanism", "SCRAM-SHA-256 or SCRAM-SHA-512"),
    ({"bootstrap.servers": "b:1", "security.protocol": "SASL_SSL", "sasl.mechanism": "GSSAPI"},
     "kafka.sasl.mechanism", "GSSAPI is not supported"),
    ({"bootstrap.servers": "b:1", "security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN"},
     "kafka.sasl.jaas.config", "needs a username and a password"),
    ({**JAVA, "security.protocol": "SSL"}, "kafka.security.protocol", "SASL settings are given"),
    ({**JAVA, "security.protocol": "TLS"}, "kafka.security.protocol", "is not one of"),
    ({**JAVA, "ssl.truststore.location": "/etc/kafka/trust.jks", "ssl.truststore.type": "JKS"},
     "kafka.ssl.truststore.location", "keytool -importkeystore"),
    ({**JAVA, "ssl.truststore.location": "/etc/kafka/trust.jks"}, "kafka.ssl.truststore.type", "is unset"),
    ({**JAVA, "ssl.keystore.location": "/etc/kafka/key.jks"}, "kafka.ssl.keystore.location", "Java-only format"),
    ({**JAVA, "ssl.truststore.location": "/t.p12", "ssl.ca.location": "/ca.pem"}, "kafka.ssl.ca.location",
     "one source of trusted certificates"),
    ({**JAVA, "ssl.enabled.protocols": "TLSv1.1,TLSv1.2"}, "kafka.ssl.enabled.protocols", "TLS 1.2 or 1.3"),
    ({**JAVA, "ssl.endpoint.identification.algorithm": "dns"}, "kafka.ssl.endpoint.identification.algorithm",
     "give https"),
    ({**JAVA, "sasl.login.callback.handler.class": "com.x.Handler"}, "kafka.sasl.login.callback.handler.class",
     "Java client setting"),
    ({"bootstrap.servers": "b:1", "ssl.ca.location": "/ca.pem"}, "kafka.security.protocol", "use SSL or SASL_SSL"),
])
def test_what_cannot_be_translated_names_the_setting(settings, option, says):
    with pytest.raises(OptionError, match=f"option '{option}'") as err:
        KafkaConfig.parse(settings)
    assert says in str(err.value)
    assert SECRET not in str(err.value) and "s3cr" not in str(err.value)


def test_store_settings_translate_per_library():
    config = KafkaConfig.parse({**JAVA, "ssl.truststore.location": "/etc/ca.pem", "ssl.truststore.type": "PEM",
                                "ssl.endpoint.identification.algorithm": "",
                                "ssl.keystore.location": "/etc/me.p12", "ssl.keystore.type": "PKCS12",
                                "ssl.keystore.password": "kp"})
    rd = config.librdkafka()
    assert rd["ssl.ca.location"] == "/etc/ca.pem" and rd["ssl.endpoint.identification.algorithm"] == "none"
    assert (rd["ssl.keystore.location"], rd["ssl.keystore.password"]) == ("/etc/me.p12", "kp")
    assert not config.security.check_hostname


def test_secrets_stay_out_of_reprs_settings_and_pickles_keep_them():
    config = KafkaConfig.parse({**JAVA, "ssl.truststore.location": "/t.p12", "ssl.truststore.password": "trustpw"})
    for text in (repr(config), str(config), repr(dict(config)), repr(config.security)):
        assert "s3cr" not in text and "trustpw" not in text and "jaas" not in text
    assert set(config) == {"bootstrap.servers", "linger.ms"}
    assert pickle.loads(pickle.dumps(config)) == config
    assert pickle.loads(pickle.dumps(KafkaConfig.parse(JAVA))).librdkafka()["sasl.password"] == SECRET
    options = KafkaSinkOptions.parse({"link": "l", "arbitrationTable": "/a", "checkpointLocation": "/c",
                                      **{f"kafka.{k}": v for k, v in JAVA.items()}})
    assert "s3cr" not in repr(options) and options.client_config.security.username == "alice"


def test_plain_config_equals_its_settings():
    assert KafkaConfig.parse({"bootstrap.servers": "b:1"}) == {"bootstrap.servers": "b:1"}
    assert KafkaConfig.parse(JAVA) != {k: v for k, v in JAVA.items() if k in ("bootstrap.servers", "linger.ms")}
