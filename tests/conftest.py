"""Session fixtures: a real Kafka broker (KRaft) and a real local Spark session.

The broker fixture reuses a broker that already answers on ``LASTAGENT_KAFKA_PORT`` (e.g. from
``make kafka-up``) or starts its own on a free port and stops it at the end of the session.

``s3`` starts an S3-compatible server (s3proxy) only in sessions where some test asks for it.

``secured_kafka`` starts a second, secured broker (SASL_SSL, SCRAM-SHA-512, ACLs; see
``dev/kafka_broker.py``) only in sessions where some test asks for it, and stops it at the end.
``oidc_endpoint`` adds an OAuth 2.0 token endpoint (``dev/oidc.py``) whose tokens that broker accepts
(SASL/OAUTHBEARER).
"""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "dev"))
sys.path.insert(0, str(ROOT / "tests"))

import kafka_broker  # noqa: E402  (dev/, stdlib only)
import oidc  # noqa: E402  (dev/, stdlib only)
import s3_server  # noqa: E402  (dev/, stdlib only)
import spark_cds  # noqa: E402  (dev/, stdlib only)

# Every Spark driver the tests start (the session below, the drivers they kill, Connect's server) starts from a
# class-data archive with the client compiler only: half the CPU of a default JVM (dev/spark_cds.py). The tiers that
# stand for a user's machine leave it out (support.no_toolchain_env).
_USER_SUBMIT_OPTS = os.environ.get("SPARK_SUBMIT_OPTS", "")
os.environ["SPARK_SUBMIT_OPTS"] = f"{_USER_SUBMIT_OPTS} {spark_cds.jvm_options()}".strip()

#: Tiers in the order make test starts them: the longest files first, so that with two workers (pytest-xdist,
#: --dist loadfile) neither is left with a crash matrix at the end while the other idles; the many short unit tests
#: fill the gaps last. Within a tier, files keep their collection order.
_TIER_ORDER = {"chaos": 0, "package": 1, "connect": 2, "notebook": 3, "integration": 4}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: _TIER_ORDER.get(item.path.parent.name, len(_TIER_ORDER)))


def _free_port_pair() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65000 and not kafka_broker.answers(port + 1):
            return port


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """bootstrap.servers of a running real broker."""
    if os.environ.get("LASTAGENT_KAFKA_BOOTSTRAP"):
        yield os.environ["LASTAGENT_KAFKA_BOOTSTRAP"]
        return
    port = kafka_broker.DEFAULT_PORT
    if kafka_broker.answers(port):
        yield f"127.0.0.1:{port}"
        return
    port = _free_port_pair()
    workdir = tmp_path_factory.mktemp("kafka")
    bootstrap = kafka_broker.up(port, workdir)
    try:
        yield bootstrap
    finally:
        kafka_broker.down(port, workdir)


@pytest.fixture(scope="session")
def kafka_admin(kafka_bootstrap: str):
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, client_id="lastagent-tests")
    yield admin
    admin.close()


@pytest.fixture
def new_topic(kafka_admin) -> Callable[..., str]:
    """Creates a uniquely named topic: ``new_topic(partitions=1, **topic_configs)``."""
    from kafka.admin import NewTopic

    def make(partitions: int = 1, prefix: str = "t", **configs: str) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        kafka_admin.create_topics(
            [NewTopic(name, partitions, 1, topic_configs={k.replace("_", "."): str(v) for k, v in configs.items()})]
        )
        return name

    return make


@pytest.fixture(scope="session")
def spark():
    from lastagent.spark_session import local_session

    # s3a's jars are on the class path of every session (loaded only when an s3a:// path is used), so
    # that the object-store tests can read back with this session's Delta reader.
    # A Python worker that dies (a crash in native code) then says where, in the error the test sees.
    # This session's JVM serves every integration test of the worker: the archive, but the optimising compiler too.
    short_lived = os.environ["SPARK_SUBMIT_OPTS"]
    os.environ["SPARK_SUBMIT_OPTS"] = f"{_USER_SUBMIT_OPTS} {spark_cds.jvm_options(short_lived=False)}".strip()
    try:
        session = local_session("lastagent-tests",
                                extra_conf={"spark.sql.warehouse.dir": str(ROOT / ".cache" / "warehouse"),
                                            "spark.jars": ",".join(str(j) for j in s3a_jars()),
                                            "spark.python.worker.faulthandler.enabled": "true"})
    finally:
        os.environ["SPARK_SUBMIT_OPTS"] = short_lived
    yield session
    session.stop()


# --- the secured broker ---------------------------------------------------------------------------


def _free_port_triple() -> int:
    """A port p with p, p+1 and p+2 free on 127.0.0.1 (client, controller, inter-broker listeners)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65000:
            continue
        try:
            for offset in (1, 2):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return port


@dataclass(frozen=True)
class SecuredKafka:
    """A running secured broker: SASL_SSL with SCRAM-SHA-512 on ``bootstrap``, ACLs enforced.

    Users (``kafka_broker.USERS``): admin/admin-secret (super user), alice/alice-secret and
    bob/bob-secret (no ACLs until a test grants some). ``pki`` holds the paths ``dev/tls.py`` made:
    ``ca`` (PEM), ``truststore_p12`` / ``truststore_jks`` (password ``trustpass``), ``client_cert`` /
    ``client_key`` / ``client_p12`` (password ``keypass``), ``other_ca`` / ``other_truststore_p12``
    (an unrelated CA), and the broker's own files.
    """

    bootstrap: str
    pki: dict[str, Path]
    workdir: Path

    @staticmethod
    def _password(user: str, password: str | None) -> str:
        return kafka_broker.USERS[user] if password is None else password

    @property
    def admin_config(self) -> dict[str, Any]:
        """kafka-python keyword arguments for the admin (super) user."""
        return self.kafka_python_config(kafka_broker.ADMIN)

    def kafka_python_config(self, user: str, password: str | None = None) -> dict[str, Any]:
        """kafka-python keyword arguments for ``user`` (password from ``kafka_broker.USERS`` unless given)."""
        return {
            "bootstrap_servers": self.bootstrap,
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_plain_username": user,
            "sasl_plain_password": self._password(user, password),
            "ssl_cafile": str(self.pki["ca"]),
            "ssl_check_hostname": True,
        }

    def kafka_options(self, user: str, password: str | None = None) -> dict[str, str]:
        """The Java-style ``kafka.*`` Spark options a user would write to connect as ``user``."""
        return {
            "kafka.bootstrap.servers": self.bootstrap,
            "kafka.security.protocol": "SASL_SSL",
            "kafka.sasl.mechanism": "SCRAM-SHA-512",
            "kafka.sasl.jaas.config": "org.apache.kafka.common.security.scram.ScramLoginModule required "
            f'username="{user}" password="{self._password(user, password)}";',
            "kafka.ssl.truststore.location": str(self.pki["truststore_p12"]),
            "kafka.ssl.truststore.type": "PKCS12",
            "kafka.ssl.truststore.password": "trustpass",
        }

    def librdkafka_config(self, user: str, password: str | None = None) -> dict[str, str]:
        """confluent-kafka (librdkafka) configuration for ``user``."""
        return {
            "bootstrap.servers": self.bootstrap,
            "security.protocol": "SASL_SSL",
            "sasl.mechanisms": "SCRAM-SHA-512",
            "sasl.username": user,
            "sasl.password": self._password(user, password),
            "ssl.ca.location": str(self.pki["ca"]),
        }


@pytest.fixture(scope="session")
def secured_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredKafka]:
    """A secured broker of this session's own, on free ports; stopped (by pid) at the end."""
    port = _free_port_triple()
    workdir = tmp_path_factory.mktemp("secured-kafka")
    try:
        bootstrap = kafka_broker.up(port, workdir, secured=True)
        yield SecuredKafka(bootstrap, kafka_broker.secured_pki(workdir), workdir)
    finally:
        kafka_broker.down(port, workdir)


@pytest.fixture(scope="session")
def secured_admin(secured_kafka: SecuredKafka):
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(client_id="lastagent-tests-secured", **secured_kafka.admin_config)
    yield admin
    admin.close()


@pytest.fixture
def new_secured_topic(secured_admin) -> Callable[..., str]:
    """Creates a uniquely named topic on the secured broker (as admin): ``new_secured_topic(partitions=1, **topic_configs)``."""

    def make(partitions: int = 1, prefix: str = "t", **configs: str) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        spec = {"num_partitions": partitions, "replication_factor": 1, "configs": {k.replace("_", "."): str(v) for k, v in configs.items()}}
        secured_admin.create_topics({name: spec}, wait_for_metadata=True)
        return name

    return make


@pytest.fixture
def grant(secured_admin) -> Callable[..., None]:
    """Grants ACLs on the secured broker, as admin, and waits until the broker enforces them.

    ``grant("alice", "TOPIC", topic, ["WRITE", "DESCRIBE"])``,
    ``grant("User:alice", "TRANSACTIONAL_ID", "tx-", "WRITE", pattern="PREFIXED")``; the cluster
    resource is named ``kafka-cluster``. Names are those of kafka-python's ``ResourceType`` and
    ``ACLOperation`` (their enum members work too).
    """
    from kafka.admin import ACL, ACLFilter, ACLOperation, ACLPermissionType, ACLResourcePatternType, ResourcePattern, ResourceType

    def grant_(principal: str, resource_type: str | ResourceType, name: str,
               operations: str | ACLOperation | Iterable[str | ACLOperation], pattern: str = "LITERAL") -> None:
        principal = principal if ":" in principal else f"User:{principal}"
        rtype = ResourceType[resource_type.upper()] if isinstance(resource_type, str) else resource_type
        resource = ResourcePattern(rtype, name, ACLResourcePatternType[pattern.upper()])
        ops = [operations] if isinstance(operations, (str, ACLOperation)) else list(operations)
        acls = [
            ACL(principal, "*", ACLOperation[op.upper()] if isinstance(op, str) else op, ACLPermissionType.ALLOW, resource)
            for op in ops
        ]
        result = secured_admin.create_acls(acls)
        if result["failed"]:
            raise AssertionError(f"creating ACLs {acls} failed: {result['failed']}")
        # CreateAcls returns once the controller committed them; the broker applies them from its
        # metadata a moment later. DescribeAcls answers from the broker's authorizer, so once it
        # lists them they are enforced.
        wanted = set(acls)
        query = ACLFilter(principal, None, ACLOperation.ANY, ACLPermissionType.ALLOW, resource)
        deadline = time.monotonic() + 10
        while True:
            found, _ = secured_admin.describe_acls(query)
            if wanted <= set(found):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the broker did not show {wanted - set(found)} within 10 s")
            time.sleep(0.05)

    return grant_


@dataclass(frozen=True)
class OidcEndpoint:
    """A running OAuth 2.0 client-credentials token endpoint (``dev/oidc.py``) whose RS256 JWTs the
    secured broker accepts on its client listener (SASL/OAUTHBEARER, principal ``User:<client id>``).

    ``url`` takes ``POST grant_type=client_credentials`` with the client in HTTP Basic (or in the
    form); ``client_id`` / ``client_secret`` are the dev client (carol, no ACLs until a test grants
    some); ``keys`` are the signing key and JWKS the broker verifies with (``oidc.sign(claims, keys)``
    makes tokens the endpoint would not); ``requests`` counts the tokens issued so far.
    """

    server: oidc.TokenServer
    client_id: str
    client_secret: str

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def issuer(self) -> str:
        return self.server.issuer

    @property
    def audience(self) -> str:
        return self.server.audience

    @property
    def keys(self) -> dict[str, Any]:
        return self.server.keys

    @property
    def requests(self) -> int:
        return self.server.requests


@pytest.fixture(scope="session")
def oidc_endpoint(secured_kafka: SecuredKafka) -> Iterator[OidcEndpoint]:
    """The token endpoint of the secured broker's OAUTHBEARER logins, on a free port; stopped at the end."""
    settings = kafka_broker.secured_oidc(secured_kafka.workdir)
    server = oidc.TokenServer(settings["dir"], settings["clients"], issuer=settings["issuer"],
                              audience=settings["audience"]).start()
    try:
        client_id, client_secret = next(iter(settings["clients"].items()))
        yield OidcEndpoint(server, client_id, client_secret)
    finally:
        server.stop()


# --- the S3-compatible server ---------------------------------------------------------------------


@dataclass(frozen=True)
class S3:
    """A running S3-compatible server (s3proxy, ``dev/s3_server.py``) of this session, path-style over http.

    ``data`` is the server's own directory of objects (one subdirectory per bucket), for tests that
    grep everything written for secrets.
    """

    port: int
    workdir: Path

    @property
    def endpoint(self) -> str:
        return s3_server.endpoint(self.port)

    @property
    def data(self) -> Path:
        return self.workdir / "data"

    def bucket(self) -> str:
        """A new, empty bucket of its own."""
        name = f"t-{uuid.uuid4().hex[:12]}"
        s3_server.create_buckets(self.workdir, [name])
        return name

    def options(self, **override: str) -> dict[str, str]:
        """The ``storage.*`` options a user gives the sinks for this server."""
        settings = {"aws_access_key_id": s3_server.ACCESS_KEY, "aws_secret_access_key": s3_server.SECRET_KEY,
                    "aws_region": s3_server.REGION, "aws_endpoint_url": self.endpoint, "aws_allow_http": "true",
                    **override}
        return {f"storage.{k}": v for k, v in settings.items()}

    def config(self, **override: str):
        """The parsed :class:`~lastagent.storage.StorageConfig` of :meth:`options`."""
        from lastagent.storage import StorageConfig

        return StorageConfig.parse(self.options(**override))

    def properties(self, path: Path) -> Path:
        """A properties file of the storage settings (``LASTAGENT_STORAGE_CONFIG`` of the example drivers)."""
        path.write_text("".join(f"{k[len('storage.'):]}={v}\n" for k, v in self.options().items()))
        return path

    def spark_conf(self) -> dict[str, str]:
        """Spark settings of a driver that reads and writes ``s3a://`` on this server (jars included)."""
        return {"spark.jars": ",".join(str(j) for j in s3a_jars()), **s3_server.s3a_hadoop_conf(self.port)}


def s3a_jars() -> list[Path]:
    """Hadoop's s3a filesystem and the AWS SDK modules it needs (``make setup``: dev/spark_jars.py --s3a)."""
    import spark_jars

    return sorted(spark_jars.S3A_JARS.glob("*.jar"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory, spark) -> Iterator[S3]:
    """An S3-compatible server of this session's own on a free port; stopped (by pid) at the end.

    The session's ``spark`` reads ``s3a://`` paths on it from here on (its Hadoop settings are set now;
    the jars are on its class path from the start).
    """
    port = _free_port()
    workdir = tmp_path_factory.mktemp("s3")
    try:
        s3_server.up(port, workdir)
        server = S3(port, workdir)
        hadoop = spark.sparkContext._jsc.hadoopConfiguration()
        for key, value in s3_server.s3a_hadoop_conf(port).items():
            hadoop.set(key[len("spark.hadoop."):], value)
        yield server
    finally:
        s3_server.down(port, workdir)
