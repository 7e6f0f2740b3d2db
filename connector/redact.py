"""How logs and errors name a record without showing its contents, and a secret without showing it. Pure, no I/O.

Nothing of a record's key, value or headers goes into a log line or an exception message
(docs/design.md: no payload in logs). A record is named by its position (topic, partition, offset,
or its index within the task) and, where that is not enough to find it, by a short digest of its
key: the first 12 hex digits of the SHA-256 of the key's bytes, labelled ``sha256:``, so a user
can find the record with ``hashlib.sha256(key).hexdigest()[:12]`` without the log holding it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

#: Hex digits of the SHA-256 shown: enough to find a record among millions, too few to guess it back.
DIGEST_HEX = 12


def digest(data: bytes | bytearray | str) -> str:
    """``sha256:<first 12 hex digits>`` of the bytes (a string is taken as its UTF-8 bytes)."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    return "sha256:" + hashlib.sha256(raw).hexdigest()[:DIGEST_HEX]


def key_label(key: bytes | bytearray | str | None) -> str:
    """How a record's key is shown: ``key sha256:<12 hex>``, or ``null key``."""
    return "null key" if key is None else f"key {digest(key)}"


@dataclass(frozen=True)
class Secret:
    """A password or key text: compared and pickled as usual, never shown."""

    value: str = field(repr=False)

    def __repr__(self) -> str:
        return "Secret(***)"

    def __str__(self) -> str:
        return "***"
