"""WS-Reliability's receiver rules for message groups, as pure rules: duplicate elimination, ordered
delivery, group termination and state removal (t1-t5). Pure: no I/O; runs wherever the group's
state is (a Spark stateful operator's task, a test).

Events in, actions out, like :mod:`lastagent.core.protocol`. All the state of one group id is a
:class:`GroupState` value. :func:`receive` takes a message and the time; :func:`advance` takes the
time alone (a timer fired). Each returns the next state and the actions to carry out in order:

* :class:`Deliver`: hand the message to the application (the sink).
* :class:`Duplicate`: drop it; it was accepted before.
* :class:`Refuse`: it goes to the dead letters, with the rule as the reason.
* :class:`Hold`: an ordered group's message waits for the gap before it to fill.
* :class:`Terminate`: the group ends; no more messages are expected for it.
* :class:`Remove`: its state (status, sequence numbers) is gone.

:func:`deadline` says when :func:`advance` next has something to do (a timer to register).

The rules follow the OASIS WS-RM TC's agreed resolution of issues Rel 52/57/82 (group termination, as WS-Reliability 1.1 adopted it):

* Every message carries a group id. A *singleton* has no sequence number; its id is kept until
  its ``ExpiryTime``, then removed. Group members carry a sequence number (from 0, the
  ``start`` message) and may carry ``status`` ``start`` or ``end``.
* The accepted sequence numbers of a group are kept as intervals, so a group of a million
  messages costs a few integers.
* The termination parameters are ``GroupExpiryTime`` or ``GroupMaxIdleDuration``, never both:
  both is ``INVALID_GROUP_PARAMETER``. The values of the message with the highest sequence
  number hold. A message carrying a ``GroupExpiryTime`` below its own ``ExpiryTime`` or below the
  ``max(ExpiryTime)`` of the messages received for the group is refused
  (``INVALID_GROUP_PARAMETER``) whatever its number, and so is a message whose ``ExpiryTime`` is
  after the ``GroupExpiryTime`` the group uses. A copy of a message refused so is refused again.
* Termination and removal of state are distinct events:

  - **t1**: ``GroupExpiryTime`` is over. The group terminates and its state is removed at once.
  - **t2**: ``GroupMaxIdleDuration`` passed since the last message. The group terminates; its
    state stays until ``max(ExpiryTime)`` for duplicate checks.
  - **t3.1**: the ``end`` message makes a group that has parameters complete. It terminates;
    removal is by t1 (at ``GroupExpiryTime``) or t2 (at ``max(ExpiryTime)``).
  - **t3.2**: the ``end`` message arrives with the group incomplete. Nothing terminates yet: t1 or
    t2 still apply. If the gap fills later, the group terminates then, with the rule named
    ``t3.2``.
  - **t4.1**: ``end`` completes a group without parameters. It terminates; the state is removed
    at ``max(ExpiryTime)``.
  - **t4.2**: ``end`` arrives, the group without parameters is incomplete. It terminates when it
    becomes complete (**t4.2a**) or when ``max(ExpiryTime)`` is reached (**t4.2b**); the state is
    removed at ``max(ExpiryTime)``.
  - **t5**: in an ordered group, a held message expires before delivery. The group terminates;
    its held messages are refused (rule ``t5``). Removal is by t1 or t2 for a group with
    parameters, at ``max(ExpiryTime)`` without.

  Each deadline is taken at its own time, earliest first, however late :func:`advance` is called:
  a held message that expired before the ``GroupExpiryTime`` ends its group by t5, not t1.

* After termination, a message of the same group id is a duplicate when its number was accepted
  before. Otherwise it starts a new group when it is a ``start`` (number 0). Anything else is
  refused as ``late`` while the old group's state is kept; once the state is removed, nothing is
  known of the old group and the message starts a new one.
* A message whose ``ExpiryTime`` has passed is never delivered: refused as ``expired``.

Two choices go beyond the text, for a stream that must not keep state forever:

* ``default_max_idle`` (:class:`Limits`): a group without parameters and without an ``end``
  would never terminate. Given a value, such a group terminates after that idle time. The rule
  is named ``t2-default``, and removal is as for t2.
* Numbers after the ``end`` message's are refused as ``beyond-end``.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

#: Rule names a Refuse, Terminate or Remove carries.
RULES = ("t1", "t2", "t2-default", "t3.1", "t3.2", "t4.1", "t4.2a", "t4.2b", "t5", "INVALID_GROUP_PARAMETER",
         "expired", "late", "beyond-end", "invalid-sequence-number", "singleton-expired", "invalid-message")


@dataclass(frozen=True)
class Message:
    """What the rules need of one message; ``ref`` is the caller's handle (a row index, an offset).

    Attributes:
        group: the group id.
        seq: the sequence number (0 first), None for a singleton.
        expiry: ``ExpiryTime``, in milliseconds since the epoch.
        status: ``start``, ``end`` or None.
        group_expiry: ``GroupExpiryTime`` (ms since the epoch), if given.
        group_max_idle: ``GroupMaxIdleDuration`` (ms), if given.
        ordered: deliver the group in sequence order.
        ref: the caller's handle, returned in the actions.
    """

    group: str
    seq: int | None
    expiry: int
    status: str | None = None
    group_expiry: int | None = None
    group_max_idle: int | None = None
    ordered: bool = False
    ref: Any = None


@dataclass(frozen=True)
class Deliver:
    message: Message


@dataclass(frozen=True)
class Duplicate:
    message: Message


@dataclass(frozen=True)
class Refuse:
    message: Message
    rule: str
    reason: str


@dataclass(frozen=True)
class Hold:
    message: Message


@dataclass(frozen=True)
class Terminate:
    group: str
    generation: int
    rule: str


@dataclass(frozen=True)
class Remove:
    group: str
    generation: int | None  # None: a singleton's id
    rule: str


Action = Deliver | Duplicate | Refuse | Hold | Terminate | Remove


@dataclass(frozen=True)
class Limits:
    """Choices beyond the rules (module docstring). ``default_max_idle``: ms, None for never."""

    default_max_idle: int | None = None


#: The rules as the resolution states them, with no extra limit.
NO_LIMITS = Limits()


# -- intervals --------------------------------------------------------------------------------------

Intervals = tuple[tuple[int, int], ...]


def contains(intervals: Intervals, n: int) -> bool:
    """True when ``n`` is in one of the closed, sorted, disjoint ``intervals``."""
    lo, hi = 0, len(intervals)
    while lo < hi:
        mid = (lo + hi) // 2
        a, b = intervals[mid]
        if n < a:
            hi = mid
        elif n > b:
            lo = mid + 1
        else:
            return True
    return False


def add(intervals: Intervals, n: int) -> Intervals:
    """``intervals`` with ``n`` added, adjacent intervals merged."""
    if contains(intervals, n):
        return intervals
    out = list(intervals)
    i = bisect.bisect_left(out, (n, n))  # the first interval that starts after n
    left = i > 0 and out[i - 1][1] == n - 1
    right = i < len(out) and out[i][0] == n + 1
    if left and right:
        out[i - 1:i + 1] = [(out[i - 1][0], out[i][1])]
    elif left:
        out[i - 1] = (out[i - 1][0], n)
    elif right:
        out[i] = (n, out[i][1])
    else:
        out.insert(i, (n, n))
    return tuple(out)


# -- state --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Generation:
    """One group of a group id: from its first message to the removal of its state.

    Attributes:
        number: 1 for the id's first group, then counting up.
        accepted: sequence numbers accepted (delivered or held), as intervals.
        end: the ``end`` message's number, once received.
        group_expiry, group_max_idle: the parameters that hold (from the highest number that had them).
        params_seq: the number they came from (-1: none yet).
        max_expiry: max ``ExpiryTime`` of the accepted messages.
        last_seen: when the last message was accepted (ms).
        ordered: deliver in order.
        next_seq: ordered groups: the next number to deliver.
        held: ordered groups: messages waiting for a gap to fill, by number.
        terminated: the rule that terminated it, or None while active.
        remove_at: when its state goes (set at termination).
        end_rule: ``t3.2`` or ``t4.2`` once an ``end`` arrived with the group incomplete.
        refused: numbers refused ``INVALID_GROUP_PARAMETER`` against the group's values, as intervals: a
            copy of one is refused again, though the group's ``GroupExpiryTime`` may have moved since.
    """

    number: int
    accepted: Intervals = ()
    end: int | None = None
    group_expiry: int | None = None
    group_max_idle: int | None = None
    params_seq: int = -1
    max_expiry: int = 0
    last_seen: int = 0
    ordered: bool = False
    next_seq: int = 0
    held: tuple[Message, ...] = ()
    terminated: str | None = None
    remove_at: int | None = None
    end_rule: str | None = None
    refused: Intervals = ()

    @property
    def complete(self) -> bool:
        return self.end is not None and self.accepted == ((0, self.end),)

    @property
    def has_params(self) -> bool:
        return self.group_expiry is not None or self.group_max_idle is not None


@dataclass(frozen=True)
class GroupState:
    """Everything kept for one group id: its active group, terminated ones kept for duplicate checks,
    and a singleton's id. Empty (:attr:`empty`) when nothing is kept: the caller may drop it."""

    group: str
    active: Generation | None = None
    retired: tuple[Generation, ...] = ()
    singleton_until: int | None = None
    generations: int = 0

    @property
    def empty(self) -> bool:
        return self.active is None and not self.retired and self.singleton_until is None

    def size(self) -> int:
        """Integers kept: what the state costs, whatever the number of messages."""
        gens = [g for g in (self.active, *self.retired) if g is not None]
        return 1 + sum(2 * len(g.accepted) + 2 * len(g.refused) + 8 + len(g.held) for g in gens) + (self.singleton_until is not None)


def _refuse(m: Message, rule: str, reason: str) -> Refuse:
    return Refuse(m, rule, reason)


def _check_params(m: Message, g: Generation | None) -> Refuse | None:
    """The parameter rules for an accepted-to-be message (a, b, c, d of the resolution).

    A ``GroupExpiryTime`` a message carries is judged whatever its number, so that the outcome of a
    message and of each copy of it does not hang on whether a higher number arrived first: below the
    message's own ``ExpiryTime`` it is refused always (a: the sender "must not send a message in that
    group with an ExpiryTime greater than the GroupExpiryTime"), below the ``max(ExpiryTime)`` of the
    messages received for the group it is refused (d: "never less than max(ExpiryTime) of messages
    received for the group"). Which value the group then uses is rule c's: the highest number's.
    """
    if m.group_expiry is not None and m.group_max_idle is not None:
        return _refuse(m, "INVALID_GROUP_PARAMETER", "GroupExpiryTime and GroupMaxIdleDuration are both present")
    if m.group_max_idle is not None and m.group_max_idle <= 0:
        return _refuse(m, "INVALID_GROUP_PARAMETER", f"GroupMaxIdleDuration {m.group_max_idle} is not positive")
    if m.group_expiry is not None and m.expiry > m.group_expiry:
        return _refuse(m, "INVALID_GROUP_PARAMETER",
                       f"ExpiryTime is after GroupExpiryTime (the message's own: {m.expiry} > {m.group_expiry})")
    if g is None:
        return None
    if m.group_expiry is not None and g.group_max_idle is not None or \
            m.group_max_idle is not None and g.group_expiry is not None:
        return _refuse(m, "INVALID_GROUP_PARAMETER", "the group's termination parameter cannot change kind")
    if m.group_expiry is not None and m.group_expiry < g.max_expiry:
        return _refuse(m, "INVALID_GROUP_PARAMETER",
                       f"GroupExpiryTime {m.group_expiry} is below max(ExpiryTime) {g.max_expiry} of the group")
    takes = (m.group_expiry is not None or m.group_max_idle is not None) and m.seq is not None and \
        m.seq > g.params_seq
    expiry = m.group_expiry if takes and m.group_expiry is not None else g.group_expiry
    if expiry is not None and expiry < max(g.max_expiry, m.expiry):
        return _refuse(m, "INVALID_GROUP_PARAMETER",
                       f"GroupExpiryTime {expiry} is below max(ExpiryTime) {max(g.max_expiry, m.expiry)} of the group")
    return None


def receive(state: GroupState, m: Message, now: int, limits: Limits = NO_LIMITS) -> tuple[GroupState, list[Action]]:
    """One message arrives at ``now`` (ms). Returns the next state and the actions, in order.

    Timers first: what was due before ``now`` happens before the message is looked at.
    """
    state, actions = advance(state, now, limits)
    if m.seq is None:
        if state.singleton_until is not None:
            return state, [*actions, Duplicate(m)]
        if m.expiry <= now:
            return state, [*actions, _refuse(m, "expired", f"ExpiryTime {m.expiry} passed before it arrived")]
        return replace(state, singleton_until=m.expiry), [*actions, Deliver(m)]
    if m.seq < 0:
        return state, [*actions, _refuse(m, "invalid-sequence-number", f"sequence number {m.seq} is negative")]
    for g in (*state.retired, state.active):
        if g is not None and contains(g.accepted, m.seq):
            return state, [*actions, Duplicate(m)]
    for g in (*state.retired, state.active):
        if g is not None and contains(g.refused, m.seq):
            return state, [*actions, _refuse(m, "INVALID_GROUP_PARAMETER", f"a copy of sequence number {m.seq}, "
                                                                           "refused before for its group parameters")]
    if m.expiry <= now:
        return state, [*actions, _refuse(m, "expired", f"ExpiryTime {m.expiry} passed before it arrived")]
    g = state.active
    if g is None:
        if state.retired and m.seq != 0:
            last = state.retired[-1]
            return state, [*actions, _refuse(m, "late", f"group {m.group!r} was terminated ({last.terminated}) "
                                                        "and this is not the start of a new one")]
        bad = _check_params(m, None)
        if bad is not None:
            return state, [*actions, bad]
        g = Generation(state.generations + 1, ordered=m.ordered)
        state = replace(state, generations=state.generations + 1)
    else:
        bad = _check_params(m, g)
        if bad is not None:
            # Remembered, so that a copy gets the same outcome whatever arrives between (a higher number
            # may raise the group's GroupExpiryTime above this message's ExpiryTime).
            active = replace(g, refused=add(g.refused, m.seq))
            return replace(state, active=active), [*actions, bad]
    if g.end is not None and m.seq > g.end:
        return state, [*actions, _refuse(m, "beyond-end", f"sequence number {m.seq} is after the end, {g.end}")]
    if m.status == "end" and g.end is not None and m.seq != g.end:
        return state, [*actions, _refuse(m, "beyond-end", f"a second end ({m.seq}); the end is {g.end}")]
    if (m.group_expiry is not None or m.group_max_idle is not None) and m.seq > g.params_seq:
        g = replace(g, group_expiry=m.group_expiry, group_max_idle=m.group_max_idle, params_seq=m.seq)
    g = replace(g, accepted=add(g.accepted, m.seq), max_expiry=max(g.max_expiry, m.expiry), last_seen=now,
                end=m.seq if m.status == "end" else g.end)
    if not g.ordered:
        actions.append(Deliver(m))
    elif m.seq != g.next_seq:
        g = replace(g, held=tuple(sorted((*g.held, m), key=lambda h: h.seq or 0)))
        actions.append(Hold(m))
    else:
        actions.append(Deliver(m))
        nxt, held = m.seq + 1, list(g.held)
        while held and held[0].seq == nxt:
            actions.append(Deliver(held.pop(0)))
            nxt += 1
        g = replace(g, next_seq=nxt, held=tuple(held))
    if g.complete:
        rule = ("t3.1" if m.status == "end" else "t3.2") if g.has_params else \
            ("t4.1" if m.status == "end" else "t4.2a")
        return _terminate(replace(state, active=g), g, rule, now, actions)
    if m.status == "end":
        g = replace(g, end_rule="t3.2" if g.has_params else "t4.2")
    return replace(state, active=g), actions


#: What :func:`receive_plain` says of each message: delivered, or a duplicate; a refusal is ``(rule, reason)``.
DELIVERED = "delivered"
DUPLICATE = "duplicate"


def receive_plain(state: GroupState, seqs: list[int], expiries: list[int], now: int,
                  limits: Limits = NO_LIMITS) -> tuple[GroupState, list[Action], list[str | tuple[str, str]]] | None:
    """Plain messages of one group, in order, all arriving at ``now``: the same as :func:`receive` on each.

    A plain message has a sequence number and an ``ExpiryTime`` and nothing else (no status, no
    parameters, unordered): most of a stream. This way costs a few integer comparisons per message and no
    object, where :func:`receive` builds a state per message.

    Returns:
        The next state, the actions of the timers due at ``now`` (before any message), and one outcome per
        message: :data:`DELIVERED`, :data:`DUPLICATE` or a refusal ``(rule, reason)``. None when the group
        is not where plain messages can take this way (an ordered or ended active group, or a terminated
        group whose state is kept): fold :func:`receive` instead.
    """
    state, actions = advance(state, now, limits)
    g = state.active
    if g is None and state.retired or g is not None and (g.ordered or g.end is not None):
        return None
    if any(r.refused for r in state.retired) or g is not None and (g.refused or g.group_expiry is not None and any(
            e > g.group_expiry for e in expiries)):
        return None  # a refusal to remember, or a copy of a refused number: receive() keeps them
    # After the one advance, none is due within the batch at the same ``now``: a message accepted now sets
    # last_seen = now and an ExpiryTime > now, and only messages can change the rest.
    kept = [r.accepted for r in state.retired]
    accepted = () if g is None else g.accepted
    # The intervals end at ``last``: a number after it is in none, and the next one extends the last interval.
    last = accepted[-1][1] if accepted else -2
    max_expiry = 0 if g is None else g.max_expiry
    group_expiry = None if g is None else g.group_expiry
    n = len(seqs)
    first = last + 1 if accepted else seqs[0] if seqs else 0
    if n and first >= 0 and not kept and seqs == list(range(first, first + n)) and min(expiries) > now and (
            group_expiry is None or group_expiry >= max(max_expiry, *expiries)):
        # The usual batch: the next numbers, none expired, within the group's expiry. Each is delivered.
        accepted = (*accepted[:-1], (accepted[-1][0], first + n - 1)) if accepted else ((first, first + n - 1),)
        max_expiry = max(max_expiry, *expiries)
        seqs, expiries = [], []
        outcomes: list[str | tuple[str, str]] = [DELIVERED] * n
        delivered = True
    else:
        outcomes, delivered = [], False
    for seq, expiry in zip(seqs, expiries):
        if seq < 0:
            outcomes.append(("invalid-sequence-number", f"sequence number {seq} is negative"))
        elif seq <= last and contains(accepted, seq) or kept and any(contains(k, seq) for k in kept):
            outcomes.append(DUPLICATE)
        elif expiry <= now:
            outcomes.append(("expired", f"ExpiryTime {expiry} passed before it arrived"))
        else:
            accepted = (*accepted[:-1], (accepted[-1][0], seq)) if seq == last + 1 else add(accepted, seq)
            last = max(last, seq)
            max_expiry = max(max_expiry, expiry)
            delivered = True
            outcomes.append(DELIVERED)
    if delivered:
        if g is None:
            g = Generation(state.generations + 1)
            state = replace(state, generations=state.generations + 1)
        state = replace(state, active=replace(g, accepted=accepted, max_expiry=max_expiry, last_seen=now))
    return state, actions, outcomes


def _removal_time(g: Generation, rule: str, now: int) -> int:
    if rule == "t1":
        return now
    if g.group_expiry is not None:
        return g.group_expiry  # t1's removal, for t3.1/t3.2/t5 of a group with GroupExpiryTime
    return g.max_expiry  # t2, t4 and t5 without parameters: kept until max(ExpiryTime)


def _terminate(state: GroupState, g: Generation, rule: str, now: int,
               actions: list[Action]) -> tuple[GroupState, list[Action]]:
    actions.append(Terminate(state.group, g.number, rule))
    if g.held:
        actions.extend(_refuse(h, rule, f"held for order, and group {state.group!r} terminated ({rule})")
                       for h in g.held)
    done = replace(g, held=(), terminated=rule, remove_at=_removal_time(g, rule, now))
    state = replace(state, active=None, retired=(*state.retired, done))
    return _remove_due(state, now, actions)


def _remove_due(state: GroupState, now: int, actions: list[Action]) -> tuple[GroupState, list[Action]]:
    kept = []
    for g in state.retired:
        if g.remove_at is not None and g.remove_at <= now:
            actions.append(Remove(state.group, g.number, g.terminated or ""))
        else:
            kept.append(g)
    state = replace(state, retired=tuple(kept))
    if state.singleton_until is not None and state.singleton_until <= now:
        actions.append(Remove(state.group, None, "singleton-expired"))
        state = replace(state, singleton_until=None)
    return state, actions


def _due_rule(g: Generation, now: int, limits: Limits) -> str | None:
    """The rule that terminates the active group at ``now``, if any (t1 first)."""
    if g.group_expiry is not None and now >= g.group_expiry:
        return "t1"
    if any(h.expiry <= now for h in g.held):
        return "t5"
    if g.group_max_idle is not None and now >= g.last_seen + g.group_max_idle:
        return "t2"
    if not g.has_params and g.end is not None and now >= g.max_expiry:
        return "t4.2b"
    if not g.has_params and g.end is None and limits.default_max_idle is not None and \
            now >= g.last_seen + limits.default_max_idle:
        return "t2-default"
    return None


def advance(state: GroupState, now: int, limits: Limits = NO_LIMITS) -> tuple[GroupState, list[Action]]:
    """The time is ``now`` (a timer fired, or a message arrives): terminations and removals that are due.

    Each deadline that passed is taken at its own time, earliest first, as if a timer had fired at
    each: the caller may look late (Spark's timers fire on a watermark that moves with micro-batches),
    and when a held message's ``ExpiryTime`` passed before the ``GroupExpiryTime``, the group ended by
    t5 then, whatever else passed since.
    """
    actions: list[Action] = []
    # Each step terminates the active group or removes something kept: at most this many.
    for _ in range(len(state.retired) + 3):
        due = deadline(state, limits)
        if due is None or due >= now:
            break
        state, step = _advance_at(state, due, limits)
        actions.extend(step)
    state, step = _advance_at(state, now, limits)
    actions.extend(step)
    return state, actions


def _advance_at(state: GroupState, now: int, limits: Limits) -> tuple[GroupState, list[Action]]:
    """What is due at ``now``, every deadline before it already taken."""
    actions: list[Action] = []
    g = state.active
    if g is not None:
        rule = _due_rule(g, now, limits)
        if rule is not None:
            return _terminate(state, g, rule, now, actions)
    return _remove_due(state, now, actions)


def deadline(state: GroupState, limits: Limits = NO_LIMITS) -> int | None:
    """The next time :func:`advance` has something to do, or None (nothing kept, or only messages can change it)."""
    times: list[int] = [g.remove_at for g in state.retired if g.remove_at is not None]
    if state.singleton_until is not None:
        times.append(state.singleton_until)
    g = state.active
    if g is not None:
        if g.group_expiry is not None:
            times.append(g.group_expiry)
        times.extend(h.expiry for h in g.held)
        if g.group_max_idle is not None:
            times.append(g.last_seen + g.group_max_idle)
        if not g.has_params and g.end is not None:
            times.append(g.max_expiry)
        if not g.has_params and g.end is None and limits.default_max_idle is not None:
            times.append(g.last_seen + limits.default_max_idle)
    return min(times) if times else None


def run(messages: Iterable[tuple[int, Message]], group: str, limits: Limits = NO_LIMITS,
        until: int | None = None) -> tuple[GroupState, list[Action]]:
    """Feeds ``(time, message)`` pairs of one group id in order, then advances to ``until``. For tests and docs."""
    state, out = GroupState(group), []
    for now, m in messages:
        state, actions = receive(state, m, now, limits)
        out.extend(actions)
    if until is not None:
        # Every deadline must change something: one that does not would be a timer firing forever.
        for _ in range(10_000):
            due = deadline(state, limits)
            if due is None or due > until:
                break
            state, actions = advance(state, due, limits)
            if not actions:
                raise RuntimeError(f"group {group!r}: the deadline {due} changed nothing")
            out.extend(actions)
        state, actions = advance(state, until, limits)
        out.extend(actions)
    return state, out


# -- encoding ----------------------------------------------------------------------------------
# A group's state as compact JSON, for a state store. Held messages keep their fields but not
# ``ref``: their payloads are the caller's to keep (by sequence number).


def _message_fields(m: Message) -> list[Any]:
    return [m.seq, m.expiry, m.status, m.group_expiry, m.group_max_idle, int(m.ordered)]


def _generation_fields(g: Generation) -> list[Any]:
    return [g.number, [list(i) for i in g.accepted], g.end, g.group_expiry, g.group_max_idle, g.params_seq,
            g.max_expiry, g.last_seen, int(g.ordered), g.next_seq, [_message_fields(h) for h in g.held],
            g.terminated, g.remove_at, g.end_rule, *([[list(i) for i in g.refused]] if g.refused else [])]


def _generation(group: str, f: list[Any]) -> Generation:
    held = tuple(Message(group, h[0], h[1], h[2], h[3], h[4], bool(h[5])) for h in f[10])
    # A 15th field, the refused numbers, only when there are some (states written before it have 14).
    refused = tuple((a, b) for a, b in f[14]) if len(f) > 14 else ()
    return Generation(f[0], tuple((a, b) for a, b in f[1]), f[2], f[3], f[4], f[5], f[6], f[7], bool(f[8]), f[9],
                      held, f[11], f[12], f[13], refused)


def to_fields(state: GroupState) -> list[Any]:
    """``state`` as JSON-ready lists (without the group id, which is the state's key)."""
    return [1, None if state.active is None else _generation_fields(state.active),
            [_generation_fields(g) for g in state.retired], state.singleton_until, state.generations]


def from_fields(group: str, f: Any) -> GroupState:
    """The state :func:`to_fields` gave for ``group``.

    Raises:
        ValueError: ``f`` is not the fields of a state of a version this code knows.
    """
    if not isinstance(f, list) or len(f) != 5 or f[0] != 1:
        raise ValueError(f"group {group!r}: the stored state is not version 1 of lastagent's group state")
    return GroupState(group, None if f[1] is None else _generation(group, f[1]),
                      tuple(_generation(group, g) for g in f[2]), f[3], f[4])


def encode(state: GroupState) -> bytes:
    """``state`` as compact JSON bytes (without the group id, which is the state's key)."""
    return json.dumps(to_fields(state), separators=(",", ":")).encode()


def decode(group: str, data: bytes) -> GroupState:
    """The state :func:`encode` wrote for ``group``.

    Raises:
        ValueError: ``data`` is not an encoded state of a version this code knows.
    """
    return from_fields(group, json.loads(data))
