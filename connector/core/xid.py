"""XA transaction ids and the link's naming scheme. Pure: no I/O, runs anywhere.

An XID (X/Open XA, and AMQP's ``dtx`` domain) is a format id plus two byte strings: the
global transaction id (gtrid, at most :data:`MAXGTRIDSIZE` bytes) and the branch qualifier
(bqual, at most :data:`MAXBQUALSIZE` bytes). lastagent names them so:

* gtrid = ``"<link>:<epoch>"`` (UTF-8): one global transaction per link and Spark epoch;
* the epoch's global XID (the *gxid*, written in arbitration records) has an empty bqual; a branch
  is named by its Kafka transactional.id, with the producer id and epoch of its transaction
  (:class:`lastagent.core.protocol.Branch`).

Transactional ids are ``lastagent-<link>-<generation>-<partition>-<attempt>``: one per task
partition and attempt of a run (the run's generation), reused by every epoch of the run, never
shared between runs and never one fresh id per epoch. Every id of a link starts with
:func:`id_prefix`, which is how recovery finds the link's open transactions on the broker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lastagent.errors import OptionError

#: XA limits (xa.h): gtrid and bqual at most 64 bytes each.
MAXGTRIDSIZE = 64
MAXBQUALSIZE = 64
#: lastagent's XID format id: ASCII "LAGT" (0x4C414754 = 1279346516).
FORMAT_ID = 0x4C414754
#: The largest epoch (Spark's batch id is a Java long).
MAX_EPOCH = 2**63 - 1
#: Longest link whose gtrid ``"<link>:<MAX_EPOCH>"`` still fits MAXGTRIDSIZE (44).
MAX_LINK_LENGTH = MAXGTRIDSIZE - 1 - len(str(MAX_EPOCH))

_PREFIX = "lastagent-"
_LINK = re.compile(r"[A-Za-z0-9._-]+")
_DECIMAL = re.compile(r"0|[1-9][0-9]*")
_INT32 = (-(2**31), 2**31 - 1)


@dataclass(frozen=True)
class Xid:
    """One XA transaction id.

    Attributes:
        format_id: the format identifier (a signed 32-bit number; -1 is XA's null XID and
            is refused).
        gtrid: global transaction id, 1 to 64 bytes.
        bqual: branch qualifier, 0 to 64 bytes (empty for the epoch's global XID).

    Raises:
        ValueError: naming the part that is wrong and its limit.
    """

    format_id: int
    gtrid: bytes
    bqual: bytes

    def __post_init__(self) -> None:
        if isinstance(self.format_id, bool) or not isinstance(self.format_id, int):
            raise ValueError(f"XID format_id must be an int, not {type(self.format_id).__name__}")
        if not _INT32[0] <= self.format_id <= _INT32[1] or self.format_id == -1:
            raise ValueError(f"XID format_id {self.format_id} must be a signed 32-bit number other than -1 "
                             "(-1 is the null XID)")
        for part, value, low, high in (("gtrid", self.gtrid, 1, MAXGTRIDSIZE), ("bqual", self.bqual, 0, MAXBQUALSIZE)):
            if not isinstance(value, bytes):
                raise ValueError(f"XID {part} must be bytes, not {type(value).__name__}")
            if not low <= len(value) <= high:
                raise ValueError(f"XID {part} is {len(value)} bytes; it must be {low} to {high} bytes "
                                 f"(MAX{part.upper()}SIZE = {high})")

    def to_text(self) -> str:
        """The stable text form ``"<format id, decimal>:<gtrid hex>:<bqual hex>"`` (lower-case hex)."""
        return f"{self.format_id}:{self.gtrid.hex()}:{self.bqual.hex()}"

    @classmethod
    def from_text(cls, text: str) -> Xid:
        """Parses :meth:`to_text`'s form; the exact inverse (only canonical text is accepted).

        Raises:
            ValueError: the text is not an XID's canonical text form.
        """
        parts = text.split(":") if isinstance(text, str) else []
        if len(parts) != 3:
            raise ValueError(f"{text!r} is not an XID text: expected '<format id>:<gtrid hex>:<bqual hex>'")
        fmt, gtrid, bqual = parts
        if not re.fullmatch(r"-?(0|[1-9][0-9]*)", fmt) or fmt == "-0":
            raise ValueError(f"{text!r} is not an XID text: format id {fmt!r} is not a canonical decimal number")
        for name, h in (("gtrid", gtrid), ("bqual", bqual)):
            if not re.fullmatch(r"(?:[0-9a-f]{2})*", h):
                raise ValueError(f"{text!r} is not an XID text: {name} {h!r} is not lower-case hex bytes")
        return cls(int(fmt), bytes.fromhex(gtrid), bytes.fromhex(bqual))


def _gtrid(link: str, epoch: int) -> bytes:
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= MAX_EPOCH:
        raise ValueError(f"epoch {epoch!r} must be an int from 0 to {MAX_EPOCH}")
    return f"{link}:{epoch}".encode()


def gxid_text(link: str, epoch: int) -> str:
    """The text of the epoch's global XID (empty bqual), as written in arbitration records."""
    return Xid(FORMAT_ID, _gtrid(link, epoch), b"").to_text()


def id_prefix(link: str) -> str:
    """Every transactional.id of the link starts with this; recovery lists open transactions by it.

    The prefix of link ``a`` also prefixes link ``a-1``'s ids: filter listed ids with
    :func:`parse_transactional_id` to keep only the link's own.
    """
    return f"{_PREFIX}{link}-"


def transactional_id(link: str, generation: int, partition: int, attempt: int) -> str:
    """The branch id of one task attempt: ``lastagent-<link>-<generation>-<partition>-<attempt>``.

    ``generation`` is the generation the run claimed (:func:`lastagent.sinks.query_run.task_generation`):
    every epoch of the run reuses the id (its branches are ended before the next epoch's tasks
    start, and a new producer on the id fences a zombie attempt of an earlier epoch), while two
    runs never share one, so a run never fences another run's open transaction. A link holds
    partitions × attempts ids per run, whatever the number of epochs.
    """
    return f"{id_prefix(link)}{generation}-{partition}-{attempt}"


def parse_transactional_id(link: str, tid: str) -> tuple[int, int, int] | None:
    """(generation, partition, attempt) when ``tid`` is exactly one of the link's branch ids, else None.

    Unambiguous although links may contain '-': a longer link ``<link>-x`` adds parts after the prefix.
    """
    prefix = id_prefix(link)
    if not tid.startswith(prefix):
        return None
    parts = tid[len(prefix):].split("-")
    if len(parts) != 3 or not all(_DECIMAL.fullmatch(p) for p in parts):
        return None
    return int(parts[0]), int(parts[1]), int(parts[2])


def check_link(link: str) -> str:
    """Validates a link name; returns it unchanged.

    Letters, digits, '.', '_' and '-' only, 1 to :data:`MAX_LINK_LENGTH` (44) characters, so
    the gtrid ``"<link>:<epoch>"`` fits XA's 64 bytes for any epoch up to 2**63-1.

    Raises:
        OptionError: for option ``link``, saying what is wrong and what would be right.
    """
    if not isinstance(link, str) or not link:
        raise OptionError("link", "is empty; give a stable name of 1 to "
                                  f"{MAX_LINK_LENGTH} letters, digits, '.', '_' or '-', e.g. 'orders-to-kafka'")
    if not _LINK.fullmatch(link):
        bad = sorted({c for c in link if not _LINK.fullmatch(c)})
        raise OptionError("link", f"{link!r} has characters not allowed in a link name ({''.join(bad)!r}); "
                                  "use only letters, digits, '.', '_' and '-'")
    if len(link) > MAX_LINK_LENGTH:
        raise OptionError("link", f"{link!r} is {len(link)} characters; at most {MAX_LINK_LENGTH} fit, so that "
                                  f"the XA gtrid '<link>:<epoch>' stays within {MAXGTRIDSIZE} bytes")
    return link


class LinkIds:
    """Mixin for a sink's options that carry ``link``: the link's transactional-id naming."""

    link: str

    @property
    def id_prefix(self) -> str:
        """Every transactional.id of this link starts with this (recovery lists by it)."""
        return id_prefix(self.link)

    def transactional_id(self, generation: int, partition: int, attempt: int) -> str:
        """The branch id of one task attempt of the run that owns ``generation``."""
        return transactional_id(self.link, generation, partition, attempt)
