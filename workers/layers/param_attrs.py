"""Attributes the loading code attaches to parameters at run time.

A parameter may carry: `weight_loader` (the layer's loader for its checkpoint shard, read by
the model's load_weights), `gguf` (its GGUF blocks), `gguf_float` (its shards fell back to float),
`quant` (its FP8 or INT4 form) and `packed_only` (its float values were dropped for a packed
copy). torch.Tensor declares none of them, so they are set here, by name from this list, rather
than by plain attribute assignment that a type checker refuses; readers use getattr with a
default.
"""

from __future__ import annotations

import torch

PARAM_ATTRS = frozenset({"weight_loader", "gguf", "gguf_float", "quant", "packed_only"})


def set_param_attr(param: torch.Tensor, name: str, value: object) -> None:
    """Attach `value` to param as `name`, one of PARAM_ATTRS (a typo raises instead of attaching
    an attribute nothing reads)."""
    if name not in PARAM_ATTRS:
        raise ValueError(f"parameter attribute: {name!r} is not one of {sorted(PARAM_ATTRS)}")
    setattr(param, name, value)
