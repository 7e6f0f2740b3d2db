"""lastagent.register and the Spark versions lastagent runs on (lastagent.spark_versions)."""

from __future__ import annotations

import pytest

import lastagent
from lastagent import cli
from lastagent.errors import LastAgentError, UnsupportedSparkError
from lastagent.spark_versions import ALLOW_UNTESTED, differences, parse_version, refusal

pytestmark = pytest.mark.unit


class Session:
    """What register() uses of a SparkSession: its ``dataSource.register``; records the formats' names."""

    def __init__(self) -> None:
        self.registered: list[str] = []
        session = self

        class DataSourceRegistration:
            @staticmethod
            def register(source):
                session.registered.append(source.name())

        self.dataSource = DataSourceRegistration


@pytest.mark.parametrize("version", ["3.5.1", "3.3.0", "2.4.8"])
def test_an_older_spark_is_named(monkeypatch, version):
    import pyspark

    monkeypatch.setattr(pyspark, "__version__", version)
    with pytest.raises(UnsupportedSparkError, match=rf"pyspark {version} has no Python Data Source API .* 4\.0, "
                                                     r"4\.1, 4\.2, 4\.3"):
        lastagent.register(object())
    assert issubclass(UnsupportedSparkError, LastAgentError)


def test_a_spark_never_tested_is_refused_unless_the_user_allows_it(monkeypatch):
    import pyspark

    monkeypatch.setattr(pyspark, "__version__", "4.4.0")
    monkeypatch.delenv(ALLOW_UNTESTED, raising=False)
    with pytest.raises(UnsupportedSparkError, match=f"pyspark 4.4.0 is newer than .*set {ALLOW_UNTESTED}=1"):
        lastagent.register(object())
    monkeypatch.setenv(ALLOW_UNTESTED, "1")
    session = Session()
    lastagent.register(session)
    assert session.registered == ["lastagent-kafka", "lastagent-delta"]


@pytest.mark.parametrize(("version", "parsed", "refused"), [
    ("4.0.5", (4, 0), False), ("4.1.4", (4, 1), False), ("4.2.0", (4, 2), False), ("4.3.0", (4, 3), False),
    ("4.0.0.dev1", (4, 0), False), ("4.2.1+db.1", (4, 2), False), ("3.5.9", (3, 5), True), ("5.0.0", (5, 0), True),
    ("4.4.0", (4, 4), True), ("unknown", None, True),
])
def test_versions(version, parsed, refused):
    assert parse_version(version) == parsed
    assert (refusal(version) is not None) is refused
    assert refusal("4.9.1", allow_untested=True) is None and refusal("3.5.1", allow_untested=True) is not None


def test_what_differs_per_minor():
    assert "Arrow" in differences("4.0.5") and "admission control" in differences("4.0.5")
    assert "Arrow" not in differences("4.1.4") and "admission control" in differences("4.1.4")
    assert differences("4.2.0") == differences("4.3.0") == "every API the formats use"


def test_version_names_the_spark_and_fails_on_one_not_supported(monkeypatch):
    import pyspark

    monkeypatch.delenv(ALLOW_UNTESTED, raising=False)
    text, ok = cli.version_text()
    assert f"pyspark {pyspark.__version__}: supported" in text and ok
    monkeypatch.setattr(pyspark, "__version__", "3.5.1")
    text, ok = cli.version_text()
    assert "pyspark 3.5.1: NOT SUPPORTED: pyspark 3.5.1 has no Python Data Source API" in text and not ok


def test_both_formats_are_registered():
    session = Session()
    lastagent.register(session)
    session_again = Session()
    lastagent.register(session_again)  # registering twice is harmless
    assert session.registered == session_again.registered == ["lastagent-kafka", "lastagent-delta"]


@pytest.mark.parametrize("entry", ["reader", "streamReader", "streamWriter", "delta streamWriter"])
def test_every_query_start_refuses_an_older_spark_by_name(monkeypatch, entry):
    import pyspark

    from lastagent.formats import DeltaDataSource, KafkaDataSource

    monkeypatch.setattr(pyspark, "__version__", "3.5.1")
    source = (DeltaDataSource if entry.startswith("delta") else KafkaDataSource)({})
    call = {"reader": lambda: source.reader(None), "streamReader": lambda: source.streamReader(None).initialOffset(),
            "streamWriter": lambda: source.streamWriter(None, False),
            "delta streamWriter": lambda: source.streamWriter(None, False)}[entry]
    with pytest.raises(UnsupportedSparkError, match="pyspark 3.5.1 has no Python Data Source API"):
        call()

