"""Gemma 3 (text) over pdserve's paged KV cache, as HF's ``Gemma3ForCausalLM`` computes it.

What differs from Llama (``llama.py``), each from ``layers/``:

* every norm is ``GemmaRMSNorm``, ``x * (1 + w)`` in float32; there are four per layer, before
  and after attention and before and after the MLP (``post_*`` norm the branch before it joins
  the residual stream);
* qk-norm: a ``GemmaRMSNorm`` over each query and key head before RoPE;
* the MLP is GeGLU (``gelu_pytorch_tanh``);
* the embedding is multiplied by ``sqrt(hidden_size)``, rounded to the activations' dtype;
* attention is scaled by ``query_pre_attn_scalar ** -0.5``;
* sliding-window layers (five of every six) rotate by a local RoPE base (10k) and attend over
  the last ``sliding_window`` keys; the others by the global base (1M, scaled where the config
  says) over every key. ``embed`` hands out both tables; each layer reads its own;
* logits may be soft-capped (``final_logit_softcapping``; None for Gemma 3).

A decode batch runs each layer as one C call (``kernels/cpu/csrc/decoder_layer.c``, which has
each of these parts), as Llama's does; prefill chunks run op by op, through the same C norms and
GeGLU where they serve.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from pdserve.engine.model.arch import ModelArchConfig
from pdserve.engine.model.layers.activation import gelu_tanh_and_mul
from pdserve.engine.model.layers.attention import AttentionMetadata
from pdserve.engine.model.layers.norm import GemmaRMSNorm, norm_qk_heads
from pdserve.engine.model.layers.quant_linear import KERNEL_MAX_ROWS
from pdserve.engine.model.layers.rotary import rope_tables
from pdserve.engine.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, fusable_projections
from pdserve.kernels.cpu import decoder_layer as cpu_decoder_layer

# Which of ``Gemma3ForCausalLM.rope_tables`` a layer rotates by.
GLOBAL_ROPE, LOCAL_ROPE = 0, 1


class Gemma3Attention(LlamaAttention):
    def __init__(self, config: ModelArchConfig, layer_index: int = 0) -> None:
        super().__init__(config, layer_index)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.rope_table = GLOBAL_ROPE if self.sliding_window is None else LOCAL_ROPE

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,  # [T, 2, D]: the global and the local table
        sin_signed: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.project_qkv(hidden)
        norm_qk_heads(qkv, self.num_heads, self.num_kv_heads, self.q_norm, self.k_norm)
        table = slice(self.rope_table, self.rope_table + 1)
        return self.attend(qkv, cos[:, table], sin_signed[:, table], kv_cache_layer, meta)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_index: int = 0) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = Gemma3Attention(config, layer_index)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = LlamaMLP(config, gelu_tanh_and_mul)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self._fused: cpu_decoder_layer.PreparedLayer | None = None
        self._fused_asked = False

    def fused(self) -> cpu_decoder_layer.PreparedLayer | None:
        """The layer as ``cpu_decoder_layer`` runs it in one C call (``LlamaDecoderLayer.fused``'s
        conditions), its norms' ``1 + w`` in float32, its own RoPE table and window."""
        if not self._fused_asked:
            self._fused_asked = True
            attn = self.self_attn
            norms = (
                self.input_layernorm,
                self.post_attention_layernorm,
                self.pre_feedforward_layernorm,
                self.post_feedforward_layernorm,
                attn.q_norm,
                attn.k_norm,
            )
            held = fusable_projections(attn, self.mlp, norms)
            if held is not None:
                self._fused = cpu_decoder_layer.PreparedLayer(
                    **held,
                    input_norm=self.input_layernorm.scale(),
                    post_norm=self.pre_feedforward_layernorm.scale(),
                    q_norm=attn.q_norm.scale(),
                    k_norm=attn.k_norm.scale(),
                    post_attention_norm=self.post_attention_layernorm.scale(),
                    post_feedforward_norm=self.post_feedforward_layernorm.scale(),
                    activation="gelu_tanh",
                    rope_table=attn.rope_table,
                    dtype=self.input_layernorm.weight.dtype,
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
        hidden, normed = self.pre_feedforward_layernorm.add_and_norm(
            hidden, self.post_attention_layernorm(attended)
        )
        return hidden + self.post_feedforward_layernorm(self.mlp(normed))


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Gemma3DecoderLayer
    norm = GemmaRMSNorm

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        # HF multiplies by sqrt(hidden) held as a float32 scalar, rounded to the weights' dtype.
        self.embed_scale = float(config.hidden_size**0.5)

    @staticmethod
    def rope_tables(config: ModelArchConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """The global table (``rope_theta`` with ``rope_scaling``) and the local one (the sliding
        layers' ``rope_local_theta``, unscaled), stacked: ``[max_positions, 2, head_dim]``."""
        local = replace(config, rope_theta=config.rope_local_theta or config.rope_theta, rope_scaling=None)
        tables = [rope_tables(config), rope_tables(local)]
        return torch.stack([cos for cos, _ in tables], 1), torch.stack([sin for _, sin in tables], 1)

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden, cos, sin_signed = super().embed(input_ids, positions)
        scale = torch.tensor(self.embed_scale, dtype=torch.float32).to(hidden.dtype)
        return hidden * scale, cos, sin_signed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
