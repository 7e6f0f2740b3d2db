"""Session fixtures: a real Kafka broker (KRaft) and a real local Spark session.

The broker fixture reuses a broker that already answers on ``LASTAGENT_KAFKA_PORT`` (e.g. from
``make kafka-up``) or starts its own on a free port and stops it at the end of the session.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "dev"))
sys.path.insert(0, str(ROOT / "tests"))

import kafka_broker  # noqa: E402  (dev/, stdlib only)


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

    session = local_session("lastagent-tests", extra_conf={"spark.sql.warehouse.dir": str(ROOT / ".cache" / "warehouse")})
    yield session
    session.stop()
