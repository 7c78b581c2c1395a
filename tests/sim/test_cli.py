"""The simulator's command line takes its defaults from the configs it drives, never copies."""

from __future__ import annotations

import pytest

from router.stats import ROUTING_STATS_PERIOD_S
from scheduler import SchedulerConfig
from sim.__main__ import command_line
from sim.fleet_config import SIM_NUM_GPU_BLOCKS, SimConfig


@pytest.mark.parametrize("command", ["run", "plan"])
def test_the_defaults_are_the_scheduler_and_simulator_configs(command):
    a = command_line().parse_args([command])
    sched = SchedulerConfig()
    assert (a.max_num_seqs, a.max_num_batched_tokens, a.block_size, a.policy) == (
        sched.max_num_seqs,
        sched.max_num_batched_tokens,
        sched.block_size,
        sched.policy,
    )
    assert a.blocks == SIM_NUM_GPU_BLOCKS  # measured by an engine: the simulator's own default
    assert a.stats_delay == SimConfig().stats_delay_s


def test_a_simulated_replica_reports_as_a_served_one():
    config = SimConfig()
    assert config.stats_period_s == ROUTING_STATS_PERIOD_S
    assert config.stats_delay_s == ROUTING_STATS_PERIOD_S / 2  # half a polling period, on average


def test_a_bad_block_size_is_refused_naming_it(capsys):
    from sim.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["run", "--requests", "1", "--block-size", "0"])
    assert exc.value.code == 2 and "block_size" in capsys.readouterr().err
