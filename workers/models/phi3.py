"""Phi-3: the Llama decoder with q/k/v and gate/up fused in the checkpoint (`qkv_proj`,
`gate_up_proj`), split here into the shards our fused layers load.

Each rank reads a fused tensor whole before taking its slices. A partial rotary factor other than
1 is refused.

LongRoPE (Phi-3 128k checkpoints): every token of a request whose context this step runs past
`original_max_position_embeddings` is rotated with the long factors, the others with the short
ones, as transformers decides per forward from the sequence's length. Keys already in the cache
keep the rotation they were written with (transformers' cache does the same), so a request that
crosses the boundary while decoding matches transformers, and a prompt longer than the boundary
is rotated long throughout when it is prefilled in one step. A prompt split into chunks across
the boundary, a recomputed preemption, or a cached prefix reused by a longer prompt keeps the
short rotation for its earlier keys: a choice per step cannot be undone later.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from transformers import PretrainedConfig

from workers.layers.attention import AttentionMetadata
from workers.layers.quantized import AnyWeight
from workers.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 (mini, small, medium; 4k-context variants)."""

    def __init__(self, config: PretrainedConfig, max_model_len: int | None = None) -> None:
        rope = getattr(config, "rope_parameters", None) or {}
        factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if factor not in (None, 1, 1.0):
            raise ValueError(
                f"rope_parameters.partial_rotary_factor: {factor!r} is not supported (only 1.0)"
            )
        super().__init__(config, max_model_len)
        self.long_offset = self.attention_blocks()[0].rotary.long_offset
        self.short_len = int(self.args.rope_parameters.get("original_max_position_embeddings", 0))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.long_offset:  # LongRoPE: the long factors' rows of the table, per request
            q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
            seq_lens = torch.repeat_interleave(meta.seq_lens, q_lens, output_size=len(positions))
            positions = positions + (seq_lens > self.short_len).long() * self.long_offset
        return super().forward(input_ids, positions, meta)

    def load_weights(self, weights: Iterable[tuple[str, AnyWeight]]) -> set[str]:
        return super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, AnyWeight]]) -> Iterator[tuple[str, AnyWeight]]:
        a = self.args
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        for name, tensor in weights:
            if name.endswith(".qkv_proj.weight"):
                whole = tensor.narrow(0, 0, tensor.shape[0])
                base = name.removesuffix("qkv_proj.weight")
                yield f"{base}q_proj.weight", whole.narrow(0, 0, q)
                yield f"{base}k_proj.weight", whole.narrow(0, q, kv)
                yield f"{base}v_proj.weight", whole.narrow(0, q + kv, kv)
            elif name.endswith(".gate_up_proj.weight"):
                whole = tensor.narrow(0, 0, tensor.shape[0])
                base, half = name.removesuffix("gate_up_proj.weight"), whole.shape[0] // 2
                yield f"{base}gate_proj.weight", whole.narrow(0, 0, half)
                yield f"{base}up_proj.weight", whole.narrow(0, half, half)
            else:
                yield name, tensor
