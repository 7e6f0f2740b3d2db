"""Model check of the foreachBatch epoch's rules (lastagent.core.batch_epoch) against a simulated Spark Delta writer.

Two runs of one link, exhaustively interleaved at every read and commit, each of them free to stop (a crash, or a
zombie that stalls) after any step:

* run A holds the link as generation 1 and decides epoch 1: enter, ``to_kafka`` (a prepared branch), the user's
  ``MERGE`` (a snapshot read with Delta's ``hasBeenExecuted`` check, then the commit with Delta's conflict check on
  the app ids the transaction read), the exit (its own empty commit when the body made none), phase 2;
* run B is the restart: it claims (fences the current generation; retries when it lost), recovers the link
  (``protocol.recover`` on the records in the history), then replays epoch 1 the same way;
* and, separately, two restarts B and C at once after A stopped with its branch prepared: concurrent claims of
  the same generation (transactional ids carry the generation, so two runs that both believed they held it would
  fence each other's branches in Kafka).

The simulated table is Delta's behaviour that the fence rests on (checked against delta-spark 4.4.0 with Spark:
a write whose app id's ``txn`` is at or above its version is skipped; a commit fails when a commit after its
snapshot changed a ``txn`` it read). The invariants: epoch 1's data is committed at most once, and once when B
finishes; every committed branch is named by the one deciding record; no record names a branch that was rolled
back (the hazard presumed abort must never meet). Mutants of the rules (no fence; a claimer that does not check
that it won; an exit that commits what it prepared without a record) must each break one. A third run shape: A's
body writes through a session the block did not set (no ``txn``, no record): A must never decide, and an exit that
does not look at what the table committed while the block was open (the mutant) does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from lastagent.core import batch_epoch as be
from lastagent.core import protocol
from lastagent.core.protocol import Branch

pytestmark = pytest.mark.unit

LINK = "l"
EPOCH = 1


@dataclass(frozen=True)
class Commit:
    txn: tuple[str, int] | None
    metadata: str | None
    data_epoch: int | None  # the user's data for that epoch (the MERGE); None for claims and empty commits


@dataclass
class World:
    commits: list[Commit] = field(default_factory=list)
    branches: dict[Branch, str] = field(default_factory=dict)  # open / committed / aborted
    hazards: list[str] = field(default_factory=list)

    def clone(self) -> World:
        return World(list(self.commits), dict(self.branches), list(self.hazards))

    def key(self) -> tuple:
        return tuple(self.commits), tuple(self.branches.items()), tuple(self.hazards)

    def txns(self, upto: int | None = None) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.commits[:upto]:
            if c.txn is not None:
                out[c.txn[0]] = c.txn[1]
        return out

    def history(self) -> list[str | None]:
        return [c.metadata for c in self.commits]

    def record(self, epoch: int) -> be.BatchRecord | None:
        for m in self.history():
            r = be.record_in(m, LINK)
            if r is not None and r.epoch == epoch:
                return r
        return None

    def begin(self, app: str, version: int) -> tuple[int, bool]:
        """A Delta write's snapshot and its hasBeenExecuted check."""
        return len(self.commits), self.txns().get(app, -1) >= version

    def commit(self, snapshot: int, skipped: bool, app: str, version: int, metadata: str,
               data_epoch: int | None) -> str:
        if skipped:
            return "skipped"
        if any(c.txn is not None and c.txn[0] == app for c in self.commits[snapshot:]):
            return "conflict"  # ConcurrentTransactionException: the app id is in the transaction's read set
        self.commits.append(Commit((app, version), metadata, data_epoch))
        return "ok"

    def prepare(self, transactional_id: str) -> Branch:
        """A task's branch: its producer's init_transactions fences (aborts) an open transaction of the same id."""
        for b, state in self.branches.items():
            if b.transactional_id == transactional_id and state == "open":
                self.branches[b] = "aborted"
        b = Branch(transactional_id, 7, sum(1 for o in self.branches if o.transactional_id == transactional_id))
        self.branches[b] = "open"
        return b

    def end(self, branch: Branch, commit: bool) -> None:
        state = self.branches.get(branch)
        if commit:
            if state == "open":
                self.branches[branch] = "committed"
            elif state != "committed":
                self.hazards.append(f"decided branch {branch} was {state}")
        elif state == "open":
            self.branches[branch] = "aborted"


class Rules:
    """The rules under test; mutants override one."""

    def claim(self, txns: dict[str, int], run: str, nonce: str) -> tuple[be.ClaimCommit, be.Claim]:
        return be.claim(LINK, run, nonce, txns)

    def claim_won(self, mine: be.Claim, history: list[str | None]) -> bool:
        return be.claim_won(mine, history)

    def leave(self, *args, **kwargs) -> be.Exit:
        return be.leave(*args, **kwargs)

    def stray(self, commits: list[be.Commit]) -> str | None:
        found = be.stray_writes(commits)
        return be.stray_reason(LINK, EPOCH, "t", found, None) if found else None


def _generation(b: Branch) -> int:
    """Transactional ids carry the run's generation (the sinks' id naming: link, generation, task, attempt)."""
    return int(b.transactional_id.split("-")[0][1:])


@dataclass
class Run:
    """One run's program counter and locals; ``step`` does one atomic step on the world."""

    name: str
    pc: str = "claim-read"
    generation: int = 0
    claim_tries: int = 0
    pending: object = None
    entry: be.Entry | None = None
    prepared: tuple[Branch, ...] = ()
    metadata: str = ""
    tx: tuple[int, bool] | None = None
    body_failed: bool = False
    decided_here: bool = False
    failed: str | None = None
    entered: int = 0  # the table's commit count when the block began
    left: bool = False  # the block's exit ran to its end
    stray_body: bool = False  # the body writes through a session the block did not set (no txn, no record)

    def done(self) -> bool:
        return self.pc == "done"

    def key(self) -> tuple:
        return tuple(getattr(self, f) for f in self.__dataclass_fields__)

    def step(self, w: World, rules: Rules) -> None:
        pc = self.pc
        if pc == "claim-read":
            self.claim_tries += 1
            self.pending = rules.claim(w.txns(), self.name, f"{self.name}-{self.claim_tries}")
            self.pc = "claim-begin"
        elif pc == "claim-begin":
            commit, _ = self.pending  # type: ignore[misc]
            self.tx = w.begin(commit.app, commit.version)
            self.pc = "claim-commit"
        elif pc == "claim-commit":
            commit, _ = self.pending  # type: ignore[misc]
            assert self.tx is not None
            w.commit(*self.tx, commit.app, commit.version, commit.metadata, None)
            self.pc = "claim-check"
        elif pc == "claim-check":
            _, mine = self.pending  # type: ignore[misc]
            if rules.claim_won(mine, w.history()):
                self.generation = mine.fenced + 1
                self.pc = "recover-read"
            else:
                self.pc = "claim-read" if self.claim_tries < 3 else "done"
                if self.pc == "done":
                    self.failed = "lost every claim"
        elif pc == "recover-read":
            records = {}
            for m in w.history():
                r = be.record_in(m, LINK)
                if r is not None:
                    records[r.epoch] = r.branches
            open_now = [b for b, s in w.branches.items() if s == "open" and _generation(b) < self.generation]
            self.pending = tuple(protocol.recover(EPOCH - 1, records, open_now))
            self.pc = "recover-act"
        elif pc == "recover-act":
            for a in self.pending:  # type: ignore[attr-defined]
                w.end(a.branch, isinstance(a, protocol.CommitBranch))
            self.pc = "enter"
        elif pc == "enter":
            self.entry = be.enter(LINK, EPOCH, self.generation, w.txns(), w.record(EPOCH))
            self.entered = len(w.commits)
            if isinstance(self.entry, be.Fresh):
                self.metadata = be.BatchRecord(LINK, EPOCH, self.generation, ()).to_metadata()
            self.pc = "to-kafka"
        elif pc == "to-kafka":
            refused = be.may_write_kafka(LINK, self.entry, w.record(EPOCH))  # type: ignore[arg-type]
            if refused is not None:
                self.body_failed = True
                self.pc = "leave"
            elif isinstance(self.entry, be.Fresh):
                self.prepared = (w.prepare(f"g{self.generation}-task"),)
                self.metadata = be.BatchRecord(LINK, EPOCH, self.generation, self.prepared).to_metadata()
                self.pc = "merge-begin"
            else:
                self.pc = "merge-begin"
        elif pc == "merge-begin":
            app = self.entry.app  # type: ignore[union-attr]
            self.tx = w.begin(app, EPOCH)
            self.pc = "merge-commit"
        elif pc == "merge-commit":
            assert self.tx is not None
            if self.stray_body:  # another session: Delta neither skips it nor adds txn or record
                w.commits.append(Commit(None, None, EPOCH))
            else:
                got = w.commit(*self.tx, self.entry.app, EPOCH, self.metadata, EPOCH)  # type: ignore[union-attr]
                self.body_failed = got == "conflict"
            self.pc = "leave"
        elif pc == "leave":
            window = [be.Commit(i, "MERGE" if c.data_epoch is not None else "WRITE", c.metadata)
                      for i, c in enumerate(w.commits) if i >= self.entered]
            stray = None if self.body_failed or self.decided_here else rules.stray(window)
            self.pending = rules.leave(LINK, self.entry, self.generation, self.prepared,
                                       [b for b, s in w.branches.items()
                                        if s == "open" and _generation(b) <= self.generation],
                                       w.record(EPOCH), self.body_failed, self.decided_here, stray)
            self.pc = "empty-begin" if isinstance(self.pending, be.DecideByEmptyCommit) else "finish"
        elif pc == "empty-begin":
            d = self.pending
            self.tx = w.begin(d.app, d.epoch)  # type: ignore[union-attr]
            self.pc = "empty-commit"
        elif pc == "empty-commit":
            d = self.pending
            assert self.tx is not None
            w.commit(*self.tx, d.app, d.epoch, d.metadata, None)  # type: ignore[union-attr]
            self.decided_here = True
            self.pc = "leave"
        elif pc == "finish":
            f = self.pending
            for b in f.commit:  # type: ignore[union-attr]
                w.end(b, True)
            for b in f.roll_back:  # type: ignore[union-attr]
                w.end(b, False)
            self.failed = f.fail or ("body failed" if self.body_failed else None)  # type: ignore[union-attr]
            self.left = True
            self.pc = "done"


def _start(restarts: int, stray_body: bool = False) -> tuple[World, Run, ...]:
    w = World()
    # Run A won the first claim (it fenced generation 0) and holds the link as generation 1.
    c = be.Claim(LINK, 0, "A", "A-0")
    w.commits.append(Commit((be.app_id(LINK, 0), be.FENCED), c.to_metadata(), None))
    a = Run("A", generation=1, pc="enter", stray_body=stray_body)
    if restarts > 1:  # A stopped for good with its branch prepared: the restarts race each other
        w.prepare("g1-task")
        a.pc = "done"
    return (w, a, *(Run(name) for name in "BC"[:restarts]))


def _violations(w: World, a: Run, *restarts: Run) -> list[str]:
    out = list(w.hazards)
    # A stray write (a session the block did not set) is the body's own, applied as often as the body runs; what the
    # rules owe is that it never decides: A fails, writes no record, and the decided data stays once.
    data = [c for c in w.commits if c.data_epoch == EPOCH and (not a.stray_body or c.metadata is not None)]
    deciding = [be.record_in(c.metadata, LINK) for c in w.commits]
    deciding = [r for r in deciding if r is not None and r.epoch == EPOCH]
    if a.stray_body and any(r.generation == a.generation for r in deciding):
        out.append("A decided the epoch after its body wrote through another session")
    if a.stray_body and a.left and a.failed is None:
        out.append("A finished without failing after its body wrote through another session")
    if len(data) > 1:
        out.append(f"epoch {EPOCH}'s data committed {len(data)} times")
    if len(deciding) > 1:
        out.append(f"{len(deciding)} records of epoch {EPOCH}")
    named = set(deciding[0].branches) if deciding else set()
    committed = {br for br, s in w.branches.items() if s == "committed"}
    if committed - named:
        out.append(f"committed without a record naming them: {sorted(committed - named, key=str)}")
    for b in restarts:
        if b.failed is None and not deciding:
            out.append(f"{b.name} finished but epoch 1 was never decided")
        elif b.failed is None and not set(deciding[0].branches) <= committed:
            out.append(f"{b.name} finished with the record's branches not all committed")
    # A restart whose block was open when A's stray write landed refuses it as well (it cannot tell it from its
    # own body's): fail closed, and the next restart goes on. Every other restart must finish.
    strays = [i for i, c in enumerate(w.commits) if c.data_epoch == EPOCH and c.metadata is None]
    owed = [b for b in restarts if not (b.left and any(i >= b.entered for i in strays))]
    if owed and all(b.failed is not None for b in owed):
        out.append("no restart finished: " + ", ".join(f"{b.name} {b.failed!r}" for b in owed))
    return out


def explore(rules: Rules, restarts: int = 1, first_only: bool = False,
            stray_body: bool = False) -> tuple[int, list[str]]:
    """Every interleaving of A (which may stop after any step) and the restarts (which run to their end);
    with ``first_only``, until the first end state that breaks an invariant; with ``stray_body``, A's body makes its
    Delta write through a session the block did not set."""
    seen: set[tuple] = set()
    bad: set[str] = set()
    finals = 0
    stack = [_start(restarts, stray_body)]
    while stack:
        state = stack.pop()
        key = tuple(x.key() for x in state)
        if key in seen:
            continue
        seen.add(key)
        w, runs = state[0], state[1:]
        moves: list[Callable[[World, tuple[Run, ...]], None]] = []
        for i, run in enumerate(runs):
            if not run.done():
                moves.append(lambda w, rs, i=i: rs[i].step(w, rules))
                if i == 0:  # A crashes, or stalls for good, here
                    moves.append(lambda w, rs: setattr(rs[0], "pc", "done"))
        if not moves:
            finals += 1
            bad.update(f"{v} ({', '.join(f'{r.name} {r.failed!r}' for r in runs)})" for v in _violations(w, *runs))
            if bad and first_only:
                break
            continue
        for move in moves:
            w2, runs2 = state[0].clone(), [dataclasses.replace(r) for r in state[1:]]
            move(w2, tuple(runs2))
            stack.append((w2, *runs2))
    return finals, sorted(bad)


@pytest.mark.parametrize("restarts", [1, 2])
def test_every_interleaving_of_a_run_and_its_restarts_keeps_the_epoch_once(restarts):
    """A run and its restart (B), and two restarts at once (B and C: concurrent claims of the same generation)
    after A stopped with its branch prepared."""
    finals, bad = explore(Rules(), restarts)
    assert finals > 50  # distinct end states: A's crash points and outcomes against the restarts'
    assert bad == []


def test_a_body_that_writes_through_another_session_never_decides():
    """A's body makes its write through a session the block's settings did not reach (no txn, no record), in every
    interleaving with its restart: A never decides (its exit sees the write and refuses), its branch is never
    committed, and B's replay decides the epoch once."""
    finals, bad = explore(Rules(), 1, stray_body=True)
    assert finals > 20
    assert bad == []


class IgnoresStrayWrites(Rules):
    """The exit does not look at what the table committed while the block was open (the block before issue 54)."""

    def stray(self, commits):
        return None


def test_the_check_catches_an_exit_that_ignores_stray_writes():
    _, bad = explore(IgnoresStrayWrites(), 1, first_only=True, stray_body=True)
    assert any("A decided the epoch after its body wrote through another session" in b for b in bad), bad


class NoFence(Rules):
    """The claim fences nothing: it commits under an app id no run decides with."""

    def claim(self, txns, run, nonce):
        commit, c = be.claim(LINK, run, nonce, txns)
        return be.ClaimCommit(f"lastagent-claims/{LINK}/{nonce}", commit.version, commit.metadata), c


class TrustsItsClaim(Rules):
    """The claimer does not look for its own claim: a skipped claim counts as won."""

    def claim_won(self, mine, history):
        return True


class CommitsWithoutRecord(Rules):
    """The exit commits what the block prepared even when no record names it."""

    def leave(self, link, entry, generation, prepared, open_branches, record, body_failed, decided_here=False,
              stray=None):
        out = be.leave(link, entry, generation, prepared, open_branches, record, body_failed, decided_here, stray)
        if isinstance(out, be.Finish) and record is None:
            return be.Finish(tuple(prepared), (), out.fail)
        return out


@pytest.mark.parametrize("mutant, restarts", [(NoFence, 1), (TrustsItsClaim, 2), (CommitsWithoutRecord, 1)])
def test_the_check_catches_a_rule_taken_out(mutant, restarts):
    _, bad = explore(mutant(), restarts, first_only=True)
    assert bad, f"{mutant.__name__}: no interleaving broke an invariant"
