"""The adapters a link's committer runs on, wired where a query starts (the sinks, the ``lastagent`` command). Driver.

The committer (:class:`lastagent.core.committer.Committer`) builds no port of its own: here its store is the
link's Delta arbitration table unless the caller gives another (the ``lastagent-delta`` sink's target table),
its Kafka resource one built from the link's Kafka settings (none for a ``lastagent-delta`` link without
Kafka outputs), and its checkpoint reader Spark's checkpoint location.
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

from lastagent.core.arbitration import ArbitrationStore
from lastagent.core.committer import Committer
from lastagent.spark_checkpoint import SparkCheckpoint

_Staged = TypeVar("_Staged")


@overload
def link_committer(options: Any, store: None = None, kafka: bool | None = None) -> Committer[None]: ...


@overload
def link_committer(options: Any, store: ArbitrationStore[_Staged], kafka: bool | None = None) -> Committer[_Staged]: ...


def link_committer(options: Any, store: ArbitrationStore[Any] | None = None, kafka: bool | None = None) -> Committer[Any]:
    """The committer of a sink's link. Driver.

    Args:
        options: a :class:`~lastagent.sinks.kafka_sink_options.KafkaSinkOptions` or
            :class:`~lastagent.sinks.delta_sink_options.DeltaSinkOptions`.
        store: the arbitration store; defaults to the table ``options.arbitration_table`` names.
        kafka: whether the link has Kafka branches to end; defaults to the options' ``has_kafka`` (true for a
            ``lastagent-kafka`` link). The ``lastagent`` command always looks.
    """
    if store is None:
        from lastagent.delta.arbitration_table import DeltaArbitrationStore

        store = DeltaArbitrationStore(options.arbitration_table, options.storage)
    xa = None
    if kafka if kafka is not None else getattr(options, "has_kafka", True):
        from lastagent.kafka.xa import KafkaXAResource

        xa = KafkaXAResource(options.client_config)
    return Committer(options, store=store, xa=xa, checkpoint=SparkCheckpoint(options.checkpoint_location,
                                                                              options.storage))
