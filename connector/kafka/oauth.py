"""OAUTHBEARER tokens for every Kafka client of one process: fetched once, shared, renewed before expiry.

Driver or executor. An :class:`OAuth` login says where tokens come from: an
OIDC token endpoint (the OAuth 2.0 client-credentials grant, RFC 6749 §4.4, as the Java client's
``OAuthBearerLoginCallbackHandler`` asks it) or the user's own function
(``kafka.sasl.oauthbearer.token.provider``, for tokens signed locally such as AWS MSK IAM's). Each of
lastagent's three kinds of client gets the same tokens through its own hook: the native clients'
``token_provider`` (librdkafka's refresh callback, which asks at 80% of a token's life), confluent-kafka's
``oauth_cb`` and kafka-python's ``sasl_oauth_token_provider``.

One :class:`Tokens` per login and process (:func:`tokens`), so a worker's many tasks share one token
instead of asking the endpoint each. A token is handed out until a quarter of its life is left, then a
new one is fetched. A token's text never reaches a log, an error or a repr.
"""

from __future__ import annotations

import base64
import importlib
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lastagent.errors import TokenError
from lastagent.redact import Secret

#: A token is renewed when less than this share of its life is left; librdkafka asks again at 80% of a
#: token's life (20% left), so it always gets a new one then.
RENEW_AT_LEFT = 0.25
#: Tries of the token endpoint per token (connection failures and 5xx answers), with backoff.
ENDPOINT_TRIES = 3


@dataclass(frozen=True)
class OAuth:
    """Where an OAUTHBEARER login gets its tokens (never a token itself; :class:`Tokens` fetches them).

    Either an OIDC client-credentials grant (``endpoint``, ``client_id``, ``client_secret``, ``scope``),
    as the Java client's ``OAuthBearerLoginCallbackHandler`` does, or ``provider``: the user's Python
    function (``package.module:function``) for tokens they sign themselves (AWS MSK IAM).
    """

    endpoint: str | None = None
    client_id: str | None = None
    client_secret: Secret | None = None
    scope: str | None = None
    extensions: tuple[tuple[str, str], ...] = ()
    provider: str | None = None
    sub_claim: str = "sub"
    connect_timeout_ms: int = 10_000
    read_timeout_ms: int = 10_000


_BACKOFF_S = 0.5


@dataclass(frozen=True)
class Token:
    """One bearer token and what a client needs besides its text."""

    value: str = field(repr=False)
    expiry_ms: int  # milliseconds since the epoch
    principal: str
    extensions: dict[str, str]
    issued_ms: int

    def fresh(self, now_ms: int) -> bool:
        """Still good to hand out: more than :data:`RENEW_AT_LEFT` of its life left."""
        return now_ms < self.expiry_ms - RENEW_AT_LEFT * max(0, self.expiry_ms - self.issued_ms)


def claims(token: str) -> dict[str, Any]:
    """The claims of a JWT (unverified: the broker verifies; the client only reads ``exp`` and ``sub``),
    or ``{}`` for a token that is not a JWT (an MSK IAM token is a signed URL)."""
    parts = token.split(".")
    if len(parts) != 3:
        return {}
    try:
        payload = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4))
        decoded = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return {}
    return decoded if isinstance(decoded, dict) else {}


class Tokens:
    """The tokens of one OAUTHBEARER login in this process, with one hook per client library.

    Thread-safe: librdkafka's background threads, kafka-python's I/O thread and tasks ask at once.
    """

    def __init__(self, oauth: OAuth, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.oauth = oauth
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._token: Token | None = None
        self.fetched = 0  # how many tokens this process fetched for this login

    def current(self) -> Token:
        """A token with at least a quarter of its life left, fetched if needed.

        Raises:
            TokenError: the endpoint or provider gave no token (names the setting to check).
        """
        with self._lock:
            now_ms = int(self._clock() * 1000)
            if self._token is None or not self._token.fresh(now_ms):
                self._token = self._provided(now_ms) if self.oauth.provider else self._granted(now_ms)
                self.fetched += 1
            return self._token

    # -- the two sources --------------------------------------------------------------------------

    def _granted(self, now_ms: int) -> Token:
        """A token from the OIDC token endpoint (client-credentials grant)."""
        oauth = self.oauth
        where = f"the OAUTHBEARER token endpoint {oauth.endpoint} (kafka.sasl.oauthbearer.token.endpoint.url)"
        form = {"grant_type": "client_credentials"}
        if oauth.scope:
            form["scope"] = oauth.scope
        # HTTP Basic with the id and secret as given (RFC 6749 §2.3.1), as the Java client sends them
        # by default (sasl.oauthbearer.header.urlencode=false).
        basic = f"{oauth.client_id}:{oauth.client_secret.value if oauth.client_secret else ''}"
        request = urllib.request.Request(
            oauth.endpoint or "", data=urllib.parse.urlencode(form).encode(), method="POST",
            headers={"Authorization": "Basic " + base64.b64encode(basic.encode()).decode(),
                     "Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json"})
        timeout_s = (oauth.connect_timeout_ms + oauth.read_timeout_ms) / 1000
        failure = ""
        for attempt in range(ENDPOINT_TRIES):
            if attempt:
                self._sleep(_BACKOFF_S * 2 ** (attempt - 1))
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                    body = answer.read()
                break
            except urllib.error.HTTPError as refused:
                error = _oauth_error(refused)
                if refused.code < 500:
                    raise TokenError(f"{where} refused client {oauth.client_id!r}: {error} (HTTP {refused.code}); "
                                     "check clientId and clientSecret (kafka.sasl.jaas.config) and "
                                     "kafka.sasl.oauthbearer.scope", error="SASL_AUTHENTICATION_FAILED") from None
                failure = f"{error} (HTTP {refused.code})"
            except (urllib.error.URLError, OSError) as unreachable:
                reason = getattr(unreachable, "reason", unreachable)
                failure = f"{type(reason).__name__}: {getattr(reason, 'strerror', None) or reason}"
        else:
            raise TokenError(f"{where} did not answer with a token after {ENDPOINT_TRIES} tries: {failure}",
                             retriable=True)
        try:
            answer_json = json.loads(body)
            value = answer_json["access_token"]
        except (ValueError, KeyError, TypeError):
            raise TokenError(f"{where} answered without an access_token (not an OAuth 2.0 token response)") from None
        if not isinstance(value, str) or not value:
            raise TokenError(f"{where} answered with an empty or non-text access_token")
        jwt = claims(value)
        expires_in = answer_json.get("expires_in")
        if isinstance(expires_in, (int, float)) and expires_in > 0:
            expiry_ms = now_ms + int(expires_in * 1000)
        elif isinstance(jwt.get("exp"), (int, float)):
            expiry_ms = int(jwt["exp"] * 1000)
        else:
            raise TokenError(f"{where} answered without expires_in, and the token carries no exp claim")
        principal = str(jwt.get(oauth.sub_claim) or oauth.client_id)
        return Token(value, expiry_ms, principal, dict(oauth.extensions), now_ms)

    def _provided(self, now_ms: int) -> Token:
        """A token from the user's function: a token text (a JWT, its ``exp`` read), or (text, expiry in ms)."""
        name = self.oauth.provider or ""
        where = f"the token provider {name} (kafka.sasl.oauthbearer.token.provider)"
        try:
            produced = load_provider(name)()
        except TokenError:
            raise
        except Exception as failed:  # the user's code: any failure is named, never swallowed
            raise TokenError(f"{where} raised {type(failed).__name__}: {failed}", retriable=True) from failed
        if isinstance(produced, tuple) and len(produced) == 2:
            value, expiry = produced
        else:
            value, expiry = produced, None
        if not isinstance(value, str) or not value:
            raise TokenError(f"{where} returned {type(value).__name__}, not a token text or (token, expiry_ms)")
        jwt = claims(value)
        exp = jwt.get("exp")
        if expiry is None and isinstance(exp, (int, float)):
            expiry = exp * 1000
        if not isinstance(expiry, (int, float)) or expiry <= now_ms:
            raise TokenError(f"{where} returned a token without a future expiry: return (token, expiry) with "
                             "expiry in milliseconds since the epoch (as MSKAuthTokenProvider.generate_auth_token "
                             "does), or a JWT with an exp claim")
        principal = str(jwt.get(self.oauth.sub_claim) or "lastagent")
        return Token(value, int(expiry), principal, dict(self.oauth.extensions), now_ms)

    # -- one hook per client library --------------------------------------------------------------

    def native(self) -> tuple[str, int, str, dict[str, str]]:
        """``lastagent._native``'s token_provider: (token, expiry ms, principal, extensions).

        Called on a librdkafka background thread; an exception there fails the token, which librdkafka
        reports to the client's error callback and asks again."""
        token = self.current()
        return token.value, token.expiry_ms, token.principal, token.extensions

    def confluent(self, _config: str | None = None) -> tuple[str, float, str, dict[str, str]]:
        """confluent-kafka's ``oauth_cb``: (token, expiry in seconds, principal, extensions)."""
        token = self.current()
        return token.value, token.expiry_ms / 1000, token.principal, token.extensions

    def kafka_python(self) -> Any:
        """kafka-python's ``sasl_oauth_token_provider`` (asked at every new connection)."""
        from kafka.net.sasl.oauth import AbstractTokenProvider

        tokens = self

        class _Provider(AbstractTokenProvider):
            def token(self) -> str:
                return tokens.current().value

            def extensions(self) -> dict[str, str]:
                return dict(tokens.oauth.extensions)

        return _Provider()


def _oauth_error(refused: urllib.error.HTTPError) -> str:
    """The ``error`` (and ``error_description``) of an OAuth error answer (RFC 6749 §5.2), else the status."""
    try:
        body = json.loads(refused.read() or b"{}")
    except (ValueError, OSError):
        body = {}
    if isinstance(body, dict) and body.get("error"):
        detail = body.get("error_description")
        return f"{body['error']}" + (f" ({detail})" if detail else "")
    return str(refused.reason or refused.code)


def load_provider(name: str) -> Callable[[], Any]:
    """The user's token function named ``package.module:function`` (or ``package.module.function``).

    Raises:
        TokenError: it cannot be imported, or is not callable.
    """
    module_name, colon, attribute = name.partition(":")
    if not colon:
        module_name, _, attribute = name.rpartition(".")
    where = f"the token provider {name} (kafka.sasl.oauthbearer.token.provider)"
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as missing:
        raise TokenError(f"{where} cannot be loaded: {type(missing).__name__}: {missing}; it must be importable on "
                         "the driver and on every executor") from None
    if not callable(target):
        raise TokenError(f"{where} is a {type(target).__name__}, not a function")
    return target


def check_login(oauth: OAuth | None) -> None:
    """Fetches the login's first token, so that a refused client or a failing function stops the
    query at start, naming the setting. Driver side, before a client is built: refused inside a
    client's token callback, it would only show as a login that never finishes (or a closed
    connection). Nothing to do without OAUTHBEARER.

    Raises:
        TokenError: no token could be had.
    """
    if oauth is not None:
        tokens(oauth).current()


_TOKENS: dict[OAuth, Tokens] = {}
_TOKENS_LOCK = threading.Lock()


def tokens(oauth: OAuth) -> Tokens:
    """This process's :class:`Tokens` for the login (one per login, shared by every client)."""
    with _TOKENS_LOCK:
        found = _TOKENS.get(oauth)
        if found is None:
            found = _TOKENS[oauth] = Tokens(oauth)
        return found
