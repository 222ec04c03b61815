/*
 * The AVX512-BF16 kernels of repack_bf16.c's matmuls of bf16 activations against weights repacked
 * 16 rows at a time (repack_bf16.c's header says how a chunk's bytes become bf16 pairs, and the
 * order of the sums): lane r of every vector is weight row r, one vdpbf16ps against a broadcast
 * pair of x serves 16 outputs. pd_repack_bf16_gemm is the native twin of repack_bf16.c's
 * pd_repack_bf16_gemm_generic (repack.h); without AVX512-BF16 this file compiles to nothing and
 * the twin runs (arch_fallback.h).
 */
#include <stdint.h>
#include <string.h>
#include "isa.h"
#include "prefetch.h"
#include "bf16.h"
#include "blocks.h"
#include "repack.h"
#include <omp.h>

#if PD_HAS_AVX512_BF16
#define BF16_X16_ROWS 8 /* rows of x a pass over a group's blocks serves (4: Q8_0's conversion paid twice at 8) */
#define BF16_X16_PREFETCH_BYTES 8192 /* how far ahead of the chunk being read the weights are asked for */
#define LOW_128 0x4300u   /* bf16 128.0: OR a value 0-15 into it for 128 + v */

/* (v & 0x000F000F) | base in each lane: one vpternlogd (A & B) | C. */
static inline __m512bh nibble_pair(__m512i v, __m512i mask, __m512i base) {
    return (__m512bh)_mm512_ternarylogic_epi32(v, mask, base, 0xEA);
}

/* The four chains of a Q4_1 chunk's 4 words (pairs[i][p]) against one row of x (its reordered
 * block xb), added as repack_bf16.c's header says. */
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
            _mm_prefetch((const char *)chunk + BF16_X16_PREFETCH_BYTES + 64 * line, WEIGHT_HINT);
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
            _mm_prefetch((const char *)chunk + BF16_X16_PREFETCH_BYTES + 64 * line, WEIGHT_HINT);
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

/* pd_repack_bf16_gemm_generic's sums with vdpbf16ps: one function a kind (above). */
void pd_repack_bf16_gemm(int kind, const uint16_t *x, const uint16_t *xs, const float *xsum, int64_t M, int64_t K,
                         const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads) {
    if (kind == KIND_Q4_1_X16)
        bf16_x16_q4_1(xs, xsum, M, K, w, N, y, y_is_bf16, threads);
    else
        bf16_x16_q8_0(x, xsum, M, K, w, N, y, y_is_bf16, threads);
}
#endif
