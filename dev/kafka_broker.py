"""A real single-node Apache Kafka broker (KRaft) for development, tests and the demo.

The broker's jars come from Maven Central through ``dev/kafka/pom.xml`` (cached under
``.cache/kafka/jars`` after the first time). The broker runs as a plain JVM process bound to
127.0.0.1, with settings fit for transactions. Standard library only, so it runs before the
project's own packages are installed.

Usage::

    python dev/kafka_broker.py up   [--port 39092] [--dir .cache/kafka/39092]
    python dev/kafka_broker.py down [--port 39092] [--dir ...]
    python dev/kafka_broker.py status
    python dev/kafka_broker.py up --secured [--port 39192] [--dir .cache/kafka/secured-39192]
    python dev/kafka_broker.py up --cluster [--port 39300] [--dir .cache/kafka/cluster-39300]

``up`` and ``down`` are idempotent.

``--secured`` starts a broker that clients reach only over SASL_SSL (SCRAM-SHA-512, PLAIN or
OAUTHBEARER, on TLS from a throw-away PKI that ``dev/tls.py`` makes in ``<dir>/pki``), with ACLs
enforced: see ``SECURED_PROPERTIES`` and ``USERS``. OAUTHBEARER tokens are RS256 JWTs checked against
the JWKS that ``dev/oidc.py`` makes in ``<dir>/oidc`` (a file, loaded at startup); its token
endpoint, ``python dev/oidc.py serve``, issues them (client ``carol``/``carol-secret``, principal
``User:carol``). It uses three ports: the client port, the controller's (+1) and the inter-broker
one (+2).

``--cluster`` starts a replicated cluster of three nodes (:class:`Cluster`): replication factor 3
for every topic and the internal ones, ``min.insync.replicas=2``; node n on ports base+2(n-1) and
the one above.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import pidfile  # dev/, stdlib only

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("LASTAGENT_CACHE", ROOT / ".cache"))
JARS = CACHE / "kafka" / "jars"
POM = ROOT / "dev" / "kafka" / "pom.xml"
#: The broker version the pom pins (the tests' and the demo's); another one with --kafka-version or
#: LASTAGENT_KAFKA_VERSION, its jars in .cache/kafka/jars-<version> (the broker-version tier runs several).
DEFAULT_VERSION = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", POM.read_text()).group(1)  # type: ignore[union-attr]
DEFAULT_PORT = int(os.environ.get("LASTAGENT_KAFKA_PORT", "39092"))
DEFAULT_SECURED_PORT = int(os.environ.get("LASTAGENT_SECURED_KAFKA_PORT", "39192"))
# Kafka aborts an open transaction after its timeout; the protocol needs room to finish a
# decided epoch long after a crash, so the ceiling is raised to one hour (issue #2).
TRANSACTION_MAX_TIMEOUT_MS = 3_600_000

# What every broker here has, secured or not, alone or in a cluster: KRaft nodes that are broker and
# controller at once, settings fit for transactions. Alone: one node, replication factor 1. In the
# replicated cluster (CLUSTER_NODES nodes): every topic, the offsets topic and the transaction log on
# every node, min.insync.replicas 2, as production clusters run them.
COMMON_PROPERTIES = """\
process.roles=broker,controller
node.id={node_id}
controller.quorum.voters={voters}
controller.listener.names=CONTROLLER
log.dirs={log_dir}
num.partitions=1
auto.create.topics.enable=false
default.replication.factor={replicas}
min.insync.replicas={min_isr}
offsets.topic.replication.factor={replicas}
offsets.topic.num.partitions=4
transaction.state.log.replication.factor={replicas}
transaction.state.log.min.isr={min_isr}
transaction.state.log.num.partitions=4
transaction.max.timeout.ms={txn_max}
# Expire timed-out transactions promptly, so expiry (a hazard the protocol must surface) is testable.
transaction.abort.timed.out.transaction.cleanup.interval.ms=1000
share.coordinator.state.topic.replication.factor={replicas}
share.coordinator.state.topic.min.isr={min_isr}
group.initial.rebalance.delay.ms=0
log.retention.check.interval.ms=1000
log.cleaner.backoff.ms=1000
log.initial.task.delay.ms=1000
delete.topic.enable=true
"""

SERVER_PROPERTIES = COMMON_PROPERTIES + """\
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}
advertised.listeners=PLAINTEXT://127.0.0.1:{port}
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
"""

# The secured broker's SCRAM-SHA-512 users, created when the log dir is formatted. Only ADMIN is a
# super user; the others start with no ACL at all (tests grant what they need).
ADMIN = "admin"
USERS = {ADMIN: "admin-secret", "alice": "alice-secret", "bob": "bob-secret"}

_PLAIN_USERS = " ".join(f'user_{name}="{password}"' for name, password in USERS.items())
_SCRAM_LOGIN = "org.apache.kafka.common.security.scram.ScramLoginModule required"
_PLAIN_LOGIN = "org.apache.kafka.common.security.plain.PlainLoginModule required"
_OAUTHBEARER_LOGIN = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required"
_OAUTHBEARER_VALIDATOR = "org.apache.kafka.common.security.oauthbearer.OAuthBearerValidatorCallbackHandler"
_BROKER_JWT_VALIDATOR = "org.apache.kafka.common.security.oauthbearer.BrokerJwtValidator"

# Three listeners, each bound to 127.0.0.1 and each authenticated:
#   CLIENT     SASL_SSL        {port}       what clients use. TLS from dev/tls.py; SCRAM-SHA-512 (the
#                                           users above), PLAIN (the same names and passwords, kept in
#                                           the JAAS line below) or OAUTHBEARER (see below). Client
#                                           certificates are requested, not required: if one is sent it
#                                           must chain to the test CA.
#   CONTROLLER SASL_PLAINTEXT  {port}+1     KRaft's own: the broker half of this node registers and
#                                           heartbeats here. PLAIN, checked against the static JAAS line
#                                           below, so authenticating here never depends on the metadata
#                                           log the controller serves (SCRAM credentials live there; with
#                                           4.1.1 in combined mode SCRAM did work here too, but only because
#                                           the metadata happened to be loaded first).
#   INTERNAL   SASL_PLAINTEXT  {port}+2     inter-broker: the transaction coordinator sends
#                                           WriteTxnMarkers to the partition leaders (this node) here.
#                                           SCRAM-SHA-512 works: the broker loads the credentials from
#                                           the metadata log before it opens this listener.
# The broker half authenticates as ADMIN on CONTROLLER and INTERNAL. Its requests there
# (BrokerRegistration, BrokerHeartbeat, WriteTxnMarkers) need CLUSTER_ACTION on the cluster, so
# the principal it uses must be a super user; keeping it User:admin means super.users has a single
# entry, and no unauthenticated principal (User:ANONYMOUS, what a PLAINTEXT controller listener
# would give) is ever a super user.
# OAUTHBEARER on CLIENT: Kafka's own validator (OAuthBearerValidatorCallbackHandler) accepts an RS256
# JWT whose signature checks against the JWKS dev/oidc.py made in <dir>/oidc, whose iss and aud are
# dev/oidc.py's ISSUER and AUDIENCE and which has not expired; the principal is User:<sub> (the OAuth
# client id, e.g. User:carol). The JWKS is a file:// URL, so the broker needs no HTTP server: the file
# must exist when the broker starts (it is loaded then; 4.1.1 reloads it when its modification time
# changes). Kafka 4 only opens URLs and files the JVM allows (secured_jvm_flags). The validator class
# must be named: in 4.1.1 the handler's default, DefaultJwtValidator, is built without the JWKS and
# falls back to ClientJwtValidator, which checks neither signature nor audience nor issuer (any
# well-formed JWT logs in). The broker itself never logs in with OAUTHBEARER: the JAAS line has no
# options.
SECURED_PROPERTIES = COMMON_PROPERTIES + f"""\
listeners=CLIENT://127.0.0.1:{{port}},CONTROLLER://127.0.0.1:{{controller_port}},INTERNAL://127.0.0.1:{{internal_port}}
advertised.listeners=CLIENT://127.0.0.1:{{port}},INTERNAL://127.0.0.1:{{internal_port}}
listener.security.protocol.map=CLIENT:SASL_SSL,CONTROLLER:SASL_PLAINTEXT,INTERNAL:SASL_PLAINTEXT
inter.broker.listener.name=INTERNAL
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
sasl.mechanism.controller.protocol=PLAIN

listener.name.client.sasl.enabled.mechanisms=SCRAM-SHA-512,PLAIN,OAUTHBEARER
listener.name.client.scram-sha-512.sasl.jaas.config={_SCRAM_LOGIN};
listener.name.client.plain.sasl.jaas.config={_PLAIN_LOGIN} {_PLAIN_USERS};
listener.name.client.oauthbearer.sasl.jaas.config={_OAUTHBEARER_LOGIN};
listener.name.client.oauthbearer.sasl.server.callback.handler.class={_OAUTHBEARER_VALIDATOR}
sasl.oauthbearer.jwt.validator.class={_BROKER_JWT_VALIDATOR}
sasl.oauthbearer.jwks.endpoint.url={{jwks_url}}
sasl.oauthbearer.expected.audience={{audience}}
sasl.oauthbearer.expected.issuer={{issuer}}
listener.name.client.ssl.keystore.type=PKCS12
listener.name.client.ssl.keystore.location={{keystore}}
listener.name.client.ssl.keystore.password={{keystore_password}}
listener.name.client.ssl.key.password={{keystore_password}}
listener.name.client.ssl.truststore.type=PKCS12
listener.name.client.ssl.truststore.location={{truststore}}
listener.name.client.ssl.truststore.password={{truststore_password}}
listener.name.client.ssl.client.auth=requested

listener.name.controller.sasl.enabled.mechanisms=PLAIN
listener.name.controller.plain.sasl.jaas.config={_PLAIN_LOGIN} username="{ADMIN}" password="{USERS[ADMIN]}" user_{ADMIN}="{USERS[ADMIN]}";

listener.name.internal.sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.internal.scram-sha-512.sasl.jaas.config={_SCRAM_LOGIN} username="{ADMIN}" password="{USERS[ADMIN]}";

authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:{ADMIN}
"""

LOG4J2 = """\
status = warn
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log_file}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.state.name = state.change.logger
logger.state.level = WARN
"""


class BrokerError(RuntimeError):
    """The broker could not be resolved, formatted or started."""


def version_of(version: str | None = None) -> str:
    """The broker version asked for: ``version``, else LASTAGENT_KAFKA_VERSION, else the pom's."""
    return (version or os.environ.get("LASTAGENT_KAFKA_VERSION", "")).strip() or DEFAULT_VERSION


def jars_dir(version: str | None = None) -> Path:
    """Where the jars of a broker version are cached (the pom's version in .cache/kafka/jars)."""
    version = version_of(version)
    return JARS if version == DEFAULT_VERSION else CACHE / "kafka" / f"jars-{version}"


def resolve_jars(version: str | None = None) -> Path:
    """Resolves a broker version's jars from Maven Central once; later calls use the cache."""
    version = version_of(version)
    jars = jars_dir(version)
    marker = jars / ".complete"
    if marker.exists():
        return jars
    jars.mkdir(parents=True, exist_ok=True)
    cmd = [
        "mvn", "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
        f"-DoutputDirectory={jars}", "-DincludeScope=runtime", f"-Dkafka.version={version}",
    ]
    print(f"kafka: resolving broker jars ({version}) from Maven Central ...", flush=True)
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BrokerError(f"mvn could not resolve Kafka {version}:\n{result.stdout}{result.stderr}")
    marker.write_text("ok\n")
    return jars


def _java(main: str, *args: str, log4j: Path, jvm_flags: Sequence[str] = (), jars: Path = JARS) -> list[str]:
    return [
        "java", "-Xms256m", "-Xmx1g", "-XX:+UseG1GC", "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={log4j}", *jvm_flags,
        "-cp", str(jars / "*"), main, *args,
    ]


def answers(port: int, timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections on 127.0.0.1:port."""
    return pidfile.port_taken(port, timeout)


def _read_pid(workdir: Path) -> int | None:
    return pidfile.read_pid(workdir / "broker.pid")


def _sibling(name: str):
    """dev/<name>.py, loaded by path: this file runs as a script and is imported from tests alike."""
    spec = importlib.util.spec_from_file_location(f"lastagent_dev_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tls():
    """dev/tls.py: the secured broker's PKI."""
    return _sibling("tls")


def pki_dir(workdir: Path) -> Path:
    """Where the secured broker started in workdir keeps its PKI (made by dev/tls.py)."""
    return Path(workdir) / "pki"


def secured_pki(workdir: Path) -> dict[str, Path]:
    """The secured broker's PKI, made once: paths by role (see dev/tls.py)."""
    return _tls().make_pki(pki_dir(workdir))


def _oidc():
    """dev/oidc.py: the OAuth signing key, JWKS and token endpoint."""
    return _sibling("oidc")


def oidc_dir(workdir: Path) -> Path:
    """Where the secured broker started in workdir keeps the OAuth signing key and its JWKS (dev/oidc.py)."""
    return Path(workdir) / "oidc"


def secured_oidc(workdir: Path) -> dict:
    """What the secured broker's OAUTHBEARER validation uses, made once: ``dir``, ``key`` (the RSA
    signing key, PEM), ``jwks`` (its JWKS file), ``jwks_url`` (file://), ``kid``, ``issuer``,
    ``audience``, and the test ``clients`` (id -> secret) for ``dev/oidc.py``'s token endpoint."""
    oidc = _oidc()
    keys = oidc.make_keys(oidc_dir(workdir))
    return {**keys, "dir": oidc_dir(workdir), "jwks_url": keys["jwks"].resolve().as_uri(), "issuer": oidc.ISSUER,
            "audience": oidc.AUDIENCE, "clients": dict(oidc.CLIENTS)}


def secured_jvm_flags(workdir: Path) -> list[str]:
    """The secured broker's JVM flags: Kafka 4 reads an OAuth URL or file only if these allow it (the
    JWKS file, nothing else)."""
    oidc = secured_oidc(workdir)
    return [f"-Dorg.apache.kafka.sasl.oauthbearer.allowed.urls={oidc['jwks_url']}",
            f"-Dorg.apache.kafka.sasl.oauthbearer.allowed.files={oidc['jwks'].resolve()}"]


def _server_properties(port: int, log_dir: Path, workdir: Path, secured: bool, *, node_id: int = 1,
                       voters: str | None = None, replicas: int = 1, min_isr: int = 1) -> str:
    shared = {"port": port, "controller_port": port + 1, "log_dir": log_dir, "txn_max": TRANSACTION_MAX_TIMEOUT_MS,
              "node_id": node_id, "voters": voters or f"{node_id}@127.0.0.1:{port + 1}", "replicas": replicas,
              "min_isr": min_isr}
    if not secured:
        return SERVER_PROPERTIES.format(**shared)
    tls = _tls()
    pki = tls.make_pki(pki_dir(workdir))
    oidc = secured_oidc(workdir)
    return SECURED_PROPERTIES.format(
        **shared, internal_port=port + 2,
        keystore=pki["broker_keystore"], keystore_password=tls.BROKER_KEYSTORE_PASSWORD,
        truststore=pki["truststore_p12"], truststore_password=tls.TRUSTSTORE_PASSWORD,
        jwks_url=oidc["jwks_url"], audience=oidc["audience"], issuer=oidc["issuer"],
    )


def new_cluster_id() -> str:
    """A random KRaft cluster id: 16 random bytes, URL-safe base64 without padding.

    Like Kafka's own ``Uuid.randomUuid()``, it never starts with ``-``: the storage tool's
    argument parser would read such an id as an option and refuse to format (1 id in 64).
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id


def _refuse_taken(ports: list[int], hint: str) -> None:
    for taken in ports:
        if answers(taken):
            raise BrokerError(f"port {taken} on 127.0.0.1 is taken by a process this script did not start; "
                              f"stop it or choose another port with {hint}")


def _configure(workdir: Path, properties: str, cluster_id: str, extra_format_args: Sequence[str] = (),
               jars: Path = JARS) -> None:
    """Writes a node's server.properties and log4j settings; formats its log dir once."""
    workdir.mkdir(parents=True, exist_ok=True)
    props = workdir / "server.properties"
    log4j = workdir / "log4j2.properties"
    props.write_text(properties)
    log4j.write_text(LOG4J2.format(log_file=workdir / "server.log"))
    if (workdir / "data" / "meta.properties").exists():
        return
    fmt = subprocess.run(
        _java("kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "-c", str(props),
              "--ignore-formatted", *extra_format_args, log4j=log4j, jars=jars),
        capture_output=True, text=True, check=False,
    )
    if fmt.returncode != 0:
        raise BrokerError(f"formatting the KRaft log dir {workdir / 'data'} failed:\n{fmt.stdout}{fmt.stderr}")


class _Starting:
    """A node's JVM, launched; :meth:`wait` returns once the node says it started."""

    def __init__(self, workdir: Path, port: int, jvm_flags: Sequence[str] = (), jars: Path = JARS) -> None:
        self.workdir, self.port = workdir, port
        self.server_log = workdir / "server.log"
        # The log is appended across restarts: only what this start writes counts.
        self.offset = self.server_log.stat().st_size if self.server_log.exists() else 0
        with open(workdir / "stdout.log", "ab") as out:
            self.proc = subprocess.Popen(
                _java("kafka.Kafka", str(workdir / "server.properties"), log4j=workdir / "log4j2.properties",
                      jvm_flags=jvm_flags, jars=jars),
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # outlives the caller (make kafka-up) until kafka-down
            )
        (workdir / "broker.pid").write_text(f"{self.proc.pid}\n")

    def started(self) -> bool:
        if self.proc.poll() is not None:
            raise BrokerError(f"the broker exited with code {self.proc.returncode}; see {self.server_log} "
                              f"and {self.workdir / 'stdout.log'}")
        if not self.server_log.exists() or not answers(self.port):
            return False
        with open(self.server_log, "rb") as f:
            f.seek(self.offset)
            return b"Kafka Server started" in f.read()

    def wait(self, deadline: float) -> None:
        while not self.started():
            if time.monotonic() > deadline:
                pidfile.stop(self.workdir / "broker.pid")
                raise BrokerError(f"the broker did not start in time; see {self.server_log}")
            time.sleep(0.3)


def up(port: int = DEFAULT_PORT, workdir: Path | None = None, wait_s: float = 120.0, *, secured: bool = False,
       version: str | None = None) -> str:
    """Starts the broker unless it already runs; returns its bootstrap servers string.

    ``secured=True``: SASL_SSL with ACLs (``SECURED_PROPERTIES``), on port, port+1 and port+2; the
    PKI is in ``pki_dir(workdir)``, the OAuth signing key and JWKS in ``oidc_dir(workdir)``. A log dir
    keeps the mode it was formatted in, and the Kafka version (:func:`version_of`) that formatted it.
    """
    workdir = Path(workdir or CACHE / "kafka" / str(port))
    version = version_of(version)
    version_file = workdir / "kafka-version"
    if version_file.exists() and version_file.read_text().strip() != version:
        raise BrokerError(f"{workdir} holds a Kafka {version_file.read_text().strip()} broker, not {version}; "
                          "use another --dir")
    bootstrap = f"127.0.0.1:{port}"
    mode = "secured" if secured else "plaintext"
    mode_file = workdir / "mode"
    # Log dirs formatted before the secured mode existed carry no mode file: they are plaintext.
    formatted = mode_file.read_text().strip() if mode_file.exists() else (
        "plaintext" if (workdir / "data" / "meta.properties").exists() else mode)
    if formatted != mode:
        raise BrokerError(f"{workdir} holds a {formatted} broker, not a {mode} one; use another --dir")
    if _read_pid(workdir) and answers(port):
        return bootstrap
    _refuse_taken([port, port + 1] + ([port + 2] if secured else []),
                  "--port (LASTAGENT_KAFKA_PORT, LASTAGENT_SECURED_KAFKA_PORT)")
    jars = resolve_jars(version)
    # SCRAM credentials go into the bootstrap metadata: the broker authenticates inter-broker
    # traffic with them before any client could have created them.
    scram = [a for name, password in USERS.items() for a in ("--add-scram", f"SCRAM-SHA-512=[name={name},password={password}]")]
    _configure(workdir, _server_properties(port, workdir / "data", workdir, secured), new_cluster_id(),
               scram if secured else [], jars)
    mode_file.write_text(f"{mode}\n")
    version_file.write_text(f"{version}\n")
    _Starting(workdir, port, secured_jvm_flags(workdir) if secured else [], jars).wait(time.monotonic() + wait_s)
    return bootstrap


def down(port: int = DEFAULT_PORT, workdir: Path | None = None, wait_s: float = 30.0) -> None:
    """Stops the broker started in workdir, by its pid; does nothing if none runs."""
    pidfile.stop(Path(workdir or CACHE / "kafka" / str(port)) / "broker.pid", wait_s)


def kill(port: int = DEFAULT_PORT, workdir: Path | None = None) -> None:
    """SIGKILLs the broker (for crash tests); its log dir stays for a restart."""
    pidfile.kill(Path(workdir or CACHE / "kafka" / str(port)) / "broker.pid")


# --- a replicated cluster ----------------------------------------------------------------------

CLUSTER_NODES = 3
DEFAULT_CLUSTER_PORT = int(os.environ.get("LASTAGENT_KAFKA_CLUSTER_PORT", "39300"))


class Cluster:
    """A replicated KRaft cluster on 127.0.0.1: ``nodes`` nodes, each a broker and a controller voter.

    Node ``n`` (1-based) serves clients on ``base_port + 2(n-1)`` and its controller on the port
    above; its log dir, pid file and logs are in ``workdir/node-<n>``. Every topic, the offsets topic
    and the transaction log have a replica on every node, ``min.insync.replicas`` is 2: one node can
    be away with every write still accepted; with two away the controller quorum and the in-sync
    replicas are both short. Stop a node cleanly (:meth:`stop`: a controlled shutdown that moves its
    leaderships first) or SIGKILL it (:meth:`kill`); :meth:`start` brings it back with its log dir.
    """

    def __init__(self, base_port: int = DEFAULT_CLUSTER_PORT, workdir: Path | None = None,
                 nodes: int = CLUSTER_NODES) -> None:
        self.base_port = base_port
        self.workdir = Path(workdir or CACHE / "kafka" / f"cluster-{base_port}")
        self.nodes = list(range(1, nodes + 1))

    def port(self, node: int) -> int:
        """Node ``node``'s client port."""
        return self.base_port + 2 * (node - 1)

    def node_dir(self, node: int) -> Path:
        return self.workdir / f"node-{node}"

    @property
    def bootstrap(self) -> str:
        """Every node's client address, as users give a cluster to their clients."""
        return ",".join(f"127.0.0.1:{self.port(n)}" for n in self.nodes)

    def running(self, node: int) -> bool:
        return pidfile.read_pid(self.node_dir(node) / "broker.pid") is not None and answers(self.port(node))

    def _properties(self, node: int) -> str:
        voters = ",".join(f"{n}@127.0.0.1:{self.port(n) + 1}" for n in self.nodes)
        return _server_properties(self.port(node), self.node_dir(node) / "data", self.node_dir(node), False,
                                  node_id=node, voters=voters, replicas=len(self.nodes), min_isr=min(2, len(self.nodes)))

    def up(self, wait_s: float = 180.0) -> str:
        """Formats (once, one cluster id for all) and starts every node not running; returns the bootstrap string."""
        resolve_jars()
        id_file = self.workdir / "cluster.id"
        if not id_file.exists():
            self.workdir.mkdir(parents=True, exist_ok=True)
            id_file.write_text(new_cluster_id() + "\n")
        cluster_id = id_file.read_text().strip()
        starting = []
        for node in self.nodes:
            if self.running(node):
                continue
            _refuse_taken([self.port(node), self.port(node) + 1], "--port (LASTAGENT_KAFKA_CLUSTER_PORT)")
            _configure(self.node_dir(node), self._properties(node), cluster_id)
            starting.append(_Starting(self.node_dir(node), self.port(node)))
        # The nodes elect a controller among themselves: all are launched before any is waited for.
        deadline = time.monotonic() + wait_s
        for node in starting:
            node.wait(deadline)
        return self.bootstrap

    def start(self, node: int, wait_s: float = 180.0) -> None:
        """Starts one node again (after :meth:`stop` or :meth:`kill`), waiting until it serves."""
        if not self.running(node):
            _Starting(self.node_dir(node), self.port(node)).wait(time.monotonic() + wait_s)

    def stop(self, node: int, wait_s: float = 120.0) -> None:
        """A clean shutdown of one node (SIGTERM: controlled shutdown), SIGKILL only after ``wait_s``."""
        pidfile.stop(self.node_dir(node) / "broker.pid", wait_s)

    def kill(self, node: int) -> None:
        """SIGKILLs one node; its log dir stays for :meth:`start`."""
        pidfile.kill(self.node_dir(node) / "broker.pid")

    def down(self, wait_s: float = 60.0) -> None:
        """Stops every node at once: one by one, the last ones would wait for a controller quorum that
        has gone and be SIGKILLed only after ``wait_s`` each."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(lambda node: self.stop(node, wait_s), self.nodes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "resolve"])
    parser.add_argument("--secured", action="store_true",
                        help=f"SASL_SSL + ACLs; default port LASTAGENT_SECURED_KAFKA_PORT or {DEFAULT_SECURED_PORT}")
    parser.add_argument("--cluster", action="store_true",
                        help=f"a replicated {CLUSTER_NODES}-node cluster; base port LASTAGENT_KAFKA_CLUSTER_PORT "
                             f"or {DEFAULT_CLUSTER_PORT}")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--kafka-version", default=None,
                        help=f"the broker's Apache Kafka version, its jars from Maven Central (default "
                             f"LASTAGENT_KAFKA_VERSION or {DEFAULT_VERSION}; not with --cluster)")
    args = parser.parse_args(argv)
    if args.cluster:
        return _cluster_main(args)
    port = args.port or (DEFAULT_SECURED_PORT if args.secured else DEFAULT_PORT)
    workdir = args.dir or CACHE / "kafka" / (f"secured-{port}" if args.secured else str(port))
    try:
        if args.command == "resolve":
            print(f"kafka: jars in {resolve_jars(args.kafka_version)}")
        elif args.command == "up":
            bootstrap = up(port, workdir, secured=args.secured, version=args.kafka_version)
            print(f"kafka: broker answers at {bootstrap} (pid {_read_pid(workdir)})")
            if args.secured:
                oidc = secured_oidc(workdir)
                print(f"kafka: SASL_SSL, SCRAM-SHA-512 users {', '.join(f'{u}/{p}' for u, p in USERS.items())}; "
                      f"PKI (CA ca.pem, truststore.p12 password trustpass) in {pki_dir(workdir)}")
                print(f"kafka: OAUTHBEARER: RS256 JWTs, iss {oidc['issuer']}, aud {oidc['audience']}, keys in "
                      f"{oidc['dir']}; token endpoint: python dev/oidc.py serve --dir {oidc['dir']}")
        elif args.command == "down":
            down(port, workdir)
            print("kafka: broker stopped")
        else:
            pid = _read_pid(workdir)
            running = pid is not None and answers(port)
            print(f"kafka: {'running, pid ' + str(pid) if running else 'not running'} on 127.0.0.1:{port}")
            return 0 if running else 1
    except BrokerError as exc:
        print(f"kafka: {exc}", file=sys.stderr)
        return 1
    return 0


def _cluster_main(args: argparse.Namespace) -> int:
    cluster = Cluster(args.port or DEFAULT_CLUSTER_PORT, args.dir)
    try:
        if args.command == "resolve":
            print(f"kafka: jars in {resolve_jars()}")
        elif args.command == "up":
            print(f"kafka: cluster answers at {cluster.up()} ({len(cluster.nodes)} nodes, replication factor "
                  f"{len(cluster.nodes)}, min.insync.replicas 2; logs in {cluster.workdir}/node-<n>)")
        elif args.command == "down":
            cluster.down()
            print("kafka: cluster stopped")
        else:
            states = {n: cluster.running(n) for n in cluster.nodes}
            for node, running in states.items():
                print(f"kafka: node {node} {'running' if running else 'not running'} on 127.0.0.1:{cluster.port(node)}")
            return 0 if all(states.values()) else 1
    except BrokerError as exc:
        print(f"kafka: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
