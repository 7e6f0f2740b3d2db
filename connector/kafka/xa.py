"""Kafka as an XA resource, the driver's half: branches are Kafka transactions, finished from any process.

After the XA verbs (start / end / prepare on the branch's own producer, commit / rollback / recover by the
transaction manager; Kafka keeps no heuristic outcome to forget): the executor's half, the branch writer that
starts, writes and prepares a branch, is :mod:`lastagent.kafka.branch`. :class:`KafkaXAResource` runs on the driver
(or in the ``lastagent`` command). It commits or rolls back a branch by its handle with ``EndTxn`` (see
:mod:`lastagent.kafka.wire`), lists the open transactions of a link from the broker, and reads the broker's
transaction limits. It is the adapter of the committer's Kafka port, :class:`lastagent.core.kafka_port.XAResource`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lastagent import faults
from lastagent.core.branch_handle import BranchHandle
from lastagent.core.kafka_port import EndOutcome, EndResult, OpenTransaction
from lastagent.errors import KafkaProtocolError, KafkaUnavailableError
from lastagent.kafka import internals as kafka_internals
from lastagent.kafka.config import KafkaConfig
from lastagent.kafka.retry import RETRIABLE_NAMES, is_retriable
from lastagent.kafka.wire import TransactionCoordinatorClient

log = logging.getLogger("lastagent.kafka")

#: Kafka error names that say this handle's transaction is no longer the open one.
_GONE = frozenset({
    "INVALID_TXN_STATE", "PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH",
    "INVALID_PRODUCER_ID_MAPPING", "TRANSACTIONAL_ID_NOT_FOUND",
})


def _ongoing(described: Mapping[str, Any]) -> list[OpenTransaction]:
    """The open (``Ongoing``) transactions of a DescribeTransactions answer, by id."""
    return [OpenTransaction(tid, desc.producer_id, desc.producer_epoch, desc.state,
                            desc.transaction_start_time_ms, desc.transaction_timeout_ms, desc.topic_partitions)
            for tid, desc in sorted(described.items()) if desc.state == "Ongoing"]


class KafkaXAResource:
    """The transaction manager's view of Kafka for one link: the :class:`~lastagent.core.kafka_port.XAResource` port. Driver side.

    Every request to the brokers is retried through broker loss (a node restarting, the
    coordinator or a leader moving, the transaction log short of in-sync replicas) within
    ``kafka.default.api.timeout.ms``, on a new client bootstrapped from any live broker
    (:meth:`TransactionCoordinatorClient.call`); only then does a call fail, with
    :class:`~lastagent.errors.KafkaUnavailableError` naming the broker's condition.

    Args:
        client_config: kafka settings with the ``kafka.`` prefix removed (bootstrap.servers...).
    """

    def __init__(self, client_config: KafkaConfig | Mapping[str, str]) -> None:
        self._config = KafkaConfig.of(client_config)
        if not self._config.bootstrap_servers.strip():
            raise KafkaProtocolError("kafka.bootstrap.servers is required")
        # kafka-python clients (each its own I/O thread, thread-safe), renewed after a broker loss.
        self._wire = TransactionCoordinatorClient(self._config)
        self._protocol: int | None = None

    def transaction_protocol(self) -> int:
        """The cluster's transaction protocol (2 or 1), asked once; see :meth:`TransactionCoordinatorClient.transaction_protocol`."""
        if self._protocol is None:
            self._protocol = self._wire.transaction_protocol()
        return self._protocol

    def _ended_epoch(self, handle: BranchHandle) -> int:
        """The producer epoch the broker reports once *this* transaction has ended.

        Protocol 2 bumps the epoch at every end, so the end of this transaction shows as epoch + 1
        (and a later transaction of the id as more); protocol 1 leaves it as it was.
        """
        return handle.producer_epoch + (1 if self.transaction_protocol() >= 2 else 0)

    def broker_max_timeout_ms(self) -> int:
        """The broker's ``transaction.max.timeout.ms``; a branch timeout above it is refused."""
        return int(self._broker_config("transaction.max.timeout.ms"))

    def _broker_config(self, name: str) -> str:
        """A broker setting, from the broker the client is connected to (any live one: a cluster's
        brokers share the settings lastagent reads)."""
        from kafka.admin import ConfigResource, ConfigResourceType

        def ask(admin: Any) -> tuple[str, Any]:
            # Each broker listed in turn: the first one of the list may be the one that is down.
            failure: BaseException | None = None
            # Fenced brokers (away, or not yet caught up) last.
            for broker in sorted(admin.describe_cluster()["brokers"], key=lambda b: bool(b.get("is_fenced"))):
                broker_id = str(broker["broker_id"])
                try:
                    return broker_id, admin.describe_configs(
                        [ConfigResource(ConfigResourceType.BROKER, broker_id, configs=[name])], config_filter="all")
                except Exception as exc:  # the next broker is asked; the last failure is raised
                    if not is_retriable(exc):
                        raise
                    failure = exc
            raise failure or KafkaUnavailableError("the cluster listed no broker")

        broker_id, res = self._wire.call(f"reading the broker setting {name}", ask)
        entry = res.get("broker", {}).get(broker_id, {}).get(name)
        if entry is None:
            # The broker leaves out what the principal may not describe, rather than refusing.
            raise KafkaProtocolError(f"the broker did not report {name}: the principal needs DescribeConfigs on "
                                     "the Cluster (docs/security.md)")
        return str(entry["value"])

    def missing_topics(self, topics: Iterable[str]) -> list[str]:
        """The topics that do not exist and that the broker will not create on first write."""
        wanted = sorted(set(topics))
        if not wanted:
            return []
        missing = [t for t in wanted if t not in set(self._wire.call("listing the topics",
                                                                       lambda admin: admin.list_topics()))]
        if missing and self._broker_config("auto.create.topics.enable").lower() == "true":
            return []
        return missing

    # -- commit / rollback -------------------------------------------------------------------

    def commit(self, handle: BranchHandle) -> EndResult:
        """Commits a prepared branch; a branch already committed counts as done."""
        return self._end(handle, commit=True)

    def rollback(self, handle: BranchHandle) -> EndResult:
        """Rolls a prepared branch back; a branch already rolled back counts as done."""
        return self._end(handle, commit=False)

    def _end(self, handle: BranchHandle, commit: bool) -> EndResult:
        if handle.read_only:
            return EndResult(handle, EndOutcome.NOTHING_TO_END)
        verb = "commit" if commit else "rollback"
        what = (f"the {verb} of branch {handle.transactional_id} (producer id {handle.producer_id}, "
                f"epoch {handle.producer_epoch})")

        def end_txn(admin: Any) -> str:
            answer = self._wire.end_txn(handle.transactional_id, handle.producer_id, handle.producer_epoch, commit,
                                        admin=admin).error
            if answer in RETRIABLE_NAMES:  # markers still being written, the coordinator moving, too few replicas
                raise KafkaProtocolError(f"EndTxn answered {answer}", retriable=True)
            return answer

        error = self._wire.call(what, end_txn)
        if error == "NONE":
            return EndResult(handle, EndOutcome.COMMITTED if commit else EndOutcome.ROLLED_BACK)
        if error in _GONE:
            return self._explain_gone(handle, commit, error)
        raise KafkaProtocolError(f"{what} failed: {error}")

    def _describe(self, transactional_ids: Sequence[str], what: str) -> dict[str, Any]:
        """The broker's DescribeTransactions answer for the ids, retried through broker loss."""
        ids = list(transactional_ids)
        return self._wire.call(what, lambda admin: kafka_internals.describe_transactions(admin, ids))

    def _explain_gone(self, handle: BranchHandle, commit: bool, error: str) -> EndResult:
        """The handle no longer names the open transaction: find out how it ended.

        Raises:
            KafkaUnavailableError: the broker could not say within the budget; nothing is concluded
                (the decided epoch stays to be completed by the next start).
        """
        try:
            desc = self._describe([handle.transactional_id], f"how branch {handle.transactional_id} ended")[
                handle.transactional_id]
            state, pid, epoch = desc.state, desc.producer_id, desc.producer_epoch
        except KafkaProtocolError as exc:
            if exc.error != "TRANSACTIONAL_ID_NOT_FOUND":
                raise
            # The broker forgot the id (transactional.id.expiration.ms): its last transaction is unknown.
            state, pid, epoch = "unknown (no such transactional id)", -1, -1
        detail = (f"EndTxn answered {error}; broker now reports {state} for producer id {pid} "
                  f"epoch {epoch} (branch had producer id {handle.producer_id} epoch {handle.producer_epoch})")
        ended = self._ended_as(handle, state, pid, epoch)
        if commit:
            if ended == "committed":
                return EndResult(handle, EndOutcome.COMMITTED, detail)
            return EndResult(handle, EndOutcome.NOT_COMMITTED, detail)
        if ended == "committed":
            return EndResult(handle, EndOutcome.HEURISTIC_COMMIT, detail)
        # Aborted, expired or fenced: for a rollback every one of those means "not committed".
        return EndResult(handle, EndOutcome.ROLLED_BACK, detail)

    def _ended_as(self, handle: BranchHandle, state: str, pid: int, epoch: int) -> str:
        """How the broker's answer for the id (state, producer id, producer epoch) says *this* transaction ended.

        The one reading of a describe answer, used by every caller. PrepareCommit counts as committed:
        the coordinator has written the commit decision to its log and finishes the markers on its own,
        even across a coordinator move; PrepareAbort likewise counts as aborted.

        Returns:
            "open" (this transaction is still open), "committed", "aborted", or "unknown" when the
            broker's last word on the id is not this transaction's end (the id moved on).
        """
        if pid == handle.producer_id and epoch == handle.producer_epoch and state == "Ongoing":
            return "open"
        if pid == handle.producer_id and epoch == self._ended_epoch(handle):
            if state in ("CompleteCommit", "PrepareCommit"):
                return "committed"
            if state in ("CompleteAbort", "PrepareAbort", "PrepareEpochFence"):
                return "aborted"
        return "unknown"

    def how_ended(self, handle: BranchHandle) -> str:
        """How a branch that is no longer open ended, from the broker's describe (no side effect).

        Returns:
            "committed" or "aborted" when the broker's last word on the id is this very
            transaction's end (same producer id; epoch + 1 under transaction protocol 2);
            "open" when it is still open; "unknown" when the id has moved on to a newer one.
        """
        desc = self._describe([handle.transactional_id], f"how branch {handle.transactional_id} ended")[
            handle.transactional_id]
        return self._ended_as(handle, desc.state, desc.producer_id, desc.producer_epoch)

    def end_all(self, handles: Iterable[BranchHandle], commit: bool, parallelism: int = 8) -> list[EndResult]:
        """Ends many branches in parallel (phase 2), results in the order given."""
        from concurrent.futures import ThreadPoolExecutor

        handles = list(handles)
        if not handles:
            return []
        # One branch first, so a crash test can stop between two branch commits.
        first = [self._end(handles[0], commit)]
        faults.point("between_branch_commits" if commit else "between_branch_rollbacks")
        handles = handles[1:]
        if len(handles) <= 1:
            return first + [self._end(h, commit) for h in handles]

        # Threads share this resource's kafka-python client, which pipelines their requests.
        with ThreadPoolExecutor(max_workers=min(parallelism, len(handles))) as pool:
            return first + list(pool.map(lambda h: self._end(h, commit), handles))

    # -- recover -------------------------------------------------------------------------------

    def recover(self, transactional_id_prefix: str) -> list[OpenTransaction]:
        """Every open transaction whose transactional.id starts with the prefix, from the broker.

        Only ``Ongoing`` transactions are in doubt: one in PrepareCommit / PrepareAbort is
        already decided by its coordinator, which completes it on its own.

        Every broker the cluster lists must answer (each coordinates a share of the transaction
        log): while one is away but still listed, the listing is retried until the cluster moves
        its share to the others or it comes back, within ``kafka.default.api.timeout.ms``; a
        partial listing is never taken for the whole.
        """
        self._require_describe(transactional_id_prefix)
        ids = self._listed(transactional_id_prefix, ["Ongoing"])
        if not ids:
            return []
        # An id that ended between list and describe is left out.
        return _ongoing(self._describe(ids, f"the open transactions of '{transactional_id_prefix}*'"))

    def open_among(self, handles: Iterable[BranchHandle]) -> list[OpenTransaction]:
        """The handles' transactions the broker holds open, each asked of its own coordinator. Driver side.

        ListTransactions can miss an open transaction while its coordinator moves (a rolling
        restart: the old leader of its transaction-log partition has unloaded it and the new one has
        not begun loading), and says nothing of it; DescribeTransactions goes to the id's
        coordinator and is retried until that one answers. An id the broker does not know is not open.
        """
        out = []
        # One id per request: only the ids a listing missed come here (rarely), and a batch answer that
        # one id is unknown names no one.
        for tid in sorted({h.transactional_id for h in handles if not h.read_only}):
            try:
                out += _ongoing(self._describe([tid], f"whether branch {tid} is still open"))
            except KafkaProtocolError as exc:
                if exc.error != "TRANSACTIONAL_ID_NOT_FOUND":
                    raise
        return out

    def transactional_ids(self, transactional_id_prefix: str) -> list[str]:
        """Every transactional id the broker holds with the prefix, in any state. Driver side.

        The broker keeps an id (and its producer state) until ``transactional.id.expiration.ms``
        after its last transaction: what a link costs the brokers (tests and ``bench/epoch_cost.py`` count them).
        """
        return self._listed(transactional_id_prefix)

    def _listed(self, prefix: str, states: Sequence[str] = ()) -> list[str]:
        """The transactional ids with the prefix that every broker lists (in the given states)."""
        listed = self._wire.call(f"listing the transactions of '{prefix}*' on every broker",
                                 lambda admin: kafka_internals.list_transactions(admin, list(states)))
        return sorted({tid for tid, _ in listed if tid.startswith(prefix)})

    def _require_describe(self, prefix: str) -> None:
        """Fails unless the principal may describe the prefix's transactional ids.

        ListTransactions leaves out the ids a principal may not describe instead of refusing, so
        without this check a missing ACL would read as "nothing open" and recovery would decide
        on a partial view. Describing an id under the prefix is refused exactly then.
        """
        try:
            # A new cluster creates its transaction log on the first FindCoordinator: retried.
            self._describe([f"{prefix}access-check"], f"listing the open transactions of '{prefix}*'")
        except KafkaProtocolError as exc:
            if exc.error != "TRANSACTIONAL_ID_NOT_FOUND":
                raise

    def close(self) -> None:
        self._wire.close()

    def __enter__(self) -> KafkaXAResource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
