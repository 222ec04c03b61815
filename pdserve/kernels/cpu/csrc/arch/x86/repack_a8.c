/*
 * The AVX512-VNNI kernel of repack_a8.c's int8-activation matmuls over weights repacked 16 rows
 * at a time (repack_a8.c's header has the layout and the order of the sums): lane r of every
 * vector is weight row r of a group, one vpdpbusd per four inputs serves 16 outputs, x's four
 * bytes are one broadcast, and the results leave as stored vectors. pd_repack_a8_gemm is the
 * native twin of repack_a8.c's pd_repack_a8_gemm_generic (repack.h); without AVX512-VNNI this file
 * compiles to nothing and the twin runs (arch_fallback.h).
 */
#include <stdint.h>
#include "isa.h"
#include "bf16.h"
#include "blocks.h"
#include "repack.h"
#include "prefetch.h"
#include <omp.h>
#include <stdlib.h>

#if PD_HAS_AVX512_VNNI
/* Rows of x one pass over a group's blocks serves: each holds one or two accumulators beside the
 * block's 8 weight vectors. */
#define X16_ROWS 8

/* Bytes ahead of the block being read that are asked for at one thread (the groups follow each
 * other; with more, prefetch_ahead). In a whole decode step at one sequence (bench step, gguf-a8
 * bf16, one Zen 5 core): 8 KB 3.32-3.46 ms, 16 KB 3.42-3.49, 24 KB 3.43-3.45. Streaming the
 * 1B-shaped file's Q4_K matrices (2048 x 8192, 8192 x 2048) from memory at one row of x, GB/s, 2
 * threads, rounds interleaved: 2 KB 30.9-36.9, 3 KB 34.4-38.9, 4 KB 37.7-39.0, 6 KB 34.4-36.7, 8
 * KB 34.5-36.0, 16 KB 33.4-34.6, 24 KB 28.9-32.6 (prefetch to L2 instead, 8 or 16 KB: 31.0-34.1;
 * none: 27.1-28.9); one thread: 4 KB 28.6-29.7, 8 KB 29.7-30.5. */
#define X16_PREFETCH_BYTES 8192

/* One block's integer dot for a row of x: weights 0-15 (`lo`, 4 vectors of 4 each) and 16-31 (`hi`)
 * against x's 32 int8 at xq, in two chains (the first from `start`), added. */
static inline __attribute__((always_inline)) __m512i block_dot(const __m512i *lo, const __m512i *hi, const int8_t *xq,
                                                               __m512i start) {
    __m512i first = start, second = _mm512_setzero_si512();
    for (int i = 0; i < 4; i++) {
        first = _mm512_dpbusd_epi32(first, lo[i], broadcast_u32(xq + 4 * i));
        second = _mm512_dpbusd_epi32(second, hi[i], broadcast_u32(xq + 16 + 4 * i));
    }
    return _mm512_add_epi32(first, second);
}

/* acc + float(dot) * (dw * d): a block's integer dot into a row's fp32 sums, in the one order every
 * kernel here keeps (so a row's bits do not depend on which kernel or tile computed it). */
static inline __attribute__((always_inline)) __m512 block_scaled(__m512 acc, __m512i dot, __m512 dw, float d) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(d)), acc);
}

/* 16 weight rows (one group: `group` points at its first chunk) against `rows` rows of x:
 * out[r] = the 16 outputs of row r. */
static inline __attribute__((always_inline)) void group_q4_1(const uint8_t *group, X16In x, int rows, int64_t ahead,
                                                             __m512 *out) {
    const int64_t blocks = x.K / QK;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[X16_ROWS], mins[X16_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = mins[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *chunk = group + b * X16 * Q4_1_BYTES;
        for (int line = 0; line < 5; line++) _mm_prefetch((const char *)chunk + ahead + 64 * line, WEIGHT_HINT);
        __m512i lo[4], hi[4];
        for (int i = 0; i < 4; i++) {
            const __m512i bytes = _mm512_loadu_si512(chunk + 64 * i);
            lo[i] = _mm512_and_si512(bytes, low);
            hi[i] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(chunk + 256)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(chunk + 288)));
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const int8_t *xq = x.q + r * x.K + b * QK;
            const __m512i dot = block_dot(lo, hi, xq, _mm512_setzero_si512());
            acc[r] = block_scaled(acc[r], dot, dw, x.d[r * x.stride + b]);
            mins[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[r * x.stride + b]), mins[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = _mm512_add_ps(acc[r], mins[r]);
}

static inline __attribute__((always_inline)) void group_q8_0(const uint8_t *group, X16In x, int rows, int64_t ahead,
                                                             __m512 *out) {
    const int64_t blocks = x.K / QK;
    __m512 acc[X16_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *chunk = group + b * X16 * Q8_0_BYTES;
        for (int line = 0; line < 9; line++) _mm_prefetch((const char *)chunk + ahead + 64 * line, WEIGHT_HINT);
        __m512i weights[8];
        for (int i = 0; i < 8; i++) weights[i] = _mm512_loadu_si512(chunk + 64 * i);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(chunk + 512)));
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const int8_t *xq = x.q + r * x.K + b * QK;
            const __m512i dot = block_dot(weights, weights + 4, xq, _mm512_set1_epi32(x.start[r * (x.K / QK) + b]));
            acc[r] = block_scaled(acc[r], dot, dw, x.d[r * x.stride + b]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = acc[r];
}

/* Lane v: the dword whose byte k is 16 where bit k of v is set. vpermd by four fifth bits (qh
 * shifted to the low nibble of each lane; vpermd reads the index's low 4 bits only) gives the
 * bytes to OR onto the four nibbles they belong to. */
static const int32_t FIFTH_BITS[16] = {
    0x00000000, 0x00000010, 0x00001000, 0x00001010, 0x00100000, 0x00100010, 0x00101000, 0x00101010,
    0x10000000, 0x10000010, 0x10001000, 0x10001010, 0x10100000, 0x10100010, 0x10101000, 0x10101010,
};

/* GGUF's Q4_0 / Q5_0 / Q5_1 interleaved (repack_a8.c's header): Q4_1_X16's nibbles, the fifth bits
 * ORed in from the qh vector, Q4_0's and Q5_0's offsets taken back by x.start, Q5_1's minima as
 * Q4_1's. */
static inline __attribute__((always_inline)) void group_gguf(int kind, const uint8_t *group, X16In x, int rows,
                                                             int64_t ahead, __m512 *out) {
    const int64_t blocks = x.K / QK;
    const int has_qh = kind != KIND_Q4_0_X16, has_min = kind == KIND_Q5_1_X16;
    const int64_t chunk_bytes = X16 * block_bytes(kind);
    const __m512i low = _mm512_set1_epi8(15), fifth = _mm512_loadu_si512(FIFTH_BITS);
    __m512 acc[X16_ROWS], mins[X16_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = mins[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *chunk = group + b * chunk_bytes;
        for (int line = 0; line < chunk_bytes / 64; line++)
            _mm_prefetch((const char *)chunk + ahead + 64 * line, WEIGHT_HINT);
        __m512i lo[4], hi[4];
        for (int i = 0; i < 4; i++) {
            const __m512i bytes = _mm512_loadu_si512(chunk + 64 * i);
            lo[i] = _mm512_and_si512(bytes, low);
            hi[i] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
        }
        if (has_qh) {
            const __m512i qh = _mm512_loadu_si512(chunk + 256);
            for (int i = 0; i < 4; i++) {
                lo[i] = _mm512_or_si512(lo[i], _mm512_permutexvar_epi32(_mm512_srli_epi32(qh, 4 * i), fifth));
                hi[i] = _mm512_or_si512(hi[i], _mm512_permutexvar_epi32(_mm512_srli_epi32(qh, 16 + 4 * i), fifth));
            }
        }
        const uint8_t *scales = chunk + 256 + 64 * has_qh;
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
        const __m512 m = has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 32)))
                                 : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const int8_t *xq = x.q + r * x.K + b * QK;
            const __m512i start = has_min ? _mm512_setzero_si512() : _mm512_set1_epi32(x.start[r * blocks + b]);
            const __m512i dot = block_dot(lo, hi, xq, start);
            acc[r] = block_scaled(acc[r], dot, dw, x.d[r * x.stride + b]);
            if (has_min) mins[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[r * x.stride + b]), mins[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = has_min ? _mm512_add_ps(acc[r], mins[r]) : acc[r];
}

/* Sub-block s's 6-bit scale and minimum of each lane's row, from its 12 bytes of scales as the
 * three vectors v[0..2] hold them (lane r: bytes 4k..4k+3 of row r's in v[k]): ggml's
 * get_scale_min_k4 in 32-bit lanes. */
static inline __attribute__((always_inline)) void k4_scale_min16(const __m512i *v, int s, __m512i *sc, __m512i *mn) {
    const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15), two = _mm512_set1_epi32(3);
    if (s < 4) {
        *sc = _mm512_and_si512(_mm512_srli_epi32(v[0], 8 * s), six);
        *mn = _mm512_and_si512(_mm512_srli_epi32(v[1], 8 * s), six);
        return;
    }
    const int j = s - 4;
    const __m512i high_sc = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(v[0], 8 * j + 6), two), 4);
    const __m512i high_mn = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(v[1], 8 * j + 6), two), 4);
    *sc = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v[2], 8 * j), four), high_sc);
    *mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v[2], 8 * j + 4), four), high_mn);
}

/* Sub-block s's dw = d sc[s] and m = dmin m[s] of each lane's row (v, d, dmin: the super-block's
 * scale vectors and fp32 d, dmin). */
static inline __attribute__((always_inline)) void k4_scales16(const __m512i *v, __m512 d, __m512 dmin, int s,
                                                              __m512 *dw, __m512 *m) {
    __m512i sc, mn;
    k4_scale_min16(v, s, &sc, &mn);
    *dw = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
    *m = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn));
}

/* Q4_K_X16 (repack_a8.c's header): per super-block its scales decoded once for the 16 rows, then
 * each sub-block as Q4_1's block, with scale d sc[s] and minimum -dmin m[s]. */
static inline __attribute__((always_inline)) void group_q4_k(const uint8_t *group, X16In x, int rows, int64_t ahead,
                                                             __m512 *out) {
    const int64_t supers = x.K / 256, chunk_bytes = X16 * 144;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[X16_ROWS]; /* the minima go into the same sums: 8 fewer registers than Q4_1's */
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < supers; sb++) {
        const uint8_t *chunk = group + sb * chunk_bytes, *head = chunk + 32 * 64;
        for (int line = 0; line < 4; line++) /* the words' lines are asked for pair by pair below */
            _mm_prefetch((const char *)head + ahead + 64 * line, WEIGHT_HINT);
        __m512i v[3];
        for (int k = 0; k < 3; k++) v[k] = _mm512_loadu_si512(head + 64 * k);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(head + 192)));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(head + 224)));
        for (int t = 0; t < 4; t++) { /* a pair of sub-blocks: 8 vectors, low nibbles then high */
            const uint8_t *words = chunk + 64 * 8 * t;
            for (int line = 0; line < 8; line++)
                _mm_prefetch((const char *)words + ahead + 64 * line, WEIGHT_HINT);
            __m512i bytes[8];
            for (int i = 0; i < 8; i++) bytes[i] = _mm512_loadu_si512(words + 64 * i);
            for (int h = 0; h < 2; h++) {
                const int s = 2 * t + h;
                __m512 dw, m;
                k4_scales16(v, d, dmin, s, &dw, &m);
                __m512i q[8];
                for (int i = 0; i < 8; i++)
                    q[i] = _mm512_and_si512(h ? _mm512_srli_epi16(bytes[i], 4) : bytes[i], low);
                const int64_t b = sb * 8 + s; /* x's block */
#pragma GCC unroll 8
                for (int r = 0; r < rows; r++) {
                    const int8_t *xq = x.q + r * x.K + b * QK;
                    const __m512i dot = block_dot(q, q + 4, xq, _mm512_setzero_si512());
                    acc[r] = block_scaled(acc[r], dot, dw, x.d[r * x.stride + b]);
                    acc[r] = _mm512_fnmadd_ps(m, _mm512_set1_ps(x.s[r * x.stride + b]), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < rows; r++) out[r] = acc[r];
}

/* group_q4_1 / group_q8_0 / group_gguf / group_q4_k with the kind and rows constants, so that the
 * loops unroll into registers. */
static inline void group_dispatch(int kind, const uint8_t *group, X16In x, int rows, int64_t ahead, __m512 *out) {
#define X16_GROUP(ROWS)                                                                        \
    do {                                                                                       \
        if (kind == KIND_Q4_1_X16)                                                             \
            group_q4_1(group, x, ROWS, ahead, out);                                            \
        else if (kind == KIND_Q8_0_X16)                                                        \
            group_q8_0(group, x, ROWS, ahead, out);                                            \
        else if (kind == KIND_Q4_0_X16)                                                        \
            group_gguf(KIND_Q4_0_X16, group, x, ROWS, ahead, out);                             \
        else if (kind == KIND_Q5_0_X16)                                                        \
            group_gguf(KIND_Q5_0_X16, group, x, ROWS, ahead, out);                             \
        else if (kind == KIND_Q4_K_X16)                                                        \
            group_q4_k(group, x, ROWS, ahead, out);                                            \
        else                                                                                   \
            group_gguf(KIND_Q5_1_X16, group, x, ROWS, ahead, out);                             \
        return;                                                                                \
    } while (0)
    switch (rows) {
        case 1: X16_GROUP(1);
        case 2: X16_GROUP(2);
        case 3: X16_GROUP(3);
        case 4: X16_GROUP(4);
        case 5: X16_GROUP(5);
        case 6: X16_GROUP(6);
        case 7: X16_GROUP(7);
        default: X16_GROUP(8);
    }
#undef X16_GROUP
}

/* Prefill (TILE_MIN_ROWS or more rows of x): tiles of TILE_ROWS rows against TILE_GROUPS groups.
 * The group_* kernels (decode's shape) give each broadcast of x one vpdpbusd, and group_q4_k decodes
 * a sub-block's scales again for every tile of rows; in a tile a broadcast serves a vpdpbusd per
 * group and a weight vector one per row, and Q4_K's scales are decoded once per group for all its
 * tiles. 512 rows of x by the 1B-shaped model's matrices (2048 or 8192 inputs, 2048-16384
 * outputs) on one Zen 5 core (vpdpbusd's peak there: 1077 GOP/s), GOP/s before -> after: Q4_K
 * 455-474 -> 644-678 (tiles of 4x2 565-595, 6x2 615-627, 8x2 587-609, 5x3 636-657, 3x4 514-530),
 * Q8_0 582-616 -> 646-751, Q4_0 606-629 -> 709-767, Q5_0 580-594 -> 679-705, Q4_1 601-615 ->
 * 652-684, Q5_1 534-553 -> 620-642 (4 and 6 rows a tile did as well for the blocks of 32). Below
 * 32 rows the group_* kernels stay: Q4_K's scales' decode is not paid back there (8 rows: 251-446
 * against 429-474 GOP/s). */
#define TILE_ROWS 5
#define TILE_GROUPS 2
#define TILE_MIN_ROWS 32

/* Every sub-block's dw = d sc[s] and m = dmin m[s] of a group's 16 rows (group_q4_k's values),
 * as 2 vectors a block in `scales`. */
static void q4_k_group_scales(const uint8_t *group, int64_t K, float *scales) {
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const uint8_t *head = group + sb * X16 * 144 + 32 * 64;
        __m512i v[3];
        for (int k = 0; k < 3; k++) v[k] = _mm512_loadu_si512(head + 64 * k);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(head + 192)));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(head + 224)));
        for (int s = 0; s < 8; s++) {
            __m512 dw, m;
            k4_scales16(v, d, dmin, s, &dw, &m);
            float *at = scales + (sb * 8 + s) * 2 * X16;
            _mm512_storeu_ps(at, dw);
            _mm512_storeu_ps(at + X16, m);
        }
    }
}

/* A tile: TILE_ROWS rows of x against TILE_GROUPS groups (`group`, the next one
 * `group_bytes` on), whose scales q4_k_group_scales wrote one after the other. Each (output, row)
 * pair gets group_q4_k's arithmetic in its order (the sub-block's integer dot, then the two fmas),
 * so a row's bits do not depend on its batch. out[r * TILE_GROUPS + g]: row r's outputs of
 * group g. */
static inline __attribute__((always_inline)) void tile_q4_k(const uint8_t *group, int64_t group_bytes, X16In x,
                                                            const float *scales, __m512 *out) {
    enum { MR = TILE_ROWS, NG = TILE_GROUPS };
    const int64_t blocks = x.K / QK, chunk_bytes = X16 * 144;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[MR * NG];
    for (int i = 0; i < MR * NG; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int s = (int)(b % 8), h = s % 2;
        const uint8_t *words = group + b / 8 * chunk_bytes + 64 * 8 * (s / 2);
        __m512i dot[MR * NG];
        for (int i = 0; i < MR * NG; i++) dot[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            __m512i w[NG];
            for (int g = 0; g < NG; g++) {
                const __m512i bytes = _mm512_loadu_si512(words + g * group_bytes + 64 * i);
                w[g] = _mm512_and_si512(h ? _mm512_srli_epi16(bytes, 4) : bytes, low);
            }
            for (int r = 0; r < MR; r++) {
                const __m512i xb = broadcast_u32(x.q + r * x.K + b * QK + 4 * i);
                for (int g = 0; g < NG; g++) dot[r * NG + g] = _mm512_dpbusd_epi32(dot[r * NG + g], w[g], xb);
            }
        }
        for (int g = 0; g < NG; g++) {
            const float *at = scales + (g * blocks + b) * 2 * X16;
            const __m512 dw = _mm512_loadu_ps(at), m = _mm512_loadu_ps(at + X16);
            for (int r = 0; r < MR; r++) {
                acc[r * NG + g] = block_scaled(acc[r * NG + g], dot[r * NG + g], dw, x.d[r * x.stride + b]);
                acc[r * NG + g] = _mm512_fnmadd_ps(m, _mm512_set1_ps(x.s[r * x.stride + b]), acc[r * NG + g]);
            }
        }
    }
    for (int i = 0; i < MR * NG; i++) out[i] = acc[i];
}

/* tile_q4_k for the kinds of blocks of 32 (Q4_1_X16, Q8_0_X16, Q4_0_X16, Q5_0_X16, Q5_1_X16), each
 * (output, row) pair with its group_* kernel's arithmetic in its order. */
static inline __attribute__((always_inline)) void tile_blocks32(const int kind, const uint8_t *group,
                                                                int64_t group_bytes, X16In x, __m512 *out) {
    enum { MR = TILE_ROWS, NG = TILE_GROUPS };
    const int is_q8 = kind == KIND_Q8_0_X16, has_qh = kind == KIND_Q5_0_X16 || kind == KIND_Q5_1_X16;
    const int has_min = kind == KIND_Q4_1_X16 || kind == KIND_Q5_1_X16;
    const int64_t blocks = x.K / QK, chunk_bytes = X16 * block_bytes(kind);
    const int scales_at = is_q8 ? 512 : 256 + 64 * has_qh;
    const __m512i low = _mm512_set1_epi8(15), fifth = _mm512_loadu_si512(FIFTH_BITS);
    __m512 acc[MR * NG], mins[MR * NG];
    for (int i = 0; i < MR * NG; i++) acc[i] = mins[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *chunk = group + b * chunk_bytes;
        __m512i dot[MR * NG];
        for (int r = 0; r < MR; r++) {
            const __m512i start = has_min ? _mm512_setzero_si512() : _mm512_set1_epi32(x.start[r * blocks + b]);
            for (int g = 0; g < NG; g++) dot[r * NG + g] = start;
        }
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            __m512i w[NG];
            for (int g = 0; g < NG; g++) {
                const uint8_t *at = chunk + g * group_bytes;
                if (is_q8) {
                    w[g] = _mm512_loadu_si512(at + 64 * i);
                    continue;
                }
                const __m512i bytes = _mm512_loadu_si512(at + 64 * (i % 4));
                w[g] = _mm512_and_si512(i < 4 ? bytes : _mm512_srli_epi16(bytes, 4), low);
                if (has_qh) {
                    const __m512i qh = _mm512_loadu_si512(at + 256);
                    const int shift = i < 4 ? 4 * i : 16 + 4 * (i - 4);
                    w[g] = _mm512_or_si512(w[g], _mm512_permutexvar_epi32(_mm512_srli_epi32(qh, shift), fifth));
                }
            }
            for (int r = 0; r < MR; r++) {
                const __m512i xb = broadcast_u32(x.q + r * x.K + b * QK + 4 * i);
                for (int g = 0; g < NG; g++) dot[r * NG + g] = _mm512_dpbusd_epi32(dot[r * NG + g], w[g], xb);
            }
        }
        for (int g = 0; g < NG; g++) {
            const uint8_t *at = chunk + g * group_bytes + scales_at;
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at));
            const __m512 m = has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(at + 32)))
                                     : _mm512_setzero_ps();
            for (int r = 0; r < MR; r++) {
                acc[r * NG + g] = block_scaled(acc[r * NG + g], dot[r * NG + g], dw, x.d[r * x.stride + b]);
                if (has_min) mins[r * NG + g] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[r * x.stride + b]), mins[r * NG + g]);
            }
        }
    }
    for (int i = 0; i < MR * NG; i++) out[i] = has_min ? _mm512_add_ps(acc[i], mins[i]) : acc[i];
}

/* tile_q4_k / tile_blocks32 with the kind a constant. */
static inline void tile_dispatch(int kind, const uint8_t *group, int64_t group_bytes, X16In x, const float *scales,
                                 __m512 *out) {
    switch (kind) {
        case KIND_Q4_K_X16: tile_q4_k(group, group_bytes, x, scales, out); return;
        case KIND_Q8_0_X16: tile_blocks32(KIND_Q8_0_X16, group, group_bytes, x, out); return;
        case KIND_Q4_0_X16: tile_blocks32(KIND_Q4_0_X16, group, group_bytes, x, out); return;
        case KIND_Q5_0_X16: tile_blocks32(KIND_Q5_0_X16, group, group_bytes, x, out); return;
        case KIND_Q4_1_X16: tile_blocks32(KIND_Q4_1_X16, group, group_bytes, x, out); return;
        default: tile_blocks32(KIND_Q5_1_X16, group, group_bytes, x, out); return;
    }
}

/* x from its row m0 on. */
static inline X16In rows_from(X16In x, int64_t m0) {
    x.q += m0 * x.K;
    x.d += m0 * x.stride;
    x.s += m0 * x.stride;
    if (x.start) x.start += m0 * (x.K / QK);
    return x;
}

/* Rows m0.. M - 1 of x against group g, X16_ROWS at a time by group_dispatch (decode's shape). */
static inline void group_rows(int kind, X16In x, int64_t m0, int64_t M, const uint8_t *w, int64_t N, int64_t g,
                              int64_t group_bytes, int64_t ahead, void *y, int y_is_bf16) {
    for (; m0 < M; m0 += X16_ROWS) { /* further rows read the group from cache */
        const int rows = (int)(M - m0 < X16_ROWS ? M - m0 : X16_ROWS);
        __m512 out[X16_ROWS];
        group_dispatch(kind, w + g * group_bytes, rows_from(x, m0), rows, ahead, out);
        for (int r = 0; r < rows; r++) put_f32x16(y, y_is_bf16, (m0 + r) * N + g * X16, out[r]);
    }
}

/* pd_repack_a8_gemm at TILE_MIN_ROWS or more rows: a task a pair of groups, its tiles down the
 * rows (Q4_K_X16's scales decoded first); the rows below a whole tile, a last odd group, or a task
 * whose scales found no memory go as group_dispatch's. */
static void gemm_tiles(int kind, X16In x, int64_t M, const uint8_t *w, int64_t N, void *y, int y_is_bf16,
                       int threads, int64_t group_bytes) {
    enum { MR = TILE_ROWS, NG = TILE_GROUPS };
    const int is_q4_k = kind == KIND_Q4_K_X16;
    const int64_t groups = N / X16, tasks = (groups + NG - 1) / NG;
    const size_t scale_bytes = (size_t)NG * (x.K / QK) * 2 * X16 * sizeof(float);
    const int64_t ahead = prefetch_ahead(X16_PREFETCH_BYTES, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t g0 = task * NG;
        float *scales = is_q4_k && groups - g0 >= NG ? aligned_alloc(64, scale_bytes) : NULL;
        const int whole = groups - g0 >= NG && (scales || !is_q4_k);
        const int64_t tiled = whole ? M / MR * MR : 0;
        if (scales)
            for (int g = 0; g < NG; g++)
                q4_k_group_scales(w + (g0 + g) * group_bytes, x.K, scales + (size_t)g * (x.K / QK) * 2 * X16);
        for (int64_t m0 = 0; m0 < tiled; m0 += MR) {
            __m512 out[MR * NG];
            tile_dispatch(kind, w + g0 * group_bytes, group_bytes, rows_from(x, m0), scales, out);
            for (int r = 0; r < MR; r++)
                for (int g = 0; g < NG; g++) put_f32x16(y, y_is_bf16, (m0 + r) * N + (g0 + g) * X16, out[r * NG + g]);
        }
        free(scales);
        for (int64_t g = g0; g < groups && g < g0 + NG; g++)
            group_rows(kind, x, tiled, M, w, N, g, group_bytes, ahead, y, y_is_bf16);
    }
}

/* pd_repack_a8_gemm_generic's sums with vpdpbusd: a group of 16 weight rows a task, tiles of X16_ROWS
 * rows of x against it (group_rows); TILE_MIN_ROWS or more rows as gemm_tiles. */
void pd_repack_a8_gemm(int kind, X16In x, int64_t M, const uint8_t *w, int64_t N, void *y, int y_is_bf16,
                       int threads) {
    const int64_t group_bytes = x.K / x16_block_weights(kind) * X16 * block_bytes(kind);
    if (M >= TILE_MIN_ROWS) {
        gemm_tiles(kind, x, M, w, N, y, y_is_bf16, threads, group_bytes);
        return;
    }
    const int64_t ahead = prefetch_ahead(X16_PREFETCH_BYTES, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t g = 0; g < N / X16; g++) group_rows(kind, x, 0, M, w, N, g, group_bytes, ahead, y, y_is_bf16);
}
#endif
