"""One run of a link, as the sinks' writers see it: started when shipped, named by its generation.

Spark builds a sink's writer through ``streamWriter`` both to ship it to an epoch's tasks and
before each epoch's commit / abort, and nothing in that call tells the two apart. What does: pyspark
pickles the writer only to ship it to the tasks. Spark plans every micro-batch's write anew, so that
happens before each epoch's tasks, not only when the query starts (seen with pyspark 4.2: one claim
per epoch, ``docs/benchmarks.md``): each epoch runs as a generation of its own. :class:`StartsWhenShipped`
runs the start (claim the link's next generation, recover) right then, and ships its result
(:class:`Started`) inside the writer; tasks refuse to write without it, and their commit messages
carry the generation the driver must decide for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lastagent.errors import LastAgentError

BATCH_ID_PROPERTY = "streaming.sql.batchId"  # set by Spark's MicroBatchExecution on every task


@dataclass(frozen=True)
class Started:
    """What query start learned, shipped to every task inside the pickled writer.

    Attributes:
        generation: the run's generation of the link (names its transactional ids).
        decided_through: the link's newest decided epoch at start (-1 for none); a re-run task
            of an epoch at or below it writes nothing.
    """

    generation: int
    decided_through: int


class NotStartedError(LastAgentError):
    """A task got a writer whose query start (claim and recovery) never ran: nothing is written."""


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
            self.started = self.start()
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
