"""The gated delta rule's pieces against transformers' torch fallbacks, tensor by tensor: the
chunked form from a state, the recurrent step over a batch of slots, the causal conv carried across
chunk cuts, the gated RMSNorm; and the config bounds of a DeltaNet layer."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from workers.layers.gated_delta import (
    DeltaDims,
    GatedRMSNorm,
    chunked,
    conv_decode,
    conv_prefill,
    recurrent_step,
)

H_K, H_V, DK, DV = 2, 4, 8, 6


def _inputs(length: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k [1, L, Hk, Dk], v [1, L, Hv, Dv], g, beta [1, L, Hv] as the layer makes them."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, length, H_K, DK, generator=gen)
    k = torch.randn(1, length, H_K, DK, generator=gen)
    v = torch.randn(1, length, H_V, DV, generator=gen)
    g = -torch.rand(1, length, H_V, generator=gen) * 0.5
    beta = torch.rand(1, length, H_V, generator=gen)
    return q, k, v, g, beta


def _ours(q, k, v, g, beta):
    """Our layout: heads first, key heads repeated to the value heads, no batch dim."""
    r = H_V // H_K
    q, k = (x[0].repeat_interleave(r, dim=1).transpose(0, 1) for x in (q, k))
    return q, k, v[0].transpose(0, 1), g[0].t(), beta[0].t()


def test_chunked_rule_from_a_state_equals_the_reference_across_any_cut():
    q, k, v, g, beta = _inputs(150)  # three chunks of 64, the last one padded
    want, want_state = hf.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    oq, ok, ov, og, ob = _ours(q, k, v, g, beta)
    state = torch.zeros(H_V, DK, DV)
    pieces = []
    for lo, hi in ((0, 37), (37, 101), (101, 150)):  # cuts inside chunks, as chunked prefill does
        out, state = chunked(
            oq[:, lo:hi], ok[:, lo:hi], ov[:, lo:hi], og[:, lo:hi], ob[:, lo:hi], state
        )
        pieces.append(out)
    got = torch.cat(pieces, dim=1).transpose(0, 1)
    torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, want_state[0], rtol=1e-4, atol=1e-5)


def test_recurrent_step_over_slots_equals_the_reference_token_by_token():
    q, k, v, g, beta = _inputs(5, seed=1)
    start = torch.randn(1, H_V, DK, DV)
    want, want_state = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=start, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    oq, ok, ov, og, ob = _ours(q, k, v, g, beta)
    state = start.clone()
    for t in range(5):  # a batch of one slot, one token a step
        out, state = recurrent_step(
            oq[None, :, t], ok[None, :, t], ov[None, :, t], og[None, :, t], ob[None, :, t], state
        )
        torch.testing.assert_close(out[0], want[0, t], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-5)
    # The chunked form from the same state agrees with the recurrence.
    out, chunk_state = chunked(oq, ok, ov, og, ob, start[0])
    torch.testing.assert_close(out.transpose(0, 1), want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(chunk_state, want_state[0], rtol=1e-4, atol=1e-5)


def test_conv_state_carries_across_chunks_and_decodes():
    channels, kernel, length = 10, 4, 9
    weight = torch.randn(channels, kernel)
    x = torch.randn(length, channels)
    want = hf.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    state = torch.zeros(channels, kernel - 1)
    first, state = conv_prefill(x[:2], state, weight)  # shorter than the kernel's history
    second, state = conv_prefill(x[2:6], state, weight)
    rows = [first, second]
    batch_state = state[None]
    for t in range(6, length):
        y, batch_state = conv_decode(x[t][None], batch_state, weight)
        rows.append(y)
    torch.testing.assert_close(torch.cat(rows), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(batch_state[0], x[length - kernel + 1 :].t())


def test_gated_norm_equals_the_reference():
    ref = hf.Qwen3NextRMSNormGated(DV, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(DV))
    ours = GatedRMSNorm(DV, 1e-6)
    ours.weight.data.copy_(ref.weight)
    x, gate = torch.randn(7, DV), torch.randn(7, DV)
    torch.testing.assert_close(ours(x, gate), ref(x, gate))


BAD = [2**64, -1, math.nan, 10**12]


@pytest.mark.parametrize("field", ["num_k_heads", "num_v_heads", "k_dim", "v_dim", "conv_kernel"])
@pytest.mark.parametrize("value", BAD)
def test_delta_dims_refuse_out_of_range_values_naming_the_field(field, value):
    dims = dict(hidden_size=16, num_k_heads=2, num_v_heads=4, k_dim=8, v_dim=8, conv_kernel=4)
    dims[field] = value
    with pytest.raises(ValueError, match=f"linear_{field}"):
        DeltaDims(eps=1e-6, **dims)


def test_delta_dims_refuse_value_heads_that_do_not_group_by_key_head():
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        DeltaDims(16, 2, 3, 8, 8, 4, 1e-6)
