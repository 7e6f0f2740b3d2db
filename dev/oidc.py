"""A small OAuth 2.0 authorization server for the secured test broker's SASL/OAUTHBEARER logins.

* ``make_keys(dir)`` makes, once, the RSA 2048 signing key (``signing.key``, PEM) and the JSON Web
  Key Set the broker verifies tokens with (``jwks.json``: one RS256 key, its ``kid`` the key's
  RFC 7638 thumbprint). The broker (``dev/kafka_broker.py --secured``) reads ``<dir>/oidc/jwks.json``
  through a ``file://`` URL at startup: it needs no HTTP server of its own.
* ``sign(claims, keys)`` makes a compact JWS (RS256, ``typ`` JWT, ``kid``).
* ``TokenServer`` is a token endpoint (RFC 6749 section 4.4, client credentials): ``POST`` a form with
  ``grant_type=client_credentials`` (and an optional ``scope``), the client authenticated by HTTP
  Basic (section 2.3.1: ``base64(urlencode(id):urlencode(secret))``; the pair without the
  urlencoding, as Kafka's Java client sends it by default, is accepted too) or by ``client_id`` /
  ``client_secret`` in the body. It answers a JWT bearer
  token (``iss`` ISSUER, ``sub`` the client id, ``aud`` AUDIENCE, ``iat``, ``nbf``, ``exp``,
  ``scope``, ``jti``); errors as section 5.2 says.

The test clients are ``CLIENTS`` (``carol``/``carol-secret``, principal ``User:carol`` on the
broker). Standard library only (RSA through the ``openssl`` CLI, like ``dev/tls.py``), so it runs
before the project's own packages are installed.

Usage (for a broker started by hand with ``make kafka-up-secured``)::

    python dev/oidc.py serve [--dir .cache/kafka/secured-39192/oidc] [--port 39190] [--client id:secret ...]
    python dev/oidc.py keys  [--dir ...]
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("LASTAGENT_CACHE", ROOT / ".cache"))
DEFAULT_PORT = int(os.environ.get("LASTAGENT_OIDC_PORT", "39190"))
_DEFAULT_SECURED_PORT = int(os.environ.get("LASTAGENT_SECURED_KAFKA_PORT", "39192"))
DEFAULT_DIR = CACHE / "kafka" / f"secured-{_DEFAULT_SECURED_PORT}" / "oidc"

# What the secured broker expects of every token (sasl.oauthbearer.expected.issuer / .audience).
ISSUER = "https://oidc.lastagent.test"
AUDIENCE = "lastagent-kafka"
# Given when a client asks for no scope (RFC 6749 section 3.3 allows a pre-defined default).
DEFAULT_SCOPE = "kafka"
# client id -> secret. The broker's principal is the token's sub, the client id: User:carol.
CLIENTS = {"carol": "carol-secret"}
TOKEN_PATH = "/oauth2/token"

# RFC 6749 appendix A.4: scope-token = 1*( %x21 / %x23-5B / %x5D-7E )
_SCOPE_TOKEN = re.compile(r"[\x21\x23-\x5b\x5d-\x7e]+")


class OidcError(RuntimeError):
    """openssl failed, or the keys are not what this module made."""


def _run(*cmd: str, data: bytes | None = None) -> bytes:
    result = subprocess.run(cmd, input=data, capture_output=True, stdin=None if data is not None else subprocess.DEVNULL, check=False)
    if result.returncode != 0:
        raise OidcError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr.decode(errors='replace')}")
    return result.stdout


def b64url(data: bytes) -> str:
    """base64url without padding (RFC 7515 section 2)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _int_b64url(value: int) -> str:
    return b64url(value.to_bytes((value.bit_length() + 7) // 8, "big"))


def _public_numbers(key: Path) -> tuple[int, int]:
    """The RSA key's modulus and public exponent, read with ``openssl rsa -text``."""
    text = _run("openssl", "rsa", "-in", str(key), "-noout", "-text").decode()
    modulus = re.search(r"^modulus:\n((?:[ \t]+[0-9a-f:]+\n)+)", text, re.MULTILINE)
    exponent = re.search(r"^publicExponent: (\d+)", text, re.MULTILINE)
    if not modulus or not exponent:
        raise OidcError(f"cannot read the public numbers of {key}")
    return int(re.sub(r"[\s:]", "", modulus.group(1)), 16), int(exponent.group(1))


def _jwk(key: Path) -> dict[str, str]:
    n, e = _public_numbers(key)
    public = {"e": _int_b64url(e), "kty": "RSA", "n": _int_b64url(n)}
    # RFC 7638: the thumbprint of the required members, sorted, without whitespace.
    kid = b64url(hashlib.sha256(json.dumps(public, sort_keys=True, separators=(",", ":")).encode()).digest())
    return {"kty": "RSA", "use": "sig", "alg": "RS256", "kid": kid, "n": public["n"], "e": public["e"]}


def make_keys(directory: Path | str) -> dict[str, Any]:
    """Makes the signing key and its JWKS in directory unless they are there; returns
    ``{"key": Path, "jwks": Path, "kid": str}``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    key, jwks = d / "signing.key", d / "jwks.json"
    if not key.exists():
        tmp = d / ".signing.key.tmp"
        tmp.unlink(missing_ok=True)
        _run("openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(tmp))
        tmp.chmod(0o600)
        os.replace(tmp, key)
        jwks.unlink(missing_ok=True)  # belongs to a key that is gone
    if not jwks.exists():
        tmp = d / ".jwks.json.tmp"
        tmp.write_text(json.dumps({"keys": [_jwk(key)]}, indent=2) + "\n")
        os.replace(tmp, jwks)
    kid = json.loads(jwks.read_text())["keys"][0]["kid"]
    return {"key": key, "jwks": jwks, "kid": kid}


def sign(claims: dict[str, Any], keys: dict[str, Any], *, kid: str | None = None) -> str:
    """A compact JWS of claims, RS256 (RSASSA-PKCS1-v1_5 with SHA-256), signed with ``keys["key"]``
    (what :func:`make_keys` returns); the header's ``kid`` is ``keys["kid"]`` unless given."""
    header = {"alg": "RS256", "typ": "JWT", "kid": kid if kid is not None else keys["kid"]}
    signing_input = ".".join(b64url(json.dumps(part, separators=(",", ":")).encode()) for part in (header, claims))
    signature = _run("openssl", "dgst", "-sha256", "-sign", str(keys["key"]), "-binary", data=signing_input.encode())
    return f"{signing_input}.{b64url(signature)}"


def claims_of(token: str) -> dict[str, Any]:
    """The claims of a compact JWS, not verified (for tests and for looking at a token)."""
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


class _OAuthError(Exception):
    def __init__(self, status: int, error: str, description: str) -> None:
        super().__init__(description)
        self.status, self.error, self.description = status, error, description


class TokenServer:
    """A client-credentials token endpoint on 127.0.0.1 (``url``), in a daemon thread once started.

    ``clients`` maps client ids to secrets; tokens are signed with the key :func:`make_keys` keeps in
    ``directory`` and live ``lifetime_s`` seconds. ``requests`` counts the tokens issued.
    """

    def __init__(self, directory: Path | str, clients: dict[str, str] | None = None, port: int = 0,
                 lifetime_s: int = 3600, issuer: str = ISSUER, audience: str = AUDIENCE,
                 default_scope: str = DEFAULT_SCOPE, log: bool = False) -> None:
        self.keys = make_keys(directory)
        self.clients = dict(CLIENTS if clients is None else clients)
        self.lifetime_s, self.issuer, self.audience, self.default_scope = lifetime_s, issuer, audience, default_scope
        self.requests = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler(log))
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{TOKEN_PATH}"

    def start(self) -> TokenServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name=f"oidc-{self.port}", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serves in the calling thread until interrupted (the CLI)."""
        try:
            self._httpd.serve_forever()
        finally:
            self._httpd.server_close()

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(10)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> TokenServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the token request (RFC 6749 sections 2.3.1, 4.4, 5) ---

    def _authenticate(self, authorization: str | None, form: dict[str, str]) -> str:
        """The authenticated client id; raises invalid_client (or invalid_request) otherwise."""
        if authorization is not None:
            if "client_secret" in form:
                raise _OAuthError(400, "invalid_request", "more than one client authentication method")
            scheme, _, credentials = authorization.partition(" ")
            if scheme.lower() != "basic":
                raise _OAuthError(401, "invalid_client", "unsupported authentication scheme")
            try:
                decoded = base64.b64decode(credentials.strip(), validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                raise _OAuthError(401, "invalid_client", "malformed Basic credentials") from None
            if ":" not in decoded:
                raise _OAuthError(401, "invalid_client", "malformed Basic credentials")
            raw_id, _, raw_secret = decoded.partition(":")
            # Section 2.3.1 / appendix B: both are form-urlencoded before they are joined. Kafka's Java
            # client only does so with sasl.oauthbearer.header.urlencode=true (default false), so the
            # pair as sent is accepted too.
            candidates = [(urllib.parse.unquote_plus(raw_id), urllib.parse.unquote_plus(raw_secret)), (raw_id, raw_secret)]
        else:
            if "client_id" not in form or "client_secret" not in form:
                raise _OAuthError(401, "invalid_client", "no client authentication")
            candidates = [(form["client_id"], form["client_secret"])]
        for client_id, secret in candidates:
            expected = self.clients.get(client_id)
            if expected is not None and _equal(secret, expected):
                if form.get("client_id", client_id) != client_id:
                    raise _OAuthError(400, "invalid_request", "client_id differs from the authenticated client")
                return client_id
        raise _OAuthError(401, "invalid_client", "client authentication failed")

    def _issue(self, method: str, path: str, headers: Any, body: bytes) -> dict[str, Any]:
        if urllib.parse.urlsplit(path).path != TOKEN_PATH:
            raise _OAuthError(404, "invalid_request", f"no such endpoint; the token endpoint is {TOKEN_PATH}")
        if method != "POST":
            raise _OAuthError(405, "invalid_request", "the token endpoint takes POST")
        content_type = (headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if content_type != "application/x-www-form-urlencoded":
            raise _OAuthError(400, "invalid_request", "the body must be application/x-www-form-urlencoded")
        try:
            pairs = urllib.parse.parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=bool(body))
        except (UnicodeDecodeError, ValueError):
            raise _OAuthError(400, "invalid_request", "malformed form body") from None
        form: dict[str, str] = {}
        for name, value in pairs:
            if name in form:  # section 3.2: no parameter more than once
                raise _OAuthError(400, "invalid_request", f"{name} given more than once")
            if value != "":  # section 3.2: empty parameters are treated as omitted
                form[name] = value
        if "grant_type" not in form:
            raise _OAuthError(400, "invalid_request", "grant_type is missing")
        client_id = self._authenticate(headers.get("Authorization"), form)
        if form["grant_type"] != "client_credentials":
            raise _OAuthError(400, "unsupported_grant_type", f"grant_type {form['grant_type']} is not supported")
        scopes = form.get("scope", self.default_scope).split(" ")
        if not all(_SCOPE_TOKEN.fullmatch(s) for s in scopes):
            raise _OAuthError(400, "invalid_scope", "malformed scope")
        scope = " ".join(dict.fromkeys(scopes))
        now = int(time.time())
        claims = {"iss": self.issuer, "sub": client_id, "aud": self.audience, "iat": now, "nbf": now,
                  "exp": now + self.lifetime_s, "scope": scope, "client_id": client_id, "jti": uuid.uuid4().hex}
        token = sign(claims, self.keys)
        with self._lock:
            self.requests += 1
        return {"access_token": token, "token_type": "Bearer", "expires_in": self.lifetime_s, "scope": scope}

    def _handler(self, log: bool) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "lastagent-oidc/1"

            def _body(self) -> bytes:
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    chunks = []
                    while (size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)) > 0:
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline().strip():  # trailers
                        pass
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _answer(self) -> None:
                try:
                    body = self._body()
                    status, answer, extra = 200, server._issue(self.command, self.path, self.headers, body), {}
                except _OAuthError as exc:
                    status, answer = exc.status, {"error": exc.error, "error_description": exc.description}
                    extra = {"WWW-Authenticate": 'Basic realm="lastagent-oidc"'} if status == 401 else {}
                    if status == 405:
                        extra = {"Allow": "POST"}
                except ValueError:
                    status, answer, extra = 400, {"error": "invalid_request", "error_description": "malformed body"}, {}
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json;charset=UTF-8")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Cache-Control", "no-store")  # section 5.1
                self.send_header("Pragma", "no-cache")
                for name, value in extra.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            do_POST = do_GET = do_PUT = do_DELETE = _answer

            def log_message(self, format: str, *args: Any) -> None:  # the base class's name
                if log:
                    super().log_message(format, *args)

        return Handler


def _equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _client(value: str) -> tuple[str, str]:
    client_id, sep, secret = value.partition(":")
    if not sep or not client_id:
        raise argparse.ArgumentTypeError(f"{value!r} is not id:secret")
    return client_id, secret


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["serve", "keys"])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                        help="where the signing key and jwks.json are (the secured broker's <dir>/oidc)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="LASTAGENT_OIDC_PORT or %(default)s; 0 for any")
    parser.add_argument("--client", type=_client, action="append", default=None, metavar="ID:SECRET",
                        help=f"a client (repeatable); default {', '.join(f'{i}:{s}' for i, s in CLIENTS.items())}")
    parser.add_argument("--lifetime", type=int, default=3600, help="token lifetime in seconds")
    args = parser.parse_args(argv)
    try:
        if args.command == "keys":
            for role, value in make_keys(args.dir).items():
                print(f"{role:5} {value}")
            return 0
        server = TokenServer(args.dir, dict(args.client) if args.client else CLIENTS, args.port, args.lifetime, log=True)
    except (OidcError, OSError) as exc:
        print(f"oidc: {exc}", file=sys.stderr)
        return 1
    print(f"oidc: token endpoint {server.url} (issuer {server.issuer}, audience {server.audience}); "
          f"clients {', '.join(server.clients)}; keys in {args.dir}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
