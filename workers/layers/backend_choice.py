"""Which attention backend an engine runs: a pure function of the device, the kernel libraries
that import and the cache's shapes, so that every case is tested without a GPU.

`auto` picks what has been verified on this code: on CUDA the Triton paged-decode kernel, the one
backend whose decode steps CUDA graphs capture and the one the published GPU figures were measured
with; elsewhere the torch backend (on CPU, its paged C++ decode kernel). flash-attn runs only when
named: its backend has not run on a GPU yet, turns CUDA graphs off and gathers every context at
our block sizes, and the library installs only by a source build.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.options import ATTENTION_BACKENDS

KERNEL_LIBRARIES = ("triton", "flash_attn")  # the imports a backend needs beyond torch
FLASH_ATTN_DTYPES = ("float16", "bfloat16")
FLASH_ATTN_MAX_HEAD_DIM = 256
FLASH_ATTN_INSTALL = "pip install -e '.[gpu-flash-attn-source-build]' --no-build-isolation"


@dataclass(frozen=True, slots=True)
class BackendInputs:
    """What the choice depends on. head_dim and block_size are None where the caller has no model
    yet (a kernel test): their checks are then skipped."""

    device_type: str  # torch.device.type: "cuda", "cpu", ...
    importable: frozenset[str]  # the KERNEL_LIBRARIES that import here
    dtype: str  # "float32" | "bfloat16" | "float16"
    head_dim: int | None = None
    block_size: int | None = None


@dataclass(frozen=True, slots=True)
class BackendChoice:
    name: str
    why: str


def choose_backend(name: str, inputs: BackendInputs) -> BackendChoice:
    """The backend for `attention_backend: name`; a named backend that cannot run here raises
    ValueError saying what it lacks."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name != "auto":
        problem = _cannot_run(name, inputs)
        if problem is not None:
            raise ValueError(f"attention_backend: {name} {problem}")
        return BackendChoice(name, "named by attention_backend")
    if inputs.device_type != "cuda":
        return BackendChoice("torch", f"auto on {inputs.device_type}")
    problem = _cannot_run("triton", inputs)
    if problem is None:
        return BackendChoice("triton", "auto on cuda: the verified kernel, captured by CUDA graphs")
    # Eager and slower, but correct: say why, the operator can fix it.
    return BackendChoice("torch", f"auto on cuda: the Triton kernel {problem}; CUDA graphs off")


def _cannot_run(name: str, inputs: BackendInputs) -> str | None:
    """Why the backend cannot run with these inputs, or None."""
    if name == "torch":
        return None
    if inputs.device_type != "cuda":
        return f"needs CUDA, this engine runs on {inputs.device_type}"
    if name == "triton":
        if "triton" not in inputs.importable:
            return "needs the triton package (it comes with torch's CUDA wheels on Linux)"
        bs = inputs.block_size
        if bs is not None and (bs < 1 or bs & (bs - 1)):
            return f"needs a power-of-two block_size, got {bs}"
        return None
    if "flash_attn" not in inputs.importable:
        return f"is not installed; it builds from source: {FLASH_ATTN_INSTALL}"
    if inputs.dtype not in FLASH_ATTN_DTYPES:
        return f"needs float16 or bfloat16, got {inputs.dtype}"
    d = inputs.head_dim
    if d is not None and (d % 8 or d > FLASH_ATTN_MAX_HEAD_DIM):
        return f"needs a head size that is a multiple of 8 up to 256, got {d}"
    return None
