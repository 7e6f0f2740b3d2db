"""Installs the crash hook (or the pause hook) in every Python process of a test's driver and Spark's workers.

Only the crash tests put this directory on ``PYTHONPATH`` (``support.run_driver``); Python imports
``sitecustomize`` at start-up, so the hook is in place before the connector runs. Nothing here is
part of the installed package: there, :func:`lastagent.faults.point` does nothing.
"""

import os

if os.environ.get("LASTAGENT_CRASH_AT"):
    # The first process is the driver, leading a session of its own (support.run_driver): its
    # group is the one to kill; the JVM and Spark's workers inherit the variable.
    os.environ.setdefault("LASTAGENT_CRASH_PGID", str(os.getpgid(0)))
    import crash_points

    from lastagent import faults

    faults.install(crash_points.kill_at)
elif os.environ.get("LASTAGENT_PAUSE_AT"):
    import crash_points

    from lastagent import faults

    faults.install(crash_points.pause_at)
