"""Which Spark versions lastagent runs on, and what differs between them. Pure but for
:func:`require_supported`, which reads ``pyspark.__version__``; imports no pyspark module of its own, so that
``lastagent --version`` and :func:`lastagent.register` can name a pyspark too old to import the formats.
"""

from __future__ import annotations

import logging
import os
import re

from lastagent.errors import UnsupportedSparkError

log = logging.getLogger("lastagent")

#: The Spark minors every release is tested on (tests/spark_versions), oldest first.
TESTED_MINORS = ((4, 0), (4, 1), (4, 2), (4, 3))
#: Set to 1 to run on a pyspark newer than the newest minor tested (at the user's risk; logged).
ALLOW_UNTESTED = "LASTAGENT_ALLOW_UNTESTED_SPARK"


# -- versions, pure -------------------------------------------------------------------------------


def parse_version(text: str) -> tuple[int, int] | None:
    """(major, minor) of a pyspark version string (``4.0.5``, ``4.1.0.dev1``, ``4.2.0+db``), or None."""
    m = re.match(r"\s*(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def refusal(version: str, allow_untested: bool = False) -> str | None:
    """Why lastagent refuses this pyspark version, or None when it runs there.

    Args:
        version: ``pyspark.__version__``.
        allow_untested: the user set :data:`ALLOW_UNTESTED`: a newer 4.x or later minor is let through.
    """
    parsed = parse_version(version)
    tested = ", ".join(f"{a}.{b}" for a, b in TESTED_MINORS)
    if parsed is None:
        return f"pyspark {version!r} is not a version lastagent can read; it runs on Spark {tested}"
    if parsed < TESTED_MINORS[0]:
        return (f"pyspark {version} has no Python Data Source API for streaming (Spark 4.0 added it); lastagent "
                f"runs on Spark {tested}")
    if parsed in TESTED_MINORS or (allow_untested and parsed > TESTED_MINORS[-1]):
        return None
    return (f"pyspark {version} is newer than every Spark lastagent was tested on ({tested}); upgrade lastagent, "
            f"or set {ALLOW_UNTESTED}=1 in the driver's and the executors' environment to run untested")


def differences(version: str) -> str:
    """What a user sees differ on this pyspark minor from the newest, in a few words (for ``--version``)."""
    parsed = parse_version(version) or (0, 0)
    notes = []
    if parsed < (4, 2):
        notes.append("no admission control for Python sources: the source caps each batch itself, and "
                     "Trigger.AvailableNow runs one batch (capped by maxOffsetsPerTrigger when set)")
    if parsed < (4, 1):
        notes.append("no Arrow stream writer: the sinks turn Spark's rows back into Arrow")
    return "; ".join(notes) if notes else "every API the formats use"


def untested_allowed() -> bool:
    """True when the user set :data:`ALLOW_UNTESTED` to 1 in this process's environment."""
    return os.environ.get(ALLOW_UNTESTED, "").strip() == "1"


def require_supported() -> None:
    """Refuses this Python's pyspark by name when lastagent does not run on it. Driver and executor.

    Raises:
        UnsupportedSparkError: older than 4.0, or newer than the newest tested minor without
            :data:`ALLOW_UNTESTED`.
    """
    import pyspark

    version = str(pyspark.__version__)
    why = refusal(version, untested_allowed())
    if why is not None:
        raise UnsupportedSparkError(why)
    if refusal(version) is not None:
        log.warning("running on pyspark %s, which lastagent was never tested on (%s=1 is set)", version, ALLOW_UNTESTED)
