"""What every tests/workers/test_triton_*.py module needs before it imports a kernel: import this
module first (after torch and pytest, before triton and the kernel modules).

Without a GPU, Triton kernels run only in Triton's CPU interpreter, and TRITON_INTERPRET=1 must be
set before `triton` is imported: `@triton.jit` reads it at decoration, and triton's own @jit
helpers (tl.cdiv, tl.sigmoid, ...) are decorated when triton is imported, so compiled ones fail
inside an interpreted kernel ("Cannot call @triton.jit'd outside of the scope of a kernel").
torch._dynamo imports triton from many torch paths, so tests/conftest.py sets the variable first
thing on machines without CUDA; it is set again here for runs without that conftest. If triton was
imported before it was set, the importing module skips: run `make test-triton`. Skipped where
triton is not installed (CI). On a machine with a CUDA GPU nothing is set and the compiled kernels
run on the GPU.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (make test-triton installs it)", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    if "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET"):
        pytest.skip(
            "triton was imported before TRITON_INTERPRET was set: `make test-triton`",
            allow_module_level=True,
        )
    os.environ["TRITON_INTERPRET"] = "1"  # before triton and the kernel modules are imported

# The interpreter keeps bfloat16 as raw uint16 bits: tl.dot on them returns garbage and casts to
# them truncate instead of rounding to nearest. Off the GPU the 16-bit checks use float16, which
# numpy holds natively.
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16
