/*
 * Matmuls over GGUF blocks held exactly as the file stores them: Q4_0, Q5_0, Q5_1 (blocks of 32)
 * and the K-quants Q4_K, Q5_K, Q6_K (super-blocks of 256), byte for byte, rows of K weights one
 * after another (quants_k.h has the layouts and the decoding every route shares).
 *
 * Why these, and why as they are: a Q4_K_M file (what people download) is Q4_K and Q6_K, with
 * Q5_0 and Q8_0 where a row is not a multiple of 256 (Gemma 3 270M, SmolLM2, Qwen2.5-0.5B).
 * Expanding them to dense weights held SmolLM2's Q4_K_M in 2.15x its file; re-expressing Q4_K as
 * Q4_1 costs 1.11x (160 bytes where the file has 144) and rounds each sub-block's scale to fp16.
 * Held as they are, a file's weights take its own bytes and decode to the values ggml and the
 * gguf package give (quants_k.h), so `--quantization none` and `gguf` see the same weights.
 *
 * The routes, as quants.c's, each taken for every batch size it serves (a row's result does not
 * depend on what it is batched with):
 *   fp32: a sub-block decoded once to 32 fp32 weights (fmaf(d, q, m)), then fp32 multiply-adds
 *         against up to ROWS_PER_TILE rows of x;
 *   bf16: x in bf16 (arch/x86/quants_k.c where the CPU has AVX512-BF16; elsewhere widened
 *         exactly to fp32 and the fp32 route);
 *   a8:   x quantized to int8 per 32 by quants_a8.c: quants_k_a8.c.
 * This file holds the portable C of the first two; arch/x86/quants_k.c the vector twins
 * (quants_k.h, arch_fallback.h). pd_quant_matmul, pd_quant_matmul_a8 and pd_quant_dequant (quants.c,
 * quants_a8.c) hand these kinds here, so the fused decoder layer takes any mix of kinds.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "isa.h"
#include "bf16.h"
#include "blocks.h"
#include "quants.h"
#include "quants_k.h"
#include <omp.h>

/* One sub-block's 32 weights in fp32: exactly the file's values (quants_k.h). */
static inline void sub_block_weights(int kind, const uint8_t *row, int64_t s, float *w) {
    SubBlock sb;
    k_sub_block(kind, row, s, &sb);
    for (int j = 0; j < 32; j++) w[j] = fmaf(sb.d[j / 16], (float)sb.q[j], sb.m[j / 16]);
}

/* The fp32 route in plain C: output rows split between threads, tiles of ROWS_PER_TILE rows of x,
 * each sub-block decoded once a tile. */
void pd_quant_k_gemm_f32_generic(int kind, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                                 void *y, int y_is_bf16, int threads) {
    const int64_t subs = K / QK, row_bytes = k_row_bytes(kind, K);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_TILE) {
            const int rows = (int)(M - m0 < ROWS_PER_TILE ? M - m0 : ROWS_PER_TILE);
            float dot[ROWS_PER_TILE] = {0}, weights[QK];
            for (int64_t s = 0; s < subs; s++) {
                sub_block_weights(kind, row, s, weights);
                for (int r = 0; r < rows; r++) {
                    const float *xb = x + (m0 + r) * K + s * QK;
                    float sum = 0.0f;
                    for (int j = 0; j < QK; j++) sum += weights[j] * xb[j];
                    dot[r] += sum;
                }
            }
            for (int r = 0; r < rows; r++) put_f32(y, y_is_bf16, (m0 + r) * N + n, dot[r]);
        }
    }
}

/* bf16 x where no bf16 route runs: widened exactly, then the fp32 route. */
void pd_quant_k_gemm_bf16_generic(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                                  void *y, int y_is_bf16, int threads) {
    float *xf = (float *)malloc((size_t)(M * K) * sizeof(float));
    if (xf == NULL) return;
    for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_fp32(x[i]);
    pd_quant_k_gemm_f32(kind, xf, M, K, w, N, y, y_is_bf16, threads);
    free(xf);
}

/* out[i, :] = W[rows[i], :] decoded (rows == NULL: every row), in fp32 or bf16: for the embedding
 * lookup and prefill chunks (pd_quant_dequant's contract, quants.c). */
void pd_quant_k_dequant_generic(int kind, const uint8_t *w, int64_t K, const int64_t *rows, int64_t count, void *out,
                                int out_is_bf16, int threads) {
    const int64_t subs = K / QK, row_bytes = k_row_bytes(kind, K);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && count > 64)
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = w + (rows ? rows[i] : i) * row_bytes;
        float weights[QK];
        for (int64_t s = 0; s < subs; s++) {
            sub_block_weights(kind, row, s, weights);
            for (int j = 0; j < QK; j++) put_f32(out, out_is_bf16, i * K + s * QK + j, weights[j]);
        }
    }
}

/* 1 when these kinds' fp32 and bf16 routes run vector code here (AVX-512: arch/x86/quants_k.c),
 * 0 where they would run the plain loops above (correct, 30-80x slower): the model loader then
 * holds such tensors dense, as it did before these kinds had kernels. */
int pd_quant_k_route(void) {
#if PD_HAS_AVX512
    return 1;
#else
    return 0;
#endif
}
