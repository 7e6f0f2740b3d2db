"""Paths and storage settings: every scheme the connector reaches, parsed once; credentials never shown."""

from __future__ import annotations

import pickle

import pytest

from lastagent.errors import OptionError
from lastagent.storage import StorageConfig, location

pytestmark = pytest.mark.unit

KEY, SECRET = "AKIAEXAMPLEKEYID0001", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
S3 = {"storage.aws_access_key_id": KEY, "storage.AWS_SECRET_ACCESS_KEY": SECRET,
      "storage.aws_endpoint_url": "http://127.0.0.1:9000", "storage.aws_allow_http": "true",
      "storage.aws_region": "us-east-1", "path": "s3a://b/t", "kafka.linger.ms": "5"}


@pytest.mark.parametrize("given, kind, uri, path", [
    ("s3a://bucket/a/table/", "s3", "s3://bucket/a/table", "bucket/a/table"),
    ("s3://bucket/t", "s3", "s3://bucket/t", "bucket/t"),
    ("S3N://bucket", "s3", "s3://bucket", "bucket"),
    ("gs://b/t", "gs", "gs://b/t", "b/t"),
    ("abfss://box@acct.dfs.core.windows.net/t", "azure", "abfss://box@acct.dfs.core.windows.net/t", "box/t"),
    ("/tmp/x/", "local", "/tmp/x", "/tmp/x"),
    ("file:///tmp/x", "local", "/tmp/x", "/tmp/x"),
    ("file:/tmp/x", "local", "/tmp/x", "/tmp/x"),
    ("rel/dir", "local", "rel/dir", "rel/dir"),
])
def test_locations_spark_users_write(given, kind, uri, path):
    where = location(given, "path")
    assert (where.kind, where.uri, where.path, where.given) == (kind, uri, path, given)
    assert where.child("_delta_log").path == f"{path}/_delta_log"


@pytest.mark.parametrize("given, words", [
    ("dbfs:/mnt/t", ["dbfs", "cloud URI", "/dbfs/"]),
    ("hdfs://nn/t", ["'hdfs'", "s3a://"]),
    ("s3a:/bucket/t", ["neither a local path nor a URI"]),
    ("s3a://", ["no bucket"]),
    ("s3://KEY:SECRET@bucket/t", ["credentials do not belong in the path"]),
    ("s3://b/t?endpoint_override=x", ["storage.*"]),
    ("  ", ["is empty"]),
])
def test_unknown_or_malformed_locations_are_refused_naming_the_option(given, words):
    with pytest.raises(OptionError) as err:
        location(given, "checkpointLocation")
    text = str(err.value)
    assert text.startswith("option 'checkpointLocation':")
    for w in words:
        assert w in text
    assert "SECRET" not in text or "credentials" in text  # the message says why, the rest is the user's own path


def test_settings_are_parsed_once_and_shown_without_credentials():
    config = StorageConfig.parse(S3)
    assert dict(config.settings) == {"aws_access_key_id": KEY, "aws_secret_access_key": SECRET,
                                     "aws_endpoint_url": "http://127.0.0.1:9000", "aws_allow_http": "true",
                                     "aws_region": "us-east-1"}
    for text in (repr(config), str(config), f"{config!r}"):
        assert KEY not in text and SECRET not in text
        assert "aws_endpoint_url=http://127.0.0.1:9000" in text and "aws_secret_access_key=***" in text
    assert pickle.loads(pickle.dumps(config)) == config


def test_delta_rs_gets_the_settings_and_a_conditional_put():
    config = StorageConfig.parse(S3)
    options = config.delta_options(location("s3a://b/t", "path"))
    assert options is not None and options["aws_conditional_put"] == "etag"
    assert options["aws_secret_access_key"] == SECRET
    assert config.delta_options(location("/tmp/t", "path")) is None


@pytest.mark.parametrize("key, value, words", [
    ("storage.AWS_S3_ALLOW_UNSAFE_RENAME", "true", ["put-if-absent"]),
    ("storage.aws_s3_locking_provider", "dynamodb", ["conditional put"]),
    ("storage.aws_conditional_put", "disabled", ["'etag'"]),
    ("storage.", "x", ["names no setting"]),
])
def test_settings_that_would_lose_put_if_absent_are_refused(key, value, words):
    with pytest.raises(OptionError) as err:
        StorageConfig.parse({key: value})
    assert str(err.value).startswith(f"option '{key}':")
    for w in words:
        assert w in str(err.value)


def test_plain_http_needs_allow_http_as_in_delta_rs():
    where = location("s3a://b/t", "path")
    config = StorageConfig.parse({"storage.aws_endpoint_url": "http://127.0.0.1:9000"})
    with pytest.raises(OptionError, match="storage.aws_allow_http=true"):
        config.check(where, environ={})
    config.check(where, environ={"AWS_ALLOW_HTTP": "true"})  # from the environment, like delta-rs
    with pytest.raises(OptionError, match="is not a URL"):
        StorageConfig.parse({"storage.aws_endpoint_url": "127.0.0.1:9000"}).check(where, environ={})
    StorageConfig().check(location("/tmp/t", "path"), environ={})


def test_pyarrow_gets_the_endpoint_from_settings_or_environment():
    from pyarrow import fs

    where = location("s3a://b/t", "path")
    s3 = StorageConfig.parse(S3).filesystem(where, environ={})
    assert isinstance(s3, fs.S3FileSystem)
    assert s3.region == "us-east-1"
    from_env = StorageConfig().filesystem(where, environ={"AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
                                                         "AWS_ALLOW_HTTP": "true", "AWS_REGION": "eu-west-1"})
    assert isinstance(from_env, fs.S3FileSystem) and from_env.region == "eu-west-1"
    assert isinstance(StorageConfig().filesystem(location("/tmp/t", "path")), fs.LocalFileSystem)
