/*
 * The int8-activation matmuls over weights interleaved 16 rows at a time (kinds Q4_1_X16 and
 * Q8_0_X16, made at load by pdserve/kernels/cpu/quant.py's interleave_rows for
 * --quantization gguf-a8 / int8-a8 on CPUs with AVX512-VNNI): the arithmetic of
 * quants_a8.c (x quantized per block of 32, y = sum_b dw d (q . xq) + m s), with 16
 * output rows in the 16 int32 lanes of one vector.
 *
 * Why: the row-major kernels (arch/x86/quants_a8.c) put a block's dot in a few lanes of a vector, so per
 * block and row they pay a permute of the scales, a conversion and an fma, and per output row a
 * horizontal sum; at eight rows of x their SmolLM2-135M matmuls took 13.7 ms a step on one Zen 5
 * core, five times the time to read the weights. Interleaved, lane r of every vector is weight
 * row r of the group: one vpdpbusd per four inputs serves 16 outputs, x's four bytes are one
 * broadcast, the 16 rows' scales one load, and the results leave as stored vectors.
 *
 * Layout: a matrix of N rows (a multiple of 16) and K inputs is N / 16 groups, each its blocks in
 * order, each (group, block) one chunk of 16 blocks' bytes:
 *   Q4_1_X16 (320 bytes): 4 vectors of 64 bytes, vector i's lane r holding bytes 4i-4i+3 of row
 *     r's 16 nibble bytes (low nibbles: inputs 4i-4i+3 of the block, high: 16+4i-16+4i+3); then
 *     the 16 rows' fp16 d, then their fp16 m;
 *   Q8_0_X16 (544 bytes): 8 vectors, vector i's lane r holding row r's int8 weights 4i-4i+3 plus
 *     128 (unsigned, as vpdpbusd's first operand takes them); then the 16 rows' fp16 d.
 * The bytes are the blocks' own, moved: the matrix takes exactly its plain layout's memory.
 * Q8_0's +128 is taken back by starting each block's int32 lanes at -128 times the sum of x's
 * 32 int8 there (the same integer as the signed dot).
 *
 * Per block and row of x, in this order for every (weight row, row of x) pair, in the vector
 * kernel and in the plain loop alike (so both give the same bits, and a row's result does not
 * depend on its batch): acc = fma(float(dot), dw * d, acc); for Q4_1 also mins = fma(m, s, mins);
 * y = acc + mins.
 *
 * This file holds the entry, the route query and the plain loop (CPUs without AVX512-VNNI: correct,
 * slow); the vpdpbusd kernel is arch/x86/repack_a8.c's pd_repack_a8_gemm, the native twin of
 * pd_repack_a8_gemm_generic here (repack.h, arch_fallback.h).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "isa.h"
#include "bf16.h"
#include "blocks.h"
#include "kernels.h"
#include "repack.h"
#include <omp.h>

/* The plain loop: one (weight row, row of x) at a time through x16_block, in the header's order. */
void pd_repack_a8_gemm_generic(int kind, X16In x, int64_t M, const uint8_t *w, int64_t N, void *y, int y_is_bf16,
                               int threads) {
    const int64_t blocks = x.K / QK;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++)
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.0f, mins = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                uint8_t qs[QK];
                uint16_t d16, m16;
                x16_block(kind, w, x.K, n, b, qs, &d16, &m16);
                const int8_t *xq = x.q + r * x.K + b * QK;
                int32_t dot = 0;
                if (kind == KIND_Q4_1_X16)
                    for (int j = 0; j < 16; j++) dot += (qs[j] & 15) * xq[j] + (qs[j] >> 4) * xq[j + 16];
                else
                    for (int j = 0; j < QK; j++) dot += (int8_t)qs[j] * xq[j];
                acc = fmaf((float)dot, fp16_to_fp32(d16) * x.d[r * x.stride + b], acc);
                if (kind == KIND_Q4_1_X16) mins = fmaf(fp16_to_fp32(m16), x.s[r * x.stride + b], mins);
            }
            put_f32(y, y_is_bf16, r * N + n, kind == KIND_Q4_1_X16 ? acc + mins : acc);
        }
}

/* y[M, N] = x @ W^T for W Q4_1_X16 or Q8_0_X16 (N a multiple of 16) and x quantized by quants_a8.c
 * (q [M, K], d and s [M, stride]). Returns 0, or -1 when a buffer could not be allocated. */
int pd_repack_a8_matmul(int kind, const int8_t *q, const float *d, const float *s, int64_t stride, int64_t M,
                        int64_t K, const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads) {
    const int64_t blocks = K / QK;
    int32_t *start = NULL;
    if (kind == KIND_Q8_0_X16) {
        start = (int32_t *)malloc((size_t)(M * blocks) * sizeof(int32_t));
        if (start == NULL) return -1;
        for (int64_t i = 0; i < M * blocks; i++) {
            int32_t sum = 0;
            for (int j = 0; j < QK; j++) sum += q[i * QK + j];
            start[i] = -128 * sum;
        }
    }
    const X16In x = {q, d, s, start, K, stride};
    pd_repack_a8_gemm(kind, x, M, w, N, y, y_is_bf16, threads);
    free(start);
    return 0;
}

/* 1 when the interleaved kinds run the vector kernel here (else the plain loop: correct, slow),
 * so that the loader interleaves only where that pays. */
int pd_repack_a8_route(void) {
#if PD_HAS_AVX512_VNNI
    return 1;
#else
    return 0;
#endif
}

