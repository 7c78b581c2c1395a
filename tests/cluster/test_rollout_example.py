"""The rollout loop of docs/rl.md, end to end on CPU: a Ray trainer actor (transformers' Llama, a
few REINFORCE steps on a toy reward) and a raylm engine actor share a gloo weight group; each
iteration the engine generates, the trainer takes an optimizer step on those rollouts and
broadcasts its weights, and the engine's prompt logprobs for a fixed prompt then equal the
trainer's own forward pass (fp32: to 1e-4)."""

from __future__ import annotations

import math

import pytest
import ray
import torch

from tests.random_checkpoint import TINY_FAMILIES, write_random_checkpoint
from workers.distributed import free_port

PROBE = [5, 17, 99, 240, 7, 1000, 33, 42, 8, 61]  # the fixed prompt whose logprobs are compared
PROMPTS = [[11, 12, 13, 14], [200, 201, 202], [31, 41, 59, 26, 53]]


@ray.remote(num_cpus=0)
class Trainer:
    """The policy being trained, and rank 0 (the source) of the weight group."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)

    def join(self, init_method: str, world_size: int) -> None:
        from workers.weight_transfer import WeightGroupSpec, open_group

        spec = WeightGroupSpec(init_method, world_size, rank=0, timeout_s=120)
        self.group = open_group(spec, torch.device("cpu"))

    def step(self, rollouts: list[tuple[list[int], list[int]]]) -> float:
        """One REINFORCE step: each rollout's sampled tokens, weighted by its reward minus the
        batch mean; returns the mean reward."""
        # The toy reward: the share of even token ids a rollout sampled.
        rewards = torch.tensor([sum(t % 2 == 0 for t in out) / len(out) for _, out in rollouts])
        advantages = rewards - rewards.mean()
        loss = torch.zeros(())
        for (prompt, out), advantage in zip(rollouts, advantages):
            loss = loss - advantage * self._logprobs(prompt, out).sum()
        self.optimizer.zero_grad()
        (loss / len(rollouts)).backward()
        self.optimizer.step()
        return float(rewards.mean())

    def push(self) -> None:
        from workers.weight_transfer import send_weights

        with torch.no_grad():
            send_weights(self.group, self.model.named_parameters())

    def _logprobs(self, prompt: list[int], out: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + out])
        logits = self.model(ids).logits[0, :-1]
        chosen = ids[0, 1:].unsqueeze(1)
        return torch.log_softmax(logits.float(), dim=-1).gather(1, chosen)[len(prompt) - 1 :, 0]

    def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        with torch.no_grad():
            return self._logprobs(prompt[:1], prompt[1:]).tolist()


@ray.remote(num_cpus=0)
class Engine:
    """A raylm engine (TP=1, in the actor's process) serving rollouts."""

    def __init__(self, model_dir: str) -> None:
        from engine.llm import LLM

        self.llm = LLM(model_dir, device="cpu", load_progress=False, kv_cache_memory_gb=0.05)

    def join(self, init_method: str, world_size: int) -> None:
        self.llm.init_weight_group(init_method, world_size, rank=1, timeout_s=120)

    def generate(self, prompts: list[list[int]], seed: int) -> list[tuple[list[int], list[int]]]:
        from scheduler.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [(p, o.token_ids) for p, o in zip(prompts, outs)]

    def update(self) -> int:
        return self.llm.update_weights(from_group=True, in_flight="recompute")

    def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        from scheduler.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        out = self.llm.generate([prompt], params, use_tqdm=False)[0]
        return [entry[0][1] for entry in out.prompt_logprobs[1:]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("rollout-llama"))
    return write_random_checkpoint(TINY_FAMILIES["llama"], path, seed=3).path


def test_a_rollout_loop_updates_the_engine_over_gloo_each_iteration(ray_cluster, model_dir):
    trainer, engine = Trainer.remote(model_dir), Engine.remote(model_dir)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ray.get([trainer.join.remote(init_method, 2), engine.join.remote(init_method, 2)])
    start = ray.get(engine.prompt_logprobs.remote(PROBE))
    assert start == pytest.approx(ray.get(trainer.prompt_logprobs.remote(PROBE)), abs=1e-4)
    for iteration in range(3):
        rollouts = ray.get(engine.generate.remote(PROMPTS * 2, seed=iteration))
        reward = ray.get(trainer.step.remote(rollouts))
        assert 0.0 <= reward <= 1.0
        _, updated = ray.get([trainer.push.remote(), engine.update.remote()])
        assert updated == 15
        served = ray.get(engine.prompt_logprobs.remote(PROBE))
        trained = ray.get(trainer.prompt_logprobs.remote(PROBE))
        assert all(math.isfinite(x) for x in served)
        assert served == pytest.approx(trained, abs=1e-4)
        assert served != pytest.approx(start, abs=1e-3)  # the policy moved
    ray.kill(engine)
    ray.kill(trainer)
