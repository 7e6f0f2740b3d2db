"""The claim rule (one claim per run, zombies refused) and the task's run and generation. Pure."""

from __future__ import annotations

import pytest

from lastagent.core.arbitration import RETIRED_RUNS, InMemoryArbitrationStore, Ownership, next_ownership
from lastagent.errors import LastAgentError, LinkOwnedError, StaleOwnerError
from lastagent.sinks.query_run import Started, task_generation, task_run

pytestmark = pytest.mark.unit


def test_a_run_claims_once_and_a_superseded_run_never_again():
    first = next_ownership("l", "t", None, "q", "run-a")
    assert first == Ownership("q", 1, "run-a", ())
    assert next_ownership("l", "t", first, "q", "run-a") is None  # the run holds it: nothing to write
    second = next_ownership("l", "t", first, "q", "run-b")
    assert second == Ownership("q", 2, "run-b", ("run-a",))
    with pytest.raises(StaleOwnerError, match="run run-a was superseded"):
        next_ownership("l", "t", second, "q", "run-a")  # the zombie run cannot claim the link back
    with pytest.raises(LinkOwnedError, match="owned by query q"):
        next_ownership("l", "t", second, "other-query", "run-c")


def test_the_admin_takeover_retires_the_running_run_and_keeps_the_owner():
    running = Ownership("q", 4, "run-a", ("run-0",))
    fenced = next_ownership("l", "t", running, "", takeover=True)
    assert fenced == Ownership("q", 5, "", ("run-0", "run-a"))
    with pytest.raises(StaleOwnerError):
        next_ownership("l", "t", fenced, "q", "run-a")
    assert next_ownership("l", "t", fenced, "q", "run-new") == Ownership("q", 6, "run-new", ("run-0", "run-a"))


def test_retired_runs_are_bounded():
    ownership = None
    for i in range(RETIRED_RUNS + 5):
        ownership = next_ownership("l", "t", ownership, "q", f"run-{i}")
    assert ownership is not None and len(ownership.retired) == RETIRED_RUNS
    assert ownership.retired[-1] == f"run-{RETIRED_RUNS + 3}"


class _Ctx:
    def __init__(self, **props: str) -> None:
        self.props = props

    def getLocalProperty(self, key: str) -> str | None:  # Spark's TaskContext API
        return self.props.get(key)


def test_a_task_claims_only_when_its_run_did_not_hold_the_link_at_start():
    store = InMemoryArbitrationStore()
    claims: list[str] = []

    def claim(run: str) -> Ownership:
        claims.append(run)
        return store.claim("l", "q", run=run)

    started = Started(0, -1, "", "q")
    assert task_generation(started, "run-a", claim) == 1  # the run's first task claims
    assert task_generation(started, "run-a", claim) == 1  # its sibling finds the claim
    later = Started(1, 3, "run-a", "q")  # a later epoch's start read the run's claim
    assert task_generation(later, "run-a", claim) == 1
    assert claims == ["run-a", "run-a"]
    assert task_generation(later, "run-b", claim) == 2  # a restart
    after_restart = Started(2, 4, "run-b", "q")
    with pytest.raises(StaleOwnerError):
        task_generation(after_restart, "run-a", claim)  # the zombie's next epoch


def test_a_task_without_a_run_id_writes_nothing():
    assert task_run(_Ctx(**{"spark.jobGroup.id": "8c0f"})) == "8c0f"
    with pytest.raises(LastAgentError, match="spark.jobGroup.id"):
        task_run(_Ctx())


def test_a_store_of_records_only_refuses_data_beside_a_decision():
    """Staged Delta files reach a store through decide(); one that holds no data refuses them, deciding nothing."""
    from lastagent.core.arbitration import ArbitrationRecord
    from lastagent.errors import ArbitrationError

    store = InMemoryArbitrationStore()
    generation = store.claim("l", "q").generation
    record = ArbitrationRecord("l", 0, "l:0", ())
    with pytest.raises(ArbitrationError, match="holds records only"):
        store.decide(record, generation, staged=object())
    assert store.get("l", 0) is None
    assert store.decide(record, generation).won
