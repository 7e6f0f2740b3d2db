"""``lastagent.epoch``: one exactly-once epoch inside ``foreachBatch``, Spark's own Delta write as the last agent.

Driver side (the block and its phase 2); ``to_kafka``'s tasks run on the executors. The rules (the fence, the
claim, entering and leaving) are :mod:`lastagent.core.batch_epoch`'s; this module carries them out with Spark (the
claim's commit; every other commit is the user's), Delta Kernel (reading the table's ``txn`` versions and history), the
sinks' :class:`~lastagent.core.committer.Committer` (the broker check, recovery after a claim, the time-left rule,
phase 2: one interpreter for every epoch) and the sinks' branch task (:mod:`lastagent.sinks.branch_task`).
Design: ``dev/designs/foreach-batch-epoch.md``.

Classic Spark and Spark Connect (the block runs on the Connect server, in the query's foreachBatch process); a
table by path or by catalog name.

**Which session carries the settings.** Delta's idempotent-write settings are session confs, read from the
session a write runs in. The block sets them on the batch's own session and nowhere else: in classic Spark that is
the query's private clone of the session it started from (every query has its own), so another query's writes,
and writes through the driver's global ``spark``, never see them; on Spark Connect it is the client's session on
the server, so the block refuses to run while that session runs any other query. Delta's auto-reset is on for the
block, so the first write takes ``txnVersion`` and a second write through the session fails in Delta itself;
leaving, the block reads what the table committed while it was open, and a data change without the block's
record (a write through another session) is refused by name (:func:`lastagent.core.batch_epoch.stray_writes`).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
import urllib.parse
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lastagent import faults
from lastagent.core import batch_epoch as be
from lastagent.core import protocol, xid
from lastagent.core.arbitration import Ownership
from lastagent.core.branch_handle import BranchHandle
from lastagent.delta.batch_table import HISTORY_DEPTH, BatchEpochTable
from lastagent.errors import BlockWriteError, EpochNotDecidedError, OptionError, StaleOwnerError
from lastagent.kafka.config import KafkaConfig
from lastagent.sinks.kafka_rows import SinkColumns, check_schema
from lastagent.sinks.kafka_sink_options import SINK_OPTIONS
from lastagent.storage import StorageConfig

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from lastagent.core.committer import Committer
    from lastagent.delta.snapshot import Snapshot

log = logging.getLogger("lastagent.epoch")

_TXN_APP = "spark.databricks.delta.write.txnAppId"
_TXN_VERSION = "spark.databricks.delta.write.txnVersion"
_USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"
#: Delta unsets ``txnVersion`` after the first write (or skip) that used it: a second write in the block then fails.
_AUTO_RESET = "spark.databricks.delta.write.txnVersion.autoReset.enabled"
_CONFS = (_TXN_APP, _TXN_VERSION, _USER_METADATA, _AUTO_RESET)
#: Delta's error for a write that finds txnAppId without txnVersion: the version went to an earlier write.
_SECOND_WRITE = "DELTA_INVALID_IDEMPOTENT_WRITES_OPTIONS"
_RUN_ID_PROPERTY = "spark.jobGroup.id"  # MicroBatchExecution's job group: the run id

#: Task outputs of one ``to_kafka`` call are numbered apart from the next call's in the transactional ids.
_CALL_STRIDE = 1_000_000

_lock = threading.Lock()
_generations: dict[tuple[str, str, str], int] = {}  # (table, link, run id) -> the generation the run won
_busy_sessions: set[tuple[str, Any]] = set()
#: The run id on a Spark Connect server: this process runs one query run's foreachBatch function (see _run_id).
_CONNECT_RUN = f"connect-{uuid.uuid4()}"


def _write_branch(client: KafkaConfig, link: str, generation: int, call: int, timeout_ms: int,
                  topic: str | None, columns: SinkColumns, batches: Iterator[Any]) -> Iterator[Any]:
    """One task of ``to_kafka``: the partition's records into one prepared branch; yields its handle. Executor."""
    import pyarrow as pa
    from pyspark import TaskContext

    from lastagent.sinks.branch_task import write_branch

    ctx = TaskContext.get()
    assert ctx is not None, "to_kafka's writer runs in a Spark task"
    tid = xid.transactional_id(link, generation, call * _CALL_STRIDE + ctx.partitionId(), ctx.attemptNumber())
    handle = write_branch(client, tid, timeout_ms, batches, topic, columns)
    yield pa.RecordBatch.from_pydict({"handle": [handle.to_json()]})


_DELTA_PATH_NAME = re.compile(r"^delta\.`(.+)`$", re.IGNORECASE)


def table_location(spark: Any, table: str) -> str:
    """The Delta table's path: a path or ``delta.`path``` as given, a catalog name by its location. Driver.

    Spark's commit can go to either, but the block reads the table's ``txn`` versions and history through Delta
    Kernel, which knows paths only; ``DESCRIBE DETAIL`` gives a catalog table's location (and format).
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
    if location.startswith("file:"):  # Spark says file:/abs/path; lastagent.storage wants the path
        location = urllib.parse.unquote(urllib.parse.urlparse(location).path)
    return location


def _is_connect(session: Any) -> bool:
    return type(session).__module__.startswith("pyspark.sql.connect")


def _session_key(session: Any) -> tuple[str, Any]:
    """What tells one Spark session from another: the JVM session's id, or a Connect session's id."""
    if _is_connect(session):
        return ("connect", session.session_id)
    return ("classic", str(session._jsparkSession.sessionUUID()))


@dataclass(frozen=True)
class BlockOptions(xid.LinkIds):
    """What the :class:`~lastagent.core.committer.Committer` reads of a block's link, as the sinks' options give it."""

    link: str
    client_config: KafkaConfig
    transaction_timeout_ms: int
    storage: StorageConfig
    phase2_parallelism: int = field(default_factory=lambda: SINK_OPTIONS.integer_value({}, "phase2Parallelism"))
    #: The block's decisions are the table's own commits: Spark's log keeps them, no cleanup of ours.
    cleanup_every: int = 1 << 62
    retention_epochs: int = 0
    checkpoint_location: str = "the query's checkpoint (read by Spark, not by the block)"


@dataclass(frozen=True)
class BlockCheckpoint:
    """The checkpoint port for a block: Spark runs epoch ``epoch`` only once every earlier one is in its commit log,
    and the run id stands for the query (the block has no checkpoint path of its own)."""

    epoch: int
    run: str

    def committed_through(self) -> int:
        return self.epoch - 1

    def query_id(self) -> str:
        return self.run


class Epoch:
    """The block; see :func:`epoch`."""

    def __init__(self, batch: Any, epoch_id: int, link: str, table: str, options: Mapping[str, str]) -> None:
        from lastagent.spark_versions import require_supported

        require_supported()  # as the formats do at a query's start
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
        self._store = BatchEpochTable(self.table, self.storage, depth=HISTORY_DEPTH)
        opts = {k: v for k, v in opts.items() if k.startswith("kafka.")}
        if not opts.get("kafka.bootstrap.servers", "").strip():
            raise OptionError("kafka.bootstrap.servers", "is required, e.g. **{'kafka.bootstrap.servers': 'host:9092'}")
        timeout = opts.pop("kafka.transaction.timeout.ms", "900000")
        if not timeout.strip().isdigit() or int(timeout) <= 0:
            raise OptionError("kafka.transaction.timeout.ms", f"is {timeout!r}; give a positive number of "
                                                              "milliseconds, at most the broker's transaction.max.timeout.ms")
        self.timeout_ms = int(timeout)
        self.client = KafkaConfig.parse({k[len("kafka."):]: v for k, v in opts.items()})
        self.options = BlockOptions(self.link, self.client, self.timeout_ms, self.storage)
        self.generation = -1
        self.entry: be.Entry | None = None
        self.prepared: list[BranchHandle] = []
        self._committer: Committer | None = None  # made on first use, closed on leaving
        self._failed: EpochNotDecidedError | None = None  # a to_kafka call's branches could not be decided
        self._calls = 0
        self._saved: dict[str, str | None] | None = None  # the batch session's settings before the block
        self._entered_version = -1  # the table's version when the block began

    @property
    def replayed(self) -> bool:
        """True when the epoch was decided by an earlier run: Delta skips the block's writes, to_kafka writes nothing."""
        return isinstance(self.entry, be.Replay)

    # -- reading the table -----------------------------------------------------------------------

    def _delta(self) -> Snapshot:
        return self._store.require()

    def _txns(self, dt: Snapshot) -> dict[str, int]:
        return BatchEpochTable.txns(dt, self.link)

    def _history(self, dt: Snapshot) -> list[str | None]:
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
        # Spark's read schema drops the columns' Delta metadata; the log has it.
        filled = {f["name"] for f in json.loads(self._delta().schema_json)["fields"]
                  if any(k.startswith(("delta.identity.", "delta.generationExpression")) for k in f.get("metadata", {}))}
        schema = spark.read.format("delta").load(self.table).schema
        return spark.createDataFrame([], StructType([f for f in schema.fields if f.name not in filled]))

    def _empty_append(self, app: str, version: int, metadata: str) -> None:
        (self._empty_frame().write.format("delta").mode("append").option("txnAppId", app)
         .option("txnVersion", str(version)).option("userMetadata", metadata).save(self.table))

    def _committer_for(self, run: str) -> Committer:
        from lastagent.core.committer import Committer
        from lastagent.kafka.xa import KafkaXAResource

        return Committer(self.options, store=self._store, xa=KafkaXAResource(self.client),
                         checkpoint=BlockCheckpoint(self.epoch, run))

    def _claim(self, run: str) -> int:
        """Wins the next generation for ``run`` (a claim commit through Spark), then recovers the link. Driver.

        First the sinks' start checks (:meth:`Committer.check`): the broker serves the transaction protocol
        lastagent needs, and ``kafka.transaction.timeout.ms`` is within its ``transaction.max.timeout.ms``. After
        the claim, the sinks' recovery (:meth:`Committer.recover_claimed`): branches a record names committed,
        the rest of earlier runs' rolled back.
        """
        with self._committer_for(run) as committer:
            committer.check()
            for attempt in range(1, 9):
                commit, mine = be.claim(self.link, run, f"{run}-{uuid.uuid4().hex[:8]}", self._txns(self._delta()))
                try:
                    self._empty_append(commit.app, commit.version, commit.metadata)
                except Exception as exc:  # a concurrent claim won the same fence (ConcurrentTransactionException)
                    if "Concurrent" not in str(exc):
                        raise
                    log.info("link %s: claim attempt %d lost a race: %s", self.link, attempt, str(exc)[:200])
                    continue
                if be.claim_won(mine, self._history(self._delta())):
                    generation = mine.fenced + 1
                    committer.recover_claimed(Ownership(run, generation, run, ()))
                    log.info("link %s: run %s holds it as generation %d", self.link, run, generation)
                    return generation
        raise StaleOwnerError(f"link {self.link!r}: run {run} lost 8 claims in a row to other runs")

    # -- the block ---------------------------------------------------------------------------------

    def __enter__(self) -> Epoch:
        if _is_connect(self.batch.sparkSession):
            self._require_own_connect_session()  # before anything is claimed or written
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
        self._entered_version = dt.version
        self.entry = be.enter(self.link, self.epoch, generation, self._txns(dt), self._record(self._history(dt)))
        if isinstance(self.entry, be.Superseded):
            raise StaleOwnerError(self.entry.reason)
        metadata = (self.entry.record.to_metadata() if isinstance(self.entry, be.Replay)
                    else be.BatchRecord(self.link, self.epoch, generation, ()).to_metadata())
        self._set_confs(self.entry.app, self.epoch, metadata)
        return self

    def _require_own_connect_session(self) -> None:
        """On Spark Connect the block's settings go on the client's session on the server, which every query of
        that client writes through: refused while the session runs another query. Driver (Connect server)."""
        active = self.batch.sparkSession.streams.active  # this block's own query among them
        if len(active) > 1:
            names = ", ".join(sorted(f"{q.name or q.id}" for q in active))
            raise OptionError("foreachBatch", f"link {self.link!r}: on Spark Connect the block's Delta settings are "
                                              "session-wide on the client's session, which runs more than this query now "
                                              f"({names}); start each lastagent.epoch query from a Connect session "
                                              "of its own (SparkSession.builder.remote(...).create()) that runs "
                                              "nothing else")

    def _set_confs(self, app: str, epoch: int, metadata: str) -> None:
        """Delta's idempotent-write settings on the batch's own session, and nowhere else. Driver."""
        session = self.batch.sparkSession
        key = _session_key(session)
        with _lock:
            if self._saved is None:
                if key in _busy_sessions:
                    raise OptionError("foreachBatch", "a lastagent.epoch block is already open on this batch's "
                                                      "session: blocks do not nest, one block per batch")
                _busy_sessions.add(key)
                self._saved = {k: session.conf.get(k, None) for k in _CONFS}
        session.conf.set(_AUTO_RESET, "true")
        session.conf.set(_TXN_APP, app)
        session.conf.set(_TXN_VERSION, str(epoch))
        session.conf.set(_USER_METADATA, metadata)

    def _restore_confs(self) -> None:
        session = self.batch.sparkSession
        with _lock:
            if self._saved is None:
                return
            for k, v in self._saved.items():
                if v is None:
                    session.conf.unset(k)
                else:
                    session.conf.set(k, v)
            _busy_sessions.discard(_session_key(session))
            self._saved = None

    def to_kafka(self, df: Any, topic: str | None = None) -> None:
        """Writes ``df`` (``value``, optional ``key``, ``topic``, ``partition``, ``headers``, as Spark's kafka sink
        takes them) into prepared branches of this epoch; visible to read_committed consumers once the block's
        Delta commit has decided the epoch. Call it before the Delta write. Driver (the job's tasks: executors)."""

        assert self.entry is not None, "to_kafka is called inside the with block"
        refused = be.may_write_kafka(self.link, self.entry, self._record(self._history(self._delta())))
        if refused is not None:
            raise StaleOwnerError(refused)
        if isinstance(self.entry, be.Replay):
            return
        assert isinstance(self.entry, be.Fresh)  # a Superseded entry was refused above
        if self.batch.sparkSession.conf.get(_TXN_VERSION, None) is None:  # a Delta write took it (auto-reset)
            raise OptionError("foreachBatch", f"link {self.link!r} epoch {self.epoch}: a Delta write was made in "
                                              "the block before this e.to_kafka, and took the block's txn; call "
                                              "every e.to_kafka first, then make the block's one Delta write")
        columns = check_schema(df.schema, topic)
        self._calls += 1
        write = functools.partial(_write_branch, self.client, self.link, self.generation, self._calls,
                                  self.timeout_ms, topic, columns)
        handles = [BranchHandle.from_json(r.handle) for r in df.mapInArrow(write, "handle string").collect()]
        live = [h for h in handles if not h.read_only]
        self.prepared += live
        self._require_time_left(live)
        faults.point("after_prepare")
        branches = tuple(protocol.Branch.of(h) for h in self.prepared)
        self._set_confs(self.entry.app, self.epoch, be.BatchRecord(self.link, self.epoch, self.generation,
                                                                   branches).to_metadata())

    def _run_committer(self) -> Committer:
        if self._committer is None:
            self._committer = self._committer_for(self._run_id())
        return self._committer

    def _require_time_left(self, handles: list[BranchHandle]) -> None:
        """The sinks' rule before a decision (:meth:`Committer.require_time_left`). Driver.

        The block's decision is the body's Delta write, after this; a branch that expires before that write
        commits is the expired-decided hazard (:class:`DecidedBranchLostError` at phase 2), so a call whose
        branches are already near their timeout (slow tasks) is refused here: the block fails, and leaving
        it rolls every branch back.
        """
        try:
            self._run_committer().require_time_left(self.epoch, self.generation, handles)
        except EpochNotDecidedError as exc:
            self._failed = exc
            raise

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self.entry is not None
        try:
            faults.point("after_arbitration")  # the body's Delta write (the decision) is behind us
            prepared = {protocol.Branch.of(h): h for h in self.prepared}
            decided_here = False
            dt = self._delta()  # one read of the table for the stray check and the record
            stray = None if exc is not None else self._stray_writes(dt)
            committer = self._run_committer()  # the block's one Kafka client, closed below
            assert committer.xa is not None
            while True:
                mine = [t for t in committer.xa.recover(xid.id_prefix(self.link))
                        if (xid.parse_transactional_id(self.link, t.transactional_id) or (self.generation + 1,))[0]
                        <= self.generation]
                handles = {**{protocol.Branch.of(t): t.handle() for t in mine}, **prepared}
                out = be.leave(self.link, self.entry, self.generation, list(prepared), list(handles),
                               self._record(self._history(dt)), exc is not None, decided_here, stray)
                if isinstance(out, be.DecideByEmptyCommit):
                    self._empty_append_with_confs()
                    decided_here = True
                    dt = self._delta()  # read again: the decision just committed
                    continue
                break
            # A recorded branch no longer open (committed already) is ended by its record's ids: the broker says so.
            known = {b: BranchHandle(b.transactional_id, b.producer_id, b.producer_epoch, 1) for b in out.commit}
            committer.end_branches([protocol.CommitBranch(b, self.epoch) for b in out.commit],
                                   [protocol.RollbackBranch(b) for b in out.roll_back], {**known, **handles})
        finally:
            self._restore_confs()
            if self._committer is not None:
                self._committer.__exit__(None, None, None)
                self._committer = None
        if out.fail is not None and exc is None:
            raise (BlockWriteError if out.stray else StaleOwnerError)(out.fail)
        if exc is not None and _SECOND_WRITE in str(exc):
            raise BlockWriteError(
                f"link {self.link!r} epoch {self.epoch}: a second Delta write in one lastagent.epoch block (Delta "
                "refused it: the block's txnVersion went to the first write, and a second write under it would be "
                f"skipped as already done). {'The epoch was decided by the first write. ' if out.commit else ''}"
                "Make exactly one Delta write per block: the others before or after the block, or one MERGE that "
                "does them all") from exc
        # The body caught the refusal and went on: its Delta write may have decided without that call's events
        # (rolled back above); the query must not carry on as if nothing happened.
        if self._failed is not None and exc is None:
            raise self._failed

    def _stray_writes(self, dt: Snapshot) -> str | None:
        """Why the body's commits cannot stand as the block's decision, or None: reads every commit of the table
        (``dt``, read after the body) since the block began (:func:`lastagent.core.batch_epoch.stray_writes`). Driver."""
        stray = be.stray_writes(BatchEpochTable.commits_since(dt, self._entered_version))
        if not stray:
            return None
        decided_by = next((int(c["version"]) for c in BatchEpochTable.history(dt)
                           if (r := be.record_in(c.get("userMetadata"), self.link)) is not None
                           and r.epoch == self.epoch), None)
        return be.stray_reason(self.link, self.epoch, self.table, stray, decided_by)

    def _empty_append_with_confs(self) -> None:
        # The session confs set at entry (and by to_kafka) carry txn(app, epoch) and the record.
        self._empty_frame().write.format("delta").mode("append").save(self.table)


def epoch(batch: DataFrame, epoch_id: int, *, link: str, table: str, **options: str) -> Epoch:
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
