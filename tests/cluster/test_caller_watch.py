"""CallerWatch tells a dead caller actor from a live one, and never takes a live one for dead."""

import asyncio
import time

import ray

from cluster.caller_watch import CallerWatch

NAMESPACE = "caller-watch-test"


@ray.remote(num_cpus=0)
class Caller:
    def ping(self) -> bool:
        return True


def test_a_live_caller_is_kept_and_a_killed_or_unknown_one_is_gone(ray_cluster):
    alive = Caller.options(name="alive", namespace=NAMESPACE).remote()
    doomed = Caller.options(name="doomed", namespace=NAMESPACE).remote()
    ray.get([alive.ping.remote(), doomed.ping.remote()])
    watch = CallerWatch(NAMESPACE, probe_timeout_s=10)

    assert asyncio.run(watch.gone({"alive", "doomed"})) == set()
    ray.kill(doomed, no_restart=True)
    for _ in range(50):  # the GCS learns of the death asynchronously
        gone = asyncio.run(watch.gone({"alive", "doomed", "never-existed"}))
        if "doomed" in gone:
            break
        time.sleep(0.1)
    assert gone == {"doomed", "never-existed"}
    ray.kill(alive, no_restart=True)


def test_a_caller_too_slow_to_answer_is_not_taken_for_dead(ray_cluster):
    slow = Caller.options(name="slow", namespace=NAMESPACE).remote()
    ray.get(slow.ping.remote())
    watch = CallerWatch(NAMESPACE, probe_timeout_s=1e-6)  # no probe can answer in time
    assert asyncio.run(watch.gone({"slow"})) == set()
    ray.kill(slow, no_restart=True)
