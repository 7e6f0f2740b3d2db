"""The two columns by which ``lastagent.reliable_groups`` marks the messages it refused, and how a sink
splits them off. Executor (tasks) and driver (schemas).

The step's output is its input's columns plus :data:`REFUSED_RULE` and :data:`REFUSED_REASON`, null
for a delivered message. ``lastagent-delta`` sends the refused rows to its dead letters with the rule
as the reason; ``lastagent-kafka`` has no dead-letter path and refuses such a query at start. This
module is all a sink needs of the step: it imports neither pyspark nor the step.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

#: The rule that refused a message (null: delivered), and why.
REFUSED_RULE = "_lastagent_refused_rule"
REFUSED_REASON = "_lastagent_refused_reason"


def split_refused(batch: pa.RecordBatch) -> tuple[pa.RecordBatch, list[tuple[dict[str, Any], str, str]]]:
    """A batch without the refusal columns, and its refused rows with their rule and reason.

    A batch without the columns comes back as it is. Executor side (the sinks' tasks).
    """
    import pyarrow.compute as pc

    names = batch.schema.names
    if REFUSED_RULE not in names:
        return batch, []
    rule = batch.column(names.index(REFUSED_RULE))
    keep = [i for i, n in enumerate(names) if n not in (REFUSED_RULE, REFUSED_REASON)]
    base = batch.select(keep)
    refused_mask = pc.is_valid(rule)
    if not pc.any(refused_mask).as_py():
        return base, []
    reasons = (batch.column(names.index(REFUSED_REASON)).to_pylist() if REFUSED_REASON in names
               else [None] * batch.num_rows)
    refused = [(row, r, reasons[i] or r) for i, (row, r) in
               enumerate(zip(base.to_pylist(), rule.to_pylist())) if r is not None]
    return base.filter(pc.invert(refused_mask)), refused


def strip_refusal_columns(schema_json: str) -> str:
    """A Spark schema's JSON without the refusal columns (the sink's table never has them). Driver."""
    schema = json.loads(schema_json)
    schema["fields"] = [f for f in schema["fields"] if f["name"] not in (REFUSED_RULE, REFUSED_REASON)]
    return json.dumps(schema)
