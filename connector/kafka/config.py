"""The user's ``kafka.*`` settings, checked once and translated for every Kafka client lastagent opens.

lastagent talks to Kafka through two client libraries: confluent-kafka (librdkafka) for the
executors' consumers and branch producers and the source's offset lookups, and kafka-python
for the driver's admin and transaction-coordinator requests (``EndTxn``, list/describe
transactions) and the ``lastagent`` command. Users bring the settings of Spark's own ``kafka``
format, which are the Java client's (``sasl.jaas.config``, key and trust stores), or
librdkafka's (``sasl.username``, ``ssl.ca.location``). :class:`KafkaConfig` reads either form
once, keeps the security part apart (secrets never appear in its ``repr``, in
:attr:`KafkaConfig.settings`, or in an error text), and hands each library its own form:
:meth:`KafkaConfig.librdkafka` and :meth:`KafkaConfig.kafka_python`. What neither library can
do is an :class:`~lastagent.errors.OptionError` naming the setting and what to use instead.

Parsing is pure; the key and trust files are read when a client is built. The driver builds its
clients at query start, so a wrong path or password fails there, naming the setting.
"""

from __future__ import annotations

import os
import re
import ssl
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from lastagent.errors import OptionError
from lastagent.kafka.oauth import OAuth, tokens
from lastagent.redact import Secret

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")

_PLAIN = "org.apache.kafka.common.security.plain.PlainLoginModule"
_SCRAM = "org.apache.kafka.common.security.scram.ScramLoginModule"
_OAUTH = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule"
#: The Java client's OIDC client-credentials login (Kafka 3.1+; the ``secured`` package before 3.4).
_OAUTH_HANDLERS = ("org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginCallbackHandler",
                   "org.apache.kafka.common.security.oauthbearer.secured.OAuthBearerLoginCallbackHandler")
_MSK_IAM_HINT = ("AWS MSK IAM: use kafka.sasl.mechanism=OAUTHBEARER with "
                 "kafka.sasl.oauthbearer.token.provider set to a function that returns "
                 "MSKAuthTokenProvider.generate_auth_token(<region>) (package aws-msk-iam-sasl-signer-python); "
                 "docs/security.md has the recipe")
#: JAAS login modules we do not translate, and what they are.
_OTHER_MODULES = {
    "com.sun.security.auth.module.Krb5LoginModule": "Kerberos (GSSAPI)",
    "software.amazon.msk.auth.iam.IAMLoginModule": _MSK_IAM_HINT,
}
#: Runtimes that shade the Kafka client (Databricks) rename its packages with a prefix.
_SHADED = re.compile(r"^(?:kafkashaded\.|shaded\.)")

#: The Java client's bound of one API call, retries included; our retries honour it (kafka_retry).
API_TIMEOUT = "default.api.timeout.ms"
DEFAULT_API_TIMEOUT_MS = 60_000

#: Java client settings neither library can honour, with what to do instead.
_JAVA_ONLY = {
    "sasl.login.callback.handler.class": "Java callback classes cannot run in Python clients; for OIDC give "
                                         f"{_OAUTH_HANDLERS[0]} (or leave it out), for a token you sign "
                                         "yourself kafka.sasl.oauthbearer.token.provider",
    "sasl.client.callback.handler.class": "Java callback classes cannot run in Python clients; for a token you "
                                          "sign yourself (AWS MSK IAM) use kafka.sasl.oauthbearer.token.provider",
    "sasl.oauthbearer.jwt.retriever.class": "Java classes cannot run in Python clients; use the client-credentials "
                                            "grant or kafka.sasl.oauthbearer.token.provider",
    "sasl.oauthbearer.config": "librdkafka's unsecured JWT is for tests only; use an OIDC token endpoint or "
                               "kafka.sasl.oauthbearer.token.provider",
    "enable.sasl.oauthbearer.unsecure.jwt": "librdkafka's unsecured JWT is for tests only; use an OIDC token "
                                            "endpoint or kafka.sasl.oauthbearer.token.provider",
    "sasl.login.class": "Java login classes cannot run in Python clients; use PLAIN or SCRAM",
    "ssl.engine.factory.class": "Java SSL engines cannot run in Python clients; give PEM or PKCS12 stores",
    "ssl.keymanager.algorithm": "the Python clients use OpenSSL; drop this setting",
    "ssl.trustmanager.algorithm": "the Python clients use OpenSSL; drop this setting",
    "ssl.provider": "the Python clients use OpenSSL; drop this setting",
    "ssl.secure.random.implementation": "the Python clients use OpenSSL; drop this setting",
    "security.providers": "Java security providers cannot run in Python clients; drop this setting",
}
#: TLS versions both libraries negotiate (OpenSSL's defaults); older ones are refused.
_TLS_VERSIONS = {"TLS", "TLSv1.2", "TLSv1.3"}
#: OAUTHBEARER settings this module owns: the Java client's (OIDC client credentials, Kafka 3.1+ and
#: 4.1's KIP-1139 names), librdkafka's, and lastagent's own token provider hook.
_OAUTH_SETTINGS = ("sasl.oauthbearer.token.endpoint.url", "sasl.login.callback.handler.class",
                   "sasl.oauthbearer.client.credentials.client.id", "sasl.oauthbearer.client.credentials.client.secret",
                   "sasl.oauthbearer.scope", "sasl.oauthbearer.sub.claim.name", "sasl.oauthbearer.scope.claim.name",
                   "sasl.login.connect.timeout.ms", "sasl.login.read.timeout.ms",
                   "sasl.oauthbearer.method", "sasl.oauthbearer.client.id", "sasl.oauthbearer.client.secret",
                   "sasl.oauthbearer.extensions", "sasl.oauthbearer.token.provider")
#: librdkafka's names for the settings this module owns (besides the Java ones).
_NATIVE_SECURITY = ("security.protocol", "sasl.mechanism", "sasl.mechanisms", "sasl.username", "sasl.password",
                    "ssl.ca.location", "ssl.ca.pem", "ssl.certificate.location", "ssl.certificate.pem",
                    "ssl.key.location", "ssl.key.pem", "ssl.key.password", "ssl.keystore.location",
                    "ssl.keystore.password", "ssl.keystore.type", "ssl.endpoint.identification.algorithm",
                    "enable.ssl.certificate.verification", "sasl.jaas.config", "ssl.truststore.location",
                    "ssl.truststore.type", "ssl.truststore.password", "ssl.truststore.certificates",
                    "ssl.keystore.key", "ssl.keystore.certificate.chain", "ssl.protocol", "ssl.enabled.protocols",
                    *_OAUTH_SETTINGS)


#: What a denied request needs, by Kafka's error name (both libraries use these names); docs/security.md.
ACL_NEEDED = {
    "TOPIC_AUTHORIZATION_FAILED": "Describe on the Topic, and Write to produce or Read to consume",
    "GROUP_AUTHORIZATION_FAILED": "Read on the consumer Group: kafka.group.id, else prefixed by the source's "
                                  "groupIdPrefix ('lastagent-source-')",
    "TRANSACTIONAL_ID_AUTHORIZATION_FAILED": "Write and Describe on TransactionalId, prefixed 'lastagent-<link>-'",
    "CLUSTER_AUTHORIZATION_FAILED": "DescribeConfigs on the Cluster",
}
#: Kafka error names of a refused login, and what to check.
LOGIN_FAILED = ("SASL_AUTHENTICATION_FAILED", "_AUTHENTICATION")
LOGIN_HINT = ("check the username and password in kafka.sasl.jaas.config (or kafka.sasl.username/kafka.sasl.password) "
              "and kafka.sasl.mechanism; with OAUTHBEARER, that the broker accepts the token's issuer, audience "
              "and signing key (docs/security.md)")


def access_hint(error_name: str) -> str | None:
    """What to grant or check after a Kafka error of this name, or None if it is not about access."""
    if error_name in ACL_NEEDED:
        return f"the principal needs {ACL_NEEDED[error_name]} (docs/security.md)"
    if error_name in LOGIN_FAILED:
        return f"the broker refused the login: {LOGIN_HINT}"
    if error_name == "_SSL":
        return ("the TLS handshake failed: check kafka.ssl.truststore.location (or kafka.ssl.ca.location) and "
                "kafka.ssl.endpoint.identification.algorithm")
    return None


@dataclass(frozen=True)
class Store:
    """Trust or key material in one of the forms both libraries can be given.

    Attributes:
        kind: ``pem-file``, ``pem-text`` or ``pkcs12``.
        option: the user's setting it came from, for error messages (e.g. ``kafka.ssl.truststore.location``).
        location: the file, for ``pem-file`` and ``pkcs12``.
        text: the PEM text, for ``pem-text`` (certificates; for a key store, certificate chain).
        key: the private key's PEM file or text (``pem-file`` / ``pem-text`` key stores).
        password: the store's password (PKCS12) or the private key's password (PEM).
    """

    kind: str
    option: str
    location: str | None = None
    text: Secret | None = None
    key: Secret | None = None
    password: Secret | None = None


@dataclass(frozen=True)
class Security:
    """How to reach the cluster: protocol, SASL login, TLS trust and client identity."""

    protocol: str = "PLAINTEXT"
    mechanism: str | None = None
    username: str | None = None
    password: Secret | None = None
    trust: Store | None = None
    identity: Store | None = None
    check_hostname: bool = True
    verify: bool = True
    oauth: OAuth | None = None

    @property
    def sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")


@dataclass(frozen=True, eq=False)
class KafkaConfig(Mapping[str, str]):
    """The checked ``kafka.*`` settings of one query (picklable; travels to executors).

    As a mapping it holds the settings that are not about security, prefix removed (e.g.
    ``bootstrap.servers``, ``group.id``, tuning): safe to log. :attr:`security` holds the rest.
    """

    settings: Mapping[str, str]
    security: Security = field(default_factory=Security)

    # -- Mapping over the non-secret settings --------------------------------------------------

    def __getitem__(self, key: str) -> str:
        return self.settings[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.settings)

    def __len__(self) -> int:
        return len(self.settings)

    def __repr__(self) -> str:
        return f"KafkaConfig({dict(self.settings)!r}, {self.security!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KafkaConfig):
            return dict(self.settings) == dict(other.settings) and self.security == other.security
        # Like any mapping; a configuration with security settings equals no plain dict.
        return isinstance(other, Mapping) and self.security == Security() and dict(self.settings) == dict(other)

    __hash__ = None  # type: ignore[assignment]  # a mapping, like dict

    @property
    def bootstrap_servers(self) -> str:
        return self.settings.get("bootstrap.servers", "")

    @property
    def api_timeout_ms(self) -> int:
        """How long one call may keep retrying through broker loss: the Java client's
        ``default.api.timeout.ms`` (default 60000), checked by :meth:`parse`."""
        return int(self.settings.get(API_TIMEOUT, DEFAULT_API_TIMEOUT_MS))

    # -- parsing ------------------------------------------------------------------------------

    @classmethod
    def of(cls, config: KafkaConfig | Mapping[str, str]) -> KafkaConfig:
        """``config`` itself if already checked, else :meth:`parse` of it."""
        return config if isinstance(config, KafkaConfig) else cls.parse(config)

    @classmethod
    def parse(cls, settings: Mapping[str, str]) -> KafkaConfig:
        """Checks the user's settings (``kafka.`` prefix removed, Java or librdkafka names).

        Raises:
            OptionError: a setting neither client can honour, or settings that contradict each
                other; the message names the ``kafka.*`` option and what to use instead.
        """
        raw = {str(k).lower() if str(k).lower() in _NATIVE_SECURITY else str(k): str(v) for k, v in settings.items()}
        for key, why in _JAVA_ONLY.items():
            if key in raw and not (key == "sasl.login.callback.handler.class"
                                   and _SHADED.sub("", raw[key].strip()) in _OAUTH_HANDLERS):
                raise OptionError(f"kafka.{key}", f"is a Java client setting lastagent cannot honour: {why}")
        protocol = raw.get("security.protocol", "PLAINTEXT").strip().upper()
        if protocol not in SECURITY_PROTOCOLS:
            raise OptionError("kafka.security.protocol", f"{protocol!r} is not one of {', '.join(SECURITY_PROTOCOLS)}")
        mechanism, username, password, oauth = _sasl(raw, protocol)
        _tls_versions(raw)
        algorithm = raw.get("ssl.endpoint.identification.algorithm", "https").strip().lower()
        if algorithm not in ("https", "", "none"):
            raise OptionError("kafka.ssl.endpoint.identification.algorithm",
                              f"{algorithm!r} is not valid; give https (check the broker's host name) or an empty "
                              "value (do not)")
        verify = _boolean(raw, "enable.ssl.certificate.verification", True)
        security = Security(protocol, mechanism, username, password, _trust(raw), _identity(raw),
                            check_hostname=algorithm == "https" and verify, verify=verify, oauth=oauth)
        if not security.tls and (security.trust or security.identity):
            raise OptionError("kafka.security.protocol",
                              f"is {protocol}, but TLS key or trust stores are given; use SSL or SASL_SSL")
        plain = {k: v for k, v in raw.items() if k not in _NATIVE_SECURITY}
        if API_TIMEOUT in plain:
            value = plain[API_TIMEOUT].strip()
            if not value.isdigit() or int(value) <= 0:
                raise OptionError(f"kafka.{API_TIMEOUT}", f"{value!r} is not a positive number of milliseconds; "
                                                          f"the default is {DEFAULT_API_TIMEOUT_MS}")
            plain[API_TIMEOUT] = value
            if int(value) == DEFAULT_API_TIMEOUT_MS:  # the default given explicitly changes nothing
                del plain[API_TIMEOUT]
        return cls(plain, security)

    # -- translations ---------------------------------------------------------------------------

    def librdkafka(self) -> dict[str, Any]:
        """Settings for a confluent-kafka client (consumer, producer, admin). Driver or executor.

        Raises:
            OptionError: a key or trust store cannot be read (names its setting).
        """
        out: dict[str, Any] = dict(self.settings)
        out.pop(API_TIMEOUT, None)  # a Java client setting that our retries honour (kafka_retry), not librdkafka
        sec = self.security
        out["security.protocol"] = sec.protocol
        if sec.oauth is not None:
            # The token comes from lastagent's provider (oauth_cb, the native clients' token_provider):
            # one path for every client, whether or not its librdkafka was built with OIDC (curl).
            out["sasl.mechanism"] = "OAUTHBEARER"
        elif sec.sasl:
            out.update({"sasl.mechanism": sec.mechanism, "sasl.username": sec.username,
                        "sasl.password": sec.password.value if sec.password else ""})
        if sec.tls:
            out["ssl.endpoint.identification.algorithm"] = "https" if sec.check_hostname else "none"
            out["enable.ssl.certificate.verification"] = sec.verify
            if sec.trust is not None:
                if sec.trust.kind == "pem-file":
                    out["ssl.ca.location"] = sec.trust.location
                else:  # PEM text, or a PKCS12 trust store librdkafka cannot read: its certificates as PEM
                    out["ssl.ca.pem"] = _trusted_pem(sec.trust)
            ident = sec.identity
            if ident is not None:
                if ident.kind == "pkcs12":
                    out["ssl.keystore.location"] = ident.location
                    out["ssl.keystore.password"] = ident.password.value if ident.password else ""
                elif ident.kind == "pem-file":
                    out["ssl.certificate.location"] = ident.location
                    out["ssl.key.location"] = ident.key.value if ident.key else ident.location
                else:
                    out["ssl.certificate.pem"] = ident.text.value if ident.text else ""
                    out["ssl.key.pem"] = ident.key.value if ident.key else ""
                if ident.kind != "pkcs12" and ident.password is not None:
                    out["ssl.key.password"] = ident.password.value
        return out

    def kafka_python(self, timeout_ms: int = 30_000, client_id: str = "lastagent") -> dict[str, Any]:
        """Keyword arguments for a kafka-python client (``KafkaAdminClient``). Driver side.

        Every request and the first connection are bounded by ``timeout_ms``.

        Raises:
            OptionError: a key or trust store cannot be read (names its setting).
        """
        sec = self.security
        out: dict[str, Any] = {
            "bootstrap_servers": [s.strip() for s in self.bootstrap_servers.split(",") if s.strip()],
            "client_id": client_id,
            "security_protocol": sec.protocol,
            "request_timeout_ms": timeout_ms,
            "bootstrap_timeout_ms": timeout_ms,
        }
        if sec.oauth is not None:
            out.update({"sasl_mechanism": "OAUTHBEARER", "sasl_oauth_token_provider": tokens(sec.oauth).kafka_python()})
        elif sec.sasl:
            out.update({"sasl_mechanism": sec.mechanism, "sasl_plain_username": sec.username,
                        "sasl_plain_password": sec.password.value if sec.password else ""})
        if sec.tls:
            out["ssl_context"] = self.ssl_context()
        return out

    def token_provider(self) -> Any:
        """The OAUTHBEARER token callable of ``lastagent._native``'s clients, or None without
        OAUTHBEARER. Driver or executor; tokens are fetched when librdkafka asks."""
        if self.security.oauth is None:
            return None
        return tokens(self.security.oauth).native

    def oauth_cb(self) -> dict[str, Any]:
        """``{"oauth_cb": ...}`` for a confluent-kafka client with OAUTHBEARER, else ``{}``."""
        if self.security.oauth is None:
            return {}
        return {"oauth_cb": tokens(self.security.oauth).confluent}

    def ssl_context(self) -> ssl.SSLContext:
        """An OpenSSL context with this configuration's trust and identity (kafka-python's form)."""
        sec = self.security
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        trust = sec.trust
        if trust is not None:
            pem = None if trust.kind == "pem-file" else _trusted_pem(trust)
            where = trust.location or ""
            _guarded(trust, lambda: context.load_verify_locations(cadata=pem) if pem is not None else
                     context.load_verify_locations(capath=where) if os.path.isdir(where) else
                     context.load_verify_locations(cafile=where))
        context.check_hostname = sec.check_hostname
        if not sec.verify:
            context.verify_mode = ssl.CERT_NONE
        if sec.identity is not None:
            _load_identity(context, sec.identity)
        return context


# -- parsing helpers --------------------------------------------------------------------------


def _boolean(raw: Mapping[str, str], key: str, default: bool) -> bool:
    text = raw.get(key)
    if text is None:
        return default
    if text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    raise OptionError(f"kafka.{key}", f"{text!r} is not a boolean; give true or false")


def _sasl(raw: Mapping[str, str], protocol: str) -> tuple[str | None, str | None, Secret | None, OAuth | None]:
    """(mechanism, username, password, OAuth login) from the Java or librdkafka settings."""
    mechanism = (raw.get("sasl.mechanism") or raw.get("sasl.mechanisms") or "").strip().upper() or None
    jaas = raw.get("sasl.jaas.config")
    username = raw.get("sasl.username")
    password = raw.get("sasl.password")
    jaas_options: dict[str, str] = {}
    if mechanism == "AWS_MSK_IAM":
        raise OptionError("kafka.sasl.mechanism", f"AWS_MSK_IAM is not supported; {_MSK_IAM_HINT}")
    if jaas is not None:
        if username is not None or password is not None:
            raise OptionError("kafka.sasl.jaas.config", "give either kafka.sasl.jaas.config or "
                                                        "kafka.sasl.username/kafka.sasl.password, not both")
        module, jaas_options = _jaas(jaas)
        username, password = jaas_options.get("username"), jaas_options.get("password")
        if module == _OAUTH:
            mechanism = mechanism or "OAUTHBEARER"
            if mechanism != "OAUTHBEARER":
                raise OptionError("kafka.sasl.mechanism", f"is {mechanism}, but kafka.sasl.jaas.config uses "
                                                          "OAuthBearerLoginModule, which is mechanism OAUTHBEARER")
        elif module == _PLAIN:
            mechanism = mechanism or "PLAIN"
            if mechanism != "PLAIN":
                raise OptionError("kafka.sasl.mechanism", f"is {mechanism}, but kafka.sasl.jaas.config uses "
                                                          "PlainLoginModule, which is mechanism PLAIN")
        elif mechanism is None or not mechanism.startswith("SCRAM-"):
            raise OptionError("kafka.sasl.mechanism", "kafka.sasl.jaas.config uses ScramLoginModule: set "
                                                      "kafka.sasl.mechanism to SCRAM-SHA-256 or SCRAM-SHA-512 "
                                                      f"(the broker's), not {mechanism or 'unset'}")
    oauth_given = [k for k in _OAUTH_SETTINGS if k in raw]
    if not protocol.startswith("SASL_"):
        # A lone sasl.mechanism is ignored, as the Java client does; credentials would silently go unused.
        if jaas is not None or username is not None or oauth_given:
            raise OptionError("kafka.security.protocol", f"is {protocol}, but SASL settings are given; "
                                                         "use SASL_SSL (or SASL_PLAINTEXT)")
        return None, None, None, None
    if mechanism is None:
        raise OptionError("kafka.sasl.mechanism", f"kafka.security.protocol is {protocol}: set kafka.sasl.mechanism "
                                                  f"to one of {', '.join(MECHANISMS)}")
    if mechanism not in MECHANISMS:
        raise OptionError("kafka.sasl.mechanism", f"{mechanism} is not supported; lastagent's clients log in with "
                                                  f"{', '.join(MECHANISMS)}")
    if mechanism == "OAUTHBEARER":
        if username is not None or password is not None:
            raise OptionError("kafka.sasl.mechanism", "is OAUTHBEARER, which logs in with a token, but a username "
                                                      "and password are given; drop them, or use PLAIN or SCRAM")
        return mechanism, None, None, _oauth(raw, jaas_options)
    if oauth_given:
        raise OptionError(f"kafka.{oauth_given[0]}", f"is an OAUTHBEARER setting, but kafka.sasl.mechanism is "
                                                     f"{mechanism}; set kafka.sasl.mechanism=OAUTHBEARER or drop it")
    if not username or password is None:
        raise OptionError("kafka.sasl.jaas.config", f"SASL {mechanism} needs a username and a password: give "
                                                    f"kafka.sasl.jaas.config ('{_SCRAM if mechanism != 'PLAIN' else _PLAIN} "
                                                    "required username=\"...\" password=\"...\";') or "
                                                    "kafka.sasl.username and kafka.sasl.password")
    return mechanism, username, Secret(password), None


def _one_of(raw: Mapping[str, str], jaas: Mapping[str, str], jaas_key: str, *keys: str) -> tuple[str | None, str]:
    """(value, the option it came from) of a setting with several names: the JAAS option or one of keys."""
    given = [(f"kafka.sasl.jaas.config {jaas_key}", jaas[jaas_key])] if jaas_key in jaas else []
    given += [(f"kafka.{k}", raw[k]) for k in keys if raw.get(k, "").strip()]
    if len(given) > 1:
        raise OptionError(given[1][0], f"gives the same setting as {given[0][0]}; give one of them")
    # Unset: name where a Java user gives it (the JAAS line), else librdkafka's name.
    return (given[0][1].strip(), given[0][0]) if given else (None, "kafka.sasl.jaas.config" if jaas else f"kafka.{keys[-1]}")


def _oauth(raw: Mapping[str, str], jaas: Mapping[str, str]) -> OAuth:
    """The OAUTHBEARER login: an OIDC client-credentials grant, or the user's token provider."""
    extra = sorted(set(jaas) - {"clientId", "clientSecret", "scope"} - {k for k in jaas if k.startswith("extension_")})
    if extra:
        raise OptionError("kafka.sasl.jaas.config", f"OAuthBearerLoginModule option(s) {', '.join(extra)} are not "
                                                    "supported; give clientId, clientSecret, scope and extension_<name>")
    handler = raw.get("sasl.login.callback.handler.class")
    if handler is not None and _SHADED.sub("", handler.strip()) not in _OAUTH_HANDLERS:
        raise OptionError("kafka.sasl.login.callback.handler.class",
                          f"is a Java class lastagent cannot run; {_JAVA_ONLY['sasl.login.callback.handler.class']}")
    method = raw.get("sasl.oauthbearer.method", "").strip().lower()
    if method not in ("", "oidc", "default"):
        raise OptionError("kafka.sasl.oauthbearer.method", f"{method!r} is not oidc or default")
    endpoint, endpoint_option = _one_of(raw, {}, "", "sasl.oauthbearer.token.endpoint.url")
    client_id, id_option = _one_of(raw, jaas, "clientId", "sasl.oauthbearer.client.credentials.client.id",
                                   "sasl.oauthbearer.client.id")
    secret, secret_option = _one_of(raw, jaas, "clientSecret", "sasl.oauthbearer.client.credentials.client.secret",
                                    "sasl.oauthbearer.client.secret")
    scope, _ = _one_of(raw, jaas, "scope", "sasl.oauthbearer.scope")
    extensions = [(k[len("extension_"):], v) for k, v in jaas.items() if k.startswith("extension_")]
    if raw.get("sasl.oauthbearer.extensions", "").strip():
        if extensions:
            raise OptionError("kafka.sasl.oauthbearer.extensions", "gives the same setting as extension_<name> in "
                                                                   "kafka.sasl.jaas.config; give one of them")
        for pair in raw["sasl.oauthbearer.extensions"].split(","):
            key, eq, value = pair.partition("=")
            if not eq or not key.strip():
                raise OptionError("kafka.sasl.oauthbearer.extensions", "is not a comma-separated list of name=value")
            extensions.append((key.strip(), value.strip()))
    timeouts = {}
    for key in ("sasl.login.connect.timeout.ms", "sasl.login.read.timeout.ms"):
        value = raw.get(key, "10000").strip()
        if not value.isdigit() or int(value) <= 0:
            raise OptionError(f"kafka.{key}", f"{value!r} is not a positive number of milliseconds")
        timeouts[key] = int(value)
    common = OAuth(scope=scope, extensions=tuple(extensions),
                   sub_claim=raw.get("sasl.oauthbearer.sub.claim.name", "sub").strip() or "sub",
                   connect_timeout_ms=timeouts["sasl.login.connect.timeout.ms"],
                   read_timeout_ms=timeouts["sasl.login.read.timeout.ms"])
    provider = raw.get("sasl.oauthbearer.token.provider", "").strip()
    if provider:
        given = [o for o, v in ((endpoint_option, endpoint), (id_option, client_id), (secret_option, secret)) if v]
        if given:
            raise OptionError("kafka.sasl.oauthbearer.token.provider", f"and {given[0]} are both given: a token "
                                                                       "comes from your provider or from the OIDC "
                                                                       "token endpoint, not both")
        if not _PROVIDER.match(provider):
            raise OptionError("kafka.sasl.oauthbearer.token.provider", f"{provider!r} is not a Python function's "
                                                                       "name: give 'package.module:function'")
        return replace(common, provider=provider)
    if method == "default":
        raise OptionError("kafka.sasl.oauthbearer.method", "is default (librdkafka's unsecured JWT or a callback): "
                                                           "use oidc with a token endpoint, or "
                                                           "kafka.sasl.oauthbearer.token.provider")
    if not endpoint:
        raise OptionError("kafka.sasl.oauthbearer.token.endpoint.url",
                          "is required with kafka.sasl.mechanism=OAUTHBEARER: the OIDC provider's token endpoint "
                          "(with clientId and clientSecret), or give kafka.sasl.oauthbearer.token.provider")
    if not re.match(r"^https?://[^/\s]+", endpoint):
        raise OptionError(endpoint_option, "is not an http(s):// URL")
    if not client_id or not secret:
        raise OptionError(secret_option if client_id else id_option,
                          "is required for the OIDC client-credentials grant: give clientId and clientSecret in "
                          f"kafka.sasl.jaas.config ('{_OAUTH} required clientId=\"...\" clientSecret=\"...\";') or "
                          "kafka.sasl.oauthbearer.client.id and kafka.sasl.oauthbearer.client.secret")
    return replace(common, endpoint=endpoint, client_id=client_id, client_secret=Secret(secret))


#: ``package.module:function`` (or ``package.module.function``).
_PROVIDER = re.compile(r"^[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*(?::[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*)?$")


_JAAS = re.compile(r"""^\s*(?P<module>[\w.$]+)\s+(?P<flag>required|requisite|sufficient|optional)(?P<rest>.*?);?\s*$""",
                   re.DOTALL)
_JAAS_OPTION = re.compile(r"""\s*(?P<key>[\w.\-]+)\s*=\s*(?:"(?P<q>(?:[^"\\]|\\.)*)"|(?P<bare>[^\s;"]+))""")


def _jaas(text: str) -> tuple[str, dict[str, str]]:
    """(login module, its options) of one JAAS entry; never quotes the text in errors."""
    m = _JAAS.match(text)
    if not m:
        raise OptionError("kafka.sasl.jaas.config", "is not a JAAS entry of the form "
                                                    "'<LoginModule class> required username=\"...\" password=\"...\";'")
    module = _SHADED.sub("", m.group("module"))
    if module not in (_PLAIN, _SCRAM, _OAUTH):
        what = _OTHER_MODULES.get(module, module)
        raise OptionError("kafka.sasl.jaas.config", f"login module {what} is not supported; lastagent's clients "
                                                    f"log in with {_PLAIN}, {_SCRAM} or {_OAUTH}")
    rest = m.group("rest")
    values: dict[str, str] = {}
    pos = 0
    while pos < len(rest.rstrip("; \t\n")):
        opt = _JAAS_OPTION.match(rest, pos)
        if not opt:
            raise OptionError("kafka.sasl.jaas.config", "has an option that is not key=\"value\" after the login "
                                                        "module's flag")
        quoted = opt.group("q")
        values[opt.group("key")] = re.sub(r"\\(.)", r"\1", quoted) if quoted is not None else opt.group("bare")
        pos = opt.end()
    return module, values


def _tls_versions(raw: Mapping[str, str]) -> None:
    for key in ("ssl.protocol", "ssl.enabled.protocols"):
        versions = {v.strip() for v in raw.get(key, "TLSv1.2").split(",") if v.strip()}
        # Both libraries negotiate TLS 1.2 or 1.3 (OpenSSL's defaults) and cannot be held to 1.3 alone.
        if not versions <= _TLS_VERSIONS or versions == {"TLSv1.3"}:
            raise OptionError(f"kafka.{key}", f"{raw[key]!r}: lastagent's clients negotiate TLS 1.2 or 1.3 "
                                              "(OpenSSL's defaults); give TLSv1.2,TLSv1.3 or drop the setting")


def _store_type(raw: Mapping[str, str], prefix: str) -> str | None:
    text = raw.get(f"{prefix}.type")
    if text is None:
        return None
    kind = text.strip().upper()
    if kind not in ("JKS", "PKCS12", "PEM"):
        raise OptionError(f"kafka.{prefix}.type", f"{text!r} is not JKS, PKCS12 or PEM")
    return kind


def _jks_error(option: str) -> OptionError:
    return OptionError(option, "is a JKS store, a Java-only format: convert it to PKCS12 with "
                               "'keytool -importkeystore -srckeystore <file>.jks -destkeystore <file>.p12 "
                               "-deststoretype PKCS12' and set the store's type to PKCS12, or give PEM files "
                               "(kafka.ssl.ca.location, kafka.ssl.certificate.location, kafka.ssl.key.location)")


def _trust(raw: Mapping[str, str]) -> Store | None:
    """The CA certificates to trust: Java trust store (PEM/PKCS12, file or text) or librdkafka's CA settings."""
    given = [k for k in ("ssl.truststore.location", "ssl.truststore.certificates", "ssl.ca.location", "ssl.ca.pem")
             if raw.get(k, "").strip()]
    if len(given) > 1:
        raise OptionError(f"kafka.{given[1]}", f"give one source of trusted certificates, not both kafka.{given[0]} "
                                               f"and kafka.{given[1]}")
    kind = _store_type(raw, "ssl.truststore")
    if not given:
        return None
    key = given[0]
    option = f"kafka.{key}"
    value = raw[key].strip()
    if key == "ssl.ca.location":
        return Store("pem-file", option, location=value)
    if key in ("ssl.ca.pem", "ssl.truststore.certificates"):
        return Store("pem-text", option, text=Secret(raw[key]))
    if kind == "JKS":
        raise _jks_error(option)
    password = raw.get("ssl.truststore.password")
    if kind == "PEM":
        return Store("pem-file", option, location=value)
    # Kafka's default trust store type is JKS; a PKCS12 store must say so or have the extension.
    if kind is None and not value.lower().endswith((".p12", ".pfx", ".pkcs12")):
        if value.lower().endswith((".pem", ".crt", ".cer")):
            return Store("pem-file", option, location=value)
        raise OptionError("kafka.ssl.truststore.type", f"is unset, and kafka.ssl.truststore.location {value!r} is "
                                                       "not named .p12/.pfx or .pem: say PKCS12 or PEM (JKS, the Java "
                                                       "default, cannot be read by Python clients)")
    return Store("pkcs12", option, location=value, password=Secret(password) if password is not None else None)


def _identity(raw: Mapping[str, str]) -> Store | None:
    """The client's own certificate and key (for brokers with ssl.client.auth), if given."""
    kind = _store_type(raw, "ssl.keystore")
    key_password = raw.get("ssl.key.password")
    kp = Secret(key_password) if key_password is not None else None
    if raw.get("ssl.keystore.key", "").strip() or raw.get("ssl.keystore.certificate.chain", "").strip():
        if not (raw.get("ssl.keystore.key", "").strip() and raw.get("ssl.keystore.certificate.chain", "").strip()):
            raise OptionError("kafka.ssl.keystore.key", "give both kafka.ssl.keystore.key and "
                                                        "kafka.ssl.keystore.certificate.chain (PEM text)")
        return Store("pem-text", "kafka.ssl.keystore.key", text=Secret(raw["ssl.keystore.certificate.chain"]),
                     key=Secret(raw["ssl.keystore.key"]), password=kp)
    if raw.get("ssl.certificate.pem", "").strip() or raw.get("ssl.key.pem", "").strip():
        return Store("pem-text", "kafka.ssl.key.pem", text=Secret(raw.get("ssl.certificate.pem", "")),
                     key=Secret(raw.get("ssl.key.pem", "")), password=kp)
    if raw.get("ssl.certificate.location", "").strip():
        key_file = raw.get("ssl.key.location", "").strip()
        if not key_file:
            raise OptionError("kafka.ssl.key.location", "is required with kafka.ssl.certificate.location")
        return Store("pem-file", "kafka.ssl.certificate.location", location=raw["ssl.certificate.location"].strip(),
                     key=Secret(key_file), password=kp)
    location = raw.get("ssl.keystore.location", "").strip()
    if not location:
        return None
    if kind == "JKS" or (kind is None and location.lower().endswith(".jks")):
        raise _jks_error("kafka.ssl.keystore.location")
    if kind == "PEM":
        # Kafka's PEM key store file holds the private key and the certificate chain.
        return Store("pem-file", "kafka.ssl.keystore.location", location=location, key=Secret(location), password=kp)
    password = raw.get("ssl.keystore.password")
    return Store("pkcs12", "kafka.ssl.keystore.location", location=location,
                 password=Secret(password) if password is not None else None)


# -- key and trust material (I/O, where a client is built) -----------------------------------------


def _guarded(store: Store, load: Any) -> Any:
    """Runs ``load``; a failure becomes an OptionError naming the store's setting, without its text."""
    try:
        return load()
    except OptionError:
        raise
    except (OSError, ssl.SSLError, ValueError, TypeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        if isinstance(exc, ValueError) and "password" in str(exc).lower():
            reason = "wrong password, or the store is not PKCS12"
        where = f" ({store.location})" if store.location else ""
        raise OptionError(store.option, f"cannot be read{where}: {reason}") from None


def _pkcs12(store: Store) -> tuple[Any, Any, list[Any]]:
    """(key, certificate, additional certificates) of a PKCS12 store."""
    from cryptography.hazmat.primitives.serialization import pkcs12

    def load() -> tuple[Any, Any, list[Any]]:
        with open(store.location or "", "rb") as f:
            data = f.read()
        if data[:4] == b"\xfe\xed\xfe\xed":
            raise _jks_error(store.option)
        password = store.password.value.encode() if store.password else None
        return pkcs12.load_key_and_certificates(data, password)

    return _guarded(store, load)


def setting_in(message: str, config: Mapping[str, Any]) -> str:
    """The ``kafka.*`` option a client's error names (the longest setting whose name is in it), else ``kafka.*``.

    librdkafka refuses a bad value at client creation with text like "Unsupported partition.assignment.strategy:
    ..." rather than a setting's name apart. No I/O.
    """
    named = [k for k in config if k in message]
    return f"kafka.{max(named, key=len)}" if named else "kafka.*"


def as_librdkafka_strings(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, value) pairs for ``lastagent._native``: librdkafka takes strings, booleans as
    "true"/"false" (as confluent-kafka passes them). Driver or executor."""
    return [(k, ("true" if v else "false") if isinstance(v, bool) else str(v)) for k, v in config.items()]


def _trusted_pem(store: Store) -> str:
    """The trusted CA certificates of a PEM-text or PKCS12 trust store, as PEM text."""
    if store.kind == "pem-text":
        text = store.text.value if store.text else ""
        if "-----BEGIN CERTIFICATE-----" not in text:
            raise OptionError(store.option, "holds no PEM certificate ('-----BEGIN CERTIFICATE-----')")
        return text
    from cryptography.hazmat.primitives.serialization import Encoding

    _key, cert, extra = _pkcs12(store)
    certs = ([cert] if cert is not None else []) + list(extra)
    if not certs:
        raise OptionError(store.option, "holds no certificate to trust")
    return "".join(c.public_bytes(Encoding.PEM).decode() for c in certs)


def _load_identity(context: ssl.SSLContext, ident: Store) -> None:
    """Loads the client certificate and key into context; key material passes through a private
    temporary file only when the ssl module cannot take it from memory (PEM text, PKCS12)."""
    if ident.kind == "pem-file":
        password = ident.password.value if ident.password else None
        _guarded(ident, lambda: context.load_cert_chain(ident.location or "", ident.key.value if ident.key else None,
                                                        password))
        return
    if ident.kind == "pem-text":
        chain, key = (ident.text.value if ident.text else ""), (ident.key.value if ident.key else "")
        password = ident.password.value if ident.password else None
    else:
        from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

        key_obj, cert, extra = _pkcs12(ident)
        if key_obj is None or cert is None:
            raise OptionError(ident.option, "holds no private key with its certificate")
        chain = "".join(c.public_bytes(Encoding.PEM).decode() for c in [cert, *extra])
        key = key_obj.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()).decode()
        password = None
    with tempfile.TemporaryDirectory(prefix="lastagent-tls-") as tmp:
        path = os.path.join(tmp, "identity.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key.strip() + "\n" + chain.strip() + "\n")
        _guarded(ident, lambda: context.load_cert_chain(path, None, password))
