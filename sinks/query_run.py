"""One run of a link, as the sinks' writers see it: started before each epoch, claimed once per run.

Spark builds a sink's writer through ``streamWriter`` both to ship it to an epoch's tasks and
before each epoch's commit / abort, and nothing in that call tells the two apart. What does: pyspark
pickles the writer only to ship it to the tasks. Spark plans every micro-batch's write anew, so that
happens before each epoch's tasks, not only when the query starts (seen with pyspark 4.2).
:class:`StartsWhenShipped` runs the start (checks, finish decided branches: nothing an earlier run
still running could depend on) right then, and ships its result (:class:`Started`) inside the writer.

Which run a task belongs to is known on the executors only: Spark sets the run's id
(``StreamingQuery.runId``) as the job group of every batch, and tasks read it as a local property.
A run's first tasks claim the link's next generation for that run id (:func:`task_generation`), once
per run; every later epoch of the run finds it already holds the link and reads nothing. The
generation names the run's transactional ids (reused across its epochs) and its tasks' commit
messages carry it to the driver, which decides only for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lastagent.errors import LastAgentError, NotStartedError, QueryStartError

BATCH_ID_PROPERTY = "streaming.sql.batchId"  # set by Spark's MicroBatchExecution on every task
RUN_ID_PROPERTY = "spark.jobGroup.id"  # the run id: MicroBatchExecution's job group for every batch
#: How long a sink's abort keeps rolling back branches that the aborted epoch's tasks open late: a task
#: killed by ``query.stop()`` in the JVM can still run in its Python worker on the input it received (seen
#: up to 0.3 s after the abort began; Spark's ``spark.python.task.killTimeout`` is 2 s). ``stop()`` returns
#: this much later. See :meth:`lastagent.core.committer.Committer.abort`.
LATE_TASKS_S = 3.0


@dataclass(frozen=True)
class Started:
    """What the start learned, shipped to every task inside the pickled writer.

    Attributes:
        generation: the link's generation at start (0 before any claim).
        decided_through: the link's newest decided epoch at start (-1 for none); a re-run task
            of an epoch at or below it writes nothing.
        run: the run that held the link at start ("" for none): a task of that run uses
            ``generation``; a task of any other run claims the link first.
        owner: the checkpoint's query id, which a claim records.
    """

    generation: int
    decided_through: int
    run: str = ""
    owner: str = ""


def shipped(ownership: Any, decided_through: int, owner: str) -> Started:
    """What a start ships to the tasks, from the ownership it read (None before any claim). Driver."""
    if ownership is None:
        return Started(0, decided_through, "", owner)
    return Started(ownership.generation, decided_through, ownership.run, owner)


def task_epoch(ctx: Any) -> int:
    """The epoch (Spark's batch id) of the running task. Executor.

    Raises:
        LastAgentError: Spark did not set the batch id on the task; without it the task cannot
            tell a re-run of a decided epoch from a new one, so it writes nothing.
    """
    raw = ctx.getLocalProperty(BATCH_ID_PROPERTY)
    if raw is None or not str(raw).isdigit():
        raise LastAgentError(f"the task has no micro-batch id (Spark's local property {BATCH_ID_PROPERTY!r} is "
                             f"{raw!r}); lastagent sinks run only as Structured Streaming sinks in micro-batch mode")
    return int(raw)


def generation_of(messages: Sequence[Any], epoch: int) -> int | None:
    """The one generation the epoch's commit messages carry; None when there are none. Driver.

    Raises:
        LastAgentError: the messages disagree (tasks of two runs in one epoch): nothing is decided.
    """
    generations = {m.generation for m in messages}
    if len(generations) > 1:
        raise LastAgentError(f"epoch {epoch}: commit messages of generations {sorted(generations)} in one epoch; "
                             "nothing was decided")
    return next(iter(generations), None)


class StartsWhenShipped:
    """Mixin for a sink's writer: query start happens when pyspark pickles it for the tasks. Driver."""

    started: Started | None = None

    def start(self) -> Started:
        """Claims the link and recovers what earlier runs left; the sink defines it."""
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        if self.started is None:
            try:
                self.started = self.start()
            except Exception as exc:  # pyspark's pickler would hide it as "Could not serialize object"
                raise QueryStartError(exc) from exc
        return self.__dict__


def require_topics(committer: Any, by_option: dict[str, list[str]]) -> None:
    """Fails at query start when a topic an option names does not exist (and will not be created). Driver.

    Raises:
        OptionError: naming the option and the topic.
    """
    from lastagent.errors import OptionError

    for option, topics in by_option.items():
        missing = committer.xa.missing_topics(topics)
        if missing:
            raise OptionError(option, f"topic(s) {', '.join(missing)} do not exist on "
                                      f"{committer.options.client_config.get('bootstrap.servers')} "
                                      "(or the principal lacks Describe on them) and the broker does not create topics "
                                      "on first write; create them first, or grant Describe and Write")


def require_started(started: Started | None) -> Started:
    """The query start a task depends on. Executor.

    Raises:
        NotStartedError: the writer reached a task without having been pickled at query start
            (never the case under Spark's runner); without the claim and recovery nothing is safe to write.
    """
    if started is None:
        raise NotStartedError("this writer reached a task without the query-start claim and recovery of its link; "
                              "lastagent sinks must be started with writeStream...start()")
    return started


def task_run(ctx: Any) -> str:
    """The id of the run a task belongs to (Spark's ``StreamingQuery.runId``). Executor.

    Raises:
        LastAgentError: Spark did not set it; without it a task cannot tell whether its run holds
            the link, so it writes nothing.
    """
    run = ctx.getLocalProperty(RUN_ID_PROPERTY)
    if not run:
        raise LastAgentError(f"the task has no run id (Spark's local property {RUN_ID_PROPERTY!r}, the job group "
                             "Structured Streaming sets to the query's runId, is not set); lastagent sinks run only as "
                             "Structured Streaming sinks in micro-batch mode, and a task must not reset its job group")
    return str(run)


def task_generation(started: Started, run: str, claim: Callable[[str], Any]) -> int:
    """The generation a task writes under: its run's, claimed by the run's first tasks. Executor.

    The claim comes before the task opens any transaction, so a transactional id of this
    generation is never used by a run the claim did not already fence: every destructive act of
    a run (a new producer on an id, rolling back what earlier runs left) follows its claim.

    Args:
        started: what the epoch's start read.
        run: the task's run id (:func:`task_run`).
        claim: claims the link for a run id, returning its ownership (the store's ``claim``);
            a no-op read when the run holds the link already (another task of the run claimed it).

    Raises:
        StaleOwnerError: the run was superseded by a newer one.
        LinkOwnedError: another query owns the link.
    """
    if run == started.run:
        return started.generation
    return int(claim(run).generation)
