"""torch.distributed set-up for one tensor-parallel rank: NCCL on CUDA, gloo on CPU.

The backend follows from the device, so the CUDA path is the CPU path with another backend:
the same rendezvous (tcp://host:port), the same group, the same collectives in workers.parallel.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from workers.parallel import init_tensor_parallel, reset_tensor_parallel
from workers.pipeline import init_pipeline, reset_pipeline

logger = logging.getLogger(__name__)


def backend_for(device: str) -> str:
    """The collective backend for a device string ("cpu", "cuda", "cuda:N")."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on host right now (nothing reserves it: another process may bind it
    first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_distributed(
    rank: int,
    world_size: int,
    address: str,
    device: str,
    timeout_s: float = 300.0,
    pipeline_parallel_size: int = 1,
) -> None:
    """Join the process group of world_size ranks rendezvousing at address ("host:port").

    Every rank must call this at about the same time. At world size 1 a real group is created too,
    so the collectives of the TP layers run (as identities) through the backend being set up.
    timeout_s bounds the rendezvous and every collective, so a lost peer cannot hang a rank forever.
    With pipeline stages, world_size is tensor_parallel_size x pipeline_parallel_size and rank
    stage x tensor_parallel_size + tp_rank (workers/pipeline.py); each stage is a TP group.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: must be in [0, {world_size}), got {rank}")
    if pipeline_parallel_size < 1 or world_size % pipeline_parallel_size:
        raise ValueError(
            f"pipeline_parallel_size: {pipeline_parallel_size} does not divide the world size "
            f"{world_size}"
        )
    if dist.is_initialized():
        raise RuntimeError("init_distributed: this process already belongs to a process group")
    backend = backend_for(device)
    host = address.rsplit(":", 1)[0]
    if backend == "gloo" and host.startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
        # Gloo listens on the interface of the machine's hostname unless told otherwise (it takes
        # no options through init_process_group); a loopback rendezvous keeps it on loopback.
        os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()
    if backend == "nccl":
        # Ray exposes one GPU per worker actor; it is device 0 of the visible set.
        torch.cuda.set_device(torch.device(device).index or 0)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    _init_groups(rank, world_size, pipeline_parallel_size)
    logger.info("rank %d/%d joined the %s group at %s", rank, world_size, backend, address)


def _init_groups(rank: int, world_size: int, pipeline_parallel_size: int) -> None:
    """This rank's TP group (the world without stages) and its pipeline stage."""
    tp = world_size // pipeline_parallel_size
    if pipeline_parallel_size == 1:
        init_tensor_parallel(rank, world_size, dist.group.WORLD)
    else:
        # Every rank creates every stage's group, in stage order, as new_group requires.
        groups = [
            dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(world_size // tp)
        ]
        init_tensor_parallel(rank % tp, tp, groups[rank // tp])
    init_pipeline(rank, tp, pipeline_parallel_size)


def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), names[0])


def destroy_distributed() -> None:
    """Leave the process group (if any) and return to a single-process state."""
    if dist.is_initialized():
        dist.destroy_process_group()
    reset_tensor_parallel()
    reset_pipeline()
