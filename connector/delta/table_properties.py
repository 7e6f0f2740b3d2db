"""A link's ownership and accepted losses in a Delta table's properties, and the race loop of every Delta commit.

Driver side (or wherever ``lastagent status`` / ``recover`` runs). The rules (who may claim, which generation
comes next) are :mod:`lastagent.core.arbitration`'s; this module reads and writes them as table properties
(``lastagent.link.<link>.*``) with a property commit through Delta Kernel's log writer
(:func:`lastagent.delta.kernel.set_properties`), and re-reads the table when another commit raced it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from lastagent.core.arbitration import (
    LostRace,
    Ownership,
    lost_key,
    next_ownership,
    owner_keys,
    ownership_properties,
    run_keys,
)
from lastagent.errors import ArbitrationError

if TYPE_CHECKING:
    from lastagent.delta.snapshot import Snapshot

log = logging.getLogger("lastagent.delta")


def delta_ownership(table: Snapshot, link: str) -> Ownership | None:
    """A link's ownership from a Delta table's properties (a snapshot read, no history)."""
    owner_key, gen_key = owner_keys(link)
    run_key, retired_key = run_keys(link)
    conf = table.configuration
    if gen_key not in conf:
        return None
    retired = tuple(r for r in conf.get(retired_key, "").split(",") if r)
    return Ownership(conf.get(owner_key, ""), int(conf[gen_key]), conf.get(run_key, ""), retired)


def accepted_lost_on_delta(table: Snapshot | None, link: str) -> frozenset[int]:
    """The epochs in a Delta table's ``lostAccepted`` property (none when the table does not exist)."""
    if table is None:
        return frozenset()
    raw = table.configuration.get(lost_key(link), "")
    return frozenset(int(e) for e in raw.split(",") if e.strip())


#: How many times a Delta commit that lost to another writer is re-read, decided again and tried again.
COMMIT_TRIES = 10

_T = TypeVar("_T")


def until_committed(attempt: Callable[[], _T], what: str, where: str) -> _T:
    """Runs ``attempt`` (read the table, decide, commit) until it does not lose a race, at most
    :data:`COMMIT_TRIES` times: each try reads the table anew, so it decides against what won. Driver.

    Raises:
        ArbitrationError: every try lost a race.
    """
    for _ in range(COMMIT_TRIES):
        try:
            return attempt()
        except LostRace as exc:
            log.info("%s in %s lost a race to another writer (%s); re-reading", what, where, exc)
    raise ArbitrationError(f"{what}: too many concurrent commits to {where} ({COMMIT_TRIES} tries)")


#: What keeps a table after a commit (``(table as read, version committed)``): :class:`lastagent.delta.upkeep.TableUpkeep`.
Kept = Callable[["Snapshot", int], None]


def alter_properties(open_table: Callable[[], Snapshot], where: str, what: str,
                     properties_of: Callable[[Snapshot], dict[str, str] | None], kept: Kept | None = None
                     ) -> dict[str, str] | None:
    """Sets Delta table properties worked out from the table's newest version. Driver side.

    A property change is a metadata commit, which Delta refuses when another commit raced it: then
    the table is read again and ``properties_of`` asked again (:func:`until_committed`).

    Args:
        open_table: the table at its newest version.
        where: the table, for messages.
        what: what the properties record, for messages (e.g. "the owner of link 'x'").
        properties_of: the properties to set, from the table as read; None when nothing is to be
            set; it may raise to refuse.
        kept: called after the commit with the table as read and the version committed (checkpoints, cleanups).

    Returns:
        The properties set, or None when ``properties_of`` said nothing was to be set.

    Raises:
        ArbitrationError: the table could not be written, or lost the race every time.
    """
    from lastagent.delta import kernel as delta_kernel

    def attempt() -> dict[str, str] | None:
        table = open_table()
        properties = properties_of(table)
        if properties is None:
            return None
        # Through Delta Kernel's log writer, not delta-rs's set_table_properties: delta-rs 1.6.6 rewrites a
        # table-features protocol with it (a reader-version-3 table gains variantType, which older readers
        # refuse), and cannot commit to a table with in-commit timestamps at all. This commit is the table's
        # metaData with these keys set and nothing else; a race re-reads (until_committed).
        version = delta_kernel.set_properties(table.uri, table.storage, table.version, table.id, properties, what)
        if kept is not None:
            kept(table, version)
        return properties

    return until_committed(attempt, f"recording {what}", where)


def accept_lost_on_delta(open_table: Callable[[], Snapshot], where: str, link: str, epoch: int,
                         kept: Kept | None = None) -> None:
    """Adds ``epoch`` to the table's ``lostAccepted`` property (a metadata commit, re-read on a race)."""
    alter_properties(open_table, where, f"the accepted loss of link {link!r} epoch {epoch}", lambda table: {
        lost_key(link): ",".join(map(str, sorted(accepted_lost_on_delta(table, link) | {epoch})))}, kept)


def claim_on_delta(open_table: Callable[[], Snapshot], where: str, link: str, owner: str, takeover: bool,
                   run: str = "", base: Callable[[], Ownership | None] | None = None,
                   kept: Kept | None = None) -> Ownership:
    """Claims the next generation in a Delta table's properties, unless ``run`` holds it already.

    A property change is a metadata commit: Delta refuses any commit (a decision, another claim)
    that raced with it, so a decider that read the old generation must re-read and is refused.
    Runs once per run of a query (by its first tasks), not per epoch: a run that holds the link
    reads the table and changes nothing. ``base`` gives the ownership to continue from when the
    table records none (claims made elsewhere before the table existed).
    """
    claimed: list[Ownership] = []

    def claim(table: Snapshot) -> dict[str, str] | None:
        current = delta_ownership(table, link)
        if current is None and base is not None:
            current = base()
        after = next_ownership(link, where, current, owner, run, takeover)
        stands = after or current  # None only when the run holds the link already
        assert stands is not None
        claimed[:] = [stands]
        return None if after is None else ownership_properties(link, after)

    changed = alter_properties(open_table, where, f"the owner of link {link!r}", claim, kept)
    ownership = claimed[0]
    if changed is not None:
        log.info("link %s: generation %d claimed by %s (run %s) in %s", link, ownership.generation, ownership.owner,
                 ownership.run or "-", where)
    return ownership

