"""Llama-family decoder (Llama, SmolLM, Mistral, Qwen2) over pdserve's paged KV cache.

Mistral is Llama with a sliding window on every layer, Qwen2 Llama with q/k/v biases: both are
numbers of ``ModelArchConfig``, not code. The other families (``qwen3.py``, ``gemma3.py``) build on
these classes.

Numerically it follows Hugging Face's ``LlamaForCausalLM`` (RMSNorm in float32, "rotate_half"
RoPE, GQA, SwiGLU); structurally it follows vLLM: tokens of all sequences are flattened into one
``[num_tokens, hidden]`` batch, q/k/v and gate/up are each one fused matmul (4 GEMMs per layer
instead of 7: fewer calls and better-shaped ones for skinny decode batches), and attention reads
and writes the paged cache through ``paged_attention``.

Parameter names are HF's except for the two fused projections (``self_attn.qkv_proj``,
``mlp.gate_up_proj``); ``weights.hf_to_model_state_dict`` / ``weights.model_to_hf_state_dict``
convert, and ``weights.build_model`` builds the model from a state dict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from pdserve.engine.model.arch import ModelArchConfig
from pdserve.engine.model.layers.activation import silu_and_mul
from pdserve.engine.model.layers.attention import AttentionMetadata, paged_attention
from pdserve.engine.model.layers.linear import lm_head_logits
from pdserve.engine.model.layers.norm import RMSNorm
from pdserve.engine.model.layers.quant_linear import KERNEL_MAX_ROWS, QuantLinear
from pdserve.engine.model.layers.rotary import apply_rope, rope_tables
from pdserve.kernels.cpu import decoder_layer as cpu_decoder_layer
from pdserve.kernels.cpu import layer_ops as cpu_layer_ops


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.layer_window(layer_index)
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_out, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin_signed: torch.Tensor,  # [T, 1, D]
        kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.attend(self.project_qkv(hidden), cos, sin_signed, kv_cache_layer, meta)

    def project_qkv(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, heads + 2 * kv_heads, head_dim]``: the q, k and v heads of one fused projection."""
        return self.qkv_proj(hidden).view(
            hidden.shape[0], self.num_heads + 2 * self.num_kv_heads, self.head_dim
        )

    def attend(
        self,
        qkv: torch.Tensor,  # [T, heads + 2 * kv_heads, D], contiguous
        cos: torch.Tensor,  # [T, 1, D]
        sin_signed: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """RoPE on q and k, the K/V write, attention over the cache and the output projection."""
        num_tokens = qkv.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if cpu_layer_ops.serves(qkv) and kv_cache_layer.device.type == "cpu" and cos.dtype == qkv.dtype:
            # RoPE in place and the K/V write in one C call; q/k/v as views of the projection.
            cpu_layer_ops.rope_and_cache(qkv, heads, cos, sin_signed, kv_cache_layer, meta.slot_mapping)
            q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
            out = paged_attention(
                q, k, v, kv_cache_layer, meta, self.scale, kv_written=True, sliding_window=self.sliding_window
            )
        else:
            # RoPE on q and k heads at once; q/k/v go to the kernels as strided views (both the
            # torch references and the Triton kernels take strides), saving a copy each.
            qk = apply_rope(qkv[:, : heads + kv_heads], cos, sin_signed)
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
            out = paged_attention(
                q, k, v, kv_cache_layer, meta, self.scale, sliding_window=self.sliding_window
            )
        return self.o_proj(out.reshape(num_tokens, heads * self.head_dim))


class LlamaMLP(nn.Module):
    """A gated MLP: ``down(act(gate(x)) * up(x))`` with gate and up as one fused projection;
    ``activation`` is SwiGLU's (Llama) or another family's (``layers.activation``)."""

    def __init__(
        self, config: ModelArchConfig, activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul
    ) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.activation = activation
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: ModelArchConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_class(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self._fused: cpu_decoder_layer.PreparedLayer | None = None
        self._fused_asked = False

    def fused(self) -> cpu_decoder_layer.PreparedLayer | None:
        """The layer as ``cpu_decoder_layer`` runs it in one C call, or None when it cannot:
        its four projections must be block-held ones the C kernel reads (``--quantization``), of
        any kinds and mix of kinds, alike in their activations (``int8_activations``), and with a bias on q/k/v at most; the
        layer's sliding window (Mistral's) goes with it. Asked once, after the weights are in
        place (the first forward pass)."""
        if not self._fused_asked:
            self._fused_asked = True
            held = fusable_projections(
                self.self_attn, self.mlp, (self.input_layernorm, self.post_attention_layernorm)
            )
            if held is not None:
                self._fused = cpu_decoder_layer.PreparedLayer(
                    **held,
                    input_norm=self.input_layernorm.weight,
                    post_norm=self.post_attention_layernorm.weight,
                    qkv_bias=self.self_attn.qkv_proj.bias,
                )
        return self._fused

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        fused = self.fused()
        if fused is not None and cpu_decoder_layer.serves(
            fused, hidden, cos, kv_cache_layer, meta, max_rows=KERNEL_MAX_ROWS
        ):
            return cpu_decoder_layer.decoder_layer(fused, hidden, cos, sin_signed, kv_cache_layer, meta)
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin_signed, kv_cache_layer, meta)
        hidden, normed = self.post_attention_layernorm.add_and_norm(hidden, attended)
        return hidden + self.mlp(normed)


def fusable_projections(
    attn: LlamaAttention, mlp: LlamaMLP, norms: Sequence[RMSNorm]
) -> dict[str, Any] | None:
    """What a layer's ``cpu_decoder_layer.PreparedLayer`` takes of its attention and MLP (shapes,
    the four projections' blocks, int8 activations, the window and scale), or None when the C
    layer cannot run it: its four projections must be block-held ones the C kernel reads
    (``--quantization``), of any kinds and mix of kinds, alike in their activations, with a bias
    on q/k/v at most, and its ``norms`` must share one eps."""
    projections: tuple[nn.Module, ...] = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    held = [p for p in projections if isinstance(p, QuantLinear) and p.use_kernel]
    if not (
        len(held) == len(projections)
        and len({p.int8_activations for p in held}) == 1
        and all(p.bias is None for p in projections[1:])
        and len({norm.eps for norm in norms}) == 1
        and cpu_decoder_layer.available()
    ):
        return None
    blocks = [cpu_decoder_layer.BlockWeight(tuple(p.parts)) for p in held]
    return {
        "heads": attn.num_heads,
        "kv_heads": attn.num_kv_heads,
        "head_dim": attn.head_dim,
        "intermediate": mlp.intermediate_size,
        "eps": norms[0].eps,
        "qkv": blocks[0],
        "o": blocks[1],
        "gate_up": blocks[2],
        "down": blocks[3],
        "int8_activations": held[0].int8_activations,
        "sliding_window": attn.sliding_window,
        "scale": attn.scale,
    }


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelArchConfig,
        decoder_layer: type[nn.Module] = LlamaDecoderLayer,
        norm: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        # nn.Embedding's own init on the meta device (weights.build_model) goes through torch._refs and
        # pulls in torch._dynamo: 2.3 s of imports at every model load. The table is made here,
        # initialised as nn.Embedding does only on a real device (the checkpoint fills it anyway).
        table = torch.empty(config.vocab_size, config.hidden_size)
        if not table.is_meta:
            table.normal_()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=table)
        self.layers = nn.ModuleList(decoder_layer(config, i) for i in range(config.num_layers))
        self.norm = norm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The whole model: ``forward`` gives final-normed hidden states, ``compute_logits`` the logits.

    Logits are a separate call so the runner projects only the rows it samples from (the last
    token of each prefill chunk, every decode token): the vocab matmul is the largest one.

    Another family subclasses it with its own ``decoder_layer`` and ``norm`` classes and, where
    its numbers differ, its own ``rope_tables``, ``embed`` or ``compute_logits``.
    """

    decoder_layer: type[nn.Module] = LlamaDecoderLayer
    norm: type[RMSNorm] = RMSNorm
    rope_cos: torch.Tensor  # buffers registered in __init__: [max_positions, tables, head_dim]
    rope_sin_signed: torch.Tensor

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.decoder_layer, self.norm)
        # The LM head in oneDNN's layout, set by ``weights.pack_linear_weights`` for serving.
        self.packed_lm_head: torch.Tensor | None = None
        # The LM head as GGUF blocks, set by ``weights.install_blocks`` (--quantization).
        self.quant_lm_head: QuantLinear | None = None
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # cos / cat(-sin, sin) per position, computed once (on the CPU, also under "meta").
        cos, sin_signed = self.rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin_signed", sin_signed, persistent=False)
        # Every layer's fused form (``fused_pass``), asked once the weights are in place.
        self._fused_layers: cpu_decoder_layer.PreparedLayers | None = None
        self._fused_layers_asked = False

    @staticmethod
    def rope_tables(config: ModelArchConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, cat(-sin, sin))`` ``[max_positions, tables, head_dim]``: one table, every
        layer's (a family whose layers rotate by several bases stacks one table per base)."""
        cos, sin_signed = rope_tables(config)
        return cos.unsqueeze(1), sin_signed.unsqueeze(1)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the final norm's: always dense, unlike a block-held embedding)."""
        return self.model.norm.weight.dtype

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first layer's input ``[T, hidden]`` and the RoPE tables ``[T, tables, D]`` (cos,
        signed sin; one table for Llama) that the layers of the pass share.

        Apart from ``forward`` so the runner can drive the layers itself (and let a request
        join a pass in flight, see ``ModelRunner.join_decodes``).
        """
        hidden = self.model.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(hidden.dtype)
        sin_signed = self.rope_sin_signed[positions].to(hidden.dtype)
        return hidden, cos, sin_signed

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        hidden, cos, sin_signed = self.embed(input_ids, positions)
        for i, layer in enumerate(self.model.layers):
            hidden = layer(hidden, cos, sin_signed, kv_cache[:, i], attn_metadata)
        return self.model.norm(hidden)

    def fused_pass(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> cpu_decoder_layer.FusedPass | None:
        """The pass with its layers fused (``FusedPass.run``: a run of layers a C call), or None
        when a layer cannot be (``LlamaDecoderLayer.fused``) or the pass is not a decode batch
        the fused layer takes (``cpu_decoder_layer.serves``): then each layer's ``forward``."""
        if not self._fused_layers_asked:
            self._fused_layers_asked = True
            asked = [cast(LlamaDecoderLayer, layer).fused() for layer in self.model.layers]
            prepared = [layer for layer in asked if layer is not None]
            if len(prepared) == len(asked):
                self._fused_layers = cpu_decoder_layer.PreparedLayers(prepared)
        layers = self._fused_layers
        if layers is None or not cpu_decoder_layer.serves(
            layers.first, hidden, cos, kv_cache[:, 0], attn_metadata, max_rows=KERNEL_MAX_ROWS
        ):
            return None
        return cpu_decoder_layer.FusedPass(layers, cos, sin_signed, kv_cache, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        if self.quant_lm_head is not None:
            return self.quant_lm_head(hidden).float()
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return lm_head_logits(hidden, weight, self.packed_lm_head).float()
