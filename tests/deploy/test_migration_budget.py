"""How often a choice moves to another replica: up to max_migrations, but never to a third engine
after two engines failed with it in flight (it may be what fails them)."""

import pytest
from ray.exceptions import RayActorError

from cluster.errors import EngineFailedError, ReplicaDrainingError
from deploy.errors import RepeatedReplicaFailureError, ReplicaUnavailableError
from deploy.generation import MAX_REPLICA_FAULTS, MigrationBudget, ReplicaAbortedError


def test_a_request_present_in_two_engine_failures_is_not_resumed_a_third_time():
    budget = MigrationBudget("r", max_migrations=10)
    budget.spend(EngineFailedError("first replica's engine died"))
    with pytest.raises(RepeatedReplicaFailureError) as raised:
        budget.spend(EngineFailedError("second replica's engine died"))
    assert MAX_REPLICA_FAULTS == 2 and budget.faults == 2
    assert raised.value.status == 500 and raised.value.code == "replica_failures"


def test_hand_backs_and_vanished_replicas_are_not_engine_failures_and_spend_only_migrations():
    # A replica process that is gone may have been stopped by Serve (a scale-down past
    # graceful_shutdown_timeout_s kills both old replicas): that is no sign against the request.
    budget = MigrationBudget("r", max_migrations=3)
    for handed_back in (ReplicaAbortedError(), RayActorError(), ReplicaDrainingError()):
        budget.spend(handed_back)
    assert (budget.migrations, budget.faults) == (3, 0)
    with pytest.raises(ReplicaUnavailableError):
        budget.spend(ReplicaDrainingError())


def test_one_fault_among_hand_backs_still_migrates():
    budget = MigrationBudget("r", max_migrations=3)
    budget.spend(ReplicaAbortedError())
    budget.spend(EngineFailedError("died"))
    assert (budget.migrations, budget.faults) == (2, 1)
