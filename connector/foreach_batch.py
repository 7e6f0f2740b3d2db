"""``lastagent.epoch``: one exactly-once epoch inside ``foreachBatch``, Spark's own Delta write as the last agent.

Driver side (the block and its phase 2); ``to_kafka``'s tasks run on the executors. The rules (the fence, the
claim, entering and leaving) are :mod:`lastagent.core.batch_epoch`'s; this module carries them out with Spark,
delta-rs (reading the table's ``txn`` versions and history only: every commit is Spark's) and the Kafka
branch writer. Design: ``dev/designs/foreach-batch-epoch.md``.

Experimental (issue 45): classic Spark and Spark Connect (the block runs on the Connect server, in the query's
foreachBatch process); a table by path or by catalog name.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from lastagent import faults
from lastagent.core import batch_epoch as be
from lastagent.core import protocol, xid
from lastagent.delta.batch_table import BatchEpochTable
from lastagent.errors import DecidedBranchLostError, EpochNotDecidedError, OptionError, StaleOwnerError
from lastagent.kafka.config import KafkaConfig
from lastagent.storage import StorageConfig

log = logging.getLogger("lastagent.epoch")

_TXN_APP = "spark.databricks.delta.write.txnAppId"
_TXN_VERSION = "spark.databricks.delta.write.txnVersion"
_USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"
_RUN_ID_PROPERTY = "spark.jobGroup.id"  # MicroBatchExecution's job group: the run id

#: Task outputs of one ``to_kafka`` call are numbered apart from the next call's in the transactional ids.
_CALL_STRIDE = 1_000_000

_lock = threading.Lock()
_generations: dict[tuple[str, str, str], int] = {}  # (table, link, run id) -> the generation the run won
_busy_sessions: set[tuple[str, Any]] = set()
#: The run id on a Spark Connect server: this process runs one query run's foreachBatch function (see _run_id).
_CONNECT_RUN = f"connect-{uuid.uuid4()}"


def _write_branch(client: KafkaConfig, link: str, generation: int, call: int, timeout_ms: int,
                  topic: str | None, batches: Iterator[Any]) -> Iterator[Any]:
    """One task of ``to_kafka``: the partition's records into one prepared branch; yields its handle. Executor."""
    import pyarrow as pa
    from pyspark import TaskContext

    from lastagent.kafka.branch import BranchWriter
    from lastagent.sinks.kafka_rows import records

    ctx = TaskContext.get()
    assert ctx is not None, "to_kafka's writer runs in a Spark task"
    tid = xid.transactional_id(link, generation, call * _CALL_STRIDE + ctx.partitionId(), ctx.attemptNumber())
    writer = BranchWriter(client, tid, timeout_ms)
    try:
        for batch in batches:
            for key, value, row_topic, part, headers in records(batch, topic):
                writer.send(row_topic, value, key, headers, part)
        handle = writer.prepare()
        writer.release()  # stays open (prepared): the driver ends it after the Delta commit
    except BaseException:
        try:
            writer.abort_local()
        except Exception as exc:  # the original failure is what matters
            log.warning("branch %s: local abort after a failed write also failed: %s", tid, exc)
        raise
    yield pa.RecordBatch.from_pydict({"handle": [handle.to_json()]})


_DELTA_PATH_NAME = re.compile(r"^delta\.`(.+)`$", re.IGNORECASE)


def table_location(spark: Any, table: str) -> str:
    """The Delta table's path: a path or ``delta.`path``` as given, a catalog name by its location. Driver.

    Spark's commit can go to either, but the block reads the table's ``txn`` versions and history with delta-rs,
    which knows paths only; ``DESCRIBE DETAIL`` gives a catalog table's location (and format).
    """
    quoted = _DELTA_PATH_NAME.match(table.strip())
    if quoted:
        return quoted.group(1)
    if "/" in table or ":" in table:
        return table
    try:
        detail = spark.sql(f"DESCRIBE DETAIL {table}").select("format", "location").first()
    except Exception as exc:  # Spark's AnalysisException: TABLE_OR_VIEW_NOT_FOUND and the like
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OptionError("table", f"{table!r} is not a path and Spark does not know it as a table: {first}") from exc
    if detail is None or str(detail.format).lower() != "delta":
        kind = "no" if detail is None else f"a {detail.format!r}"
        raise OptionError("table", f"{table!r} is {kind} table; the block's one commit must be a Delta table's")
    location = str(detail.location)
    if location.startswith("file:"):  # Spark says file:/abs/path; delta-rs wants the path
        location = urllib.parse.unquote(urllib.parse.urlparse(location).path)
    return location


def _is_connect(session: Any) -> bool:
    return type(session).__module__.startswith("pyspark.sql.connect")


def _session_key(session: Any) -> tuple[str, Any]:
    """What tells one Spark session from another: the JVM session's identity, or a Connect session's id."""
    if _is_connect(session):
        return ("connect", session.session_id)
    return ("classic", session._jsparkSession.hashCode())


class Epoch:
    """The block; see :func:`epoch`."""

    def __init__(self, batch: Any, epoch_id: int, link: str, table: str, options: Mapping[str, str]) -> None:
        self.batch = batch
        self.epoch = int(epoch_id)
        self.link = xid.check_link(link)
        self.table = table_location(batch.sparkSession, str(table))
        opts = {k.lower(): v for k, v in options.items()}
        unknown = sorted(k for k in opts if not k.startswith(("kafka.", "storage.")))
        if unknown:
            raise OptionError(unknown[0], "lastagent.epoch takes kafka.* client settings and storage.* settings "
                                          "(for a table on object storage) only")
        self.storage = StorageConfig.parse(opts)
        self._store = BatchEpochTable(self.table, self.storage)
        opts = {k: v for k, v in opts.items() if k.startswith("kafka.")}
        if not opts.get("kafka.bootstrap.servers", "").strip():
            raise OptionError("kafka.bootstrap.servers", "is required, e.g. **{'kafka.bootstrap.servers': 'host:9092'}")
        timeout = opts.pop("kafka.transaction.timeout.ms", "900000")
        if not timeout.strip().isdigit() or int(timeout) <= 0:
            raise OptionError("kafka.transaction.timeout.ms", f"is {timeout!r}; give a positive number of "
                                                              "milliseconds, at most the broker's transaction.max.timeout.ms")
        self.timeout_ms = int(timeout)
        self.client = KafkaConfig.parse({k[len("kafka."):]: v for k, v in opts.items()})
        self.generation = -1
        self.entry: be.Entry | None = None
        self.prepared: list[Any] = []  # BranchHandle
        self._xa_client: Any = None  # KafkaXAResource, made on first use and closed on leaving
        self._failed: EpochNotDecidedError | None = None  # a to_kafka call's branches could not be decided
        self._calls = 0
        self._saved: list[tuple[Any, dict[str, str | None]]] = []

    @property
    def replayed(self) -> bool:
        """True when the epoch was decided by an earlier run: Delta skips the block's writes, to_kafka writes nothing."""
        return isinstance(self.entry, be.Replay)

    # -- reading the table -----------------------------------------------------------------------

    def _delta(self) -> Any:
        return self._store.require()

    def _txns(self, dt: Any) -> dict[str, int]:
        return BatchEpochTable.txns(dt, self.link)

    def _history(self, dt: Any) -> list[str | None]:
        return [c.get("userMetadata") for c in BatchEpochTable.history(dt)]

    def _record(self, history: list[str | None]) -> be.BatchRecord | None:
        for m in history:
            r = be.record_in(m, self.link)
            if r is not None and r.epoch == self.epoch:
                return r
        return None

    # -- the claim ---------------------------------------------------------------------------------

    def _run_id(self) -> str:
        if _is_connect(self.batch.sparkSession):
            # A Connect server runs a query's foreachBatch function in a Python process of its own, started
            # when the query starts and attached to the client's session; no run id reaches it, so the
            # process's own stands for the run.
            return _CONNECT_RUN
        run = self.batch.sparkSession.sparkContext.getLocalProperty(_RUN_ID_PROPERTY)
        if not run:
            raise OptionError("foreachBatch", "lastagent.epoch runs inside a streaming query's foreachBatch "
                                              f"function (Spark's local property {_RUN_ID_PROPERTY!r} is not set)")
        return str(run)

    def _empty_frame(self) -> Any:
        """No rows, in the table's columns but those Delta fills itself (identity, generated): an append of it
        makes a commit that carries ``txn`` and the metadata and changes no data."""
        from pyspark.sql.types import StructType

        spark = self.batch.sparkSession
        # Spark's read schema drops the columns' Delta metadata; the log (delta-rs) has it.
        filled = {f.name for f in self._delta().schema().fields
                  if any(k.startswith(("delta.identity.", "delta.generationExpression")) for k in f.metadata)}
        schema = spark.read.format("delta").load(self.table).schema
        return spark.createDataFrame([], StructType([f for f in schema.fields if f.name not in filled]))

    def _empty_append(self, app: str, version: int, metadata: str) -> None:
        (self._empty_frame().write.format("delta").mode("append").option("txnAppId", app)
         .option("txnVersion", str(version)).option("userMetadata", metadata).save(self.table))

    def _claim(self, run: str) -> int:
        """Wins the next generation for ``run`` (a claim commit through Spark), then recovers the link.

        First the sinks' start checks: the broker serves the transaction protocol lastagent needs, and
        ``kafka.transaction.timeout.ms`` is within its ``transaction.max.timeout.ms``.
        """
        from lastagent.kafka.xa import KafkaXAResource

        with KafkaXAResource(self.client) as xa:
            xa.transaction_protocol()  # refuses a broker that cannot serve us
            broker_max = xa.broker_max_timeout_ms()
        if self.timeout_ms > broker_max:
            raise OptionError("kafka.transaction.timeout.ms", f"{self.timeout_ms} exceeds the broker's "
                                                              f"transaction.max.timeout.ms ({broker_max}); lower the "
                                                              "option or raise the broker setting")
        for attempt in range(1, 9):
            commit, mine = be.claim(self.link, run, f"{run}-{uuid.uuid4().hex[:8]}", self._txns(self._delta()))
            try:
                self._empty_append(commit.app, commit.version, commit.metadata)
            except Exception as exc:  # a concurrent claim won the same fence (ConcurrentTransactionException)
                if "Concurrent" not in str(exc):
                    raise
                log.info("link %s: claim attempt %d lost a race: %s", self.link, attempt, str(exc)[:200])
                continue
            dt = self._delta()
            history = self._history(dt)
            if be.claim_won(mine, history):
                faults.point("in_recovery")
                generation = mine.fenced + 1
                decisions = {}
                for m in reversed(history):
                    r = be.record_in(m, self.link)
                    if r is not None:
                        decisions[r.epoch] = r.branches
                with KafkaXAResource(self.client) as xa:
                    earlier = [t for t in xa.recover(xid.id_prefix(self.link))
                               if (xid.parse_transactional_id(self.link, t.transactional_id) or (generation,))[0]
                               < generation]
                    handles = {protocol.Branch.of(t): t.handle() for t in earlier}
                    actions = protocol.recover(self.epoch - 1, decisions, list(handles))
                    self._carry_out(xa, [a for a in actions if isinstance(a, protocol.CommitBranch)],
                                    [a for a in actions if isinstance(a, protocol.RollbackBranch)], handles)
                log.info("link %s: run %s holds it as generation %d", self.link, run, generation)
                return generation
        raise StaleOwnerError(f"link {self.link!r}: run {run} lost 8 claims in a row to other runs")

    def _carry_out(self, xa: Any, commits: list[Any], rollbacks: list[Any], handles: Mapping[Any, Any]) -> None:
        from lastagent.kafka.branch import BranchHandle
        from lastagent.kafka.xa import EndOutcome

        def handle(b: protocol.Branch) -> Any:
            return handles.get(b) or BranchHandle(b.transactional_id, b.producer_id, b.producer_epoch, 1)

        for i, a in enumerate(commits):
            if i:
                faults.point("between_branch_commits")
            result = xa.commit(handle(a.branch))
            if result.outcome not in (EndOutcome.COMMITTED, EndOutcome.NOTHING_TO_END):
                raise DecidedBranchLostError(protocol.lost_branch_reason(self.link, a.epoch, a.branch, result.detail))
        for a in rollbacks:
            xa.rollback(handle(a.branch))

    # -- the block ---------------------------------------------------------------------------------

    def __enter__(self) -> Epoch:
        run = self._run_id()
        key = (self.table, self.link, run)
        with _lock:
            generation = _generations.get(key)
        if generation is None:
            generation = self._claim(run)
            with _lock:
                _generations[key] = generation
        self.generation = generation
        dt = self._delta()
        self.entry = be.enter(self.link, self.epoch, generation, self._txns(dt), self._record(self._history(dt)))
        if isinstance(self.entry, be.Superseded):
            raise StaleOwnerError(self.entry.reason)
        metadata = (self.entry.record.to_metadata() if isinstance(self.entry, be.Replay)
                    else be.BatchRecord(self.link, self.epoch, generation, ()).to_metadata())
        self._set_confs(self.entry.app, self.epoch, metadata)
        return self

    def _sessions(self) -> list[Any]:
        """The sessions the block's Delta write may run in. Classic: the batch's (a per-query clone) and the
        driver's own. Connect: the batch's, which is the client's own session on the server."""
        from pyspark.sql import SparkSession

        if _is_connect(self.batch.sparkSession):
            return [self.batch.sparkSession]
        out, seen = [], set()
        for s in (self.batch.sparkSession, SparkSession.getActiveSession(), SparkSession.builder.getOrCreate()):
            if s is not None and _session_key(s) not in seen:
                seen.add(_session_key(s))
                out.append(s)
        return out

    def _set_confs(self, app: str, epoch: int, metadata: str) -> None:
        sessions = self._sessions()
        with _lock:
            busy = [s for s in sessions if _session_key(s) in _busy_sessions]
            if busy and not self._saved:
                raise OptionError("foreachBatch", "another lastagent.epoch block runs on the same Spark session; "
                                                  "Delta's idempotent-write settings are per session: run one "
                                                  "block at a time per session")
            if not self._saved:
                _busy_sessions.update(_session_key(s) for s in sessions)
                self._saved = [(s, {k: s.conf.get(k, None) for k in (_TXN_APP, _TXN_VERSION, _USER_METADATA)})
                               for s in sessions]
        for s in sessions:
            s.conf.set(_TXN_APP, app)
            s.conf.set(_TXN_VERSION, str(epoch))
            s.conf.set(_USER_METADATA, metadata)

    def _restore_confs(self) -> None:
        with _lock:
            for s, before in self._saved:
                for k, v in before.items():
                    if v is None:
                        s.conf.unset(k)
                    else:
                        s.conf.set(k, v)
                _busy_sessions.discard(_session_key(s))
            self._saved = []

    def to_kafka(self, df: Any, topic: str | None = None) -> None:
        """Writes ``df`` (``value``, optional ``key``, ``topic``, ``partition``, ``headers``, as Spark's kafka sink
        takes them) into prepared branches of this epoch; visible to read_committed consumers once the block's
        Delta commit has decided the epoch. Call it before the Delta write. Driver (the job's tasks: executors)."""
        from lastagent.kafka.branch import BranchHandle
        from lastagent.sinks.kafka_rows import check_schema

        assert self.entry is not None, "to_kafka is called inside the with block"
        refused = be.may_write_kafka(self.link, self.entry, self._record(self._history(self._delta())))
        if refused is not None:
            raise StaleOwnerError(refused)
        if isinstance(self.entry, be.Replay):
            return
        assert isinstance(self.entry, be.Fresh)  # a Superseded entry was refused above
        check_schema(df.schema, topic)
        self._calls += 1
        write = functools.partial(_write_branch, self.client, self.link, self.generation, self._calls,
                                  self.timeout_ms, topic)
        handles = [BranchHandle.from_json(r.handle) for r in df.mapInArrow(write, "handle string").collect()]
        live = [h for h in handles if not h.read_only]
        self.prepared += live
        self._require_time_left(live)
        faults.point("after_prepare")
        branches = tuple(protocol.Branch.of(h) for h in self.prepared)
        self._set_confs(self.entry.app, self.epoch, be.BatchRecord(self.link, self.epoch, self.generation,
                                                                   branches).to_metadata())

    def _xa(self) -> Any:
        from lastagent.kafka.xa import KafkaXAResource

        if self._xa_client is None:
            self._xa_client = KafkaXAResource(self.client)
        return self._xa_client

    def _require_time_left(self, handles: list[Any]) -> None:
        """The sinks' rule before a decision: every branch still open with enough of its timeout left. Driver.

        The block's decision is the body's Delta write, after this; a branch that expires before that write
        commits is the expired-decided hazard (:class:`DecidedBranchLostError` at phase 2), so a call whose
        branches are already near their timeout (slow tasks) is refused here: the block fails, and leaving
        it rolls every branch back.
        """
        if not handles:
            return
        xa = self._xa()
        wanted = {protocol.Branch.of(h) for h in handles}
        open_now = [t for t in xa.recover(xid.id_prefix(self.link)) if protocol.Branch.of(t) in wanted]
        listed = {protocol.Branch.of(t) for t in open_now}
        # A listing can miss a transaction whose coordinator is moving; its own coordinator cannot.
        open_now += [t for t in xa.open_among(h for h in handles if protocol.Branch.of(h) not in listed)
                     if protocol.Branch.of(t) in wanted]
        times = {protocol.Branch.of(t): (t.started_ms, t.timeout_ms) for t in open_now}
        now = int(time.time() * 1000)
        unsafe = protocol.unsafe_branches([protocol.Branch.of(h) for h in handles], times, now,
                                          protocol.decision_margin_ms(self.timeout_ms))
        if unsafe:
            started = [s for s, _ in times.values()]
            self._failed = EpochNotDecidedError(protocol.not_decided_reason(
                self.link, self.epoch, unsafe, now - min(started) if started else None, self.timeout_ms))
            raise self._failed

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self.entry is not None
        try:
            faults.point("after_arbitration")  # the body's Delta write (the decision) is behind us
            prepared = {protocol.Branch.of(h): h for h in self.prepared}
            decided_here = False
            xa = self._xa()  # the block's one client, closed below
            while True:
                mine = [t for t in xa.recover(xid.id_prefix(self.link))
                        if (xid.parse_transactional_id(self.link, t.transactional_id) or (self.generation + 1,))[0]
                        <= self.generation]
                handles = {**{protocol.Branch.of(t): t.handle() for t in mine}, **prepared}
                out = be.leave(self.link, self.entry, self.generation, list(prepared), list(handles),
                               self._record(self._history(self._delta())), exc is not None, decided_here)
                if isinstance(out, be.DecideByEmptyCommit):
                    self._empty_append_with_confs()
                    decided_here = True
                    continue
                break
            self._carry_out(xa, [protocol.CommitBranch(b, self.epoch) for b in out.commit],
                            [protocol.RollbackBranch(b) for b in out.roll_back], handles)
        finally:
            self._restore_confs()
            if self._xa_client is not None:
                self._xa_client.close()
                self._xa_client = None
        if out.fail is not None and exc is None:
            raise StaleOwnerError(out.fail)
        # The body caught the refusal and went on: its Delta write may have decided without that call's events
        # (rolled back above); the query must not carry on as if nothing happened.
        if self._failed is not None and exc is None:
            raise self._failed

    def _empty_append_with_confs(self) -> None:
        # The session confs set at entry (and by to_kafka) carry txn(app, epoch) and the record.
        self._empty_frame().write.format("delta").mode("append").save(self.table)


def epoch(batch: Any, epoch_id: int, *, link: str, table: str, **options: str) -> Epoch:
    """One exactly-once epoch inside ``foreachBatch``: Kafka outputs and the Delta write decided as one.

    ``with lastagent.epoch(batch, epoch_id, link="orders-cdc", table="/data/orders", **kafka) as e:`` then
    ``e.to_kafka(df, topic=...)`` for every Kafka output, then the one Delta write (a ``MERGE``, ``UPDATE``,
    ``DELETE`` or append through Spark, on ``table``). Driver side.

    Args:
        batch: the micro-batch DataFrame foreachBatch passes.
        epoch_id: its batch id.
        link: the link's stable name (it names the transactional ids and the Delta app ids).
        table: the Delta table the block's write goes to: a path, ``delta.`path``` or a catalog name.
        options: ``kafka.*`` client settings (``kafka.bootstrap.servers`` required) and, for a table on object
            storage, the ``storage.*`` settings the sinks take (Spark's own write uses Spark's settings).
    """
    return Epoch(batch, epoch_id, link, table, options)
