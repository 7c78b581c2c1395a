"""A scheduler's policies, built once from its config: the waiting queue's order, the preemption
victim rule, the admission rule, and the output-length model they share."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.admission import ForesightAdmission, make_admission
from scheduler.config import SchedulerConfig
from scheduler.length_live import make_live_predictor
from scheduler.length_prediction import LengthPredictor, RemainingLength
from scheduler.preemption import VictimPolicy
from scheduler.queues import FairQueue, SRPTQueue, WaitingQueue, make_waiting_queue


@dataclass(slots=True)
class Policies:
    waiting: WaitingQueue
    victims: VictimPolicy
    admission: ForesightAdmission | None  # None: greedy
    # The length model predicted_load reads when neither the queue nor the admission has one.
    own_length_model: RemainingLength | None


def make_policies(config: SchedulerConfig, num_blocks: int, max_model_len: int) -> Policies:
    # A served replica's predictor (the hidden-state probe, persistence) when asked for one.
    live = make_live_predictor(config)
    waiting = make_waiting_queue(config.policy, config.srpt_aging_factor, live)
    victims = VictimPolicy(
        config.preemption_victim,
        by_priority=config.policy == "priority",
        remaining=waiting.predicted_remaining,
    )
    admission = make_admission(
        config.admission,
        waiting,
        num_blocks,
        config.block_size,
        max_model_len,
        config.foresight_estimate,
        live,
    )
    own = None
    if length_model_of(waiting, admission, None) is None:
        own = live if live is not None else LengthPredictor()
    return Policies(waiting, victims, admission, own)


def length_model_of(
    queue: WaitingQueue, admission: ForesightAdmission | None, own: RemainingLength | None
) -> RemainingLength | None:
    """The output-length predictor in use: the queue's (srpt, fair_srpt), the admission's
    (foresight), else the scheduler's own."""
    if isinstance(queue, (SRPTQueue, FairQueue)) and queue.predictor is not None:
        return queue.predictor
    if admission is not None:
        return admission.predictor
    return own
