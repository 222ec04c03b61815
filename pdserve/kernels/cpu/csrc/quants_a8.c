/*
 * Quantized-weight matmuls with int8 activations: y[M, N] = x[M, K] @ W[N, K]^T, W in GGUF's
 * blocks (the layouts of quants.c), x quantized per block of 32 first. Opt-in
 * (--quantization gguf-a8 / int8-a8): pd_quant_matmul keeps x in its dtype.
 *
 * Why: on a CPU without AVX-512 (the AMD Zen 3 here) the fp32-activation kernel is bound by its
 * arithmetic, not by memory: per 8 weights it converts them to fp32 and does an fp32 fma, 2.7-2.9
 * ns a Q4_1 block against 1.3 ns to stream the block's 20 bytes. With x in int8, vpmaddubsw
 * multiplies 32 weights by 32 activations and adds them in pairs in one instruction, and the
 * block's sum is one vpmaddwd and one conversion away: llama.cpp's Q4_1 x Q8_1 dot, the reason
 * its decode outran ours at one stream.
 *
 * x's quantization is llama.cpp's Q8_1, with its scale kept in fp32: for each row and block of
 * 32, d = max|x| / 127, q = x * (1 / d) rounded to the nearest integer, ties to even (0 where d
 * is 0), and s = d * sum(q). Then
 *   Q4_1: sum_j (dw q_j + m) (d xq_j) ~= dw d (q . xq) + m s
 *   Q8_0: sum_j (dw q_j) (d xq_j)     ~= dw d (q . xq)
 * with the integer dots exact. The error is x's rounding only (relative 1/254 of the block's
 * largest activation at worst, per element); tests/engine/model/test_quality_quant.py measures what it costs.
 *
 * Q4_1 runs two blocks a step (pair_q4_1_a8, x stored in the order it reads them): one load and
 * one vpmaddwd/conversion/fma for two blocks. At one row of x, SmolLM2's layer matrices in cache
 * went from 1.88 to 1.25 ns a block; streamed from memory, from 1.5-1.6x to 1.33-1.43x the time of
 * a pure read of their bytes (one core of the AMD EPYC Zen 3 here).
 *
 * On CPUs with AVX512-VNNI both run on 512-bit vpdpbusd instead: Q4_1 four blocks a step, Q8_0
 * two.
 *
 * A row's sum runs the same way whatever M is (one chain of fmas a block; Q4_1's minima into
 * it 8 blocks at a time), so a request's logits do not depend on what it is batched with.
 *
 * This file holds the entry point, x's quantization and the plain C loop (CPUs without AVX2);
 * the AVX-512 quantization and the AVX2 and AVX512-VNNI kernels are arch/x86/quants_a8.c's, each
 * the native twin of a _generic function here (quants.h, arch_fallback.h). Built into the
 * quantized-matmul library (pdserve/kernels/cpu/quant.py) at first use with -march=native.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "isa.h"
#include "bf16.h"
#include "blocks.h"
#include "kernels.h"
#include "quants.h"
#include "quants_k.h"
#include "repack.h"
#include <omp.h>

/* x [M, K] (bf16 or fp32) per block of 32: q [M, K] int8, d and s [M, stride] fp32 (zero past
 * the row's blocks, so that loads of 8 or 16 blocks' scales stay in bounds), as the header says.
 * With AVX-512 (arch/x86/quants_a8.c) a block is two vectors, with the same operations in the
 * same order as this plain loop (IEEE division and product, rounding to nearest even), so both
 * give the same bits. */
void pd_quant_a8_quantize_generic(const void *x, int x_is_bf16, int64_t M, int64_t K, int8_t *q, float *d, float *s,
                                  int64_t stride) {
    const int64_t blocks = K / QK;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t first = r * K + b * QK;
            float values[QK], amax = 0.0f;
            for (int j = 0; j < QK; j++) values[j] = get_f32(x, x_is_bf16, first + j);
            for (int j = 0; j < QK; j++) { /* not fmaxf: a library call per element, not vectorised */
                const float magnitude = fabsf(values[j]);
                amax = magnitude > amax ? magnitude : amax;
            }
            const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
            int sum = 0;
            for (int j = 0; j < QK; j++) {
                const int v = (int)nearbyintf(values[j] * inverse); /* ties to even: the default mode */
                q[first + j] = (int8_t)v;
                sum += v;
            }
            d[r * stride + b] = scale;
            s[r * stride + b] = scale * (float)sum;
        }
}

/* Without AVX2: the same arithmetic, a block at a time in plain C. */
int pd_quant_a8_gemm_generic(int kind, int8_t *q, const float *d, const float *s, int64_t stride, int64_t M,
                             int64_t K, const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads) {
    const int64_t blocks = K / QK, row_bytes = blocks * block_bytes(kind);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *w_row = w + n * row_bytes;
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                const int8_t *xq = q + r * K + b * QK;
                int dot = 0;
                float dw, m = 0.0f;
                if (kind == 0) {
                    const uint16_t *scales = (const uint16_t *)(w_row + K / 2);
                    const uint8_t *qs = w_row + b * 16;
                    for (int j = 0; j < 16; j++) dot += (qs[j] & 15) * xq[j] + (qs[j] >> 4) * xq[j + 16];
                    dw = fp16_to_fp32(scales[b]);
                    m = fp16_to_fp32(scales[blocks + b]);
                } else {
                    const uint8_t *block = w_row + b * Q8_0_BYTES;
                    const int8_t *qs = (const int8_t *)(block + 2);
                    for (int j = 0; j < QK; j++) dot += qs[j] * xq[j];
                    dw = fp16_to_fp32(*(const uint16_t *)block);
                }
                acc += (float)dot * (dw * d[r * stride + b]) + m * s[r * stride + b];
            }
            put_f32(y, y_is_bf16, r * N + n, acc);
        }
    }
    return 0;
}

/*
 * y[M, N] = x[M, K] @ W^T with x quantized to int8 per block of 32 (the header). kind 0: Q4_1
 * rows, 1: Q8_0 blocks, as pd_quant_matmul takes them, 2 and 3 the same interleaved by 16 rows
 * (repack_a8.c; N a multiple of 16), 4-9 the kinds held as GGUF stores them (quants_k.h), 10-13
 * GGUF's Q4_0, Q5_0, Q5_1, Q4_K interleaved by 16 rows (repack_a8.c); x and y bf16 (flag 1) or fp32 (flag 0),
 * contiguous; K a multiple of 32. Returns 0, or -1 when its buffers could not be allocated
 * (nothing written then).
 */
int pd_quant_matmul_a8(int kind, const void *x, int x_is_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                       void *y, int y_is_bf16, int threads) {
    const int64_t blocks = K / QK, stride = (blocks + 15) / 16 * 16; /* arch/x86/quants_a8.c reads 16 at a time */
    if (M <= 0 || N <= 0) return 0; /* nothing to compute (and malloc(0) may return NULL) */
    int8_t *q = (int8_t *)malloc((size_t)(M * K));
    float *d = (float *)calloc((size_t)(M * stride), sizeof(float));
    float *s = (float *)calloc((size_t)(M * stride), sizeof(float));
    if (q == NULL || d == NULL || s == NULL) {
        free(q);
        free(d);
        free(s);
        return -1;
    }
    pd_quant_a8_quantize(x, x_is_bf16, M, K, q, d, s, stride);
    int status;
    if (is_k_kind(kind)) /* held as GGUF stores them (quants_k.c) */
        status = pd_quant_k_a8_gemm(kind, q, d, stride, M, K, w, N, y, y_is_bf16, threads);
    else if (is_x16(kind) || is_x16_gguf(kind)) /* rows interleaved by 16 (repack_a8.c) */
        status = pd_repack_a8_matmul(kind, q, d, s, stride, M, K, w, N, y, y_is_bf16, threads);
    else
        status = pd_quant_a8_gemm(kind, q, d, s, stride, M, K, w, N, y, y_is_bf16, threads);
    free(q);
    free(d);
    free(s);
    return status;
}
