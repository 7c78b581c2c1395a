"""Named tensors broadcast from a trainer to raylm engines' ranks over a torch.distributed group.

The protocol (docs/rl.md): every member opens the same stand-alone group (`WeightGroupSpec`: a
tcp:// init method, the world size, a rank; the trainer is rank 0 and hosts the rendezvous), gloo
on CPU and NCCL on CUDA, apart from the engine's own tensor-parallel group. Then, per update:

1. the trainer broadcasts a manifest: the length of a JSON document, then the document (each
   tensor's name, dtype, shape, bucket and byte offset; each bucket's size);
2. every member all-reduces (MIN) a verdict on it: 1 accepted, 0 refused (a name, shape or dtype
   the engine's model lacks);
3. if accepted, the trainer broadcasts each bucket (the tensors' bytes back to back, so many small
   tensors cost one collective), and the members all-reduce a second verdict (0: a tensor held NaN
   or inf). The trainer's `send_weights` raises when either verdict is 0.

Nothing here knows the model: engine ranks check the manifest against their model in
workers/weight_update.py.
"""

from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, cast
from urllib.parse import urlsplit

import torch
import torch.distributed as dist


class WeightGroup(Protocol):
    """A member's end of a weight group: gloo's or NCCL's backend object, apart from
    torch.distributed's default group (the engine's tensor-parallel one)."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> dist.Work: ...


# Bounds of the protocol's fields: a manifest (JSON) and the members of one group.
MAX_MANIFEST_BYTES = 64 << 20
MAX_GROUP_SIZE = 1 << 16
MAX_TIMEOUT_S = 86_400.0
DEFAULT_BUCKET_BYTES = 256 << 20
MAX_BUCKET_BYTES = 1 << 40
_ALIGN = 64  # bytes: every tensor in a bucket starts aligned for any dtype's view

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_NAME_OF = {v: k for k, v in DTYPE_NAMES.items()}


@dataclass(frozen=True, slots=True)
class WeightGroupSpec:
    """Where a weight-transfer group meets. The trainer is rank 0 and binds the init method's
    address; an engine joins as `rank`, and its tensor-parallel rank r as rank + r."""

    init_method: str  # tcp://host:port
    world_size: int
    rank: int
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        host, port = self.address
        del host, port  # parsed (and checked) by the property
        _check_int("world_size", self.world_size, 2, MAX_GROUP_SIZE)
        _check_int("rank", self.rank, 0, self.world_size - 1)
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ValueError(f"timeout_s: must be a finite number of seconds, got {t!r}")
        if not 0 < t <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s: must be in (0, {MAX_TIMEOUT_S:.0f}], got {t!r}")

    @property
    def address(self) -> tuple[str, int]:
        if not isinstance(self.init_method, str) or len(self.init_method) > 1024:
            raise ValueError(f"init_method: must be tcp://host:port, got {self.init_method!r}")
        parts = urlsplit(self.init_method)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme != "tcp" or not parts.hostname or port is None or not 0 < port < 65536:
            raise ValueError(f"init_method: must be tcp://host:port, got {self.init_method!r}")
        return parts.hostname, port

    def member(self, offset: int) -> WeightGroupSpec:
        """The spec of the member `offset` ranks after this one (an engine's TP rank)."""
        _check_int("rank", self.rank + offset, 0, self.world_size - 1)
        return WeightGroupSpec(
            self.init_method, self.world_size, self.rank + offset, self.timeout_s
        )


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name}: must be an integer in [{lo}, {hi}], got {value!r}")


def open_group(spec: WeightGroupSpec, device: torch.device) -> WeightGroup:
    """Join the group (blocks until all world_size members have): NCCL for a CUDA device, else
    gloo, on the init method's host (rank 0 hosts the rendezvous store there)."""
    host, port = spec.address
    timeout = timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(host, port, spec.world_size, spec.rank == 0, timeout=timeout)
    if device.type == "cuda":
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = timeout
        return cast(WeightGroup, dist.ProcessGroupNCCL(store, spec.rank, spec.world_size, nccl))
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in the stubs
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_address(host))]
    return cast(WeightGroup, dist.ProcessGroupGloo(store, spec.rank, spec.world_size, options))


def _local_address(host: str) -> str:
    """The address this member's gloo endpoint binds: loopback for a loopback group (never the
    machine's outward interface), else this node's address as Ray or the OS know it."""
    if host.startswith("127.") or host == "localhost":
        return "127.0.0.1"
    return os.environ.get("RAYLM_NODE_IP") or socket.gethostbyname(socket.gethostname())


# ---- the manifest -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_NAMES[self.dtype].itemsize


@dataclass(frozen=True, slots=True)
class Manifest:
    tensors: list[TensorEntry]
    bucket_bytes: list[int]

    def encode(self) -> bytes:
        rows = [[t.name, t.dtype, list(t.shape), t.bucket, t.offset] for t in self.tensors]
        return json.dumps({"tensors": rows, "buckets": self.bucket_bytes}).encode()

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        """The manifest, each field checked: a malformed one is a ValueError, never an
        allocation."""
        try:
            doc = json.loads(data)
            buckets = [int(b) for b in doc["buckets"]]
            tensors = [
                TensorEntry(str(n), str(d), tuple(int(x) for x in s), int(b), int(o))
                for n, d, s, b, o in doc["tensors"]
            ]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"weights manifest: malformed ({exc})") from None
        manifest = cls(tensors, buckets)
        manifest.check()
        return manifest

    def check(self) -> None:
        for size in self.bucket_bytes:
            _check_int("bucket size", size, 1, MAX_BUCKET_BYTES)
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise ValueError(f"weights manifest: tensor {t.name!r} is listed twice")
            seen.add(t.name)
            if t.dtype not in DTYPE_NAMES:
                raise ValueError(f"{t.name}: dtype {t.dtype!r} is not one of {sorted(DTYPE_NAMES)}")
            if any(d < 0 for d in t.shape) or not 0 <= t.bucket < len(self.bucket_bytes):
                raise ValueError(f"{t.name}: bad shape {t.shape} or bucket {t.bucket}")
            if t.offset < 0 or t.offset + t.nbytes > self.bucket_bytes[t.bucket]:
                raise ValueError(f"{t.name}: bytes outside bucket {t.bucket}")


def plan_buckets(
    tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Manifest:
    """Tensors in order, packed into buckets of at most bucket_bytes (a bigger tensor gets a
    bucket of its own)."""
    _check_int("bucket_bytes", bucket_bytes, 1, MAX_BUCKET_BYTES)
    entries: list[TensorEntry] = []
    sizes: list[int] = []
    for name, t in tensors:
        if t.dtype not in _NAME_OF:
            raise ValueError(f"{name}: dtype {t.dtype} is not one of {sorted(DTYPE_NAMES)}")
        nbytes = t.numel() * t.element_size()
        start = -(-sizes[-1] // _ALIGN) * _ALIGN if sizes else 0
        if not sizes or (start + nbytes > bucket_bytes and sizes[-1] > 0):
            sizes.append(0)
            start = 0
        entries.append(TensorEntry(name, _NAME_OF[t.dtype], tuple(t.shape), len(sizes) - 1, start))
        sizes[-1] = start + nbytes
    return Manifest(entries, [max(s, 1) for s in sizes])


# ---- the collectives ----------------------------------------------------------------------------
def _broadcast(group: WeightGroup, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _verdict(group: WeightGroup, ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    group.allreduce([flag], _min_options()).wait()
    return bool(flag.item())


def _min_options() -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # RedOpType, as torch's own
    return options


class WeightsRefusedError(ValueError):
    """An engine refused the update (its own error says why); the engine keeps its weights."""


def send_weights(
    group: WeightGroup,
    tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """The trainer's side (rank 0): broadcast these named tensors to every engine in the group.
    Raises WeightsRefusedError if an engine refused the manifest or the values."""
    named = [(n, t.detach().contiguous()) for n, t in tensors]
    device = named[0][1].device if named else torch.device("cpu")
    manifest = plan_buckets(named, bucket_bytes)
    data = torch.frombuffer(bytearray(manifest.encode()), dtype=torch.uint8).to(device)
    _broadcast(group, torch.tensor([data.numel()], dtype=torch.int64, device=device))
    _broadcast(group, data)
    if not _verdict(group, True, device):
        raise WeightsRefusedError("weights: an engine refused the manifest (see its error)")
    for index, size in enumerate(manifest.bucket_bytes):
        bucket = torch.zeros(size, dtype=torch.uint8, device=device)
        for entry, (_, t) in zip(manifest.tensors, named):
            if entry.bucket == index:
                flat = t.reshape(-1).view(torch.uint8)
                bucket[entry.offset : entry.offset + flat.numel()].copy_(flat)
        _broadcast(group, bucket)
    if not _verdict(group, True, device):
        raise WeightsRefusedError("weights: an engine refused the values (see its error)")


def receive_weights(
    group: WeightGroup,
    device: torch.device,
    check_manifest: Callable[[Manifest], None],
    check_values: Callable[[list[tuple[str, torch.Tensor]]], None],
) -> list[tuple[str, torch.Tensor]]:
    """An engine rank's side: the manifest, checked (check_manifest raises ValueError), then the
    tensors, checked (check_values raises ValueError); the verdicts tell every member. Raises
    what the checks raised, after the protocol has run to its end (the group stays usable)."""
    length = torch.zeros(1, dtype=torch.int64, device=device)
    _broadcast(group, length)
    size = int(length.item())
    error: ValueError | None = None
    if not 0 < size <= MAX_MANIFEST_BYTES:
        error = ValueError(f"weights manifest: {size} bytes, must be in [1, {MAX_MANIFEST_BYTES}]")
        size = 1  # still take part in the broadcast
    data = torch.zeros(size, dtype=torch.uint8, device=device)
    _broadcast(group, data)
    manifest = None
    if error is None:
        try:
            manifest = Manifest.decode(data.cpu().numpy().tobytes())
            check_manifest(manifest)
        except ValueError as exc:
            error = exc
    if not _verdict(group, error is None, device) or manifest is None:
        raise error or WeightsRefusedError("weights: another engine rank refused the manifest")
    received = _receive_buckets(group, manifest, device)
    try:
        check_values(received)
    except ValueError as exc:
        error = exc
    if not _verdict(group, error is None, device):
        raise error or WeightsRefusedError("weights: another engine rank refused the values")
    return received


def _receive_buckets(
    group: WeightGroup, manifest: Manifest, device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    out = []
    for index, size in enumerate(manifest.bucket_bytes):
        bucket = torch.empty(size, dtype=torch.uint8, device=device)
        _broadcast(group, bucket)
        for e in manifest.tensors:
            if e.bucket == index:
                raw = bucket[e.offset : e.offset + e.nbytes]
                out.append((e.name, raw.view(DTYPE_NAMES[e.dtype]).view(e.shape)))
    return out
