"""Pipeline parallelism: which decoder layers this rank's stage holds, and the point-to-point
hand-offs between stages.

Rank layout (shared with every executor): world size = tensor_parallel_size x
pipeline_parallel_size, global rank = stage x tensor_parallel_size + tp_rank; each stage is one
tensor-parallel group. Stage 0 holds the embedding, the last stage the final norm and the LM head
(with tied embeddings, a copy of the embedding of its own). Between stages, each TP rank sends its
(replicated) hidden states and residual to the same TP rank of the next stage; only the last
stage's TP rank 0 samples, and the executor takes the step's ModelRunnerOutput from that rank's
answer (sampling_rank), so a stage is done with a step once it has handed it on (and free for the
next micro-batch). Like the TP rank, the stage is process state that the model code reads as it
builds its layers (workers/parallel.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from workers.pipeline_cost import decode_costs
from workers.pipeline_split import split_layers

W = TypeVar("W")


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """One stage: its index among `size` stages and the decoder layers [start, end) it holds
    (end None: through the last layer; the model fills it in)."""

    index: int = 0
    size: int = 1
    start: int = 0
    end: int | None = None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def holds(self, layer: int) -> bool:
        return self.start <= layer and (self.end is None or layer < self.end)

    def layer_range(self, num_layers: int) -> range:
        return range(self.start, num_layers if self.end is None else self.end)


@dataclass(slots=True)
class _State:
    stage: PipelineStage
    tp_size: int = 1
    rank: int = 0  # global rank in the world group


_state = _State(PipelineStage())


def init_pipeline(rank: int, tp_size: int, size: int) -> None:
    """Record this process's stage (layers unset until set_stage_layers) from its global rank."""
    _state.stage = PipelineStage(rank // tp_size, size)
    _state.tp_size, _state.rank = tp_size, rank


def reset_pipeline() -> None:
    """Back to one stage holding every layer."""
    _state.stage, _state.tp_size, _state.rank = PipelineStage(), 1, 0


def set_stage_layers(config: PretrainedConfig, expected_size: int, split: list[int] | None) -> None:
    """Fix the layers of this process's stage before its model (whose text config is `config`) is
    built: `split` when given, else the split that balances what a decode step costs the stages
    (workers/pipeline_cost.py), the same on every rank. expected_size is the configured
    pipeline_parallel_size: a process that is not one of that many stages (a single in-process
    runner) is refused."""
    stage = _state.stage
    if stage.size != expected_size:
        raise ValueError(
            f"pipeline_parallel_size: {expected_size} stages need a worker process each; this "
            f"process runs {stage.size} (distributed_executor_backend: mp or ray starts them)"
        )
    if stage.size == 1:  # every layer, of this model and of any other built here (a draft)
        return
    costs = decode_costs(config) if split is None else config.num_hidden_layers
    layers = split_layers(costs, stage.size, split)[stage.index]
    _state.stage = PipelineStage(stage.index, stage.size, layers.start, layers.stop)


def current_stage() -> PipelineStage:
    return _state.stage


class MissingLayer(nn.Module):
    """What a stage holds in place of a module another stage owns: no parameters; calling it is
    a bug."""

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("this module lives on another pipeline stage")


def check_stage_built(model: nn.Module, stage: PipelineStage) -> None:
    """Refuse, naming the family, a model whose decoder did not build this stage's layers only (a
    family that does not read the stage as it builds: workers/models/llama.py shows how)."""
    if stage.size == 1:
        return
    layers = getattr(getattr(model, "model", None), "layers", None)
    held = stage.layer_range(len(layers)) if isinstance(layers, nn.ModuleList) else range(0)
    if not held or any(
        isinstance(m, MissingLayer) != (i not in held) for i, m in enumerate(layers or ())
    ):
        raise ValueError(
            f"pipeline_parallel_size: {type(model).__name__} cannot be split into pipeline "
            "stages yet; run it with pipeline_parallel_size 1"
        )


# ---- weights ---------------------------------------------------------------------------------
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def stage_weights(
    weights: Iterable[tuple[str, W]], stage: PipelineStage, tied: bool
) -> Iterator[tuple[str, W]]:
    """The checkpoint tensors this stage holds (Hugging Face names): its layers, the embedding on
    the first stage, the final norm and LM head on the last. With tied embeddings a last stage
    that is not the first loads the embedding as its LM head."""
    if stage.size == 1:
        yield from weights
        return
    for name, tensor in weights:
        hit = _LAYER.match(name)
        if hit is not None:
            if stage.holds(int(hit.group(1))):
                yield name, tensor
        elif name.startswith("model.embed_tokens."):
            if stage.is_first:
                yield name, tensor
            if tied and stage.is_last:
                yield name.replace("model.embed_tokens.", "lm_head."), tensor
        elif name.startswith(("model.norm.", "lm_head.")):
            if stage.is_last:
                yield name, tensor
        elif stage.is_first:  # anything else (rotary buffers): read once, where it is checked
            yield name, tensor


# ---- hand-offs -------------------------------------------------------------------------------
def _peer(offset: int) -> int:
    return _state.rank + offset * _state.tp_size


def send_hidden(x: torch.Tensor, residual: torch.Tensor) -> None:
    """This stage's output to the same TP rank of the next stage: x and residual stacked, one
    message per step."""
    dist.send(torch.stack((x, residual)).contiguous(), dst=_peer(1))


def recv_hidden(
    num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous stage's (x, residual) for this step's num_tokens tokens."""
    buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
    dist.recv(buf, src=_peer(-1))
    return buf[0], buf[1]


def run_stage(
    layers: nn.ModuleList,
    embed: Callable[[torch.Tensor], torch.Tensor],
    norm: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: object,
) -> torch.Tensor:
    """A decoder over this stage's layers: embed (first stage) or receive, the layers, then send
    on or apply the final norm (last stage). Returns the final hidden states on the last stage,
    this stage's output elsewhere. Every family's decoder layer takes (positions, x, residual,
    meta) and fuses the residual add into its next norm, so (x, residual) is all that crosses."""
    stage = _state.stage
    x: torch.Tensor
    residual: torch.Tensor | None = None
    if stage.is_first:
        x = embed(input_ids)
    else:
        # The first layer's input norm: a float parameter of hidden_size in every family.
        like = layers[stage.start].get_parameter("input_layernorm.weight")
        x, residual = recv_hidden(len(input_ids), like.shape[0], like.dtype, like.device)
    for i in stage.layer_range(len(layers)):
        x, residual = layers[i](positions, x, residual, meta)
    assert residual is not None  # every stage holds a layer
    if not stage.is_last:
        send_hidden(x, residual)
        return x
    x, _ = norm(x, residual)
    return x


def sampling_rank(world_size: int, pipeline_parallel_size: int) -> int:
    """The global rank whose step answer holds the sampled tokens: TP rank 0 of the last stage
    (rank 0 without stages). Executors return its answer, so no stage waits for another's output
    and the first stage is free for the next micro-batch as soon as it has sent its hidden
    states on."""
    return world_size - world_size // pipeline_parallel_size
