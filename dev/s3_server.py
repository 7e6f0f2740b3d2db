"""A real S3-compatible server (s3proxy on its local filesystem backend) for development and tests.

The server is s3proxy's self-contained jar, resolved from Maven Central through ``dev/s3/pom.xml``
(cached under ``.cache/s3/jars`` after the first time). It runs as a plain JVM process bound to
127.0.0.1, keeps its objects under ``<dir>/data`` (one subdirectory per bucket) and checks AWS
signatures (v2 or v4) against one fixed development identity, ``ACCESS_KEY`` / ``SECRET_KEY``.
Addressing is path-style only (``http://127.0.0.1:<port>/<bucket>/<key>``). ``PUT`` with
``If-None-Match: *`` is atomic (412 when the key exists), which is what delta-rs commits rely on.
Standard library only, so it runs before the project's own packages are installed.

Usage::

    python dev/s3_server.py up     [--port 39900] [--dir .cache/s3/39900] [--bucket NAME ...]
    python dev/s3_server.py down   [--port 39900] [--dir ...]
    python dev/s3_server.py status [--port 39900] [--dir ...]
    python dev/s3_server.py resolve

``up`` and ``down`` are idempotent; ``up --bucket NAME`` (repeatable) creates the buckets that do
not exist yet, whether the server was already running or not.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import hmac
import http.client
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pidfile  # dev/, stdlib only

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("LASTAGENT_CACHE", ROOT / ".cache"))
JARS = CACHE / "s3" / "jars"
POM = ROOT / "dev" / "s3" / "pom.xml"
DEFAULT_PORT = int(os.environ.get("LASTAGENT_S3_PORT", "39900"))
# The one identity the server accepts. Development only: the server is bound to 127.0.0.1.
ACCESS_KEY = "lastagent-dev"
SECRET_KEY = "lastagent-dev-secret-not-for-production"
REGION = "us-east-1"

SERVER_PROPERTIES = """\
s3proxy.endpoint=http://127.0.0.1:{port}
s3proxy.authorization=aws-v2-or-v4
s3proxy.identity={identity}
s3proxy.credential={credential}
jclouds.provider=filesystem
jclouds.filesystem.basedir={data}
"""

# S3 bucket naming rules (lowercase letters, digits, dots, hyphens; 3-63 characters), which also
# keeps a name from escaping the data directory.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


class ServerError(RuntimeError):
    """The server could not be resolved or started."""


def resolve_jars() -> Path:
    """Resolves s3proxy's jar from Maven Central once; later calls use the cache."""
    marker = JARS / ".complete"
    if marker.exists():
        return JARS
    JARS.mkdir(parents=True, exist_ok=True)
    cmd = [
        "mvn", "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
        f"-DoutputDirectory={JARS}", "-DincludeScope=runtime",
    ]
    print("s3: resolving s3proxy from Maven Central ...", flush=True)
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ServerError(f"mvn could not resolve s3proxy:\n{result.stdout}{result.stderr}")
    marker.write_text("ok\n")
    return JARS


def server_jar() -> Path:
    jars = sorted(resolve_jars().glob("s3proxy-*-jar-with-dependencies.jar"))
    if len(jars) != 1:
        raise ServerError(f"expected one s3proxy jar-with-dependencies in {JARS}, found {len(jars)}; "
                          f"remove {JARS} and resolve again")
    return jars[0]


def endpoint(port: int = DEFAULT_PORT) -> str:
    """The server's endpoint URL (path-style addressing)."""
    return f"http://127.0.0.1:{port}"


def delta_storage_options(port: int = DEFAULT_PORT) -> dict[str, str]:
    """delta-rs ``storage_options`` for this server (``s3://`` and ``s3a://`` URIs alike)."""
    return {
        "aws_access_key_id": ACCESS_KEY,
        "aws_secret_access_key": SECRET_KEY,
        "aws_region": REGION,
        "aws_endpoint_url": endpoint(port),
        "aws_allow_http": "true",
        "aws_conditional_put": "etag",
    }


def s3a_hadoop_conf(port: int = DEFAULT_PORT) -> dict[str, str]:
    """Spark settings for Hadoop's s3a filesystem on this server (jars: ``dev/spark_jars.py --s3a``)."""
    return {
        "spark.hadoop.fs.s3a.endpoint": endpoint(port),
        "spark.hadoop.fs.s3a.endpoint.region": REGION,
        "spark.hadoop.fs.s3a.path.style.access": "true",
        "spark.hadoop.fs.s3a.connection.ssl.enabled": "false",
        "spark.hadoop.fs.s3a.access.key": ACCESS_KEY,
        "spark.hadoop.fs.s3a.secret.key": SECRET_KEY,
        "spark.hadoop.fs.s3a.aws.credentials.provider": "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider",
        # Hadoop 3.5.0 reads through the analytics accelerator by default; the classic stream is
        # the long-proven path against a non-AWS server.
        "spark.hadoop.fs.s3a.input.stream.type": "classic",
    }


def answers(port: int, timeout: float = 1.0) -> bool:
    """True when an HTTP server answers on 127.0.0.1:port (any status: anonymous requests get 403)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/")
        conn.getresponse().read()
        return True
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def _read_pid(workdir: Path) -> int | None:
    return pidfile.read_pid(workdir / "server.pid")


def create_buckets(workdir: Path, buckets: list[str] | tuple[str, ...]) -> None:
    """Creates the buckets that do not exist yet: with the filesystem backend a bucket is a directory.

    The filesystem backend reads a bucket's ACL from the directory's mode: "others may read" means
    public-read (anonymous listing). New buckets get 0751, what s3proxy itself gives a private one.
    """
    for bucket in buckets:
        if not _BUCKET.match(bucket) or ".." in bucket:
            raise ServerError(f"{bucket!r} is not a valid S3 bucket name (3-63 of a-z, 0-9, '.', '-')")
    for bucket in buckets:
        path = Path(workdir) / "data" / bucket
        if not path.is_dir():
            path.mkdir(parents=True)
            path.chmod(0o751)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def up(port: int = DEFAULT_PORT, workdir: Path | None = None, wait_s: float = 60.0,
       buckets: list[str] | tuple[str, ...] = ()) -> str:
    """Starts the server unless it already runs, creates ``buckets``; returns the endpoint URL."""
    workdir = Path(workdir or CACHE / "s3" / str(port))
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)  # s3proxy's filesystem backend needs it to exist
    create_buckets(workdir, buckets)
    if _read_pid(workdir) and answers(port):
        return endpoint(port)
    if pidfile.port_taken(port):
        raise ServerError(
            f"port {port} on 127.0.0.1 is taken by a process this script did not start; "
            "stop it or choose another port with --port (LASTAGENT_S3_PORT)"
        )
    jar = server_jar()
    conf = workdir / "s3proxy.conf"
    server_log = workdir / "server.log"
    conf.write_text(SERVER_PROPERTIES.format(port=port, identity=ACCESS_KEY, credential=SECRET_KEY, data=data))
    with open(server_log, "ab") as out:
        proc = subprocess.Popen(
            ["java", "-Xms64m", "-Xmx512m", "-XX:+UseSerialGC", "-Djava.awt.headless=true",
             # logback would print its own start-up status (a warning about an unused appender) first.
             "-Dlogback.statusListenerClass=ch.qos.logback.core.status.NopStatusListener",
             "-jar", str(jar), "--properties", str(conf)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir,
            start_new_session=True,  # outlives the caller (make s3-up) until s3-down
        )
    (workdir / "server.pid").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            (workdir / "server.pid").unlink(missing_ok=True)
            raise ServerError(f"s3proxy exited with code {proc.returncode}; {server_log} ends with:\n"
                              f"{_tail(server_log)}")
        if answers(port):
            return endpoint(port)
        time.sleep(0.3)
    down(port, workdir)
    raise ServerError(f"s3proxy did not answer within {wait_s:.0f}s; {server_log} ends with:\n{_tail(server_log)}")


def down(port: int = DEFAULT_PORT, workdir: Path | None = None, wait_s: float = 30.0) -> None:
    """Stops the server started in workdir, by its pid; does nothing if none runs. The data stays."""
    pidfile.stop(Path(workdir or CACHE / "s3" / str(port)) / "server.pid", wait_s)


def kill(port: int = DEFAULT_PORT, workdir: Path | None = None) -> None:
    """SIGKILLs the server (for crash tests); its data stays for a restart."""
    pidfile.kill(Path(workdir or CACHE / "s3" / str(port)) / "server.pid")


def signed_request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                   port: int = DEFAULT_PORT, timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """One S3 request signed with SigV4 as ``ACCESS_KEY``: ``path`` is ``/bucket/key`` (no query).

    Returns (status, headers, body). For checks that need headers no S3 client here lets you set,
    such as ``If-None-Match: *`` on a PUT.
    """
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload_hash = hashlib.sha256(body).hexdigest()
    all_headers = {k.lower(): v.strip() for k, v in (headers or {}).items()}
    all_headers.update({"host": f"127.0.0.1:{port}", "x-amz-date": amz_date, "x-amz-content-sha256": payload_hash})
    signed = ";".join(sorted(all_headers))
    canonical = "\n".join([
        method, quote(path, safe="/~"), "",
        "".join(f"{k}:{all_headers[k]}\n" for k in sorted(all_headers)), signed, payload_hash,
    ])
    scope = f"{day}/{REGION}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = f"AWS4{SECRET_KEY}".encode()
    for part in (day, REGION, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    all_headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/{scope}, "
                                    f"SignedHeaders={signed}, Signature={signature}")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, quote(path, safe="/~"), body=body, headers=all_headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "resolve"])
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="default LASTAGENT_S3_PORT or 39900")
    parser.add_argument("--dir", type=Path, default=None, help="default .cache/s3/<port>")
    parser.add_argument("--bucket", action="append", default=[], metavar="NAME",
                        help="with up: create this bucket if missing (repeatable)")
    args = parser.parse_args(argv)
    port = args.port
    workdir = args.dir or CACHE / "s3" / str(port)
    try:
        if args.command == "resolve":
            print(f"s3: jar in {server_jar()}")
        elif args.command == "up":
            url = up(port, workdir, buckets=args.bucket)
            print(f"s3: server answers at {url} (pid {_read_pid(workdir)})")
            print(f"s3: access key {ACCESS_KEY}, secret key {SECRET_KEY}, region {REGION}, path-style; "
                  f"data in {workdir / 'data'}" + (f"; buckets {', '.join(args.bucket)}" if args.bucket else ""))
        elif args.command == "down":
            down(port, workdir)
            print("s3: server stopped")
        else:
            pid = _read_pid(workdir)
            running = pid is not None and answers(port)
            print(f"s3: {'running, pid ' + str(pid) if running else 'not running'} on {endpoint(port)}")
            return 0 if running else 1
    except ServerError as exc:
        print(f"s3: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
