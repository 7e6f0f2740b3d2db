"""How a describe answer reads for one branch: one classification, used by every caller. No I/O."""

from __future__ import annotations

import pytest

from lastagent.core.branch_handle import BranchHandle
from lastagent.kafka.xa import KafkaXAResource

pytestmark = pytest.mark.unit


def _resource(protocol_version: int) -> KafkaXAResource:
    xa = object.__new__(KafkaXAResource)  # no client: _ended_as reads only the protocol version
    xa._protocol = protocol_version
    return xa


@pytest.mark.parametrize("protocol_version, ended_epoch", [(2, 8), (1, 7)])
def test_prepare_commit_is_committed_everywhere(protocol_version, ended_epoch):
    """PrepareCommit: the coordinator logged the commit and finishes it on its own, so it is committed,
    for the decision check, the end of a branch and the hazard report alike."""
    xa = _resource(protocol_version)
    h = BranchHandle("lastagent-l-1-0-0", 41, 7, 10)
    assert xa._ended_as(h, "Ongoing", 41, 7) == "open"
    for state in ("PrepareCommit", "CompleteCommit"):
        assert xa._ended_as(h, state, 41, ended_epoch) == "committed"
    for state in ("PrepareAbort", "CompleteAbort"):
        assert xa._ended_as(h, state, 41, ended_epoch) == "aborted"
    # the id moved on (a newer producer, a later transaction): not this branch's end
    assert xa._ended_as(h, "CompleteCommit", 41, ended_epoch + 2) == "unknown"
    assert xa._ended_as(h, "CompleteCommit", 99, ended_epoch) == "unknown"
    if protocol_version == 2:
        assert xa._ended_as(h, "Ongoing", 41, 8) == "unknown"  # the next transaction of the id
