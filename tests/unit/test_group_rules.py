"""The WS-Reliability group rules (t1-t5), pure: each rule by name, then exhaustively over message orders and
duplicates, and over seeded random histories with clock steps, against invariants."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from lastagent.groups.rules import (
    RULES,
    Deliver,
    Duplicate,
    GroupState,
    Hold,
    Limits,
    Message,
    Refuse,
    Remove,
    Terminate,
    add,
    advance,
    contains,
    deadline,
    decode,
    encode,
    receive,
    run,
)

pytestmark = pytest.mark.unit

G = "g"
FAR = 10**12


def msg(seq, expiry=1000, status=None, ref=None, **kw) -> Message:
    return Message(G, seq, expiry, status, ref=seq if ref is None else ref, **kw)


def kinds(actions):
    out = []
    for a in actions:
        if isinstance(a, (Deliver, Duplicate, Hold)):
            out.append((type(a).__name__, a.message.seq))
        elif isinstance(a, Refuse):
            out.append(("Refuse", a.message.seq, a.rule))
        else:
            out.append((type(a).__name__, a.rule))
    return out


# -- intervals ----------------------------------------------------------------------------------


def test_intervals_match_a_set_for_every_insertion_order():
    for order in itertools.permutations(range(7)):
        intervals, seen = (), set()
        for n in order:
            intervals, seen = add(intervals, n), seen | {n}
            assert all(contains(intervals, k) == (k in seen) for k in range(-1, 9))
            assert all(a <= b for a, b in intervals) and all(b + 1 < c for (_, b), (c, _) in zip(intervals, intervals[1:]))
        assert intervals == ((0, 6),)


def test_a_hundred_thousand_messages_cost_a_few_integers():
    state = GroupState(G)
    for n in range(0, 100_000, 1000):  # every thousandth number: the state grows with gaps, not with messages
        state, _ = receive(state, msg(n, expiry=FAR), 0)
    gaps = state.size()
    for n in range(100_000):
        if n % 1000:
            state, _ = receive(state, msg(n, expiry=FAR), 0)
    assert state.active is not None and state.active.accepted == ((0, 99_999),)
    assert state.size() < 20 < gaps


# -- each rule by name -----------------------------------------------------------------------------


def test_t1_group_expiry_terminates_and_removes_at_once():
    state, out = run([(0, msg(0, status="start", group_expiry=500, expiry=400)), (10, msg(1, expiry=400))], G,
                     until=500)
    assert kinds(out)[-2:] == [("Terminate", "t1"), ("Remove", "t1")] and state.empty
    _, late = receive(state, msg(2, expiry=450), 600)
    assert kinds(late) == [("Refuse", 2, "expired")]  # its ExpiryTime is before GroupExpiryTime: never delivered


def test_t2_idle_terminates_and_keeps_ids_until_max_expiry():
    state, out = run([(0, msg(0, status="start", group_max_idle=100, expiry=900)), (50, msg(1, expiry=900))], G,
                     until=200)
    assert kinds(out)[-1] == ("Terminate", "t2") and not state.empty
    state, dup = receive(state, msg(1, expiry=900), 300)
    assert kinds(dup) == [("Duplicate", 1)]
    state, late = receive(state, msg(2, expiry=900), 310)
    assert kinds(late) == [("Refuse", 2, "late")]
    state, out = advance(state, 900)
    assert kinds(out) == [("Remove", "t2")] and state.empty


def test_t3_1_end_completes_a_group_with_parameters():
    state, out = run([(0, msg(0, status="start", group_max_idle=100, expiry=700)), (1, msg(1, status="end"))], G)
    assert kinds(out)[-1] == ("Terminate", "t3.1")
    assert state.retired[0].remove_at == 1000  # by t2: max(ExpiryTime)
    state, out = run([(0, msg(0, status="start", group_expiry=2000, expiry=700)), (1, msg(1, status="end"))], G)
    assert kinds(out)[-1] == ("Terminate", "t3.1") and state.retired[0].remove_at == 2000  # by t1


def test_t3_2_end_of_an_incomplete_group_terminates_nothing_until_t2_or_completion():
    state, out = run([(0, msg(0, status="start", group_max_idle=100)), (1, msg(2, status="end"))], G)
    assert not any(isinstance(a, Terminate) for a in out) and state.active.end_rule == "t3.2"
    filled, out = receive(state, msg(1), 50)
    assert kinds(out)[-1] == ("Terminate", "t3.2")
    idle, out = advance(state, 101)
    assert kinds(out) == [("Terminate", "t2")]


def test_t4_1_end_completes_a_group_without_parameters():
    state, out = run([(0, msg(0, status="start", expiry=800)), (1, msg(1, status="end", expiry=900))], G)
    assert kinds(out)[-1] == ("Terminate", "t4.1") and state.retired[0].remove_at == 900


def test_t4_2_incomplete_at_end_terminates_when_complete_or_at_max_expiry():
    state, _ = run([(0, msg(0, status="start", expiry=800)), (1, msg(2, status="end", expiry=900))], G)
    assert state.active.end_rule == "t4.2"
    _, out = receive(state, msg(1, expiry=850), 5)
    assert ("Terminate", "t4.2a") in kinds(out)
    gone, out = advance(state, 900)
    assert kinds(out) == [("Terminate", "t4.2b"), ("Remove", "t4.2b")] and gone.empty


def test_t5_a_held_message_that_expires_terminates_an_ordered_group():
    state, out = run([(0, msg(0, status="start", ordered=True)), (1, msg(2, expiry=300, ordered=True)),
                      (2, msg(3, expiry=900, ordered=True))], G)
    assert kinds(out) == [("Deliver", 0), ("Hold", 2), ("Hold", 3)]
    state, out = advance(state, 300)
    assert kinds(out) == [("Terminate", "t5"), ("Refuse", 2, "t5"), ("Refuse", 3, "t5")]
    assert state.retired[0].remove_at == 1000  # no parameters: max(ExpiryTime)


def test_ordered_groups_release_in_order_when_the_gap_fills():
    _, out = run([(0, msg(2, ordered=True)), (1, msg(1, ordered=True)), (2, msg(0, status="start", ordered=True))], G)
    assert kinds(out) == [("Hold", 2), ("Hold", 1), ("Deliver", 0), ("Deliver", 1), ("Deliver", 2)]


@pytest.mark.parametrize("first, later, why", [
    (msg(0, group_expiry=900, group_max_idle=10), None, "both present"),
    (msg(0, expiry=950, group_expiry=900), None, "ExpiryTime is after GroupExpiryTime"),
    (msg(0, expiry=500, group_expiry=2000), msg(1, expiry=600, group_expiry=550), "ExpiryTime is after GroupExpiryTime"),
    (msg(0, expiry=500, group_expiry=2000), msg(1, expiry=400, group_expiry=450), "below max(ExpiryTime)"),
    (msg(0, expiry=500, group_expiry=2000), msg(1, expiry=600, group_max_idle=5), "cannot change kind"),
])
def test_invalid_group_parameter(first, later, why):
    state, out = receive(GroupState(G), first, 0)
    if later is not None:
        state, out = receive(state, later, 1)
    assert isinstance(out[-1], Refuse) and out[-1].rule == "INVALID_GROUP_PARAMETER" and why in out[-1].reason


def test_a_held_message_that_expired_first_ends_its_group_by_t5_however_late_the_look():
    """The held message's ExpiryTime (500) passes before the GroupExpiryTime (800); the rules next look at
    1000, after both: t5 (its triggering event came first), not t1."""
    ge = 800
    state, out = run([(0, msg(0, ordered=True, expiry=700, group_expiry=ge)),
                      (1, msg(2, ordered=True, expiry=500, group_expiry=ge))], G)
    assert kinds(out) == [("Deliver", 0), ("Hold", 2)]
    for look in (advance, lambda st, now: receive(st, msg(5, expiry=2000), now)):  # a timer, or a message
        _, out = look(state, 1000)
        assert [a for a in out if isinstance(a, Terminate)] == [Terminate(G, 1, "t5")]
        assert [(a.message.seq, a.rule) for a in out if isinstance(a, Refuse)][0] == (2, "t5")
        # Removal is t1's, at the GroupExpiryTime, which passed too.
        assert [a for a in out if isinstance(a, Remove)] == [Remove(G, 1, "t5")]
    # Looked at between the two times, the same.
    _, out = advance(state, 600)
    assert [a for a in out if isinstance(a, Terminate)] == [Terminate(G, 1, "t5")]


@pytest.mark.parametrize("between", [[], [msg(2, group_expiry=5000)], [msg(2, group_expiry=5000), msg(3, expiry=900)]])
def test_copies_of_a_message_get_one_outcome_whatever_arrives_between(between):
    """Message 1 carries a GroupExpiryTime (600) below its own ExpiryTime (700): refused, and each copy of it,
    whether or not a higher number (whose value the group then uses) arrived before it."""
    first = msg(0, expiry=500, group_expiry=2000)
    bad = msg(1, expiry=700, group_expiry=600)
    for order in ([first, bad, *between, bad, bad], [first, *between, bad, bad]):
        _, out = run([(t, m) for t, m in enumerate(order)], G)
        got = [a.rule if isinstance(a, Refuse) else type(a).__name__ for a in out
               if isinstance(a, (Deliver, Duplicate, Refuse)) and a.message.seq == 1]
        assert got and set(got) == {"INVALID_GROUP_PARAMETER"}, (order, got)


def test_a_copy_of_a_message_refused_against_the_groups_value_is_refused_again():
    """Message 1 (ExpiryTime 3000, carrying no GroupExpiryTime) is after the value the group uses (2000, from
    number 2) and is refused; number 3 then raises the group's value to 5000. A copy of 1 is still refused, the
    rule the same: one outcome for the copies of one message."""
    history = [msg(0, expiry=500, group_expiry=2000), msg(2, expiry=500, group_expiry=2000), msg(1, expiry=3000),
               msg(3, expiry=500, group_expiry=5000), msg(1, expiry=3000)]
    state, out = run([(t, m) for t, m in enumerate(history)], G)
    assert [a.rule for a in out if isinstance(a, Refuse)] == ["INVALID_GROUP_PARAMETER"] * 2
    assert state.active is not None and state.active.refused == ((1, 1),)
    assert decode(G, encode(state)) == state  # remembered in the stored state


def test_parameters_come_from_the_highest_sequence_number():
    state, _ = run([(0, msg(0, status="start", group_max_idle=100)), (1, msg(2, group_max_idle=500)),
                    (2, msg(1, group_max_idle=50))], G)
    assert state.active.group_max_idle == 500 and state.active.params_seq == 2


def test_after_termination_a_start_opens_a_new_group_unless_it_is_a_duplicate():
    state, _ = run([(0, msg(0, status="start", group_max_idle=10, expiry=5000)), (1, msg(1, status="end"))], G)
    state, out = receive(state, msg(0, status="start"), 20)
    assert kinds(out) == [("Duplicate", 0)]  # the old group's ids are kept until max(ExpiryTime)
    state, _ = advance(state, 5000)
    state, out = receive(state, msg(0, status="start", expiry=9000), 5001)
    assert kinds(out) == [("Deliver", 0)] and state.generations == 2


def test_singletons_are_kept_until_they_expire():
    one = Message(G, None, 100)
    state, out = receive(GroupState(G), one, 0)
    state, again = receive(state, one, 50)
    assert kinds(out) == [("Deliver", None)] and kinds(again) == [("Duplicate", None)]
    state, out = advance(state, 100)
    assert kinds(out) == [("Remove", "singleton-expired")] and state.empty


def test_expired_and_beyond_end_are_refused():
    state, out = receive(GroupState(G), msg(0, expiry=10), 10)
    assert kinds(out) == [("Refuse", 0, "expired")]
    state, _ = run([(0, msg(0, status="start")), (1, msg(3, status="end"))], G)
    _, out = receive(state, msg(4), 2)
    assert kinds(out) == [("Refuse", 4, "beyond-end")]


def test_a_default_idle_ends_groups_that_would_never_terminate():
    state, _ = run([(0, msg(0, status="start"))], G)
    assert deadline(state) is None
    limits = Limits(default_max_idle=100)
    assert deadline(state, limits) == 100
    _, out = advance(state, 100, limits)
    assert ("Terminate", "t2-default") in kinds(out)


# -- every order, every duplicate -------------------------------------------------------------------


def outcome(actions) -> dict:
    """Final outcome per message ref (Hold is not final); Terminate/Remove per generation."""
    finals: Counter = Counter()
    delivered: list = []
    for a in actions:
        if isinstance(a, (Deliver, Duplicate, Refuse)):
            finals[a.message.ref] += 1
        if isinstance(a, Deliver):
            delivered.append(a.message.seq)
    return {"finals": finals, "delivered": delivered}


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("params", [{}, {"group_max_idle": 10_000}, {"group_expiry": 50_000}])
def test_every_order_with_a_duplicate_delivers_each_number_once(ordered, params):
    n = 4
    checked = 0
    for order in itertools.permutations(range(n)):
        for dup_of, dup_at in itertools.product(range(n), range(n + 1)):
            arrivals = list(order)
            arrivals.insert(dup_at, dup_of)
            messages = [(t, msg(s, expiry=40_000, status="start" if s == 0 else "end" if s == n - 1 else None,
                                ref=i, ordered=ordered, **params)) for i, (t, s) in enumerate(enumerate(arrivals))]
            state, actions = run(messages, G, until=FAR)
            seen = outcome(actions)
            assert all(c == 1 for c in seen["finals"].values()) and len(seen["finals"]) == n + 1, (arrivals, actions)
            assert sorted(seen["delivered"]) == list(range(n)), (arrivals, actions)
            if ordered:
                assert seen["delivered"] == list(range(n)), (arrivals, actions)
            assert sum(isinstance(a, Duplicate) for a in actions) == 1
            terminations = [a.rule for a in actions if isinstance(a, Terminate)]
            assert terminations in (["t3.1"], ["t3.2"], ["t4.1"], ["t4.2a"]), (arrivals, terminations)
            assert [a.rule for a in actions if isinstance(a, Remove)] == terminations and state.empty
            checked += 1
    assert checked == 24 * n * (n + 1)


# -- random histories with clock steps --------------------------------------------------------------


def _history(rng: random.Random) -> list[tuple[int, Message]]:
    n = rng.randint(1, 7)
    ordered = rng.random() < 0.5
    kind = rng.choice(["none", "idle", "expiry", "both"])
    now, out = 0, []
    for i in range(rng.randint(1, 14)):
        now += rng.choice([0, 1, 5, 50, 400, 2000])
        seq = None if rng.random() < 0.05 else rng.randrange(n)
        expiry = now + rng.choice([1, 100, 1000, 5000])
        params = {"none": {}, "idle": {"group_max_idle": rng.choice([100, 1000])},
                  "expiry": {"group_expiry": rng.choice([expiry, expiry + 3000, now + 10])},
                  "both": {"group_expiry": expiry, "group_max_idle": 100} if rng.random() < 0.2 else {}}[kind]
        status = "start" if seq == 0 else "end" if seq == n - 1 and rng.random() < 0.8 else None
        out.append((now, Message(G, seq, expiry, status, ordered=ordered, ref=i, **params)))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_random_histories_keep_the_invariants(seed):
    rng = random.Random(seed)
    limits = Limits(default_max_idle=rng.choice([None, 3000]))
    for _ in range(300):
        history = _history(rng)
        state, actions = run(history, G, limits, until=FAR)
        seen = outcome(actions)
        assert all(c == 1 for c in seen["finals"].values()) and len(seen["finals"]) == len(history), (history, actions)
        # Deliveries between two terminations belong to one group: each number once, and in order from 0
        # for an ordered group.
        group_seqs: list[list[int]] = [[]]
        for a in actions:
            if isinstance(a, Terminate):
                group_seqs.append([])
            if isinstance(a, Deliver) and a.message.seq is not None:
                group_seqs[-1].append(a.message.seq)
            if isinstance(a, (Refuse, Terminate, Remove)):
                assert a.rule in RULES
        for seqs in group_seqs:
            assert len(seqs) == len(set(seqs)), f"a number delivered twice within one group: {seqs}"
            if history[0][1].ordered:
                assert seqs == list(range(len(seqs))), f"an ordered group out of order: {seqs}"
        terminated = Counter(a.generation for a in actions if isinstance(a, Terminate))
        removed = Counter(a.generation for a in actions if isinstance(a, Remove) and a.generation is not None)
        assert terminated == removed and all(c == 1 for c in terminated.values()), "terminate then remove, once"
        assert state.active is None or limits.default_max_idle is None or state.active.has_params, \
            "only a group no rule can end may stay"
        assert not state.retired and state.singleton_until is None, "state left after every deadline passed"


# -- the short way for plain messages ------------------------------------------------------------------


def _fold_plain(state, seqs, expiries, now, limits):
    """receive, one message at a time: what receive_plain must equal."""
    before, outcomes = [], []
    for i, (seq, expiry) in enumerate(zip(seqs, expiries)):
        state, actions = receive(state, Message(G, seq, expiry, ref=("batch", i)), now, limits)
        mine = [a for a in actions if isinstance(a, (Deliver, Duplicate, Refuse)) and a.message.ref == ("batch", i)]
        others = [a for a in actions if a not in mine]
        assert len(mine) == 1 and (not others or i == 0), (actions, i)  # timers act before the first only
        before.extend(others)
        a = mine[0]
        outcomes.append("delivered" if isinstance(a, Deliver) else "duplicate" if isinstance(a, Duplicate)
                        else (a.rule, a.reason))
    return state, before, outcomes


@pytest.mark.parametrize("seed", range(20))
def test_plain_messages_take_the_short_way_to_the_same_state_and_outcomes(seed):
    """receive_plain equals receive on each message, from states reached by random histories (every kind of
    message, ordered or not, with parameters and ends) and over random plain batches with duplicates,
    expired messages, gaps and clock steps; where it declines (None), the states are the ones it names."""
    from lastagent.groups.rules import receive_plain

    rng = random.Random(1000 + seed)
    took, declined = 0, 0
    for _ in range(1000):
        limits = Limits(default_max_idle=rng.choice([None, 3000]))
        state, now = GroupState(G), 0
        history = _history(rng)[:rng.randint(0, 6)]
        for t, m in history:
            state, _ = receive(state, m, t, limits)
            now = t
        for _ in range(rng.randint(1, 3)):
            now += rng.choice([0, 1, 500, 3000, 20_000])
            n = rng.randint(1, 8)
            seqs = [rng.choice([-1, *range(10)]) if rng.random() < 0.05 else rng.randint(0, 9) for _ in range(n)]
            seqs.sort()
            if rng.random() < 0.4:  # the next numbers in a run (the usual batch), or a run from elsewhere
                g = state.active
                start = g.accepted[-1][1] + 1 if g is not None and g.accepted and rng.random() < 0.7 else \
                    rng.randint(0, 5)
                seqs = list(range(start, start + n))
            expiries = [now + rng.choice([-5, 0, 1, 100, 4000, 10**6]) for _ in range(n)]
            short = receive_plain(state, seqs, expiries, now, limits)
            if short is None:
                declined += 1
                after, _ = advance(state, now, limits)
                g = after.active
                assert (g is None and after.retired) or (g is not None and (g.ordered or g.end is not None)) or \
                    any(r.refused for r in after.retired) or g is not None and (g.refused or (
                        g.group_expiry is not None and max(expiries) > g.group_expiry))
                break
            took += 1
            expected = _fold_plain(state, seqs, expiries, now, limits)
            assert short == expected, (state, seqs, expiries, now)
            state = short[0]
    assert took > 800 and declined > 100, (took, declined)  # both ways were taken often
