/*
 * Interleaved weight blocks (kinds Q4_1_X16 and Q8_0_X16, int8_x16.c's layout: 16 rows at a
 * time) against bf16 activations, on CPUs with AVX512-BF16: the decode matmuls and the LM head
 * of --quantization gguf (the default) in bf16.
 *
 * Why: the row-major routes (quant_matmul.c) leave a block's dot in the lanes of one vector, so
 * per output row and row of x they pay a horizontal sum, and decode a weight row's block again
 * for every tile of rows of x: SmolLM2-135M's layer matrices took 15.5 ms a decode step at 8
 * sequences on one Zen 5 core, six times the time to read them, and its Q8_0 LM head 1.0 ms at
 * one sequence (0.75 to read it). Interleaved, lane r of every vector is weight row r: one
 * chunk's bytes become vectors of bf16 pairs shared by every row of x, each multiplied by one
 * broadcast pair of x with one vdpbf16ps that serves 16 outputs, and results leave as vectors.
 *
 * Decoding without a table: a 4-bit value v is made the bf16 128 + v by OR-ing it into the
 * mantissa of 128.0 (0x4300: seven mantissa bits, step 1 between 128 and 256), and 16 v as
 * 2048 + 16 v (0x4500, step 16). Each 32-bit lane of a chunk's word holds a row's bytes
 * [b0 b1 b2 b3]; masking the lane, and it shifted by 8, 4 and 12, with 0x000F000F gives the
 * low nibbles of (b0, b2) and (b1, b3) and the high ones, already one pair per lane: one shift
 * and one vpternlogd (mask and OR in one) a pair, where a table lookup took a shuffle, a mask
 * and a vpermw. x is reordered once per call to match: pairs (j, j + 2).
 *
 *   Q4_1 (w = d q + m, q a nibble): a block's 16 bytes are 4 words, nibble bytes k = 0..15
 *   holding inputs k (low) and 16 + k (high). T = sum_j (128 + q_j) x_j, so
 *   y = sum_b d T + (m - 128 d) xsum (xsum: the block's x summed).
 *   Q8_0 (w = d q, q int8, stored as u = q + 128 = 16 h + l): 8 words, byte k inputs k. Both
 *   nibbles of u go in, T = sum_j (128 + l_j) x_j + (2048 + 16 h_j) x_j = sum u x + 2176 xsum,
 *   so y = sum_b d (T - 2304 xsum).
 *
 * Every product is exact in fp32 (8-bit by 8-bit significands); the offsets cost a few bits of
 * fp32 on the sums (relative 2^-19 at worst, against bf16's 2^-9 on the output). T is summed
 * in four chains of four pairs (chain i: word i's four pairs in order, and for Q8_0 words i
 * and 4 + i as two halves added after), added as (c0 + c1) + (c2 + c3), so a row's result does
 * not depend on its batch. The plain loop (CPUs without AVX512-BF16) sums in the same order, up
 * to how vdpbf16ps rounds inside a pair.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "avx2.h"
#include "bf16.h"
#include "blocks.h"
#include "kernels.h"
#include <omp.h>

#define BF16_X16_ROWS 4 /* rows of x a pass over a group's blocks serves */
#define BF16_X16_PREFETCH_BYTES 8192 /* how far ahead of the chunk being read the weights are asked for */
#define LOW_128 0x4300u   /* bf16 128.0: OR a value 0-15 into it for 128 + v */
#define HIGH_2048 0x4500u /* bf16 2048.0: OR v for 2048 + 16 v */
#define Q8_0_OFFSET 2304.0f /* 2176 from the two nibbles' offsets, 128 from u = q + 128 */

/* The input of pair p (0-3) of word i, for its first element (the second is 2 on): p = 0 low
 * nibbles of bytes (0, 2), 1 low of (1, 3), 2 high of (0, 2), 3 high of (1, 3). */
static inline int pair_input(int kind, int i, int p) {
    if (plain_kind(kind) == KIND_Q4_1) return 4 * i + (p & 1) + (p & 2 ? 16 : 0);
    return 4 * i + (p & 1);
}

/* Where pair p of word i starts in a block of xs (prepare_x's order): Q4_1 has 4 distinct pairs
 * a word, Q8_0 2 (its low and high nibbles share them). */
static inline int pair_at(int q4, int i, int p) { return q4 ? 8 * i + 2 * p : 4 * i + 2 * (p & 1); }

/* xs [M, blocks, pairs]: each block's x as the kernels read its pairs, word by word (Q4_1: 4
 * words x 4 pairs; Q8_0: 8 words x 2 distinct pairs, low and high nibbles sharing them). And
 * xsum [M, blocks]: each block's x summed in fp32, in order. */
static void prepare_x(int kind, const uint16_t *x, int64_t M, int64_t K, uint16_t *xs, float *xsum) {
    const int64_t blocks = K / QK;
    const int q4 = plain_kind(kind) == KIND_Q4_1, words = x16_words(kind), pairs = q4 ? 4 : 2;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const uint16_t *xb = x + r * K + b * QK;
            uint16_t *out = xs + r * K + b * QK;
            for (int i = 0; i < words; i++)
                for (int p = 0; p < pairs; p++) {
                    const int j = pair_input(kind, i, p);
                    *out++ = xb[j];
                    *out++ = xb[j + 2];
                }
            float sum = 0.0f;
            for (int j = 0; j < QK; j++) sum += bf16_to_fp32(xb[j]);
            xsum[r * blocks + b] = sum;
        }
}

/* Pair p of a word's lane (its row's 4 bytes) as the two exact fp32 the vector kernel makes of
 * it: 128 + a nibble, or for Q8_0's high nibbles 2048 + 16 times it. */
static inline void decode_pair(int kind, uint32_t lane, int p, float *first, float *second) {
    static const int shift[4] = {0, 8, 4, 12};
    const uint32_t v = lane >> shift[p];
    const int high = p >= 2 && plain_kind(kind) == KIND_Q8_0;
    const float base = high ? 2048.0f : 128.0f, step = high ? 16.0f : 1.0f;
    *first = base + step * (float)(v & 15);
    *second = base + step * (float)((v >> 16) & 15);
}

/* The plain loop: the header's sums for one (weight row, row of x) at a time. */
static void bf16_x16_plain(int kind, const uint16_t *xs, const float *xsum, int64_t M, int64_t K, const uint8_t *w,
                           int64_t N, void *y, int y_is_bf16, int threads) {
    const int64_t blocks = K / QK;
    const int q4 = plain_kind(kind) == KIND_Q4_1, halves = q4 ? 1 : 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++)
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.0f, mins = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                uint8_t qs[QK];
                uint16_t d16, m16;
                x16_block(kind, w, K, n, b, qs, &d16, &m16);
                const uint16_t *xb = xs + r * K + b * QK;
                float t = 0.0f;
                for (int half = 0; half < halves; half++) {
                    float chain[4];
                    for (int c = 0; c < 4; c++) { /* word 4 half + c, pair by pair as vdpbf16ps adds */
                        const int i = 4 * half + c;
                        uint32_t lane; /* as the vector kernel's lane holds it: Q8_0 plus 128 */
                        memcpy(&lane, qs + 4 * i, 4);
                        if (!q4) lane ^= 0x80808080u;
                        float sum = 0.0f;
                        for (int p = 0; p < 4; p++) {
                            const uint16_t *pair = xb + pair_at(q4, i, p);
                            float q0, q1;
                            decode_pair(kind, lane, p, &q0, &q1);
                            sum = sum + (q0 * bf16_to_fp32(pair[0]) + q1 * bf16_to_fp32(pair[1]));
                        }
                        chain[c] = sum;
                    }
                    t += (chain[0] + chain[1]) + (chain[2] + chain[3]);
                }
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

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* (v & 0x000F000F) | base in each lane: one vpternlogd (A & B) | C. */
static inline __m512bh nibble_pair(__m512i v, __m512i mask, __m512i base) {
    return (__m512bh)_mm512_ternarylogic_epi32(v, mask, base, 0xEA);
}

/* The four chains of `words` 4 words of a chunk (pairs[i][p]) against one row of x (its
 * reordered block xb), added as the header says. */
static inline __attribute__((always_inline)) __m512 chains_of(const __m512bh pairs[4][4], const uint16_t *xb,
                                                              int q4) {
    __m512 chain[4];
    for (int i = 0; i < 4; i++) {
        chain[i] = _mm512_setzero_ps();
        for (int p = 0; p < 4; p++) {
            const uint16_t *pair = xb + pair_at(q4, i, p);
            chain[i] = _mm512_dpbf16_ps(chain[i], pairs[i][p], (__m512bh)broadcast_u32(pair));
        }
    }
    return _mm512_add_ps(_mm512_add_ps(chain[0], chain[1]), _mm512_add_ps(chain[2], chain[3]));
}

/* Words 4 h .. 4 h + 3 of a chunk decoded into pairs. */
static inline __attribute__((always_inline)) void decode_words(const uint8_t *chunk, int h, int q4,
                                                               __m512bh pairs[4][4]) {
    const __m512i mask = _mm512_set1_epi32(0x000F000F), low = _mm512_set1_epi32((int)(LOW_128 * 0x10001u));
    const __m512i high = q4 ? low : _mm512_set1_epi32((int)(HIGH_2048 * 0x10001u));
    for (int i = 0; i < 4; i++) {
        const __m512i v = _mm512_loadu_si512(chunk + 64 * (4 * h + i));
        pairs[i][0] = nibble_pair(v, mask, low);
        pairs[i][1] = nibble_pair(_mm512_srli_epi32(v, 8), mask, low);
        pairs[i][2] = nibble_pair(_mm512_srli_epi32(v, 4), mask, high);
        pairs[i][3] = nibble_pair(_mm512_srli_epi32(v, 12), mask, high);
    }
}

/* 16 weight rows (a group, from its first chunk) against `rows` rows of reordered x: out[r]. */
static inline __attribute__((always_inline)) void group_bf16(int kind, const uint8_t *group, const uint16_t *xs,
                                                             int64_t K, const float *xsum, int rows, __m512 *out) {
    const int64_t blocks = K / QK;
    const int q4 = plain_kind(kind) == KIND_Q4_1, bytes = X16 * block_bytes(kind), words = x16_words(kind);
    __m512 acc[BF16_X16_ROWS], mins[BF16_X16_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = mins[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *chunk = group + b * bytes;
        for (int line = 0; line < (bytes + 63) / 64; line++)
            _mm_prefetch((const char *)chunk + BF16_X16_PREFETCH_BYTES + 64 * line, _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(chunk + 64 * words)));
        __m512bh pairs[4][4];
        if (q4) {
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(chunk + 64 * words + 32)));
            const __m512 offset_m = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.0f), m); /* m - 128 d */
            decode_words(chunk, 0, 1, pairs);
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) {
                const __m512 t = chains_of(pairs, xs + r * K + b * QK, 1);
                acc[r] = _mm512_fmadd_ps(t, d, acc[r]);
                mins[r] = _mm512_fmadd_ps(offset_m, _mm512_set1_ps(xsum[r * blocks + b]), mins[r]);
            }
        } else {
            __m512 t[BF16_X16_ROWS];
            decode_words(chunk, 0, 0, pairs);
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) t[r] = chains_of(pairs, xs + r * K + b * QK, 0);
            decode_words(chunk, 1, 0, pairs);
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) {
                t[r] = _mm512_add_ps(t[r], chains_of(pairs, xs + r * K + b * QK + 16, 0));
                const __m512 offset_t = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * blocks + b]),
                                                        _mm512_set1_ps(-Q8_0_OFFSET), t[r]);
                acc[r] = _mm512_fmadd_ps(offset_t, d, acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) out[r] = _mm512_add_ps(acc[r], mins[r]);
}

/* Group g of one kind against every tile of rows of x (kind a constant where it is inlined). */
static inline __attribute__((always_inline)) void group_tiles(int kind, int64_t g, const uint16_t *xs,
                                                              const float *xsum, int64_t M, int64_t K,
                                                              const uint8_t *w, int64_t N, void *y, int y_is_bf16) {
    const int64_t blocks = K / QK;
    const uint8_t *group = w + g * blocks * X16 * block_bytes(kind);
    for (int64_t m0 = 0; m0 < M; m0 += BF16_X16_ROWS) {
        const int rows = (int)(M - m0 < BF16_X16_ROWS ? M - m0 : BF16_X16_ROWS);
        __m512 out[BF16_X16_ROWS];
        const uint16_t *xt = xs + m0 * K;
        const float *st = xsum + m0 * blocks;
        switch (rows) {
            case 1: group_bf16(kind, group, xt, K, st, 1, out); break;
            case 2: group_bf16(kind, group, xt, K, st, 2, out); break;
            case 3: group_bf16(kind, group, xt, K, st, 3, out); break;
            default: group_bf16(kind, group, xt, K, st, 4, out); break;
        }
        for (int r = 0; r < rows; r++) put_f32x16(y, y_is_bf16, (m0 + r) * N + g * X16, out[r]);
    }
}

/* One function a kind, so that each is compiled for its own (an OpenMP loop is outlined once
 * whatever inlines it, and a kind known only at run time left GCC spilling the decoded pairs). */
static void bf16_x16_q4_1(const uint16_t *xs, const float *xsum, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                          void *y, int y_is_bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t g = 0; g < N / X16; g++) group_tiles(KIND_Q4_1_X16, g, xs, xsum, M, K, w, N, y, y_is_bf16);
}

static void bf16_x16_q8_0(const uint16_t *xs, const float *xsum, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                          void *y, int y_is_bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t g = 0; g < N / X16; g++) group_tiles(KIND_Q8_0_X16, g, xs, xsum, M, K, w, N, y, y_is_bf16);
}
#endif

/* y[M, N] = x[M, K] @ W^T for W Q4_1_X16 or Q8_0_X16 and x bf16. Returns 0, or -1 when a buffer
 * could not be allocated. */
int bf16_x16_matmul(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
                    int y_is_bf16, int threads) {
    float *xsum = (float *)malloc((size_t)(M * (K / QK)) * sizeof(float));
    uint16_t *xs = (uint16_t *)malloc((size_t)(M * K) * sizeof(uint16_t));
    if (xsum == NULL || xs == NULL) {
        free(xsum);
        free(xs);
        return -1;
    }
    prepare_x(kind, x, M, K, xs, xsum);
#if defined(__AVX512BF16__)
    if (kind == KIND_Q4_1_X16)
        bf16_x16_q4_1(xs, xsum, M, K, w, N, y, y_is_bf16, threads);
    else
        bf16_x16_q8_0(xs, xsum, M, K, w, N, y, y_is_bf16, threads);
#else
    bf16_x16_plain(kind, xs, xsum, M, K, w, N, y, y_is_bf16, threads);
#endif
    free(xs);
    free(xsum);
    return 0;
}

/* 1 when bf16 x against the interleaved kinds runs the vector kernel here (AVX512-BF16). */
int pd_quant_bf16_x16_route(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
