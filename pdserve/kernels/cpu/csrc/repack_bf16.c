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
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "isa.h"
#include "bf16.h"
#include "blocks.h"
#include "kernels.h"
#include <omp.h>

#define BF16_X16_ROWS 8 /* rows of x a pass over a group's blocks serves (4: Q8_0's conversion paid twice at 8) */
#define BF16_X16_PREFETCH_BYTES 8192 /* how far ahead of the chunk being read the weights are asked for */
#define LOW_128 0x4300u   /* bf16 128.0: OR a value 0-15 into it for 128 + v */
#define Q8_0_OFFSET 128.0f /* u = q + 128 */

/* Where Q4_1's pair p (0-3) of word i starts in a block of xs (prepare_x's order): p = 0 low
 * nibbles of bytes (0, 2), 1 low of (1, 3), 2 high of (0, 2), 3 high of (1, 3). */
static inline int pair_at(int i, int p) { return 8 * i + 2 * p; }

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
static void bf16_x16_plain(int kind, const uint16_t *x, const uint16_t *xs, const float *xsum, int64_t M, int64_t K,
                           const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads) {
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

#if PD_HAS_AVX512_BF16

/* (v & 0x000F000F) | base in each lane: one vpternlogd (A & B) | C. */
static inline __m512bh nibble_pair(__m512i v, __m512i mask, __m512i base) {
    return (__m512bh)_mm512_ternarylogic_epi32(v, mask, base, 0xEA);
}

/* The four chains of a Q4_1 chunk's 4 words (pairs[i][p]) against one row of x (its reordered
 * block xb), added as the header says. */
static inline __attribute__((always_inline)) __m512 chains_of(const __m512bh pairs[4][4], const uint16_t *xb) {
    __m512 chain[4];
    for (int i = 0; i < 4; i++) {
        chain[i] = _mm512_setzero_ps();
        for (int p = 0; p < 4; p++)
            chain[i] = _mm512_dpbf16_ps(chain[i], pairs[i][p], (__m512bh)broadcast_u32(xb + pair_at(i, p)));
    }
    return _mm512_add_ps(_mm512_add_ps(chain[0], chain[1]), _mm512_add_ps(chain[2], chain[3]));
}

/* A Q4_1 chunk's 4 words decoded into pairs. */
static inline __attribute__((always_inline)) void decode_words(const uint8_t *chunk, __m512bh pairs[4][4]) {
    const __m512i mask = _mm512_set1_epi32(0x000F000F), low = _mm512_set1_epi32((int)(LOW_128 * 0x10001u));
    for (int i = 0; i < 4; i++) {
        const __m512i v = _mm512_loadu_si512(chunk + 64 * i);
        pairs[i][0] = nibble_pair(v, mask, low);
        pairs[i][1] = nibble_pair(_mm512_srli_epi32(v, 8), mask, low);
        pairs[i][2] = nibble_pair(_mm512_srli_epi32(v, 4), mask, low);
        pairs[i][3] = nibble_pair(_mm512_srli_epi32(v, 12), mask, low);
    }
}

/* 16 bytes (4 rows' 4 inputs) as exact fp32. */
static inline __m512 bytes_fp32(const uint8_t *at) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)at)));
}

/* Q8_0 word i of a chunk as two bf16 vectors: rows 0-7 (half[0]) and 8-15 (half[1]), lane
 * 2 r + h holding row r's u at inputs (4 i + 2 h, 4 i + 2 h + 1). vcvtne2ps2bf16 puts its
 * second operand's 16 values in the low 8 lanes (consecutive pairs), its first's in the high. */
static inline __attribute__((always_inline)) void convert_word(const uint8_t *word, __m512bh half[2]) {
    half[0] = _mm512_cvtne2ps_pbh(bytes_fp32(word + 16), bytes_fp32(word));
    half[1] = _mm512_cvtne2ps_pbh(bytes_fp32(word + 48), bytes_fp32(word + 32));
}

/* 16 weight rows (a group, from its first chunk) against `rows` rows of reordered x: out[r]. */
static inline __attribute__((always_inline)) void group_q4_1(const uint8_t *group, const uint16_t *xs, int64_t K,
                                                             const float *xsum, int rows, __m512 *out) {
    const int64_t blocks = K / QK;
    const int bytes = X16 * Q4_1_BYTES;
    __m512 acc[BF16_X16_ROWS], mins[BF16_X16_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = mins[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *chunk = group + b * bytes;
        for (int line = 0; line < (bytes + 63) / 64; line++)
            _mm_prefetch((const char *)chunk + BF16_X16_PREFETCH_BYTES + 64 * line, _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(chunk + 64 * 4)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(chunk + 64 * 4 + 32)));
        const __m512 offset_m = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.0f), m); /* m - 128 d */
        __m512bh pairs[4][4];
        decode_words(chunk, pairs);
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const __m512 t = chains_of(pairs, xs + r * K + b * QK);
            acc[r] = _mm512_fmadd_ps(t, d, acc[r]);
            mins[r] = _mm512_fmadd_ps(offset_m, _mm512_set1_ps(xsum[r * blocks + b]), mins[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = _mm512_add_ps(acc[r], mins[r]);
}

/* The same for Q8_0 against `rows` rows of x as it is. */
static inline __attribute__((always_inline)) void group_q8_0(const uint8_t *group, const uint16_t *x, int64_t K,
                                                             const float *xsum, int rows, __m512 *out) {
    const int64_t blocks = K / QK;
    const int bytes = X16 * Q8_0_BYTES;
    /* lane l of (chain[0], chain[1]) is row l / 2 of (0-7, 8-15): the rows' lanes gathered back */
    const __m512i first_of_pair = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i second_of_pair = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    __m512 acc[BF16_X16_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *chunk = group + b * bytes;
        for (int line = 0; line < (bytes + 63) / 64; line++)
            _mm_prefetch((const char *)chunk + BF16_X16_PREFETCH_BYTES + 64 * line, _MM_HINT_T0);
        __m512 chain[BF16_X16_ROWS][2];
        for (int r = 0; r < rows; r++) chain[r][0] = chain[r][1] = _mm512_setzero_ps();
        for (int i = 0; i < 8; i++) {
            __m512bh half[2];
            convert_word(chunk + 64 * i, half);
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                uint64_t four; /* x's inputs 4 i .. 4 i + 3 */
                memcpy(&four, x + r * K + b * QK + 4 * i, 8);
                const __m512bh xq = (__m512bh)_mm512_set1_epi64((long long)four);
                chain[r][0] = _mm512_dpbf16_ps(chain[r][0], half[0], xq);
                chain[r][1] = _mm512_dpbf16_ps(chain[r][1], half[1], xq);
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(chunk + 64 * 8)));
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const __m512 t = _mm512_add_ps(_mm512_permutex2var_ps(chain[r][0], first_of_pair, chain[r][1]),
                                           _mm512_permutex2var_ps(chain[r][0], second_of_pair, chain[r][1]));
            const __m512 offset_t = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * blocks + b]),
                                                    _mm512_set1_ps(-Q8_0_OFFSET), t);
            acc[r] = _mm512_fmadd_ps(offset_t, d, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = acc[r];
}

static inline __attribute__((always_inline)) void group_bf16(int kind, const uint8_t *group, const uint16_t *xs,
                                                             int64_t K, const float *xsum, int rows, __m512 *out) {
    if (kind == KIND_Q4_1_X16)
        group_q4_1(group, xs, K, xsum, rows, out);
    else
        group_q8_0(group, xs, K, xsum, rows, out);
}

/* Group g of one kind against every tile of rows of x (kind a constant where it is inlined); xs
 * is what the kind reads: Q4_1 prepare_x's reordered pairs, Q8_0 x as it is. */
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
            case 4: group_bf16(kind, group, xt, K, st, 4, out); break;
            case 5: group_bf16(kind, group, xt, K, st, 5, out); break;
            case 6: group_bf16(kind, group, xt, K, st, 6, out); break;
            case 7: group_bf16(kind, group, xt, K, st, 7, out); break;
            default: group_bf16(kind, group, xt, K, st, 8, out); break;
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

static void bf16_x16_q8_0(const uint16_t *x, const float *xsum, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                          void *y, int y_is_bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t g = 0; g < N / X16; g++) group_tiles(KIND_Q8_0_X16, g, x, xsum, M, K, w, N, y, y_is_bf16);
}
#endif

/* y[M, N] = x[M, K] @ W^T for W Q4_1_X16 or Q8_0_X16 and x bf16. Returns 0, or -1 when a buffer
 * could not be allocated. */
int bf16_x16_matmul(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
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
#if PD_HAS_AVX512_BF16
    if (q4)
        bf16_x16_q4_1(xs, xsum, M, K, w, N, y, y_is_bf16, threads);
    else
        bf16_x16_q8_0(x, xsum, M, K, w, N, y, y_is_bf16, threads);
#else
    bf16_x16_plain(kind, x, xs, xsum, M, K, w, N, y, y_is_bf16, threads);
#endif
    free(xs);
    free(xsum);
    return 0;
}

/* 1 when bf16 x against the interleaved kinds runs the vector kernel here (AVX512-BF16). */
int pd_quant_bf16_x16_route(void) {
#if PD_HAS_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}
