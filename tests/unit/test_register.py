"""lastagent.register: the registration call for runtimes that do not discover pyspark_* modules."""

from __future__ import annotations

import pytest

import lastagent
from lastagent.errors import LastAgentError

pytestmark = pytest.mark.unit


def test_an_older_spark_is_named(monkeypatch):
    import pyspark

    monkeypatch.setattr(pyspark, "__version__", "3.5.1")
    with pytest.raises(LastAgentError, match="needs Spark 4.0 or newer .* pyspark 3.5.1"):
        lastagent.register(object())


def test_both_formats_are_registered():
    registered = []

    class Session:
        class dataSource:  # SparkSession's attribute name
            @staticmethod
            def register(source):
                registered.append(source.name())

    lastagent.register(Session())
    assert registered == ["lastagent-kafka", "lastagent-delta"]
