"""Named protocol points, where crash tests kill processes. Inert in the installed package.

The connector calls :func:`point` at ``after_prepare``, ``after_arbitration``,
``between_branch_commits``, ``after_phase2``, ``in_recovery``, ``before_files``,
``after_files``, ``before_dead_letter_table`` and ``task_mid_write`` (``lastagent.epoch``: the first four
and ``in_recovery``, on the driver). Nothing happens there unless
a hook was installed with :func:`install`; only the crash tests install one (tests/crashhook/), in
the processes they start. A point then costs one global lookup.
"""

from __future__ import annotations

from collections.abc import Callable

_hook: Callable[[str], None] | None = None


def install(hook: Callable[[str], None] | None) -> None:
    """Installs (or, with None, removes) the function called with each point's name. Tests only."""
    global _hook
    _hook = hook


def point(name: str) -> None:
    """Marks a protocol point; calls the installed hook, if any."""
    hook = _hook
    if hook is not None:
        hook(name)
