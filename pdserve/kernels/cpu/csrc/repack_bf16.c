/*
 * Interleaved weight blocks (kinds Q4_1_X16 and Q8_0_X16, repack_a8.c's layout: 16 rows at a
 * time) against bf16 activations, on CPUs with AVX512-BF16: the decode matmuls and the LM head
 * of --quantization gguf (the default) in bf16.
 *
 * Why: the row-major routes (quants.c) leave a block's dot in the lanes of one vector, so
 * per output row and row of x they pay a horizontal sum, and decode a weight row's block again
 * for every tile of rows of x: SmolLM2-135M's layer matrices took 15.5 ms a decode step at 8
 * sequences on one Zen 5 core, six times the time to read them, and its Q8_0 LM head 1.0 ms at
 * one sequence (0.75 to read it). Interleaved, lane r of every vector is weight row r: one
 * chunk's bytes become vectors of bf16 pairs shared by every row of x, each multiplied by one
 * broadcast pair of x with one vdpbf16ps that serves 16 outputs, and results leave as vectors.
 *
 * Decoding Q4_1 without a table: a 4-bit value v is made the bf16 128 + v by OR-ing it into
 * the mantissa of 128.0 (0x4300: seven mantissa bits, step 1 between 128 and 256). Each 32-bit
 * lane of a chunk's word holds a row's bytes [b0 b1 b2 b3]; masking the lane, and it shifted by
 * 8, 4 and 12, with 0x000F000F gives the low nibbles of (b0, b2) and (b1, b3) and the high
 * ones, already one pair per lane: one shift and one vpternlogd (mask and OR in one) a pair,
 * where a table lookup took a shuffle, a mask and a vpermw. x is reordered once per call to
 * match: pairs (j, j + 2).
 *
 *   Q4_1 (w = d q + m, q a nibble): a block's 16 bytes are 4 words, nibble bytes k = 0..15
 *   holding inputs k (low) and 16 + k (high). T = sum_j (128 + q_j) x_j, so
 *   y = sum_b d T + (m - 128 d) xsum (xsum: the block's x summed).
 *   Q4_1's T is summed in four chains of four pairs (chain i: word i's four pairs in order),
 *   added as (c0 + c1) + (c2 + c3).
 *
 *   Q8_0 (w = d q, q int8, stored as u = q + 128): 8 words, byte k inputs k. A byte u (0-255)
 *   is an integer bf16 holds exactly, so it is converted, not split: a word's 64 bytes become
 *   four fp32 vectors (vpmovzxbd, vcvtdq2ps) and two bf16 vectors (vcvtne2ps2bf16, exact
 *   here), one for rows 0-7 and one for rows 8-15, lane 2 r + h holding row r's inputs
 *   (4 i + 2 h, 4 i + 2 h + 1). x then needs no reordering: its inputs 4 i .. 4 i + 3 are one
 *   64-bit broadcast. A block is two chains a row (h = 0, 1), 8 words each in order; the
 *   chains' lanes are paired back to rows (T = chain 0 + chain 1) and
 *   y = sum_b d (T - 128 xsum). One vdpbf16ps a pair of weights, where splitting u into two
 *   nibbles (each OR-ed into a bf16) took two: SmolLM2-135M's LM head at 8 rows of x went from
 *   2.3 to 1.4 ms on one Zen 5 core (4 rows: 1.18 -> 0.89; 1 row: the same, memory-bound).
 *
 * Every product is exact in fp32 (8-bit by 8-bit significands); the offsets cost a few bits of
 * fp32 on the sums (relative 2^-19 at worst, against bf16's 2^-9 on the output). Each row's
 * sums run in the same order whatever rows share its batch, so a row's result does not depend on
 * its batch. The plain loop (CPUs without AVX512-BF16) sums in the same order, up to how
 * vdpbf16ps rounds inside a pair.
 *
 * This file holds the entry, x's preparation, the route query and the plain loop; the
 * AVX512-BF16 kernels are arch/x86/repack_bf16.c's pd_repack_bf16_gemm, the native twin of
 * pd_repack_bf16_gemm_generic here (repack.h, arch_fallback.h).
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

/* The input of Q4_1's pair p of word i, for its first element (the second is 2 on). */
static inline int pair_input(int i, int p) { return 4 * i + (p & 1) + (p & 2 ? 16 : 0); }

/* xsum [M, blocks]: each block's x summed in fp32, in order; and for Q4_1 xs [M, blocks, 16
 * pairs]: each block's x as the kernels read its pairs, word by word (Q8_0 reads x as it is). */
static void prepare_x(int kind, const uint16_t *x, int64_t M, int64_t K, uint16_t *xs, float *xsum) {
    const int64_t blocks = K / QK;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const uint16_t *xb = x + r * K + b * QK;
            if (plain_kind(kind) == KIND_Q4_1) {
                uint16_t *out = xs + r * K + b * QK;
                for (int i = 0; i < 4; i++)
                    for (int p = 0; p < 4; p++) {
                        const int j = pair_input(i, p);
                        *out++ = xb[j];
                        *out++ = xb[j + 2];
                    }
            }
            float sum = 0.0f;
            for (int j = 0; j < QK; j++) sum += bf16_to_fp32(xb[j]);
            xsum[r * blocks + b] = sum;
        }
}

/* A block's T for one (weight row, row of x), summed as the vector kernel sums it: Q4_1 the
 * four chains of word i's pairs (128 + nibble) against xs's reordered pairs; Q8_0 the two chains
 * (h = 0, 1) of words 0-7's pair (4 i + 2 h, 4 i + 2 h + 1) of u = q + 128 against x. */
static float block_t(int q4, const uint8_t *qs, const uint16_t *xb) {
    if (!q4) {
        float chain[2] = {0.0f, 0.0f};
        for (int i = 0; i < 8; i++)
            for (int h = 0; h < 2; h++) {
                const int j = 4 * i + 2 * h;
                const float u0 = (float)(qs[j] ^ 0x80), u1 = (float)(qs[j + 1] ^ 0x80);
                chain[h] = chain[h] + (u0 * bf16_to_fp32(xb[j]) + u1 * bf16_to_fp32(xb[j + 1]));
            }
        return chain[0] + chain[1];
    }
    static const int shift[4] = {0, 8, 4, 12};
    float chain[4];
    for (int i = 0; i < 4; i++) {
        uint32_t lane;
        memcpy(&lane, qs + 4 * i, 4);
        float sum = 0.0f;
        for (int p = 0; p < 4; p++) { /* pair by pair as vdpbf16ps adds */
            const uint32_t v = lane >> shift[p];
            const uint16_t *pair = xb + pair_at(i, p);
            sum = sum + ((128.0f + (float)(v & 15)) * bf16_to_fp32(pair[0]) +
                         (128.0f + (float)((v >> 16) & 15)) * bf16_to_fp32(pair[1]));
        }
        chain[i] = sum;
    }
    return (chain[0] + chain[1]) + (chain[2] + chain[3]);
}

/* The plain loop: the header's sums for one (weight row, row of x) at a time. */
void pd_repack_bf16_gemm_generic(int kind, const uint16_t *x, const uint16_t *xs, const float *xsum, int64_t M,
                                 int64_t K, const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads) {
    const int64_t blocks = K / QK;
    const int q4 = plain_kind(kind) == KIND_Q4_1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++)
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.0f, mins = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                uint8_t qs[QK]; /* x16_block gives Q8_0 back signed; block_t takes the stored u */
                uint16_t d16, m16;
                x16_block(kind, w, K, n, b, qs, &d16, &m16);
                const float t = block_t(q4, qs, (q4 ? xs : x) + r * K + b * QK);
                const float d = fp16_to_fp32(d16), x_sum = xsum[r * blocks + b];
                if (q4) {
                    acc = fmaf(t, d, acc);
                    mins = fmaf(fmaf(d, -128.0f, fp16_to_fp32(m16)), x_sum, mins);
                } else {
                    acc = fmaf(fmaf(x_sum, -Q8_0_OFFSET, t), d, acc);
                }
            }
            put_f32(y, y_is_bf16, r * N + n, acc + mins);
        }
}

/* y[M, N] = x[M, K] @ W^T for W Q4_1_X16 or Q8_0_X16 and x bf16. Returns 0, or -1 when a buffer
 * could not be allocated. */
int pd_repack_bf16_matmul(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
                          int y_is_bf16, int threads) {
    const int q4 = kind == KIND_Q4_1_X16; /* Q8_0 reads x as it is */
    float *xsum = (float *)malloc((size_t)(M * (K / QK)) * sizeof(float));
    uint16_t *xs = q4 ? (uint16_t *)malloc((size_t)(M * K) * sizeof(uint16_t)) : NULL;
    if (xsum == NULL || (q4 && xs == NULL)) {
        free(xsum);
        free(xs);
        return -1;
    }
    prepare_x(kind, x, M, K, xs, xsum);
    pd_repack_bf16_gemm(kind, x, xs, xsum, M, K, w, N, y, y_is_bf16, threads);
    free(xs);
    free(xsum);
    return 0;
}

/* 1 when bf16 x against the interleaved kinds runs the vector kernel here (AVX512-BF16). */
int pd_repack_bf16_route(void) {
#if PD_HAS_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}

