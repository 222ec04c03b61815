/*
 * The kinds held as GGUF stores them (quants_k.c, quants_k.h) against activations quantized to
 * int8 per block of 32 (quants_a8.c's x: q, and its scale d per block; --quantization gguf-a8):
 * per half of a 32-weight sub-block, the exact integer dot of the weights' unsigned q with x's
 * int8 and the sum of x's int8, so that
 *     sum_j w_j x_j ~= dx * sum_h (d[h] (q . xq)_h + m[h] sum(xq)_h)
 * with x's rounding the only error, as for Q4_1 and Q8_0 (quants_a8.c's header). Two halves,
 * because Q6_K scales every 16 weights; the other kinds have one d and m for both.
 * This file holds the plain C loop; arch/x86/quants_k_a8.c the vector twins (quants_k.h,
 * arch_fallback.h). pd_quant_matmul_a8 (quants_a8.c) quantizes x and hands these kinds here.
 */
#include <stdint.h>
#include "isa.h"
#include "bf16.h"
#include "blocks.h"
#include "quants_k.h"
#include <omp.h>

/* In plain C: per half of each sub-block, d q . xq + m sum(xq) in exact integers
 * scaled once, times x's block scale d; x's int8 q [M, K] and scales d [M, stride] as
 * pd_quant_a8_quantize makes them. Returns 0. */
int pd_quant_k_a8_gemm_generic(int kind, const int8_t *q, const float *d, int64_t stride, int64_t M, int64_t K,
                               const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads) {
    const int64_t subs = K / QK, row_bytes = k_row_bytes(kind, K);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.0f;
            for (int64_t s = 0; s < subs; s++) {
                SubBlock sb;
                k_sub_block(kind, row, s, &sb);
                const int8_t *xq = q + r * K + s * QK;
                float block = 0.0f;
                for (int h = 0; h < 2; h++) {
                    int dot = 0, sum = 0;
                    for (int j = 16 * h; j < 16 * h + 16; j++) {
                        dot += sb.q[j] * xq[j];
                        sum += xq[j];
                    }
                    block += sb.d[h] * (float)dot + sb.m[h] * (float)sum;
                }
                acc += block * d[r * stride + s];
            }
            put_f32(y, y_is_bf16, r * N + n, acc);
        }
    }
    return 0;
}
