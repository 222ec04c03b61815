/*
 * Where a build has no native version of a kernel, its portable twin takes the kernel's name:
 * NAME_generic (plain C, in csrc/<family>.c) becomes NAME, which arch/x86/<family>.c defines
 * where the build's instruction sets have what it needs (isa.h). The one place that maps each
 * kernel to its fallback, as ggml-cpu's arch-fallback.h does; each condition is the negation of
 * the one its native version is compiled under. Included through the family headers (quants.h,
 * repack.h, attention.h), before the twins are declared or defined.
 */
#ifndef PDSERVE_ARCH_FALLBACK_H
#define PDSERVE_ARCH_FALLBACK_H
#include "isa.h"

/* quants.c: the fp32 route (AVX-512, or AVX2), the bf16 routes (AVX512-BF16; elsewhere bf16 x is
 * widened and takes the fp32 route), the dequantization (AVX-512) */
#if !PD_HAS_AVX512 && !PD_ROUTE_AVX2
#define pd_quant_gemm_f32_generic pd_quant_gemm_f32
#endif
#if !PD_HAS_AVX512_BF16
#define pd_quant_gemm_bf16_generic pd_quant_gemm_bf16
#endif
#if !PD_HAS_AVX512
#define pd_quant_dequant_generic pd_quant_dequant
#endif

/* quants_a8.c: x's quantization (AVX-512), the int8 dots (AVX2, or AVX512-VNNI) */
#if !PD_HAS_AVX512
#define pd_quant_a8_quantize_generic pd_quant_a8_quantize
#endif
#if !PD_HAS_AVX2
#define pd_quant_a8_gemm_generic pd_quant_a8_gemm
#endif

/* quants_k.c: the fp32 route and the dequantization (AVX-512), the bf16 route (AVX512-BF16;
 * elsewhere bf16 x is widened and takes the fp32 route); quants_k_a8.c: the int8
 * dots (AVX2, or AVX512-VNNI) */
#if !PD_HAS_AVX512
#define pd_quant_k_gemm_f32_generic pd_quant_k_gemm_f32
#define pd_quant_k_dequant_generic pd_quant_k_dequant
#endif
#if !PD_HAS_AVX512_BF16
#define pd_quant_k_gemm_bf16_generic pd_quant_k_gemm_bf16
#endif
#if !PD_HAS_AVX2
#define pd_quant_k_a8_gemm_generic pd_quant_k_a8_gemm
#endif

/* repack_a8.c (AVX512-VNNI), repack_bf16.c (AVX512-BF16) */
#if !PD_HAS_AVX512_VNNI
#define pd_repack_a8_gemm_generic pd_repack_a8_gemm
#endif
#if !PD_HAS_AVX512_BF16
#define pd_repack_bf16_gemm_generic pd_repack_bf16_gemm
#endif

/* paged_attention.c (AVX-512, or AVX2), causal_attention.c (AVX512-BF16) */
#if !PD_HAS_AVX512 && !PD_ROUTE_AVX2
#define pd_paged_decode_attention_generic pd_paged_decode_attention
#endif
#if !PD_HAS_AVX512_BF16
#define pd_causal_attention_bf16_generic pd_causal_attention_bf16
#endif
#endif
