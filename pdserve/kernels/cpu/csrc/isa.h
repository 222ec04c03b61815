/*
 * The instruction sets a build of the CPU kernels may use, in pdserve's own names: the one file
 * that reads the compiler's feature macros (__AVX2__, __AVX512F__, ..., set by the -march the
 * library is built with: pdserve/kernels/cpu/build.py), so that every other source says what it
 * needs ("AVX512-VNNI", "the AVX2 route") and each condition is written once. Every macro is 0 or
 * 1 and is tested with #if (the build warns with -Wundef: a misspelt name is not a silent 0).
 *
 * What each one means, and which code takes it:
 *   PD_HAS_F16C          fp16 <-> fp32 in one instruction: blocks.h's fp16_to_fp32.
 *   PD_HAS_AVX2_FMA      8 fp32 lanes with fma: vexp.h's exp_nonpositive8, layer_ops.c's SiLU.
 *   PD_HAS_AVX2          AVX2, FMA and F16C (AVX-512 CPUs have them too): the quantized kernels'
 *                        AVX2 code (arch/x86/avx2.h; arch/x86/quants_a8.c's int8 kernels).
 *   PD_HAS_AVX512        AVX-512 Foundation, 16 fp32 or int32 lanes: the AVX-512 paths.
 *   PD_HAS_AVX512_BW     ... with 16-bit lanes (vpermw): bf16.h's fp32x16_to_bf16.
 *   PD_HAS_AVX512_BW_VL  ... with 16-bit lanes and AVX-512 on 256 bits (masked bf16 loads and
 *                        stores): layer_ops.c's 16-lane RMSNorm, RoPE and SiLU.
 *   PD_HAS_AVX512_BF16   vdpbf16ps and vcvtne2ps2bf16 (AMD Zen 4/5, Intel Cooper Lake and
 *                        Sapphire Rapids on): the bf16-activation kernels.
 *   PD_HAS_AVX512_VNNI   vpdpbusd on 512 bits, with AVX2, BW and VL (AMD Zen 4/5, Intel Ice Lake
 *                        on): the int8-activation kernels.
 * Routes, where a source picks one of exclusive paths:
 *   PD_ROUTE_AVX2        AVX2 (PD_HAS_AVX2) and no AVX-512 (AMD Zen 2/3, older Intel): the 8-lane
 *                        fp32 paths of arch/x86/quants.c and arch/x86/paged_attention.c; with
 *                        AVX-512 the 16-lane ones run instead.
 * Where a build lacks what a kernel's x86 version needs, its portable twin runs (arch_fallback.h).
 */
#ifndef PDSERVE_ISA_H
#define PDSERVE_ISA_H

#if defined(__F16C__)
#define PD_HAS_F16C 1
#else
#define PD_HAS_F16C 0
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define PD_HAS_AVX2_FMA 1
#else
#define PD_HAS_AVX2_FMA 0
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PD_HAS_AVX2 1
#else
#define PD_HAS_AVX2 0
#endif

#if defined(__AVX512F__)
#define PD_HAS_AVX512 1
#else
#define PD_HAS_AVX512 0
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PD_HAS_AVX512_BW 1
#else
#define PD_HAS_AVX512_BW 0
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PD_HAS_AVX512_BW_VL 1
#else
#define PD_HAS_AVX512_BW_VL 0
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PD_HAS_AVX512_BF16 1
#else
#define PD_HAS_AVX512_BF16 0
#endif

#if PD_HAS_AVX2 && PD_HAS_AVX512_BW_VL && defined(__AVX512VNNI__)
#define PD_HAS_AVX512_VNNI 1
#else
#define PD_HAS_AVX512_VNNI 0
#endif

#if PD_HAS_AVX2 && !PD_HAS_AVX512
#define PD_ROUTE_AVX2 1
#else
#define PD_ROUTE_AVX2 0
#endif

/* The intrinsics of every x86 instruction set (only those the build enables can be called). */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#endif
