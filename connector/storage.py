"""Where lastagent's own files live and how it reaches them: paths and the ``storage.*`` settings.

Driver and executors. Much of lastagent's I/O happens outside Spark's Hadoop filesystems: tasks
write parquet files with pyarrow, the driver reads and commits through Delta Kernel (the target table, the
arbitration table, the dead-letter table) and reads Spark's checkpoint with pyarrow. So every
path option is parsed here once, at query start, into a :class:`Location`, and every client is
built from it and the query's :class:`StorageConfig`:

* local paths and ``file://`` URIs;
* S3 and S3-compatible stores: ``s3://``, and Hadoop's ``s3a://`` / ``s3n://`` for the same
  objects (tested against a real S3-compatible server);
* Google Cloud Storage (``gs://``) and Azure Data Lake / Blob (``abfss://``, ``abfs://``,
  ``az://``) take the same route (Delta Kernel's store and pyarrow both have them) but are not tested here.

Anything else (``dbfs:/``, ``hdfs://``, a typo) is an :class:`~lastagent.errors.OptionError` at
query start naming the option, never a silent fall-back to the local disk.

The settings are object_store's configuration keys (delta-rs's storage options: the same names) under the prefix
``storage.``, e.g. ``storage.aws_endpoint_url``; Delta Kernel's store gets them as they are, pyarrow gets
them translated. A setting not given is taken from the process's environment the way object_store
and the cloud SDKs take it (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, instance credentials,
...), in the process that does the I/O, so executors use their own machine's credentials.
Values are never shown: the ``repr`` names the keys and hides every credential.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from lastagent.errors import OptionError
from lastagent.options import Option, OptionTable

#: The prefix of the storage settings among a format's options.
PREFIX = "storage."

#: URI scheme → store kind. Hadoop names S3 ``s3a`` (and, long ago, ``s3n``); the objects are the same.
SCHEMES = {"s3": "s3", "s3a": "s3", "s3n": "s3", "gs": "gs", "gcs": "gs", "abfss": "azure", "abfs": "azure",
           "az": "azure", "azure": "azure", "file": "local"}

#: The documented settings (docs/options.md is generated from this table). Any other ``storage.*`` name is
#: passed to Delta Kernel's store as it is (object_store's names); the ones below are also translated for pyarrow.
STORAGE_SETTINGS = OptionTable([
    Option("storage.aws_access_key_id", "string", "", "S3 access key id. Unset: the AWS SDK's chain in the process "
                                                      "doing the I/O (AWS_ACCESS_KEY_ID, a profile, the instance's "
                                                      "role), on the driver and on every executor."),
    Option("storage.aws_secret_access_key", "string", "", "Its secret; never shown in logs, errors or tables. "
                                                          "Unset: the AWS SDK's chain, as above."),
    Option("storage.aws_session_token", "string", "", "Session token of temporary credentials. Unset: "
                                                      "AWS_SESSION_TOKEN or the chain."),
    Option("storage.aws_region", "string", "", "The bucket's region. Unset: AWS_REGION, else AWS_DEFAULT_REGION."),
    Option("storage.aws_endpoint_url", "string", "", "Endpoint of an S3-compatible store, e.g. "
                                                     "http://127.0.0.1:9000 (path-style requests). Unset: "
                                                     "AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL, else AWS S3."),
    Option("storage.aws_allow_http", "boolean", "false", "true allows an http:// endpoint (object_store refuses "
                                                         "plain HTTP otherwise). Unset: AWS_ALLOW_HTTP."),
    Option("storage.azure_storage_account_name", "string", "", "Azure storage account of abfss:// paths (not "
                                                               "tested here). Unset: AZURE_STORAGE_ACCOUNT_NAME."),
    Option("storage.azure_storage_account_key", "string", "", "Its key (not tested here). Unset: "
                                                              "AZURE_STORAGE_ACCOUNT_KEY or Azure's default "
                                                              "credential."),
], exempt_prefixes=())

#: Settings whose values may be shown (in errors and the ``repr``); every other value is a credential.
_SHOWN = {"aws_region", "region", "aws_default_region", "aws_endpoint_url", "aws_endpoint", "endpoint_url",
          "endpoint", "aws_allow_http", "allow_http", "aws_virtual_hosted_style_request",
          "virtual_hosted_style_request", "aws_conditional_put", "conditional_put", "aws_s3_express",
          "aws_skip_signature", "azure_storage_account_name", "account_name", "azure_use_azure_cli",
          "google_bucket", "timeout", "connect_timeout"}
#: Store settings (delta-rs's, which users may carry over) that would take away the put-if-absent a decision relies
#: on, and why.
_REFUSED = {
    "aws_s3_allow_unsafe_rename": "it switches delta-rs to a commit path with no put-if-absent, so two deciders "
                                  "could both write an epoch's decision; lastagent needs the store's conditional "
                                  "put (the default of delta-rs, and of S3 and S3-compatible servers)",
    "aws_s3_locking_provider": "delta-rs 1.x has no lock provider and commits through the store's conditional "
                               "put, which lastagent relies on; remove the setting",
}
_CONDITIONAL_PUT = ("aws_conditional_put", "conditional_put")
#: Aliases of the same setting, first the name used when translating for pyarrow.
_S3_KEYS = {
    "access_key": ("aws_access_key_id", "access_key_id"),
    "secret_key": ("aws_secret_access_key", "secret_access_key"),
    "session_token": ("aws_session_token", "session_token", "aws_token", "token"),
    "region": ("aws_region", "region", "aws_default_region"),
    "endpoint": ("aws_endpoint_url", "aws_endpoint", "endpoint_url", "endpoint"),
    "allow_http": ("aws_allow_http", "allow_http"),
}
#: Environment variables each S3 setting falls back to, in order (as object_store and the AWS SDKs read them).
_S3_ENV = {
    "region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
    "endpoint": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
    "allow_http": ("AWS_ALLOW_HTTP",),
}
_AZURE_KEYS = {
    "account_name": ("azure_storage_account_name", "account_name"),
    "account_key": ("azure_storage_account_key", "azure_storage_access_key", "account_key", "access_key"),
}


@dataclass(frozen=True)
class Location:
    """A path option, parsed: which store and where in it.

    Attributes:
        option: the option it came from (errors name it), e.g. ``path`` or ``checkpointLocation``.
        given: the path as the user wrote it.
        kind: ``local``, ``s3``, ``gs`` or ``azure``.
        uri: the form Delta Kernel's store takes (a local path, or ``s3://bucket/key`` for any S3 scheme).
        path: the form pyarrow's filesystem takes (a local path, or ``bucket/key``).
    """

    option: str
    given: str
    kind: str
    uri: str
    path: str

    @property
    def is_local(self) -> bool:
        return self.kind == "local"

    def child(self, name: str) -> Location:
        """The location of ``name`` below this one."""
        return Location(self.option, f"{self.given.rstrip('/')}/{name}", self.kind, f"{self.uri.rstrip('/')}/{name}",
                        f"{self.path.rstrip('/')}/{name}")


def location(given: str, option: str) -> Location:
    """Parses a path option. Pure.

    Raises:
        OptionError: for ``option``, when the scheme is not one lastagent can reach outside Spark.
    """
    text = given.strip()
    if not text:
        raise OptionError(option, "is empty; give a local path or an s3://, s3a://, gs:// or abfss:// URI")
    if text.lower().startswith("dbfs:"):
        raise OptionError(option, f"{given!r}: dbfs: paths are Databricks' own filesystem, which lastagent cannot "
                                  "reach outside Spark (it writes files and commits with pyarrow and Delta Kernel); "
                                  "give the cloud URI behind it (s3://, abfss://, gs://) or the /dbfs/... path "
                                  "of the same location")
    if text.lower().startswith("file:") and not text.lower().startswith("file://"):
        text = "file://" + text[len("file:"):]  # Hadoop's file:/tmp/x
    scheme, sep, rest = text.partition("://")
    if not sep:
        if ":" in text.split("/")[0] and not text.startswith("/"):
            raise OptionError(option, f"{given!r} is neither a local path nor a URI (scheme://...)")
        local = text.rstrip("/") or "/"
        return Location(option, given, "local", local, local)
    kind = SCHEMES.get(scheme.lower())
    if kind is None:
        raise OptionError(option, f"{given!r}: lastagent cannot reach paths of scheme {scheme!r} (it reads and "
                                  "writes them outside Spark, with pyarrow and Delta Kernel); use a local path or one "
                                  f"of {', '.join(s + '://' for s in sorted(SCHEMES))}")
    if kind == "local":
        local = "/" + rest.lstrip("/")
        local = local.rstrip("/") or "/"
        return Location(option, given, "local", local, local)
    parts = urlsplit(text)
    if parts.query or parts.fragment:
        raise OptionError(option, f"{given!r}: a storage URI takes no '?' or '#' part; give endpoints and "
                                  "credentials as storage.* options")
    if "@" in parts.netloc and kind != "azure":
        raise OptionError(option, f"{given!r}: credentials do not belong in the path; give them as storage.* "
                                  "options (or in the environment)")
    bucket = parts.netloc
    key = parts.path.strip("/")
    if kind == "azure":
        bucket = bucket.split("@")[0]  # abfss://<container>@<account>.dfs.core.windows.net/<path>
    if not bucket:
        raise OptionError(option, f"{given!r} names no bucket or container")
    uri_scheme = "s3" if kind == "s3" else scheme.lower()
    host = parts.netloc if kind == "azure" else bucket
    uri = f"{uri_scheme}://{host}/{key}" if key else f"{uri_scheme}://{host}"
    path = f"{bucket}/{key}" if key else bucket
    return Location(option, given, kind, uri, path)


def _secret(value: str) -> str:
    return "***" if value else ""


@dataclass(frozen=True)
class StorageConfig:
    """The query's ``storage.*`` settings, checked once on the driver and shipped to the tasks.

    Attributes:
        settings: lower-case setting name (without the prefix) → value, sorted by name.
    """

    settings: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> StorageConfig:
        """The settings among a format's options (keys of any case). Pure; runs at query start.

        Raises:
            OptionError: a setting that would take away put-if-absent, or an empty setting name.
        """
        found: dict[str, str] = {}
        for key, value in options.items():
            lower = key.lower()
            if not lower.startswith(PREFIX):
                continue
            name = lower[len(PREFIX):]
            if not name:
                raise OptionError(key, "names no setting; give e.g. storage.aws_endpoint_url")
            if name in _REFUSED:
                raise OptionError(key, f"is not allowed: {_REFUSED[name]}")
            text = str(value)
            if name in _CONDITIONAL_PUT and text.strip().lower() != "etag":
                raise OptionError(key, f"{text!r}: lastagent decides each epoch with a put-if-absent, so only "
                                       "'etag' (the default) is allowed")
            found[name] = text
        return cls(tuple(sorted(found.items())))

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v if k in _SHOWN else _secret(v)}" for k, v in self.settings)
        return f"StorageConfig({shown})"

    def _get(self, names: tuple[str, ...]) -> str | None:
        mine = dict(self.settings)
        for name in names:
            if name in mine:
                return mine[name]
        return None

    def _s3(self, what: str, environ: Mapping[str, str]) -> str | None:
        value = self._get(_S3_KEYS[what])
        if value is None:
            for var in _S3_ENV.get(what, ()):
                if environ.get(var):
                    return environ[var]
        return value

    def check(self, where: Location, environ: Mapping[str, str] | None = None) -> None:
        """Refuses, before any I/O, settings that cannot reach ``where``. Pure.

        Raises:
            OptionError: an ``http://`` S3 endpoint without ``storage.aws_allow_http=true`` (object_store refuses
                plain HTTP otherwise), or an endpoint that is not a URL.
        """
        if where.kind != "s3":
            return
        env = os.environ if environ is None else environ
        endpoint = self._s3("endpoint", env)
        if endpoint is None:
            return
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise OptionError(PREFIX + "aws_endpoint_url", f"{endpoint!r} is not a URL; give e.g. "
                                                            "https://s3.eu-west-1.amazonaws.com or http://127.0.0.1:9000")
        allow = (self._s3("allow_http", env) or "false").strip().lower() == "true"
        if parts.scheme == "http" and not allow:
            raise OptionError(PREFIX + "aws_endpoint_url", f"{endpoint!r} is plain HTTP: set "
                                                            "storage.aws_allow_http=true to allow it (for "
                                                            f"{where.option} {where.given!r})")

    def delta_options(self, where: Location) -> dict[str, str] | None:
        """The settings Delta Kernel's store (object_store) takes for ``where`` (None for a local path). Driver.

        The store reads what is not given from the environment itself. For S3 the conditional put every commit
        relies on is asked for explicitly, as object_store's docs say to for S3-compatible stores.
        """
        if where.is_local:
            return None
        options = dict(self.settings)
        if where.kind == "s3" and not any(k in options for k in _CONDITIONAL_PUT):
            options["aws_conditional_put"] = "etag"
        return options

    def filesystem(self, where: Location, environ: Mapping[str, str] | None = None) -> Any:
        """A pyarrow filesystem for ``where`` (use it with :attr:`Location.path`). Runs anywhere.

        pyarrow's S3 client does not read ``AWS_ENDPOINT_URL`` when built directly, so the endpoint
        is taken from the settings or the environment here; credentials not given are left to the
        AWS SDK's chain (environment, profile, instance role), as object_store does.

        Raises:
            OptionError: the filesystem cannot be built from these settings.
        """
        from pyarrow import fs

        if where.is_local:
            return fs.LocalFileSystem()
        env = os.environ if environ is None else environ
        self.check(where, env)
        try:
            if where.kind == "s3":
                kwargs: dict[str, Any] = {}
                for arg in ("access_key", "secret_key", "session_token", "region"):
                    value = self._s3(arg, env)
                    if value:
                        kwargs[arg] = value
                endpoint = self._s3("endpoint", env)
                if endpoint:
                    parts = urlsplit(endpoint)
                    kwargs["endpoint_override"] = parts.netloc + parts.path.rstrip("/")
                    kwargs["scheme"] = parts.scheme
                return fs.S3FileSystem(**kwargs)
            if where.kind == "azure":
                name = self._get(_AZURE_KEYS["account_name"]) or env.get("AZURE_STORAGE_ACCOUNT_NAME")
                if not name:
                    raise OptionError(PREFIX + "azure_storage_account_name",
                                      f"is needed for {where.option} {where.given!r}")
                key = self._get(_AZURE_KEYS["account_key"]) or env.get("AZURE_STORAGE_ACCOUNT_KEY")
                return fs.AzureFileSystem(account_name=name, account_key=key) if key else \
                    fs.AzureFileSystem(account_name=name)
            return fs.GcsFileSystem()
        except (ValueError, TypeError, OSError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise OptionError(where.option, f"{where.given!r}: cannot open its store: {exc}") from exc


def require_reachable(config: StorageConfig, paths: Mapping[str, str | None]) -> None:
    """Fails at query start when a path option's store cannot be reached. Driver side.

    Each object-store location's bucket (or container) is looked up with these settings; local
    paths are left to the code that uses them. No file is written.

    Args:
        config: the query's storage settings.
        paths: option name → path as given (None or blank: not set).

    Raises:
        OptionError: naming the option: the store does not answer, refuses these credentials, or has no
            such bucket.
    """
    from pyarrow import fs

    for option, given in paths.items():
        if not given or not given.strip():
            continue
        where = location(given, option)
        if where.is_local:
            continue
        filesystem = config.filesystem(where)
        bucket = where.path.split("/")[0]
        try:
            info = filesystem.get_file_info(bucket)
        except OSError as exc:
            raise OptionError(option, f"{given!r}: cannot reach its store with the storage.* settings and the "
                                      f"environment ({exc}); nothing was changed") from exc
        if info.type == fs.FileType.NotFound:
            raise OptionError(option, f"{given!r}: bucket {bucket!r} does not exist, or these credentials cannot "
                                      "see it; lastagent does not create buckets")


def open_path(given: str, option: str, config: StorageConfig | None = None) -> tuple[Any, str]:
    """(pyarrow filesystem, path) for a path option, in one step. Runs anywhere.

    Raises:
        OptionError: the scheme is not one lastagent can reach, or its store cannot be opened.
    """
    where = location(given, option)
    return (config or StorageConfig()).filesystem(where), where.path
