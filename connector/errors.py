"""Every exception lastagent raises on purpose, in one hierarchy under :class:`LastAgentError`.

Every message stands alone and names what to change. This module imports nothing of lastagent, so any module
raises from it; the ones users catch most are exported from :mod:`lastagent` too.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Protocol


class Refusal(Protocol):
    """A record the broker refused, as :class:`TransactionFailed` carries it (no contents):
    :class:`lastagent.kafka.branch.RefusedRecord`."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int | None: ...
    @property
    def index(self) -> int | None: ...
    @property
    def key(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def error(self) -> str: ...
    @property
    def text(self) -> str: ...

    def position(self) -> str:
        """Where the record is: its index in the branch, topic and partition."""
        ...

    def describe(self) -> str:
        """Its position, the broker's reason and what to change."""
        ...


class LastAgentError(Exception):
    """Base of every error lastagent raises on purpose."""


class OptionError(LastAgentError, ValueError):
    """A reader or writer option is missing, unknown, or has a bad value.

    The message names the option and the values that would be right.
    """

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"option '{option}': {message}")
        self.option = option


class KafkaProtocolError(LastAgentError):
    """A Kafka request failed or the broker could not be reached.

    Attributes:
        retriable: True when the same request may succeed later (coordinator moving, broker
            starting); False when retrying cannot help.
        error: Kafka's name for the failure (``TRANSACTIONAL_ID_NOT_FOUND``), when the broker gave one.
    """

    def __init__(self, message: str, retriable: bool = False, error: str = "") -> None:
        super().__init__(message)
        self.retriable = retriable
        self.error = error


class DataLossError(LastAgentError):
    """Records the query should read are gone (retention, deleted partition).

    Raised only when ``failOnDataLoss`` is true; the message names topic, partition and offsets.
    """


class UnsupportedSparkError(LastAgentError):
    """The pyspark in this Python is one lastagent does not run on (older than 4.0) or was never tested on.

    The message names the version found and the versions lastagent runs on.
    """


class KafkaUnavailableError(KafkaProtocolError):
    """Kafka could not be asked within the budget: brokers away, leaders or the coordinator moving.

    The message starts with the broker's condition (the last error seen), then what was asked and
    how long it was tried. Nothing was decided on the strength of the missing answer.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, retriable=True)


class TokenError(KafkaProtocolError):
    """No OAUTHBEARER token could be had: the endpoint refused the client, failed, or the provider raised."""


class BranchError(LastAgentError):
    """Writing or preparing a branch failed on the executor; the task fails and Spark retries it."""


class RecordTooLarge(BranchError):
    """The client refused a record at once: larger than the producer's ``message.max.bytes``.

    Nothing was added to the branch, which stays usable (a caller may route the record elsewhere).
    """


class TransactionFailed(BranchError):
    """The broker refused a record of the branch (or the transaction failed otherwise).

    Kafka then fails the whole transaction: every record of it is dropped and nothing more can be
    added. The branch has been aborted (unless the message says the abort failed), so it holds no
    partition's last stable offset. Nothing of the records' contents is in the message.

    Attributes:
        refused: the first refused records (for a size refusal, the largest first).
        failed: how many records failed in all.
        dropped: how many more records were dropped with the failed transaction.
        aborted: whether the branch was aborted before this was raised.
    """

    def __init__(self, message: str, refused: Sequence[Refusal] = (), failed: int = 0, dropped: int = 0,
                 aborted: bool = False) -> None:
        super().__init__(message)
        self.refused = tuple(refused)
        self.failed = failed
        self.dropped = dropped
        self.aborted = aborted


class ArbitrationError(LastAgentError):
    """The arbitration table cannot be read or written; nothing was decided by this call."""


class LinkMismatchError(ArbitrationError):
    """The arbitration table belongs to another link (the `link` option was renamed)."""


class LinkOwnedError(ArbitrationError):
    """Another query (another checkpoint) owns the link; this one was refused and changed nothing."""


class StaleOwnerError(ArbitrationError):
    """A newer run of the link started (its generation moved on); this run may decide nothing more."""


class DecidedBranchLostError(LastAgentError):
    """A branch of a decided epoch can no longer be committed (expired or fenced).

    The epoch's Delta/arbitration record says it committed, so its Kafka records are missing:
    the query stops and names link, epoch and branch; nothing is silently dropped.
    """


class EpochNotDecidedError(LastAgentError):
    """An epoch was not decided: one of its branches was gone or too close to its timeout.

    Nothing of the epoch was committed and its branches were rolled back; Spark replays the epoch
    from the same offsets when the query restarts. The message names the branch, the epoch's
    duration and ``kafka.transaction.timeout.ms``.
    """


class BlockWriteError(LastAgentError):
    """A ``lastagent.epoch`` body's Delta writes were not the block's one decision: a data change to the table the
    block's settings did not reach (another session), or a second Delta write in the block."""


class DeadLetterError(LastAgentError):
    """A record could be neither delivered nor dead-lettered; the batch fails, nothing is dropped."""


class SchemaError(OptionError):
    """The query's output columns do not fit the Kafka sink; names the column and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__("schema", message)


class UnsupportedTableFeatureError(LastAgentError):
    """The table uses a Delta feature lastagent cannot write as Spark would; nothing was claimed or written.

    Attributes:
        feature: the feature's protocol name (or the property / column metadata that implies it).
        table: the table's path.
    """

    def __init__(self, feature: str, table: str, role: str, why: str) -> None:
        super().__init__(f"Delta table {table} ({role}) uses the table feature '{feature}', which lastagent-delta "
                         f"does not write: {why}. Nothing was claimed or written. Write to a table without it "
                         "(see docs/delta.md for the features lastagent writes)")
        self.feature = feature
        self.table = table


class NotStartedError(LastAgentError):
    """A task got a writer whose query start (claim and recovery) never ran: nothing is written."""


class QueryStartError(LastAgentError, pickle.PicklingError):
    """A sink's query start (checks, claim, recovery) failed; the message is the cause's type and message.

    The start runs while pyspark pickles the writer for the tasks, and pyspark's pickler turns every error
    but a ``pickle.PickleError`` into ``PicklingError: Could not serialize object``. So the start's failure
    travels as this class, which is both, and the user reads what failed; the cause is chained.
    """

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"the query could not start: {type(cause).__name__}: {cause}")
        self.cause = cause


class SchemaMismatchError(LastAgentError):
    """The query's rows do not fit the table's schema; nothing was committed."""


class TableChangedError(SchemaMismatchError):
    """The table's features, constraints or generated columns changed while the epoch ran; nothing was committed."""


class IdentityExhaustedError(LastAgentError):
    """An identity column's next values would pass the range of BIGINT (or a task's partition is past the slots the
    values interleave); the task wrote nothing that is committed."""


class UnsupportedExpressionError(LastAgentError):
    """A CHECK constraint or generation expression this module cannot evaluate exactly as Spark does.

    The message names the rule (``what``), its SQL and the construct that is not supported.

    Attributes:
        what: the rule, e.g. ``CHECK constraint 'positive'``.
        construct: what in the expression is not supported.
    """

    def __init__(self, what: str, sql: str, construct: str) -> None:
        super().__init__(f"{what} ({sql}) cannot be evaluated by lastagent exactly as Spark's Delta writer does: "
                         f"{construct}. Rewrite it with the supported constructs (see lastagent.delta.expressions) "
                         "or write to this table with Spark's Delta writer")
        self.what = what
        self.construct = construct
