"""An epoch's figures on the sinks' side: counts for the record, and timings kept until the next epoch. Driver.

How long an epoch's decision and phase 2 took is known only after its record was written, so it
goes into the next epoch's record (:attr:`~lastagent.core.figures.EpochFigures.previous`). pyspark
runs each epoch's commit in a fresh writer (often a fresh Python process), so in between the
timings live in the query's checkpoint: ``<checkpointLocation>/lastagent/<link>.timings.json``,
one small file, overwritten after each decided epoch.

Figures are for operators: a checkpoint that cannot be read or written costs the figures, never
the epoch (a warning is logged), and nothing of the protocol reads them.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from lastagent.core.figures import EpochTimings
from lastagent.errors import LastAgentError
from lastagent.storage import StorageConfig

log = logging.getLogger("lastagent.figures")


def _where(checkpoint_location: str, link: str, storage: StorageConfig | None) -> tuple[Any, str]:
    from lastagent.spark_checkpoint import filesystem

    fs_, base = filesystem(checkpoint_location, storage=storage)
    return fs_, f"{base.rstrip('/')}/lastagent/{link}.timings.json"


def previous_timings(checkpoint_location: str, link: str, epoch: int,
                     storage: StorageConfig | None = None) -> EpochTimings | None:
    """The timings of epoch ``epoch - 1`` kept in the checkpoint, or None (none kept, or of another epoch).

    Driver, before the epoch's decision.
    """
    try:
        fs_, path = _where(checkpoint_location, link, storage)
        with fs_.open_input_stream(path) as f:
            kept = EpochTimings.from_dict(json.loads(f.read()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, LastAgentError) as exc:
        log.warning("link %s: cannot read the previous epoch's timings from the checkpoint (%s); epoch %d's "
                    "record goes without them", link, exc, epoch)
        return None
    return kept if kept.epoch == epoch - 1 else None


def keep_timings(checkpoint_location: str, link: str, timings: EpochTimings | None,
                 storage: StorageConfig | None = None) -> None:
    """Keeps ``timings`` in the checkpoint for the next epoch's record. Driver, after phase 2."""
    if timings is None:
        return
    try:
        fs_, path = _where(checkpoint_location, link, storage)
        fs_.create_dir(path.rsplit("/", 1)[0], recursive=True)
        # Written aside and moved: a torn file must not read as another epoch's timings.
        with fs_.open_output_stream(f"{path}.tmp") as f:
            f.write(json.dumps(timings.to_dict()).encode())
        fs_.move(f"{path}.tmp", path)
    except (OSError, LastAgentError) as exc:
        log.warning("link %s: cannot keep epoch %d's timings in the checkpoint (%s); the next record goes without "
                    "them", link, timings.epoch, exc)
