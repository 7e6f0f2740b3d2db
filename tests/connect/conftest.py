"""Fixtures of the Spark Connect tier: one real Connect server per session, and a client runner.

The server (:mod:`connect_server`) runs in a process group of its own, started once per session
and stopped (by its process group) at the end; :meth:`ConnectServer.restart` kills it with SIGKILL
and starts it again on the same port for the recovery test.

The client side runs in subprocesses (``connect_client.py``), never in the pytest process: in
pyspark 4.2 ``SparkSession.builder.remote(...)`` refuses to run beside the classic ``spark`` session
fixture (``[SESSION_ALREADY_EXIST]``), and ``.create()`` sets ``SPARK_CONNECT_MODE_ENABLED`` in
``os.environ``, which switches every later session of the process to Connect mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from connect_server import ClientRun, ConnectServer, finish_client, free_port, start_client


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConnectServer]:
    """A running Spark Connect server on 127.0.0.1 (``.url``); its log tail is ``.tail()``."""
    server = ConnectServer(free_port(), tmp_path_factory.mktemp("connect-server"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def run_client(connect_server: ConnectServer, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., ClientRun]:
    """``run_client(scenario, args, timeout_s=420)``: runs one client scenario to its end."""

    def run(scenario: str, args: dict[str, Any], timeout_s: float = 420.0) -> ClientRun:
        log = tmp_path_factory.mktemp(f"client-{scenario}") / "client.log"
        return finish_client(start_client(connect_server, scenario, args, log), connect_server, log, timeout_s)

    return run
