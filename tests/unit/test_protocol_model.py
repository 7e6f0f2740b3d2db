"""Exhaustive model check of the protocol as production runs it: the real ``Committer`` under crashes.

A small simulated world, all in memory:

* a Kafka broker with a clock: transactions per transactional id with producer id and producer
  epoch; open, committed or aborted; the broker aborts a transaction on its own once it has been
  open for the timeout (an event that falls between any two steps; skewed and stalled tasks make
  it happen); a new producer on an id fences the id (aborts its open transaction);
  an end of a transaction moves the producer epoch (transaction protocol v2); ``EndTxn``
  from any process by (transactional id, producer id, producer epoch), a retried commit
  recognised as done;
* the arbitration table: decide is atomic and idempotent per epoch (the first record stands);
* Spark's checkpoint: offset log and commit log; the commit log gets N only after the sink's
  commit(N) returned; a restarted query re-runs the newest epoch with logged offsets and no
  commit;
* the driver is ``lastagent.core.committer.Committer`` itself, the one interpreter of the rules in
  ``lastagent.core.protocol``, wired to the world through the three ports it has in production (the
  XA resource, the arbitration store with its owner generation, Spark's checkpoint); tasks
  name their branches by the generation the start claimed and write deterministic records
  (epoch, task, i) into one branch each.

Every port call that changes the world is a crash point. The check runs each scenario without a crash,
with a crash at every step followed by a restart, and with a crash at every step of that restart
(recovery included) followed by a second restart, for every order of the per-branch phase-2
commits, and asserts docs/design.md's invariants after each schedule (and the safety ones at each
crash). Mutants of the rules and of the interpreter must be caught by the same checker.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from lastagent.core import protocol, xid
from lastagent.core.arbitration import ArbitrationRecord, Decision, Ownership, next_ownership
from lastagent.core.branch_handle import BranchHandle
from lastagent.core.committer import Committer
from lastagent.core.kafka_port import EndOutcome, EndResult, OpenTransaction
from lastagent.core.protocol import Branch, CommitBranch, FinishEpoch, FollowDecision, RollbackBranch, WriteDecision
from lastagent.errors import DecidedBranchLostError, EpochNotDecidedError, StaleOwnerError
from lastagent.sinks.kafka_sink_options import KafkaSinkOptions
from lastagent.sinks.query_run import Started, shipped, task_generation

pytestmark = pytest.mark.unit

LINK = "model"
PREFIX = xid.id_prefix(LINK)
EPOCHS = 2
TASKS = 3
RECORDS = 2
MAX_ATTEMPTS = 2  # Spark's spark.task.maxFailures in the model
MAX_RUNS = 8  # restarts after which a schedule counts as making no progress
MS_PER_STEP = 1_000  # the world's clock moves this much at every step
TIMEOUT_MS = 60_000  # kafka.transaction.timeout.ms in the model: a clean epoch takes ~15 steps

ORDERS = list(itertools.permutations(range(TASKS)))  # phase-2 commit orders


class Crash(Exception):
    """The whole application dies (driver and executors); only durable state survives."""


class QueryFailed(Exception):
    """The driver stopped the query on purpose (an epoch not decided, a decided branch not committed)."""


class TaskDied(Exception):
    """One task attempt died mid-write; Spark retries it."""


class Fenced(Exception):
    """The broker refused a write from a fenced producer."""


# -- the world ---------------------------------------------------------------------------------


@dataclass
class Txn:
    branch: Branch
    epoch: int  # ghost: the Spark epoch its writer worked for (model-only knowledge)
    started_ms: int = 0  # the broker's clock when the transaction began
    records: list[tuple[int, int, int]] = field(default_factory=list)


class Broker:
    """Kafka's transaction coordinator and one topic, reduced to what the protocol touches."""

    def __init__(self) -> None:
        self.now_ms = 0  # the broker's clock (the world's)
        self.producers: dict[str, list[int]] = {}  # tid -> [producer id, producer epoch]
        self.open: dict[str, Txn] = {}
        self.ended: dict[Branch, bool] = {}  # True: committed, False: aborted
        self.txn_epoch: dict[Branch, int] = {}  # ghost: every transaction ever begun
        self.expired: set[Branch] = set()  # ghost: the transactions the broker aborted on its own
        self.log: list[tuple[int, int, int]] = []  # committed records, in commit order
        self.committed: list[Txn] = []
        self._next_pid = 1000

    def init_producer(self, tid: str) -> Branch:
        if tid in self.open:  # InitProducerId fences the id: its open transaction is aborted
            self._end(self.open[tid], commit=False)
        if tid not in self.producers:
            self.producers[tid] = [self._next_pid, 0]
            self._next_pid += 1
        else:
            self.producers[tid][1] += 1
        pid, epoch = self.producers[tid]
        return Branch(tid, pid, epoch)

    def write(self, b: Branch, record: tuple[int, int, int], epoch: int) -> None:
        if self.producers.get(b.transactional_id) != [b.producer_id, b.producer_epoch]:
            raise Fenced(b)
        txn = self.open.get(b.transactional_id)
        if txn is None:
            txn = self.open[b.transactional_id] = Txn(b, epoch, self.now_ms)
            self.txn_epoch[b] = epoch
        txn.records.append(record)

    def _end(self, txn: Txn, commit: bool) -> None:
        tid = txn.branch.transactional_id
        del self.open[tid]
        self.ended[txn.branch] = commit
        if commit:
            self.log.extend(txn.records)
            self.committed.append(txn)
        self.producers[tid][1] += 1  # transaction protocol v2: the epoch moves at every end

    def end_txn(self, b: Branch, commit: bool) -> str:
        """EndTxn by handle, from any process; the outcome names as in ``kafka_xa.EndOutcome``."""
        txn = self.open.get(b.transactional_id)
        if txn is not None and txn.branch == b:
            self._end(txn, commit)
            return "committed" if commit else "rolled_back"
        prior = self.ended.get(b)
        if commit:
            return "committed" if prior is True else "not_committed"
        return "heuristic_commit" if prior is True else "rolled_back"

    def expire(self, tid: str) -> None:
        """transaction.timeout.ms passed: the broker aborts the open transaction."""
        self.expired.add(self.open[tid].branch)
        self._end(self.open[tid], commit=False)

    def tick(self, ms: int) -> None:
        """Time passes; the broker aborts every transaction open longer than its timeout (an event
        that can fall between any two steps of the query, as on a real broker)."""
        self.now_ms += ms
        for tid, txn in list(self.open.items()):
            if self.now_ms - txn.started_ms >= TIMEOUT_MS:
                self.expire(tid)

    def list_open(self, prefix: str) -> list[Branch]:
        return [t.branch for tid, t in sorted(self.open.items()) if tid.startswith(prefix)]


class Arbitration:
    """The arbitration table: one atomic, idempotent decision per epoch (the link is fixed)."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[Branch, ...]] = {}
        self.records: dict[int, ArbitrationRecord] = {}
        self.owner: Ownership | None = None

    def decide(self, epoch: int, branches: tuple[Branch, ...], record: ArbitrationRecord) -> ArbitrationRecord:
        """Atomic and idempotent: the first record of an epoch stands."""
        self.rows.setdefault(epoch, branches)
        return self.records.setdefault(epoch, record)


class Checkpoint:
    """Spark's offset log and commit log."""

    def __init__(self) -> None:
        self.offsets: set[int] = set()
        self.commits: set[int] = set()


class World:
    """Durable state plus the crash schedule: ``crash_plan[i]`` is the step index (within the
    i-th segment, a segment ending at a crash) before which the i-th crash happens."""

    def __init__(self, crash_plan: tuple[int, ...] = ()) -> None:
        self.broker = Broker()
        self.arb = Arbitration()
        self.ckpt = Checkpoint()
        self.crash_plan = crash_plan
        self.segment = 0
        self.steps = 0
        self.segment_steps: list[int] = []
        self.trace: list[str] = []
        self.turns: Turns | None = None  # two runs at once: whose step is next

    def step(self, label: str) -> None:
        if self.turns is not None:
            self.turns.take()
            label = f"{threading.current_thread().name}: {label}"
        if self.segment < len(self.crash_plan) and self.steps == self.crash_plan[self.segment]:
            raise Crash(label)
        self.broker.tick(MS_PER_STEP)
        self.steps += 1
        self.trace.append(label)

    def crashed(self) -> None:
        self.segment_steps.append(self.steps)
        self.trace.append("CRASH")
        self.segment += 1
        self.steps = 0


# -- the ports: the real Committer runs against the model world ---------------------------------------


@dataclass
class Rules:
    """The protocol functions and the interpreter the query uses; mutants replace one of them."""

    recover: Callable = protocol.recover
    commit_epoch: Callable = protocol.commit_epoch
    abort_epoch: Callable = protocol.abort_epoch
    skip_task: Callable = protocol.skip_task
    task_generation: Callable = task_generation
    committer: type = Committer

    @contextlib.contextmanager
    def installed(self):
        """The rules in force in ``lastagent.core.protocol`` (where the Committer looks them up)."""
        saved = {name: getattr(protocol, name) for name in ("recover", "commit_epoch", "abort_epoch")}
        for name in saved:
            setattr(protocol, name, getattr(self, name))
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(protocol, name, fn)


OPTIONS = KafkaSinkOptions.parse({"kafka.bootstrap.servers": "model:9092", "link": LINK, "arbitrationTable": "model",
                                  "checkpointLocation": "model", "phase2Parallelism": "1",
                                  "kafka.transaction.timeout.ms": str(TIMEOUT_MS)})


class ModelXA:
    """The XA resource port over the model broker. Every end is a step (a crash point)."""

    def __init__(self, world: World, order: tuple[int, ...]) -> None:
        self.w = world
        self.order = order

    def transaction_protocol(self) -> int:
        return 2

    def broker_max_timeout_ms(self) -> int:
        return 1 << 40

    def missing_topics(self, topics) -> list[str]:
        return []

    def commit(self, handle: BranchHandle) -> EndResult:
        return self.end_all([handle], True)[0]

    def rollback(self, handle: BranchHandle) -> EndResult:
        return self.end_all([handle], False)[0]

    def end_all(self, handles, commit: bool, parallelism: int = 8) -> list[EndResult]:
        handles = list(handles)
        # Phase-2 commits may run in any order: the schedule's order permutes them.
        rank = sorted(range(len(handles)), key=lambda i: self.order[i] if commit and i < len(self.order) else i)
        results: dict[int, EndResult] = {}
        for i in rank:
            b = Branch.of(handles[i])
            self.w.step(f"{'commit' if commit else 'rollback'} {b.transactional_id}/{b.producer_epoch}")
            outcome = self.w.broker.end_txn(b, commit)
            if not commit and outcome == "heuristic_commit":
                raise QueryFailed(f"rolled back a committed branch {b}")
            results[i] = EndResult(handles[i], EndOutcome(outcome))
        return [results[i] for i in range(len(handles))]

    def recover(self, prefix: str) -> list[OpenTransaction]:
        # A listing changes nothing (no crash point) but takes time, as the broker's round trips do.
        self.w.broker.tick(MS_PER_STEP)
        return [self._described(b) for b in self.w.broker.list_open(prefix)]

    def _described(self, b: Branch) -> OpenTransaction:
        return OpenTransaction(b.transactional_id, b.producer_id, b.producer_epoch, "Ongoing",
                               self.w.broker.open[b.transactional_id].started_ms, TIMEOUT_MS)

    def open_among(self, handles) -> list[OpenTransaction]:
        # Each id's own coordinator; the model's listing misses nothing, so the committer never asks.
        self.w.broker.tick(MS_PER_STEP)
        wanted = {Branch.of(h) for h in handles}
        return [self._described(b) for b in self.w.broker.list_open(PREFIX) if b in wanted]

    def how_ended(self, handle: BranchHandle) -> str:
        return "unknown"

    def close(self) -> None:
        pass


class ModelStore:
    """The arbitration store port over the model table: claim and decide are steps (crash points)."""

    def __init__(self, world: World) -> None:
        self.w = world

    def claim(self, link: str, owner: str, *, takeover: bool = False, run: str = "") -> Ownership:
        if next_ownership(link, "model", self.w.arb.owner, owner, run, takeover) is not None:
            self.w.step("claim")  # a metadata commit: atomic with what it read (Delta's conflict check)
        current = self.w.arb.owner
        claimed = next_ownership(link, "model", current, owner, run, takeover)
        if claimed is None:  # the run holds the link already: a read, no step
            assert current is not None
            return current
        self.w.arb.owner = claimed
        return claimed

    def ownership(self, link: str) -> Ownership | None:
        return self.w.arb.owner

    def decide(self, record: ArbitrationRecord, generation: int, staged=None) -> Decision:
        assert staged is None, "the model's links write no Delta data"
        self.w.step(f"decide e{record.epoch}")
        if self.w.arb.owner is None or self.w.arb.owner.generation != generation:
            raise StaleOwnerError(f"generation {generation} superseded")
        branches = tuple(Branch.of(BranchHandle.from_json(j)) for j in record.branches)
        won = record.epoch not in self.w.arb.rows
        standing = self.w.arb.decide(record.epoch, branches, record)
        return Decision(standing, won)

    def get(self, link: str, epoch: int) -> ArbitrationRecord | None:
        return self.w.arb.records.get(epoch)

    def records(self, link: str) -> list[ArbitrationRecord]:
        return [self.w.arb.records[e] for e in sorted(self.w.arb.records)]

    def latest_epoch(self, link: str) -> int | None:
        return max(self.w.arb.rows, default=None)

    def cleanup(self, link: str, retain_epochs: int) -> int:
        return 0

    def check_link(self, link: str) -> None:
        pass

    def empty_through(self, link: str) -> int:
        return -1

    def size(self) -> tuple[int, int]:
        return len(self.w.arb.rows), 0

    def accepted_lost(self, link: str) -> frozenset[int]:
        return frozenset()  # no operator in the model: a lost decided branch always stops the query

    def accept_lost(self, link: str, epoch: int) -> None:
        raise AssertionError("the model has no operator")


class ModelCheckpoint:
    """The checkpoint port over the model's commit log."""

    def __init__(self, world: World) -> None:
        self.w = world

    def committed_through(self) -> int:
        return max(self.w.ckpt.commits, default=-1)

    def query_id(self) -> str:
        return "model-query"


# -- Spark: the query and its tasks ----------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """Task faults: (epoch, task, attempt) -> "die" (mid-write) or "lost" (prepared, result lost)."""

    name: str
    faults: dict[tuple[int, int, int], str]
    first_run_only: bool = False

    def fault(self, run: int, epoch: int, task: int, attempt: int) -> str | None:
        if self.first_run_only and run > 0:
            return None
        return self.faults.get((epoch, task, attempt))


#: Task faults that take time: the task's clock jumps this many ms mid-write. "slow" leaves the
#: epoch's other branches open but with less than the decision margin left (and little enough that
#: a decision without the margin would lose one in phase 2); "stalled" outlasts the timeout.
SLOW = {"slow": TIMEOUT_MS - 10_000, "stalled": TIMEOUT_MS + 10_000}

VARIANTS: list[Variant] = [
    Variant("clean", {}),
    Variant("task-retry", {(0, 1, 0): "die"}),
    Variant("lost-result", {(1, 2, 0): "lost"}),
    Variant("abort-then-restart", {(1, 0, 0): "die", (1, 0, 1): "die"}, first_run_only=True),
    Variant("retries-in-both-epochs", {(0, 2, 0): "lost", (0, 0, 0): "die", (1, 1, 0): "die", (1, 2, 0): "lost"}),
    Variant("skewed-task", {(0, 2, 0): "slow"}, first_run_only=True),
    Variant("stalled-task", {(1, 1, 0): "stalled"}, first_run_only=True),
]
VARIANT = {v.name: v for v in VARIANTS}


def run_task(w: World, rules: Rules, epoch: int, task: int, attempt: int, started: Started, run: str,
             fault: str | None) -> tuple[int, BranchHandle | None]:
    """One task attempt as the sinks' ``write`` runs it: its run's generation (claimed by the run's
    first task), then nothing for a decided epoch, else one branch: (generation, handle or None)."""
    generation = rules.task_generation(started, run, lambda r: ModelStore(w).claim(LINK, started.owner, run=r))
    if rules.skip_task(epoch, started.decided_through):
        return generation, None  # read-only: the decided epoch's records are in its recorded branches
    tid = xid.transactional_id(LINK, generation, task, attempt)
    w.step(f"e{epoch} t{task}.{attempt} init")
    b = w.broker.init_producer(tid)
    for i in range(RECORDS):
        w.step(f"e{epoch} t{task}.{attempt} write {i}")
        try:
            w.broker.write(b, (epoch, task, i), epoch)
        except Fenced:
            if w.broker.ended.get(b) is False:  # the broker aborted it (timeout): the task fails, Spark retries it
                raise TaskDied() from None
            raise
        if fault == "die":
            raise TaskDied()
        if fault in SLOW and i == 0:
            w.broker.tick(SLOW[fault])  # a skewed task: the others' prepared branches age meanwhile
    # prepared: flushed inside the open transaction; the handle is the commit message
    return generation, BranchHandle(b.transactional_id, b.producer_id, b.producer_epoch, RECORDS)


def run_query(w: World, variant: Variant, run: int, order: tuple[int, ...], rules: Rules,
              run_id: str | None = None) -> str:
    """One run of the query as Spark drives a sink: the writer's start before each epoch's tasks (the
    real Committer's, with the model's ports), tasks that claim the link for their run, then the
    epoch's commit (or abort). Returns "done", "aborted", "not decided" or "superseded"."""
    run_id = run_id or f"run-{run}"
    committer = rules.committer(OPTIONS, store=ModelStore(w), xa=ModelXA(w, order), checkpoint=ModelCheckpoint(w),
                                now_ms=lambda: w.broker.now_ms)
    try:
        ckpt = w.ckpt
        committed_through = max(ckpt.commits, default=-1)
        latest = max(ckpt.offsets, default=-1)
        epoch = latest if latest > committed_through else committed_through + 1
        resumed = epoch
        while epoch < EPOCHS:
            if epoch != resumed or epoch not in ckpt.offsets:
                if epoch in ckpt.offsets:
                    return "superseded"  # Spark: "Concurrent update to the log. Multiple streaming jobs detected"
                w.step(f"offsets e{epoch}")
                ckpt.offsets.add(epoch)
            ownership, newest = committer.start()
            started = shipped(ownership, newest, "model-query")
            messages: list[BranchHandle] = []
            generations: set[int] = set()
            for task in range(TASKS):
                attempt = 0
                while True:
                    fault = variant.fault(run, epoch, task, attempt)
                    try:
                        generation, m = run_task(w, rules, epoch, task, attempt, started, run_id, fault)
                    except StaleOwnerError:
                        # the task's claim was refused: a newer run holds the link. Every retry fails
                        # the same way, so Spark aborts the epoch and the query stops.
                        committer.abort(epoch, next(iter(generations), None), messages)
                        return "superseded"
                    except TaskDied:
                        attempt += 1
                        if attempt == MAX_ATTEMPTS:
                            committer.abort(epoch, next(iter(generations), None), messages)
                            return "aborted"
                        continue
                    if fault == "lost":  # executor lost after the prepare: Spark runs the task again
                        attempt += 1
                        continue
                    generations.add(generation)
                    if m is not None:
                        messages.append(m)
                    break
            assert len(generations) == 1, generations
            generation = generations.pop()
            try:
                committer.commit(epoch, generation, messages)
            except (StaleOwnerError, EpochNotDecidedError):
                committer.abort(epoch, generation, messages)  # Spark aborts an epoch whose commit failed
                raise
            if epoch in ckpt.commits:
                return "superseded"  # Spark: "Concurrent update to the commit log"
            w.step(f"commit log e{epoch}")
            ckpt.commits.add(epoch)
            epoch += 1
        return "done"
    except EpochNotDecidedError:
        return "not decided"  # nothing committed, branches rolled back: the restart replays the epoch
    except StaleOwnerError:
        return "superseded"  # a newer run holds the link: this one decides nothing more
    except DecidedBranchLostError as exc:
        raise QueryFailed(str(exc)) from exc


# -- invariants ----------------------------------------------------------------------------------


def check_safety(w: World) -> list[str]:
    """What must hold at every instant, crashes included."""
    out = []
    b, rows = w.broker, w.arb.rows
    for txn in b.committed:
        if txn.branch not in rows.get(txn.epoch, ()):
            out.append(f"branch {txn.branch} of epoch {txn.epoch} committed without that epoch's decision")
    for epoch, branches in rows.items():
        for br in branches:
            if b.txn_epoch.get(br) != epoch:
                out.append(f"decision of epoch {epoch} records {br}, written for epoch {b.txn_epoch.get(br)}")
    dup = [r for r, n in Counter(b.log).items() if n > 1]
    if dup:
        out.append(f"records committed more than once: {sorted(dup)}")
    for epoch in w.ckpt.commits:
        if epoch not in rows or not all(b.ended.get(br) is True for br in rows[epoch]):
            out.append(f"Spark logged epoch {epoch} as committed before its decided branches all committed")
    return out


def check_final(w: World) -> list[str]:
    """docs/design.md's invariants once the query has run to its end."""
    out = check_safety(w)
    b, rows = w.broker, w.arb.rows
    if w.ckpt.commits != set(range(EPOCHS)):
        out.append(f"Spark committed epochs {sorted(w.ckpt.commits)}, expected {list(range(EPOCHS))}")
    for epoch in range(EPOCHS):  # atomicity
        if epoch in rows:
            lost = [br for br in rows[epoch] if b.ended.get(br) is not True]
            if lost:
                out.append(f"atomicity: epoch {epoch} decided but branches {lost} not committed")
        elif any(t.epoch == epoch for t in b.committed):
            out.append(f"atomicity: epoch {epoch} undecided but has committed branches")
    expected = Counter((e, t, i) for e in range(EPOCHS) for t in range(TASKS) for i in range(RECORDS))
    got = Counter(b.log)
    if got != expected:
        out.append(f"exactly once: missing {sorted(expected - got)}, extra {sorted(got - expected)}")
    still_open = b.list_open(PREFIX)
    if still_open:
        out.append(f"progress: branches still open after the final recovery: {still_open}")
    return out


@dataclass
class Outcome:
    world: World
    violations: list[str]


def simulate(variant: Variant, order: tuple[int, ...], crash_plan: tuple[int, ...] = (), rules: Rules | None = None,
             between_runs: Callable[[World], None] | None = None) -> Outcome:
    """Runs the query, restarting after every crash or abort, until it finishes or fails."""
    rules = rules or Rules()
    with rules.installed():
        return _simulate(variant, order, crash_plan, rules, between_runs)


def _simulate(variant: Variant, order: tuple[int, ...], crash_plan: tuple[int, ...], rules: Rules,
              between_runs: Callable[[World], None] | None) -> Outcome:
    w = World(crash_plan)
    violations: list[str] = []
    for run in range(MAX_RUNS):
        if run and between_runs:
            between_runs(w)
        try:
            status = run_query(w, variant, run, order, rules)
        except Crash as crash:
            violations += [f"at crash before '{crash}': {v}" for v in check_safety(w)]
            w.crashed()
            continue
        except QueryFailed as failed:
            violations.append(f"query failed: {failed}")
            w.segment_steps.append(w.steps)
            return Outcome(w, violations)
        except (Fenced, AssertionError) as exc:
            violations.append(f"model error: {exc!r}")
            w.segment_steps.append(w.steps)
            return Outcome(w, violations)
        if status == "done":
            if w.segment < len(crash_plan) and crash_plan[w.segment] == w.steps:
                w.crashed()  # a crash after the last step: the restart must change nothing
                continue
            w.segment_steps.append(w.steps)
            return Outcome(w, violations + check_final(w))
    violations.append(f"no progress after {MAX_RUNS} runs")
    w.segment_steps.append(w.steps)
    return Outcome(w, violations)


def explore(variant: Variant, order: tuple[int, ...], depth: int = 2,
            **kw) -> tuple[int, list[tuple[tuple[int, ...], str]]]:
    """Every crash schedule up to ``depth`` crashes: (schedules run, [(crash plan, violation)])."""
    found: list[tuple[tuple[int, ...], str]] = []
    count = 0
    frontier: list[tuple[int, ...]] = [()]
    for level in range(depth + 1):
        nxt = []
        for plan in frontier:
            result = simulate(variant, order, plan, **kw)
            count += 1
            found += [(plan, v) for v in result.violations]
            if level < depth and not result.violations:
                # the segment after the last crash in this plan: crash before each of its steps,
                # and after its last one
                nxt += [plan + (k,) for k in range(result.world.segment_steps[len(plan)] + 1)]
        frontier = nxt
    return count, found


# -- the exhaustive check ---------------------------------------------------------------------------


def test_exhaustive_crash_schedules_keep_the_invariants():
    t0 = time.monotonic()
    total = 0
    per_variant = {}
    for variant in VARIANTS:
        n = 0
        for order in ORDERS:
            count, found = explore(variant, order, depth=2)
            assert not found, f"{variant.name} order {order}: {found[:5]}"
            n += count
        per_variant[variant.name] = n
        total += n
    elapsed = time.monotonic() - t0
    print(f"\nmodel check: {total} schedules in {elapsed:.1f}s; per variant {per_variant}")
    # floor: a clean run is 30 steps, so each order gives 31 single-crash plans and ~31 x 30
    # double-crash plans (~1,000); 7 passes per variant give ~4,700 or more.
    assert total > 20_000, per_variant
    assert all(n > 4_000 for n in per_variant.values()), per_variant


def test_no_crash_run_shape():
    """Sanity of the model: a clean run decides each epoch with exactly its three branches."""
    out = simulate(VARIANTS[0], ORDERS[0])
    assert out.violations == []
    w = out.world
    assert sorted(w.arb.rows) == [0, 1] and all(len(bs) == TASKS for bs in w.arb.rows.values())
    assert w.broker.log and not w.broker.open
    # the run's first task claims the link before it opens a transaction, once for the whole run
    assert w.trace[:3] == ["offsets e0", "claim", "e0 t0.0 init"]
    assert w.trace.count("claim") == 1
    # the run reuses its ids across its epochs: one per task, not one per task and epoch
    assert len(w.broker.ended) == EPOCHS * TASKS and len({b.transactional_id for b in w.broker.ended}) == TASKS
    assert w.segment_steps[0] >= 30


def test_the_lost_result_branch_is_rolled_back_not_committed():
    out = simulate(VARIANTS[2], ORDERS[0])
    assert out.violations == []
    w = out.world
    stale = [br for br, committed in w.broker.ended.items() if w.broker.txn_epoch[br] == 1 and not committed]
    assert [s.transactional_id for s in stale] == [xid.transactional_id(LINK, 1, 2, 0)]


# -- the decided-but-expired hazard ------------------------------------------------------------------


def test_expired_decided_branch_fails_naming_link_epoch_and_branch():
    clean = simulate(VARIANTS[0], ORDERS[0])
    crash_at = clean.world.trace.index("decide e0") + 2  # decided, one branch committed, then crash
    expired: list[Branch] = []

    def expire_one(w: World) -> None:
        if not expired:
            victim = next(br for br in w.arb.rows[0] if br.transactional_id in w.broker.open)
            w.broker.expire(victim.transactional_id)
            expired.append(victim)

    out = simulate(VARIANTS[0], ORDERS[0], (crash_at,), between_runs=expire_one)
    assert len(out.violations) == 1, out.violations
    msg = out.violations[0]
    assert msg.startswith("query failed: ")
    assert f"link {LINK!r} epoch 0" in msg and expired[0].transactional_id in msg
    assert "transaction.timeout.ms" in msg


@pytest.mark.parametrize("name", ["skewed-task", "stalled-task"])
def test_a_slow_task_leaves_its_epoch_undecided_and_the_restart_replays_it(name):
    """The other branches aged (or expired) while one task ran: no decision, everything rolled back,
    and the restarted query writes the epoch once."""
    out = simulate(VARIANT[name], ORDERS[0])
    assert out.violations == []
    w = out.world
    assert w.trace.count("claim") == 3, "one refused run, the claim its abort makes, then one run that finishes"
    epoch = next(e for (e, t, _), fault in VARIANT[name].faults.items())
    refused = [br for br, committed in w.broker.ended.items() if w.broker.txn_epoch[br] == epoch and not committed]
    assert refused, "the first run's branches of the slow epoch were rolled back or expired"
    assert all(br not in w.arb.rows[epoch] for br in refused)
    # skewed: the driver rolled back branches still open but too near their timeout;
    # stalled: the broker had expired one already
    assert bool(w.broker.expired & set(refused)) == (name == "stalled-task")


# -- mutants: the checker must catch broken rules ------------------------------------------------------

#: The real rules, for mutants to wrap (while a mutant is installed, ``protocol.*`` is the mutant).
_RECOVER, _COMMIT_EPOCH = protocol.recover, protocol.commit_epoch


def _recover_rolls_back_decided(sct, decisions, open_branches, **_):
    return [RollbackBranch(b) for b in open_branches]


def _recover_commits_every_open_branch(sct, decisions, open_branches, **_):
    return [CommitBranch(b, sct + 1) for b in open_branches]


def _recover_rolls_back_at_start(sct, decisions, open_branches, **_):
    # a start that rolls back what no decision names, as if no earlier run could still be running
    return _RECOVER(sct, decisions, open_branches, roll_back_undecided=True)


class _CommitsBeforeDeciding(Committer):
    """An interpreter that runs phase 2 before the last agent's decision."""

    def commit(self, epoch, generation, handles, staged=None):
        known = {Branch.of(h): h for h in handles}
        self._carry_out([CommitBranch(b, epoch) for b in known], known)
        return super().commit(epoch, generation, handles, staged)


class _IgnoresLostBranches(Committer):
    """An interpreter that takes any end of a decided branch for a commit (no expired-decided hazard)."""

    def _require_committed(self, results, epoch_of):
        return None


def _decides_without_looking(epoch, prepared, open_now, decided, *, now_ms, **kw):
    # decides as if the broker held every prepared branch open, just begun
    return _COMMIT_EPOCH(epoch, prepared, {**{b: (now_ms, TIMEOUT_MS) for b in prepared}, **open_now}, decided,
                         now_ms=now_ms, **kw)


def _no_margin(epoch, prepared, open_now, decided, *, timeout_ms, **kw):
    # decides any branch still open, however close to its timeout (the margin comes from the timeout)
    return _COMMIT_EPOCH(epoch, prepared, open_now, decided, timeout_ms=0, **kw)


def _keeps_stale_attempts(epoch, prepared, open_now, decided, **kw):
    # leaves open what the epoch's record does not name (failed or superseded attempts)
    return [a if not isinstance(a, FinishEpoch) else FinishEpoch(a.epoch, tuple(prepared))
            for a in _COMMIT_EPOCH(epoch, prepared, open_now, decided, **kw)]


def _ignores_earlier_decisions(epoch, prepared, open_now, decided, **kw):
    # rolls back every other open branch, as if no earlier run could have decided after this run's start
    return _COMMIT_EPOCH(epoch, prepared, open_now, {}, **kw)


def _ignores_the_record(epoch, prepared, open_now, decided, **kw):
    # treats a re-run of a decided epoch as fresh: commits the new attempts whatever record stands
    actions = _COMMIT_EPOCH(epoch, prepared, open_now, decided, **kw)
    return [*actions[:1], *(CommitBranch(b, epoch) for b in prepared), *actions[1:]]


@pytest.mark.parametrize("name, rules, variant", [
    ("recover rolls back decided branches", Rules(recover=_recover_rolls_back_decided), VARIANTS[0]),
    ("recover commits undecided branches", Rules(recover=_recover_commits_every_open_branch), VARIANTS[0]),
    ("phase 2 before the decision", Rules(committer=_CommitsBeforeDeciding), VARIANTS[0]),
    ("stale attempts left open", Rules(commit_epoch=_keeps_stale_attempts), VARIANTS[2]),
    ("decide a branch the broker expired", Rules(commit_epoch=_decides_without_looking), VARIANT["stalled-task"]),
    ("decide a branch about to expire", Rules(commit_epoch=_no_margin), VARIANT["skewed-task"]),
    ("re-run decided epoch writes and commits again",
     Rules(commit_epoch=_ignores_the_record, skip_task=lambda epoch, newest: False), VARIANTS[0]),
])
def test_mutants_are_caught(name, rules, variant):
    count, found = explore(variant, ORDERS[0], depth=1, rules=rules)
    assert found, f"mutant '{name}' survived {count} schedules: the checker cannot fail"


def test_a_silent_expired_branch_is_caught():
    """An interpreter that takes a lost decided branch for committed lets the query finish with its records missing."""
    clean = simulate(VARIANTS[0], ORDERS[0])
    crash_at = clean.world.trace.index("decide e0") + 2

    def expire_one(w: World) -> None:
        for br in w.arb.rows[0]:
            if br.transactional_id in w.broker.open:
                w.broker.expire(br.transactional_id)
                return

    out = simulate(VARIANTS[0], ORDERS[0], (crash_at,), rules=Rules(committer=_IgnoresLostBranches),
                   between_runs=expire_one)
    # the decided epoch's re-run commit still meets the lost branch, or the final check sees it
    assert any("was not committed" in v or "atomicity" in v or "exactly once" in v for v in out.violations), \
        out.violations


# -- two runs at once: a zombie run and the run that supersedes it ----------------------------------------


class Turns:
    """Runs two runs of the query in threads, one step at a time, in the order a plan gives.

    ``plan`` is [(run name, steps)]: that run takes that many steps (None: until it ends), then the
    next entry's run goes on. Only one run is ever running: a run hands over when it comes to a
    step beyond its budget, so its reads between two steps happen at once, between the other run's
    steps; this covers every point at which one run can stop and the other go on.
    """

    def __init__(self, plan: list[tuple[str, int | None]]) -> None:
        self.plan = plan
        self.turn = 0
        self.used = 0
        self.finished: set[str] = set()
        self.cond = threading.Condition()

    def _current(self) -> str | None:
        while self.turn < len(self.plan) and self.plan[self.turn][0] in self.finished:
            self.turn, self.used = self.turn + 1, 0
        return self.plan[self.turn][0] if self.turn < len(self.plan) else None

    def wait(self) -> None:
        """Blocks the calling run until it is its turn (a run's start)."""
        me = threading.current_thread().name
        with self.cond:
            while self._current() not in (me, None):
                self.cond.wait(timeout=5)

    def take(self) -> None:
        """The calling run takes one step, handing over first if its turn's budget is used."""
        me = threading.current_thread().name
        with self.cond:
            while True:
                current = self._current()
                if current is None:
                    return
                if current == me:
                    budget = self.plan[self.turn][1]
                    if budget is None or self.used < budget:
                        self.used += 1
                        return
                    self.turn, self.used = self.turn + 1, 0
                    self.cond.notify_all()
                    continue
                self.cond.wait(timeout=5)

    def finish(self) -> None:
        with self.cond:
            self.finished.add(threading.current_thread().name)
            self.cond.notify_all()


def two_runs(old_steps: int, new_steps: int | None, rules: Rules | None = None) -> Outcome:
    """The old run takes ``old_steps`` steps, a new run of the same query (a restart while the old
    driver still runs: a zombie driver with zombie tasks) takes ``new_steps``, then the old run goes
    on to its end, then the new one. Then the user restarts the query until it finishes."""
    rules = rules or Rules()
    with rules.installed():
        w = World()
        turns = Turns([("old", old_steps), ("new", new_steps), ("old", None), ("new", None)])
        w.turns = turns
        results: dict[str, object] = {}

        def body(name: str) -> None:
            turns.wait()
            try:
                results[name] = run_query(w, VARIANTS[0], 0, ORDERS[0], rules, run_id=f"run-{name}")
            except (QueryFailed, Fenced, AssertionError) as exc:
                results[name] = exc
            finally:
                turns.finish()

        threads = [threading.Thread(target=body, args=(n,), name=n, daemon=True) for n in ("old", "new")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive(), "a run of the model did not end"
        w.turns = None
        violations = [f"{name} run failed: {r}" for name, r in results.items() if isinstance(r, BaseException)]
        violations += check_safety(w)
        try:
            for run in range(1, MAX_RUNS):  # the user restarts the query
                if run_query(w, VARIANTS[0], run, ORDERS[0], rules) == "done":
                    break
        except QueryFailed as failed:
            violations.append(f"the restarted query failed: {failed}")
        w.segment_steps.append(w.steps)
        return Outcome(w, violations + check_final(w))


def _two_run_schedules(rules: Rules | None = None) -> tuple[int, list[tuple[tuple[int, int | None], str]]]:
    clean = simulate(VARIANTS[0], ORDERS[0]).world.segment_steps[0]
    found, count = [], 0
    for old_steps in range(clean + 1):
        for new_steps in [*range(clean + 1), None]:
            count += 1
            found += [((old_steps, new_steps), v) for v in two_runs(old_steps, new_steps, rules).violations]
    return count, found


def test_a_zombie_run_and_the_run_that_supersedes_it_keep_the_invariants():
    """A restart while the earlier run still runs (a driver that lost its cluster but not its
    process, or a job re-launched by a scheduler): at every step of the old run the new one goes
    on for every number of steps, then the old run finishes, then the new one. Every record once,
    nothing committed without its decision, no decided branch lost."""
    count, found = _two_run_schedules()
    assert not found, found[:5]
    assert count > 900


def test_a_zombie_run_is_superseded_by_the_new_runs_claim():
    """The new run claims the link with its first task; the old run's next decision is refused."""
    out = two_runs(12, None)
    assert out.violations == []
    assert "new: claim" in out.world.trace
    claims = [i for i, label in enumerate(out.world.trace) if label.endswith("claim")]
    assert len(claims) == 2, out.world.trace  # one per run, not one per epoch


def _tasks_without_claim(started, run, claim):
    # a task that writes under the generation the start read whenever some run holds the link
    return started.generation if started.run else claim(run).generation


@pytest.mark.parametrize("name, rules", [
    ("a start that rolls back undecided branches", Rules(recover=_recover_rolls_back_at_start)),
    ("a commit that ignores earlier runs' decisions", Rules(commit_epoch=_ignores_earlier_decisions)),
    ("tasks that do not claim for their run", Rules(task_generation=_tasks_without_claim)),
])
def test_zombie_mutants_are_caught(name, rules):
    count, found = _two_run_schedules(rules)
    assert found, f"mutant '{name}' survived {count} two-run schedules"


# -- the pure rules, directly ---------------------------------------------------------------------------


def _b(i: int, epoch: int = 0) -> Branch:
    return Branch(xid.transactional_id(LINK, 1, i, 0), 1000 + i, epoch)


def test_commit_epoch_decides_then_finishes_what_is_open():
    a, b, stale, earlier = _b(0), _b(1), _b(2), _b(3)
    open_now = {a: (1_000, 60_000), b: (2_000, 60_000), stale: (500, 60_000), earlier: (100, 60_000)}
    actions = protocol.commit_epoch(5, [a, b], open_now, {earlier: 4}, now_ms=3_000, timeout_ms=60_000, link=LINK)
    assert actions == [WriteDecision(5, (a, b), 4), FinishEpoch(5, (a, b, stale)), CommitBranch(earlier, 4)]
    assert protocol.commit_epoch(0, [], {}, {}, now_ms=0, timeout_ms=60_000) == [WriteDecision(0, (), -1),
                                                                                   FinishEpoch(0, ())]


def test_abort_epoch():
    a, b, c = _b(0), _b(1), _b(2)
    assert protocol.abort_epoch(3, None, [a, b], reported=[c, a]) == [
        RollbackBranch(c), RollbackBranch(a), RollbackBranch(b)]
    assert protocol.abort_epoch(3, (a,), [a, b]) == [CommitBranch(a, 3), RollbackBranch(b)]


def test_recover_rules():
    d0, d1, d2, undecided, gone = _b(0, 7), _b(1, 9), _b(2, 9), _b(3, 4), _b(4, 9)
    decisions = {4: (d0,), 5: (d1, d2, gone)}
    assert protocol.recover(4, decisions, [undecided, d2, d1]) == [
        CommitBranch(d2, 5), CommitBranch(d1, 5), RollbackBranch(undecided), CommitBranch(gone, 5)]
    # a start before every epoch finishes decided branches only
    assert protocol.recover(4, decisions, [undecided, d0], roll_back_undecided=False) == [
        CommitBranch(d0, 4), CommitBranch(d1, 5), CommitBranch(d2, 5), CommitBranch(gone, 5)]
    # epochs Spark already committed are done: their branches are never re-examined
    assert protocol.recover(5, decisions, []) == []
    assert protocol.recover(-1, {}, []) == []


def test_skip_task():
    assert protocol.skip_task(3, 3) and protocol.skip_task(2, 3)
    assert not protocol.skip_task(4, 3) and not protocol.skip_task(0, -1)
    assert Branch.of(_b(1)) == _b(1)


def test_unsafe_branches_and_the_refusal():
    a, b, c = _b(0), _b(1), _b(2)
    timeout = 60_000
    margin = protocol.decision_margin_ms(timeout)
    assert margin == 15_000 and protocol.decision_margin_ms(900_000) == protocol.MAX_DECISION_MARGIN_MS
    open_now = {a: (1_000, timeout), b: (40_000, timeout)}  # c: not open any more
    unsafe = protocol.unsafe_branches([a, b, c], open_now, now_ms=50_000, margin_ms=margin)
    assert set(unsafe) == {a, c}  # a has 11 s left (< 15 s), b has 50 s
    assert "11.0 s left" in unsafe[a] and "no longer open" in unsafe[c]
    assert protocol.unsafe_branches([a, b], open_now, now_ms=45_000, margin_ms=margin) == {}
    prepared_open = {x: open_now[x] for x in (a, b)}
    actions = protocol.commit_epoch(4, [a, b, c], prepared_open, {}, now_ms=50_000, timeout_ms=timeout, link=LINK)
    assert actions == [FollowDecision(4, actions[0].reason, a), FinishEpoch(4, (a, b, c))]
    reason = actions[0].reason
    assert f"link {LINK!r} epoch 4 was not decided" in reason and "49.0 s" in reason
    assert "kafka.transaction.timeout.ms (now 60000 ms)" in reason and a.transactional_id in reason
