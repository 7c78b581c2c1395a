"""DeepSeek-V3's multi-token-prediction layer (`num_nextn_predict_layers`), as a proposer's model.

The checkpoint keeps it as one more decoder layer after the model's, `model.layers.{N}.*` with
N = num_hidden_layers: an MLA attention and a MoE block like the model's own, plus `enorm`,
`hnorm`, `eh_proj`, its own `embed_tokens` and `shared_head.{norm,head}`. At position i it reads
the model's final hidden state h_i and the embedding of the next token t_{i+1}:

    x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]);   m_i = block(x);   logits = head(norm(m_i))

and so proposes t_{i+2}. Chained (workers/mtp.py), m_i stands in for the model's hidden state to
propose t_{i+3}, as vLLM's DeepSeekMTP does. Only the first MTP layer is used.

`DeepseekMTP` is a one-layer DeepseekV3ForCausalLM whose tensors are the MTP layer's renamed
(`mtp_weights`), with the input projection in front; its paged KV (the MLA latent of its one
layer) is the proposer's.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from workers.layers.attention import AttentionMetadata
from workers.layers.norm import RMSNorm
from workers.layers.quantized import AnyWeight
from workers.models.deepseek import DeepseekV3ForCausalLM, _load_direct

# The MTP layer's own tensors and the one-layer model's names for them.
_RENAMED = {
    "embed_tokens.": "model.embed_tokens.",
    "shared_head.norm.": "model.norm.",
    "shared_head.head.": "lm_head.",
}
_OWN = ("enorm.", "hnorm.", "eh_proj.")


def num_mtp_layers(config: PretrainedConfig) -> int:
    """How many MTP layers the checkpoint's config declares (0: none)."""
    n = getattr(config, "num_nextn_predict_layers", 0) or 0
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= 16:
        raise ValueError(f"num_nextn_predict_layers: must be an integer in [0, 16], got {n!r}")
    return n


def mtp_weights(
    weights: Iterable[tuple[str, AnyWeight]], num_layers: int
) -> Iterator[tuple[str, AnyWeight]]:
    """The first MTP layer's tensors under the one-layer model's names."""
    prefix = f"model.layers.{num_layers}."
    for name, tensor in weights:
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix) :]
        for old, new in _RENAMED.items():
            if rest.startswith(old):
                yield new + rest[len(old) :], tensor
                break
        else:
            yield (rest if rest.startswith(_OWN) else "model.layers.0." + rest), tensor


class DeepseekMTP(DeepseekV3ForCausalLM):
    """The MTP layer over the model's hidden states (the module docstring)."""

    def __init__(self, config: PretrainedConfig, max_model_len: int | None = None) -> None:
        if config.model_type not in ("deepseek_v3", "kimi_k2"):
            raise ValueError(
                f"speculative.method: 'mtp' runs DeepSeek-V3's MTP layer, not {config.model_type!r}"
            )
        if not num_mtp_layers(config):
            raise ValueError(
                "speculative.method: 'mtp' needs a checkpoint with MTP layers "
                "(num_nextn_predict_layers >= 1)"
            )
        one = copy.deepcopy(config)
        # Its one layer is layer N of the checkpoint: a MoE block when N is past the dense ones.
        one.first_k_dense_replace = int(
            config.num_hidden_layers < (getattr(config, "first_k_dense_replace", 0) or 0)
        )
        one.num_hidden_layers = 1
        super().__init__(one, max_model_len)
        h, eps = self.args.hidden_size, self.args.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.checkpoint_layers = config.num_hidden_layers

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        """m per token (before the head's norm): input_ids are the next tokens, hidden the model's
        (or the previous MTP step's) hidden states at the same positions."""
        e = self.model.embed_tokens(input_ids)
        e = e.masked_fill((positions == 0)[:, None], 0)  # as vLLM's DeepSeekMTP: no use there
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden.to(e.dtype))], dim=-1))
        (layer,) = self.model.layers
        x, residual = layer(positions, x, None, meta)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The shared head's logits of m: its norm, then its projection."""
        return super().compute_logits(self.model.norm(hidden))

    def load_weights(self, weights: Iterable[tuple[str, AnyWeight]]) -> set[str]:
        """The checkpoint's tensors: the first MTP layer's are loaded, the rest skipped."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def rest() -> Iterator[tuple[str, AnyWeight]]:
            for name, tensor in mtp_weights(weights, self.checkpoint_layers):
                if name.startswith(_OWN):
                    _load_direct(params, name, tensor, type(self).__name__)
                    loaded.add(name)
                else:
                    yield name, tensor

        return loaded | super().load_weights(rest())
