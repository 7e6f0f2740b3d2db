"""The transformer hook and conversion to the table's schema, record by record on failure. Executor side.

A transformer is a Python callable named ``module:function`` (option ``transformer``) that
takes a ``pyarrow.RecordBatch`` and returns a ``RecordBatch`` or ``Table``. It runs on whole
batches; when it raises, it runs again on each record alone so that only the failing records go
to the dead letters (after the JMS bridge's message transformer and dead-message queue). The
same split applies when a batch cannot be cast to the table's schema.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from lastagent.errors import OptionError

Transform = Callable[[pa.RecordBatch], Any]


@dataclass(frozen=True)
class Failure:
    """One record that failed: its input row (a one-row batch) and why."""

    row: pa.RecordBatch
    reason: str
    error: BaseException


#: What Arrow raises when a value does not fit the table's type.
_CAST_ERRORS = (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError)


class ConversionFailed(ValueError):
    """A record's column does not fit the table's type.

    The message (kept with the dead letter) has Arrow's reason, which may quote the value;
    ``summary`` names only the column and the types, for logs and errors.
    """

    def __init__(self, column: str, source: pa.DataType, target: pa.DataType, cause: BaseException) -> None:
        self.summary = f"column '{column}' ({source}) does not convert to the table's {target}"
        super().__init__(f"{self.summary}: {type(cause).__name__}: {cause}")


def load(spec: str) -> Transform:
    """Imports ``module:function``.

    Raises:
        OptionError: naming option ``transformer`` when the module or function is missing.
    """
    module_name, _, func_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise OptionError("transformer", f"cannot import module {module_name!r} ({exc}); it must be importable "
                                         "on the driver and on every executor (with Spark Connect: installed into "
                                         "the Connect server's Python and its executors'; a module added with "
                                         "spark.addArtifacts does not reach a data source's tasks)") from exc
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise OptionError("transformer", f"{module_name!r} has no callable {func_name!r}")
    return fn


def _batches(out: Any) -> list[pa.RecordBatch]:
    if isinstance(out, pa.RecordBatch):
        return [out]
    if isinstance(out, pa.Table):
        return out.combine_chunks().to_batches()
    raise TypeError(f"the transformer returned {type(out).__name__}; return a pyarrow RecordBatch or Table")


def _per_record(batch: pa.RecordBatch, step: Callable[[pa.RecordBatch], list[pa.RecordBatch]],
                reason: str) -> tuple[list[pa.RecordBatch], list[Failure]]:
    ok: list[pa.RecordBatch] = []
    failed: list[Failure] = []
    for i in range(batch.num_rows):
        row = batch.slice(i, 1)
        try:
            ok.extend(step(row))
        except Exception as exc:  # the record goes to the dead letters with this error
            failed.append(Failure(row, reason, exc))
    return ok, failed


def apply(fn: Transform, batch: pa.RecordBatch) -> tuple[list[pa.RecordBatch], list[Failure]]:
    """Runs the transformer on a batch; on failure, record by record.

    Returns:
        (output batches, failed input records with reason ``transformer-failed``).
    """
    try:
        return _batches(fn(batch)), []
    except Exception:  # find out which records fail, one at a time
        return _per_record(batch, lambda row: _batches(fn(row)), "transformer-failed")


def conform(batch: pa.RecordBatch, target: pa.Schema, merge: bool) -> tuple[list[pa.RecordBatch], list[Failure]]:
    """Casts a batch to the table's schema (missing columns become nulls); on failure, record by record.

    With ``merge``, columns the table lacks are kept (the committer adds them to the table);
    without it, such a column is a schema error raised by the committer before any commit, so
    it is kept here too and reported by the batch's schema.

    Returns:
        (conforming batches, failed records with reason ``conversion-failed``).
    """
    def cast(b: pa.RecordBatch) -> list[pa.RecordBatch]:
        arrays, fields = [], []
        names = set(b.schema.names)
        for f in target:
            if f.name in names:
                column = b.column(f.name)
                try:
                    arrays.append(column.cast(f.type))
                except _CAST_ERRORS as exc:
                    raise ConversionFailed(f.name, column.type, f.type, exc) from exc
            else:
                arrays.append(pa.nulls(b.num_rows, f.type))
            fields.append(pa.field(f.name, f.type, True))
        known = set(target.names)
        for f, col in zip(b.schema, b.columns):
            if f.name not in known:
                arrays.append(col)
                fields.append(f)
        return [pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields))]

    if batch.schema.equals(target, check_metadata=False):
        return [batch], []
    try:
        return cast(batch), []
    except (*_CAST_ERRORS, ConversionFailed):
        return _per_record(batch, cast, "conversion-failed")
