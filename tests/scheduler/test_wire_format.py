"""The TP wire format: a step and rank 0's answer survive encode/decode field for field."""

from scheduler.outputs import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from scheduler.sampling_params import SamplingParams


def test_a_step_round_trips_with_every_field():
    step = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData("a", [1, 2, 3], SamplingParams(max_tokens=5, seed=7), [4, 5], 0, [9])
        ],
        scheduled_cached_reqs=CachedRequestData(
            ["b", "c"], [False, True], [[11], []], [[], [6, 7]], [40, 0]
        ),
        num_scheduled_tokens={"a": 3, "b": 1, "c": 12},
        total_num_scheduled_tokens=16,
        preempted_req_ids={"d"},
        finished_req_ids={"e", "f"},
        blocks_to_swap_out=[(1, 2)],
        blocks_to_swap_in=[(3, 4)],
        scheduled_spec_tokens={"b": [8, 9]},
        truncated_block_tables={"g": 3},
    )
    assert SchedulerOutput.decode(step.encode()) == step
    assert (
        SchedulerOutput.decode(bytearray(step.encode())) == step
    )  # as the step channel hands it over


def test_an_empty_step_and_a_runner_output_round_trip():
    empty = SchedulerOutput([], CachedRequestData(), {}, 0)
    assert SchedulerOutput.decode(empty.encode()) == empty
    out = ModelRunnerOutput(
        ["a", "b"],
        [[5], []],
        [[[(5, -0.25), (6, -1.5)]], None],
        {"c": "bad logit_bias"},
        [[7, 8], []],
    )
    assert ModelRunnerOutput.decode(out.encode()) == out
