"""The tests' JVM options for Spark's drivers (``dev/spark_cds.py``) and where they are left out."""

from __future__ import annotations

import os

import pytest
import spark_cds  # dev/, on the path from tests/conftest.py
import support

pytestmark = pytest.mark.unit


def test_options_name_the_archive_only_when_it_exists(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(spark_cds, "CDS_DIR", tmp_path)
    assert spark_cds.jvm_options() == spark_cds.FAST_START
    from importlib.metadata import version

    archive = tmp_path / f"spark-{version('pyspark')}.jsa"
    archive.write_bytes(b"")
    assert spark_cds.jvm_options() == f"{spark_cds.FAST_START} -XX:SharedArchiveFile={archive} -Xlog:cds*=off"
    assert spark_cds.jvm_options(short_lived=False) == f"-XX:SharedArchiveFile={archive} -Xlog:cds*=off"


def test_the_tests_drivers_get_them_and_a_users_machine_does_not() -> None:
    assert spark_cds.FAST_START in os.environ["SPARK_SUBMIT_OPTS"]  # set by tests/conftest.py
    assert "SPARK_SUBMIT_OPTS" not in support.no_toolchain_env()
