"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a flattened token batch.

Variants differ only in flags read from the Hugging Face config: qkv bias (Qwen2), per-head
q/k RMSNorm (Qwen3), tied embeddings, rope scaling. Tensor parallelism lives in the layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PretrainedConfig

from workers.layers.activation import SiluAndMul
from workers.layers.attention import Attention, AttentionMetadata
from workers.layers.backends.cpu_driver import decode_driver
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from workers.layers.norm import RMSNorm
from workers.layers.quantized import AnyWeight, float_only
from workers.layers.rotary import RotaryEmbedding
from workers.pipeline import MissingLayer, current_stage, run_stage


@dataclass(slots=True)
class LlamaArgs:
    """The config fields the model reads, normalised across families."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # Per layer: attend to at most this many most recent tokens (None: the whole context).
    sliding_windows: list[int | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.sliding_windows:
            self.sliding_windows = [None] * self.num_layers
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(
                f"layer_types: {len(self.sliding_windows)} entries for {self.num_layers} layers"
            )

    @classmethod
    def from_hf_config(
        cls, config: PretrainedConfig, *, qkv_bias: bool = False, qk_norm: bool = False
    ) -> LlamaArgs:
        attention_bias = bool(getattr(config, "attention_bias", False))
        rope = dict(
            getattr(config, "rope_parameters", None)
            or {"rope_type": "default", "rope_theta": getattr(config, "rope_theta", 10000.0)}
        )
        if rope.get("rope_type") == "longrope" and rope.get("factor") is None:
            # LongRoPE's scale on cos/sin follows from how far the context was stretched
            old = rope.get("original_max_position_embeddings")
            if not isinstance(old, int) or isinstance(old, bool) or old < 1:
                raise ValueError(
                    "rope_parameters.original_max_position_embeddings: must be a positive "
                    f"integer, got {old!r}"
                )
            rope["factor"] = config.max_position_embeddings / old
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=getattr(config, "head_dim", None)
            or config.hidden_size // config.num_attention_heads,
            rms_norm_eps=config.rms_norm_eps,
            rope_parameters=dict(rope),
            max_position=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=qk_norm,
            sliding_windows=sliding_windows_of(config),
        )


def sliding_windows_of(config: PretrainedConfig) -> list[int | None]:
    """Each layer's attention window from an HF config: `sliding_window` on every layer (Mistral,
    Mixtral) or on the layers `layer_types` marks "sliding_attention" (Qwen2); None: full."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return [None] * n
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window: must be a positive integer, got {window!r}")
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * n
    return [window if t == "sliding_attention" else None for t in types]


class LlamaAttention(nn.Module):
    """Self-attention: fused qkv projection, optional q/k norm, rotary, paged attention, o_proj."""

    def __init__(
        self,
        a: LlamaArgs,
        rotary: RotaryEmbedding,
        sliding_window: int | None = None,
        *,
        scale: float | None = None,
        logit_softcap: float | None = None,
        qk_norm: type[nn.Module] | None = None,
    ) -> None:
        """scale: the scores' scale (None: 1/sqrt(head_dim)); logit_softcap: the scores' tanh cap;
        qk_norm: the q/k norm's class where a family has its own (Gemma), else RMSNorm when
        a.qk_norm."""
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            a.hidden_size, a.head_dim, a.num_heads, a.num_kv_heads, a.qkv_bias
        )
        self.o_proj = RowParallelLinear(a.num_heads * a.head_dim, a.hidden_size, a.o_bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.head_dim = a.head_dim
        norm = qk_norm or (RMSNorm if a.qk_norm else None)
        self.q_norm = norm(a.head_dim, a.rms_norm_eps) if norm is not None else None
        self.k_norm = norm(a.head_dim, a.rms_norm_eps) if norm is not None else None
        self.rotary = rotary  # one cos/sin table shared by all layers
        # [this rank's query heads] sink logits (gpt-oss sets them after construction); None: none
        self.sinks: nn.Parameter | None = None
        self.attn = Attention(
            self.qkv_proj.num_heads,
            a.head_dim,
            self.qkv_proj.num_kv_heads,
            a.head_dim**-0.5 if scale is None else scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, -1, self.head_dim)
        k = k.view(t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # built together
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta, sinks=self.sinks))


class LlamaMLP(nn.Module):
    """SiLU-gated MLP with gate and up fused into one column-parallel matrix."""

    def __init__(self, a: LlamaArgs, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or a.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(a.hidden_size, [inter] * 2, a.mlp_bias)
        self.down_proj = RowParallelLinear(inter, a.hidden_size, a.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def first_norm(
    norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's input norm with the previous layer's residual add fused in: (normed x,
    residual). The first layer has no residual yet, so its input becomes the residual."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


class PreNormBlock(nn.Module):
    """A decoder layer's step: pre-norm attention, then pre-norm MLP, the residual add fused into
    the next norm. Subclasses build `self_attn`, `mlp` and the two norms."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = first_norm(self.input_layernorm, x, residual)
        x = self.mix(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.feed_forward(x), residual

    def mix(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The token mixer: attention here; a hybrid layer's may be a linear-attention one."""
        return self.self_attn(positions, x, meta)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class LlamaDecoderLayer(PreNormBlock):
    """Pre-norm block; the residual add is fused into the next norm. `mlp` replaces the dense MLP
    (a mixture of experts)."""

    def __init__(
        self,
        a: LlamaArgs,
        rotary: RotaryEmbedding,
        index: int = 0,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(a, rotary, a.sliding_windows[index])
        self.mlp = mlp if mlp is not None else LlamaMLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(
        self, a: LlamaArgs, make_mlp: Callable[[int], nn.Module | None] | None = None
    ) -> None:
        super().__init__()
        # A pipeline stage builds its own layers only (workers/pipeline.py); the others are
        # placeholders without weights, so layer indices and checkpoint names stay global.
        stage = current_stage()
        self.embed_tokens: nn.Module = (
            VocabParallelEmbedding(a.vocab_size, a.hidden_size)
            if stage.is_first
            else MissingLayer()
        )
        rotary = RotaryEmbedding(a.head_dim, a.max_position, a.rope_parameters)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(a, rotary, i, make_mlp(i) if make_mlp else None)
            if stage.holds(i)
            else MissingLayer()
            for i in range(a.num_layers)
        )
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps) if stage.is_last else MissingLayer()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        driver = decode_driver(self, meta)
        if driver is not None:  # a CPU decode step on int8 GGUF layers: one C++ call
            return driver(self.embed_tokens(input_ids), positions, meta)
        return run_stage(self.layers, self.embed_tokens, self.norm, input_ids, positions, meta)


# checkpoint name fragment -> (our fused parameter fragment, shard id)
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; forward returns hidden states, compute_logits the vocabulary scores."""

    qkv_bias = False
    qk_norm = False

    def __init__(self, config: PretrainedConfig, max_model_len: int | None = None) -> None:
        super().__init__()
        self.args = LlamaArgs.from_hf_config(config, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm)
        if max_model_len is not None:  # the rotary table needs no rows past the longest sequence
            self.args.max_position = min(self.args.max_position, max_model_len)
        self.model = LlamaModel(self.args, self.make_mlp)
        self.lm_head = lm_head_of(self.args, self.model.embed_tokens)

    def make_mlp(self, layer: int) -> nn.Module | None:
        """The feed-forward block of a layer; None: the dense Llama MLP (families override)."""
        return None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the vocabulary on rank 0 of the last stage (None on other ranks)."""
        if not isinstance(self.lm_head, ParallelLMHead):  # a pipeline stage before the last
            return None
        return self.lm_head.compute_logits(hidden)

    @property
    def head_tied(self) -> bool:
        """The LM head is the embedding itself (tied, and both on this stage)."""
        return (
            self.args.tie_word_embeddings
            and isinstance(self.lm_head, ParallelLMHead)
            and (self.lm_head.weight is getattr(self.model.embed_tokens, "weight", None))
        )

    def attention_blocks(self) -> list[LlamaAttention]:
        """Each decoder layer's self-attention block (every family's layers keep one as
        `self_attn`)."""
        blocks = []
        for layer in self.model.layers:
            if isinstance(layer, MissingLayer):  # on another pipeline stage
                continue
            attn = layer.self_attn
            if not isinstance(attn, LlamaAttention):
                raise TypeError(
                    f"{type(layer).__name__}.self_attn: expected LlamaAttention, "
                    f"got {type(attn).__name__}"
                )
            blocks.append(attn)
        return blocks

    def attention_layers(self) -> list[Attention]:
        return [block.attn for block in self.attention_blocks()]

    def load_weights(self, weights: Iterable[tuple[str, AnyWeight]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into this rank's shards; returns names
        loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.head_tied):
                continue
            shard_id = None
            for ckpt, ours, sid in _STACKED:
                if ckpt in name:
                    name, shard_id = name.replace(ckpt, ours), sid
                    break
            if name not in params:
                raise ValueError(
                    f"weights: checkpoint tensor {name!r} has no parameter in {type(self).__name__}"
                )
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                whole = float_only(tensor, name)
                _copy_plain(param, whole.narrow(0, 0, whole.shape[0]), name)  # all of it
            else:
                loader(
                    param, tensor, shard_id
                )  # the loader reads its slice; copy_ converts the dtype
            loaded.add(name)
        return loaded

    def check_loaded(self, loaded: set[str]) -> None:
        """Raise if a parameter received no checkpoint tensor."""
        names = {n for n, _ in self.named_parameters()}
        if self.head_tied:
            names.discard("lm_head.weight")
        missing = sorted(names - loaded)
        if missing:
            raise ValueError(
                f"weights: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}"
            )


def lm_head_of(a: LlamaArgs, embed_tokens: nn.Module) -> nn.Module:
    """The LM head on the last pipeline stage (a placeholder elsewhere); tied embeddings share the
    embedding's weight when the stage holds both, else the head loads a copy of its own."""
    if not current_stage().is_last:
        return MissingLayer()
    head = ParallelLMHead(a.vocab_size, a.hidden_size)
    if a.tie_word_embeddings and isinstance(embed_tokens, VocabParallelEmbedding):
        head.weight = embed_tokens.weight
    return head


def _copy_plain(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(
            f"{name}: checkpoint has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )
    param.data.copy_(tensor)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama layout; its sliding window is applied in attention."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: bias on the q, k and v projections."""

    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: RMSNorm over each q and k head before rotary."""

    qk_norm = True
