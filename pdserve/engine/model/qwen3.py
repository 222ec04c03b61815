"""Qwen3 over pdserve's paged KV cache: Llama's layers with qk-norm.

HF's ``Qwen3ForCausalLM`` normalises each query and key head (``self_attn.q_norm`` /
``k_norm``, Llama-style RMSNorms over ``head_dim``) after the projection and before RoPE; its
``head_dim`` is its own number (128), not ``hidden_size / num_heads``. Everything else is
Llama's (``llama.py``): SwiGLU, pre-norms, the same state-dict names; the fused one-call C
decoder layer takes the qk-norm too.
"""

from __future__ import annotations

from typing import cast

import torch

from pdserve.engine.model.arch import ModelArchConfig
from pdserve.engine.model.layers.attention import AttentionMetadata
from pdserve.engine.model.layers.norm import RMSNorm, norm_qk_heads
from pdserve.engine.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    fusable_projections,
)
from pdserve.kernels.cpu import decoder_layer as cpu_decoder_layer


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelArchConfig, layer_index: int = 0) -> None:
        super().__init__(config, layer_index)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.project_qkv(hidden)
        norm_qk_heads(qkv, self.num_heads, self.num_kv_heads, self.q_norm, self.k_norm)
        return self.attend(qkv, cos, sin_signed, kv_cache_layer, meta)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention

    def fused(self) -> cpu_decoder_layer.PreparedLayer | None:
        """``LlamaDecoderLayer.fused`` with the qk-norm's weights."""
        if not self._fused_asked:
            self._fused_asked = True
            attn = cast(Qwen3Attention, self.self_attn)
            norms = (self.input_layernorm, self.post_attention_layernorm, attn.q_norm, attn.k_norm)
            held = fusable_projections(attn, self.mlp, norms)
            if held is not None:
                self._fused = cpu_decoder_layer.PreparedLayer(
                    **held,
                    input_norm=self.input_layernorm.weight,
                    post_norm=self.post_attention_layernorm.weight,
                    qkv_bias=attn.qkv_proj.bias,
                    q_norm=attn.q_norm.weight,
                    k_norm=attn.k_norm.weight,
                )
        return self._fused


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Qwen3DecoderLayer
