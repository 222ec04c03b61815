/*
 * The x86 twin of quants_k_a8.c: the kinds held as GGUF stores them (Q4_0, Q5_0, Q5_1, Q4_K,
 * Q5_K, Q6_K; quants_k.h) against x quantized to int8 per block of 32 (quants_a8.c), with
 * 512-bit vpdpbusd where the CPU has AVX512-VNNI (AMD Zen 4/5, Intel Ice Lake on), and with
 * 256-bit vpmaddubsw on CPUs with AVX2 and no VNNI (AMD Zen 3). pd_quant_k_a8_gemm is the native
 * twin of quants_k_a8.c's pd_quant_k_a8_gemm_generic (quants_k.h, arch_fallback.h); without AVX2
 * this file compiles to nothing.
 *
 * Why: the plain C loop decodes every sub-block to bytes and multiplies them one at a time, far
 * from the memory bound a decode step at one row of x lives under. Every kind's weights are
 * unsigned integers (0-15, 0-31, 0-63) under a scale and a minimum (quants_k.h), and x is int8:
 * exactly vpdpbusd's operands (unsigned bytes times signed bytes, four products into an int32
 * lane), as in llama.cpp's ggml_vec_dot_q4_K_q8_K and friends.
 *
 * How. A row is read in units of 256 weights: a K-quant super-block, or 8 blocks of Q4_0 / Q5_0 /
 * Q5_1. A unit is 16 groups of 16 weights, each under one weight scale and inside one block of x
 * (Q6_K's scales are per 16; the other kinds' per 32 cover two groups). Its bytes are loaded as
 * the file lays them out into four vectors, each 128-bit lane one group's 16 unsigned weights:
 * the nibbles split, Q5's fifth bits added where a byte test finds them, Q6_K's two high bits
 * shifted in; the small kinds' blocks (18, 22, 24 bytes) picked out of three 64-byte loads by
 * vpermt2w, with their fp16 scales and fifth bits. A 4 x 4 transpose of dwords within 128-bit
 * lanes (transpose16) then leaves every group in one int32 lane of all four vectors, so four
 * vpdpbusd put each group's whole integer dot in its own lane, and one conversion, one product
 * of scales and one fma per unit and row of x scale them all.
 *
 * x is rearranged once per call into records, one per unit and row (unit_x): its int8 in the
 * order the lanes read it (GROUP_OF_LANE16), and per block of 32 its scale dx and dx times its
 * sum of x, which the minima multiply: Q5_1's m, Q4_K / Q5_K's -dmin mn, and Q4_0 / Q5_0's -8 d
 * and -16 d (w = d (q - offset)). Q6_K's offset (w = d sc (q - 32)) is folded into the integers
 * instead, each lane's sums starting from -32 times its group's sum of x. So
 *     y ~= sum over units and lanes of (d_w dx) (q . xq [- 32 sum]) + sum over blocks of m dx sum
 * with the integers exact and x's rounding the only error, as for Q4_1 and Q8_0 (quants_a8.c's
 * header), every other error an fp32 rounding. A unit's scales are decoded once, not per group:
 * a K-quant's eight 6-bit scales and minima with llama.cpp's arithmetic on three words
 * (get_scale_min_k4 for all eight), Q6_K's sixteen int8 scales with one widening.
 *
 * Tiles (rows16_single, rows16_batch): at one row of x, a K-quant's weight rows one at a time (one
 * stream, prefetched 8 KB ahead), the small kinds' four at a time (the next tile prefetched at
 * the same place; without software prefetch, from memory, 2-3x slower on a Zen 5 core);
 * otherwise up to 8 rows of x share each decoded unit, in blocks of 16 weight rows and chunks of
 * 8 units, so that a chunk's records (20 KB at 8 rows) stay in L1 for the whole block. Output
 * rows are split between OpenMP threads. Every (weight row, row of x) pair runs the same
 * operations in the same order whatever its tile, so a row's result does not depend on what it
 * is batched with.
 *
 * With AVX2 the same in 256 bits (unit8_*, rows8_*): units of 128 weights (a K-quant's half
 * super-block, 4 small blocks), 8 lanes; vpmaddubsw's pairs summed in int16 (at most 4 * 2 * 31 *
 * 127 for the 4- and 5-bit kinds; Q6_K's widened two by two) and vpmaddwd to int32; the fifth
 * bits spread to bytes as llama.cpp's bytes_from_bits_32; tiles of up to 4 rows of x (16
 * registers).
 *
 * On one Zen 5 core, in cache, a unit costs 11-21 cycles at one row of x (Q4_K the least, Q5_0
 * and Q5_1 the most), against the 15-24 its bytes take to stream from memory; at 8 rows, 5.5-8.5
 * cycles a row of x; the plain C loop, 350-1500. pdserve/bench/quant_matmul.py measures them
 * against a read of their bytes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "isa.h"
#include "avx2.h"
#include "bf16.h"
#include "blocks.h"
#include "quants_k.h"
#include "prefetch.h"
#include <omp.h>

#if PD_HAS_AVX2
/* How a kind's unit is decoded: blocks of 32 (Q4_0, Q5_0, Q5_1), Q4_K / Q5_K, or Q6_K. */
enum { FAMILY_SMALL = 0, FAMILY_K4 = 1, FAMILY_K6 = 2 };

static inline int family_of(int kind) {
    return kind <= KIND_Q5_1 ? FAMILY_SMALL : kind == KIND_Q6_K ? FAMILY_K6 : FAMILY_K4;
}

/*
 * Which group of 16 weights of a unit (weights 16g .. 16g + 15, in the file's order) lane p holds
 * after the transpose, per family; 16 lanes for 512 bits, 8 for 256. Lane p = 4j + i is dword i
 * of 128-bit lane j of the vectors before it (transpose16), so it holds what vector i's 128-bit
 * lane j held there:
 *   small: vectors (low nibbles of blocks 0-3, high nibbles of 0-3, low of 4-7, high of 4-7), a
 *          block a 128-bit lane (AVX2: blocks 0-1 and 2-3, two a vector): g = 2 * block + half;
 *   K4:    qs[0..63] low, high, qs[64..127] low, high: bytes 32t .. 32t + 31 hold sub-block 2t
 *          (low nibbles) and 2t + 1 (high), a 128-bit lane half of one (AVX2: qs[0..31],
 *          qs[32..63] of the half super-block);
 *   K6:    weights 0-63, 64-127, 128-191, 192-255 (AVX2: 32 each), in order.
 * Lane p's block of x (and the small kinds' block, the K-quants' sub-block) is g / 2.
 */
static const uint8_t GROUP_OF_LANE16[3][16] = {
    {0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15},
    {0, 2, 8, 10, 1, 3, 9, 11, 4, 6, 12, 14, 5, 7, 13, 15},
    {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15},
};
static const uint8_t GROUP_OF_LANE8[3][8] = {
    {0, 1, 4, 5, 2, 3, 6, 7},
    {0, 2, 4, 6, 1, 3, 5, 7},
    {0, 2, 4, 6, 1, 3, 5, 7},
};

static inline const uint8_t *group_of_lane(int kind, int lanes) {
    return lanes == 16 ? GROUP_OF_LANE16[family_of(kind)] : GROUP_OF_LANE8[family_of(kind)];
}

/* Bytes of x's record of one unit (16 * lanes weights) and row (see unit_x). */
static inline int64_t record_bytes(int kind, int lanes) {
    return (family_of(kind) == FAMILY_K6 ? 22 : 20) * (int64_t)lanes;
}

/*
 * x as the kernels read it: one record per unit and row of x, units outermost ([units][M]
 * [record]), so that a tile's rows of x are fixed offsets from one pointer. A record: q [4]
 * [lanes][4] int8 (vector k, lane p: x of weights 4k .. 4k + 3 of lane p's group); for Q6_K, per
 * lane, int32 -32 times its group's sum of q (the lane's integer start); then per block of 32 of
 * the unit (lanes / 2 of them, in order) fp32 dx, its scale, and, but for Q6_K, per block fp32
 * dx * sum(q) (xs: the minima's part). `units` records a row, zeros past its end. `padded` holds
 * a row of units * 16 * lanes int8, `sums` its units * lanes int32 sums of 16.
 */
static void unit_x(int kind, int lanes, const int8_t *q, const float *d, int64_t stride, int64_t M, int64_t K,
                   int64_t units, uint8_t *records, int8_t *padded, int32_t *sums) {
    const int64_t unit = 16 * lanes;
    const uint8_t *group_of = group_of_lane(kind, lanes);
    const int blocks = lanes / 2, k6 = family_of(kind) == FAMILY_K6;
    int at[64]; /* where each 4-byte word of a record's q comes from in its unit */
    for (int k = 0; k < 4; k++)
        for (int p = 0; p < lanes; p++) at[k * lanes + p] = 16 * group_of[p] + 4 * k;
    for (int64_t r = 0; r < M; r++) {
        memcpy(padded, q + r * K, (size_t)K);
        memset(padded + K, 0, (size_t)(units * unit - K));
        for (int64_t g = 0; g < units * unit / 16; g++) { /* every group's sum of x */
            int32_t sum = 0;
            for (int j = 0; j < 16; j++) sum += padded[16 * g + j];
            sums[g] = sum;
        }
        for (int64_t u = 0; u < units; u++) {
            uint8_t *record = records + (u * M + r) * record_bytes(kind, lanes);
            const int8_t *x = padded + u * unit;
            const int32_t *sum = sums + u * unit / 16;
            for (int word = 0; word < 4 * lanes; word++) memcpy(record + 4 * word, x + at[word], 4);
            if (k6)
                for (int p = 0; p < lanes; p++) {
                    const int32_t start = -32 * sum[group_of[p]];
                    memcpy(record + unit + 4 * p, &start, 4);
                }
            float *scales = (float *)(record + unit + (k6 ? 4 * lanes : 0));
            for (int b = 0; b < blocks; b++) {
                const int64_t block = u * unit / QK + b;
                scales[b] = block < K / QK ? d[r * stride + block] : 0.0f;
                if (!k6) scales[blocks + b] = scales[b] * (float)(sum[2 * b] + sum[2 * b + 1]);
            }
        }
    }
}

/* Bytes of one unit of `kind` (16 * lanes weights) in a row, and, for Q4_0/Q5_0/Q5_1, where a
 * block holds its nibbles, fifth bits and minimum. */
static inline int64_t unit_bytes(int kind, int lanes) {
    return (int64_t)lanes * 16 / k_block_weights(kind) * k_block_bytes(kind);
}
static inline int small_qs_at(int kind) { return kind == KIND_Q4_0 ? 2 : kind == KIND_Q5_0 ? 6 : 8; }
static inline int small_qh_at(int kind) { return kind == KIND_Q5_0 ? 2 : 4; }

/* Q4_K / Q5_K's 8 scales and 8 minima (get_scale_min_k4 for all eight, llama.cpp's arithmetic on
 * three words), as bytes sc0-7, mn0-7, from the super-block's first 16 bytes (d, dmin, then the
 * 12 bytes: words u0-u2 in its dwords 1-3). */
static inline __m128i k4_scales_mins(__m128i head) {
    const __m128i a = _mm_shuffle_epi32(head, _MM_SHUFFLE(3, 2, 3, 1)); /* u0, u2, u1, u2 */
    const __m128i b = _mm_shuffle_epi32(head, _MM_SHUFFLE(2, 2, 1, 1)); /* u0, u0, u1, u1 */
    const __m128i low = _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)),
                                      _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    /* bits 6-7 of u0 (u1) as bits 4-5 of the high scales (minima) */
    const __m128i high = _mm_and_si128(_mm_srli_epi32(b, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(low, high);
}
#endif

#if PD_HAS_AVX512_VNNI
/* Rows a tile serves: weight rows at one row of x, rows of x otherwise. */
#define K_A8_COLS 4
#define K_A8_MAX_ROWS 8

/* A unit of 256 weights decoded: v[k] lane p holds weights 4k .. 4k + 3 of group
 * GROUP_OF_LANE16[family][p] as unsigned bytes. scales: Q6_K's d sc per lane; the other kinds'
 * weight scale of each block (sub-block) of 32 in lanes 0-7, in order, and its minimum in lanes
 * 8-15 (Q4_0 -8 d, Q5_0 -16 d, Q5_1 m, K4 -dmin mn): the layout of x's record's scales, so that
 * one product gives d dx and m xs for every block. */
typedef struct {
    __m512i v[4];
    __m512 scales;
} Unit16;

/* The permutes every unit of a kind reuses: each lane's block of 32 (and Q6_K's group of 16 for
 * its scales), and Q5_K's qh bit per 128-bit lane of each vector before the transpose. */
typedef struct {
    __m512i block_of_lane, group_of_lane, q5k_bit[4];
} Lanes16;

static inline Lanes16 lanes16(int kind) {
    Lanes16 lanes;
    const uint8_t *group_of = GROUP_OF_LANE16[family_of(kind)];
    int32_t block[16], group[16];
    for (int p = 0; p < 16; p++) {
        block[p] = group_of[p] / 2;
        group[p] = group_of[p];
    }
    lanes.block_of_lane = _mm512_loadu_si512(block);
    lanes.group_of_lane = _mm512_loadu_si512(group);
    for (int i = 0; i < 4; i++) { /* vector i's 128-bit lane j holds sub-block group_of[4j + i] / 2 */
        uint32_t bit[16];
        for (int p = 0; p < 16; p++) bit[p] = 0x01010101u << (group_of[4 * (p / 4) + i] / 2);
        lanes.q5k_bit[i] = _mm512_loadu_si512(bit);
    }
    return lanes;
}

/* Dword i of 128-bit lane j of v[k] -> dword k of 128-bit lane j of v[i]: each lane 4j + i then
 * holds vector i's 16 bytes there, 4 in each of the four vectors. */
static inline __attribute__((always_inline)) void transpose16(__m512i *v) {
    const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
    v[0] = _mm512_unpacklo_epi64(t0, t2);
    v[1] = _mm512_unpackhi_epi64(t0, t2);
    v[2] = _mm512_unpacklo_epi64(t1, t3);
    v[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* The index vector of vpermt2w taking `count` (<= 32) 16-bit words of a unit, at byte offsets
 * at[i], from two of its 64-byte windows: window `first` (indices 0-31), else first + 1 (32-63);
 * window w starts at byte window[w]. A word neither holds gets index 0 (its lane is taken from
 * elsewhere). */
static inline __m512i words_at(const int *at, int count, const int *window, int first) {
    uint16_t index[32] = {0};
    for (int i = 0; i < count; i++)
        for (int w = first + 1; w >= first; w--) /* the first window that holds it */
            if (at[i] >= window[w] && at[i] + 2 <= window[w] + 64)
                index[i] = (uint16_t)(32 * (w - first) + (at[i] - window[w]) / 2);
    return _mm512_loadu_si512(index);
}

/* What the small kinds' units reuse: the windows' word indices of their nibbles, scales and
 * fifth bits, and the byte shuffles and bit tests that spread the fifth bits (see unit16_small). */
typedef struct {
    __m512i qs[2], head[2], qh_spread[4], qh_bit;
    __mmask32 head_late;
} Small16;

/*
 * A unit of 8 blocks is read as three 64-byte windows: its first 64 bytes, the next 64, and its
 * last 64 (Q4_0 80-143, Q5_0 112-175, Q5_1 128-191), so that no read passes the unit. Blocks 0-3's
 * nibbles lie in the first two windows and 4-7's in the last two, so each group of four is one
 * vpermt2w; "head" gathers the blocks' fp16 d (twice, or Q5_1's d then m) and then their fifth
 * bits (blocks 0-3's low 16 bits, 0-3's high, 4-7's low, 4-7's high), from the first two windows
 * and, for the blocks past them (head_late), the last.
 */
static inline Small16 small16(int kind) {
    Small16 small;
    const int bytes = k_block_bytes(kind), unit = 8 * bytes, window[3] = {0, 64, unit - 64};
    for (int half = 0; half < 2; half++) {
        int at[32];
        for (int w = 0; w < 32; w++) at[w] = (4 * half + w / 8) * bytes + small_qs_at(kind) + 2 * (w % 8);
        small.qs[half] = words_at(at, 32, window, half);
    }
    int at[32], late = 0;
    for (int b = 0; b < 8; b++) {
        at[b] = b * bytes;
        at[8 + b] = b * bytes + (kind == KIND_Q5_1 ? 2 : 0);
    }
    for (int i = 0; i < 16; i++) { /* the fifth bits' words: block, then which half of its qh */
        const int block = 4 * (i / 8) + i % 4, high = (i / 4) % 2;
        at[16 + i] = block * bytes + small_qh_at(kind) + 2 * high;
    }
    uint16_t late_index[32] = {0};
    for (int i = 0; i < 32; i++)
        if (at[i] + 2 > 128) { /* past the first two windows: from the last */
            late |= 1 << i;
            late_index[i] = (uint16_t)((at[i] - window[2]) / 2);
        }
    small.head[0] = words_at(at, 32, window, 0);
    small.head[1] = _mm512_loadu_si512(late_index);
    small.head_late = (__mmask32)late;
    /* vector (low blocks 0-3, high 0-3, low 4-7, high 4-7): byte t of 128-bit lane j tests bit t
     * % 8 of byte t / 8 of its block's half of qh, a word at 2 * (4 * (v % 2) + j) of the 16 bytes
     * of qh words (v < 2: head's words 16-23, else 24-31, broadcast to every lane) */
    for (int v = 0; v < 4; v++) {
        uint8_t spread[64];
        for (int j = 0; j < 4; j++)
            for (int t = 0; t < 16; t++) spread[16 * j + t] = (uint8_t)(2 * (4 * (v % 2) + j) + t / 8);
        small.qh_spread[v] = _mm512_loadu_si512(spread);
    }
    uint8_t bit[64];
    for (int t = 0; t < 64; t++) bit[t] = (uint8_t)(1 << (t % 8));
    small.qh_bit = _mm512_loadu_si512(bit);
    return small;
}

/* 8 blocks of Q4_0 / Q5_0 / Q5_1 from b (see small16): nibbles split into four vectors, the fifth
 * bits added where a test of their bytes finds them, transposed; d (and m) converted once. */
static inline __attribute__((always_inline)) Unit16 unit16_small(int kind, const uint8_t *b, const Small16 *small) {
    const int unit = 8 * k_block_bytes(kind);
    const __m512i first = _mm512_loadu_si512(b), second = _mm512_loadu_si512(b + 64);
    const __m512i last = _mm512_loadu_si512(b + unit - 64), low = _mm512_set1_epi8(15);
    Unit16 out;
    for (int half = 0; half < 2; half++) {
        const __m512i raw = half ? _mm512_permutex2var_epi16(second, small->qs[1], last)
                                 : _mm512_permutex2var_epi16(first, small->qs[0], second);
        out.v[2 * half] = _mm512_and_si512(raw, low);
        out.v[2 * half + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    __m512i head = _mm512_permutex2var_epi16(first, small->head[0], second);
    head = _mm512_mask_permutexvar_epi16(head, small->head_late, small->head[1], last);
    if (kind != KIND_Q4_0) {
        const __m512i sixteen = _mm512_set1_epi8(16);
        for (int v = 0; v < 4; v++) {
            const __m512i words = _mm512_shuffle_i32x4(head, head, v < 2 ? 0xAA : 0xFF); /* 16-23 or 24-31 */
            const __m512i spread = _mm512_shuffle_epi8(words, small->qh_spread[v]);
            out.v[v] = _mm512_mask_add_epi8(out.v[v], _mm512_test_epi8_mask(spread, small->qh_bit), out.v[v], sixteen);
        }
    }
    transpose16(out.v);
    out.scales = _mm512_cvtph_ps(_mm512_castsi512_si256(head)); /* d, then d or m */
    if (kind != KIND_Q5_1) /* the minimum is -offset d */
        out.scales = _mm512_mul_ps(out.scales, _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(1.0f),
                                                                    _mm512_set1_ps(kind == KIND_Q4_0 ? -8.0f : -16.0f)));
    return out;
}

/* A Q4_K / Q5_K super-block: d sc and -dmin mn per sub-block (quants_k.h), its 128 bytes of
 * nibbles as two vectors split in four, Q5_K's fifth bits (bit s of qh[t] for weight t of
 * sub-block s) added where a test of qh against each lane's bit finds them. */
static inline __attribute__((always_inline)) Unit16 unit16_k4(int kind, const uint8_t *sb, const Lanes16 *lanes) {
    const __m128i head = _mm_loadu_si128((const __m128i *)sb);
    const __m512 both = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(k4_scales_mins(head)));
    const __m512 d_dmin = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                                _mm512_castps128_ps512(_mm_cvtph_ps(head)));
    Unit16 unit;
    unit.scales = _mm512_mul_ps(both, d_dmin); /* the minima dmin mn, subtracted (unit16_row) */
    const uint8_t *qs = sb + (kind == KIND_Q5_K ? 48 : 16);
    const __m512i low = _mm512_set1_epi8(15);
    for (int half = 0; half < 2; half++) {
        const __m512i raw = _mm512_loadu_si512(qs + 64 * half);
        unit.v[2 * half] = _mm512_and_si512(raw, low);
        unit.v[2 * half + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    if (kind == KIND_Q5_K) { /* qh[0..15], qh[16..31] in each half: a 128-bit lane's t is its byte */
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(sb + 16)));
        const __m512i sixteen = _mm512_set1_epi8(16);
        for (int i = 0; i < 4; i++)
            unit.v[i] = _mm512_mask_add_epi8(unit.v[i], _mm512_test_epi8_mask(qh, lanes->q5k_bit[i]), unit.v[i], sixteen);
    }
    transpose16(unit.v);
    return unit;
}

/* A Q6_K super-block: per half of 128 weights, ql's 64 bytes (low nibbles: weights 0-63, high:
 * 64-127) and qh's 32 in both 256-bit halves, whose bit pairs 0-1, 2-3, 4-5, 6-7 are those
 * weights' high bits: shifted to bits 4-5 by 4, 2 (low nibbles' halves) and 0, -2 (high
 * nibbles'). The int8 scales times d, per 16, in the lanes' order. */
static inline __attribute__((always_inline)) Unit16 unit16_k6(const uint8_t *sb, const Lanes16 *lanes) {
    const __m512i low = _mm512_set1_epi8(15), bits45 = _mm512_set1_epi8(0x30);
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i qh_both = _mm512_loadu_si512(sb + 128);
    Unit16 unit;
    for (int half = 0; half < 2; half++) {
        const __m512i ql = _mm512_loadu_si512(sb + 64 * half);
        const __m512i qh = _mm512_shuffle_i64x2(qh_both, qh_both, half ? 0xEE : 0x44);
        /* 0xF8: a | (b & c), a the high bits, b the nibbles' byte, c the nibble mask */
        unit.v[2 * half] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_sllv_epi16(qh, up), bits45), ql, low, 0xF8);
        unit.v[2 * half + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srlv_epi16(qh, down), bits45),
                                                         _mm512_srli_epi16(ql, 4), low, 0xF8);
    }
    transpose16(unit.v);
    const __m512 scales = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sb + 192))));
    unit.scales = _mm512_mul_ps(_mm512_permutexvar_ps(lanes->group_of_lane, scales),
                                _mm512_set1_ps(fp16_to_fp32(k_u16(sb + 208))));
    return unit;
}

static inline __attribute__((always_inline)) Unit16 unit16(int kind, const uint8_t *at, const Lanes16 *lanes,
                                                          const Small16 *small) {
    if (family_of(kind) == FAMILY_SMALL) return unit16_small(kind, at, small);
    if (family_of(kind) == FAMILY_K4) return unit16_k4(kind, at, lanes);
    return unit16_k6(at, lanes);
}

/*
 * One unit against one row of x (its record), into acc: the four vpdpbusd (Q6_K's from each
 * lane's start, -32 times its group's sum of x), then acc += float(dot) * (d dx) of the lane's
 * block, and the minima's m xs per block (lanes 8-15 of the scales and of the record's, 0-7 left
 * as they are).
 */
static inline __attribute__((always_inline)) __m512 unit16_row(int kind, const Unit16 *unit, const Lanes16 *lanes,
                                                              const uint8_t *record, __m512 acc) {
    if (kind == KIND_Q6_K) {
        __m512i dot = _mm512_loadu_si512(record + 256);
        for (int k = 0; k < 4; k++) dot = _mm512_dpbusd_epi32(dot, unit->v[k], _mm512_loadu_si512(record + 64 * k));
        const __m512 dx = _mm512_castps256_ps512(_mm256_loadu_ps((const float *)(record + 320)));
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                               _mm512_mul_ps(unit->scales, _mm512_permutexvar_ps(lanes->block_of_lane, dx)), acc);
    }
    __m512i dot = _mm512_setzero_si512();
    for (int k = 0; k < 4; k++) dot = _mm512_dpbusd_epi32(dot, unit->v[k], _mm512_loadu_si512(record + 64 * k));
    const __m512 products = _mm512_mul_ps(unit->scales, _mm512_loadu_ps((const float *)(record + 256))); /* d dx, m xs */
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(lanes->block_of_lane, products), acc);
    return family_of(kind) == FAMILY_K4 ? _mm512_mask_sub_ps(acc, 0xFF00, acc, products)
                                        : _mm512_mask_add_ps(acc, 0xFF00, acc, products);
}

/* What every tile of a call reads and writes: the weights (rows row_bytes apart), x's records
 * (M rows a unit, units a row), the output, and the permutes every unit reuses. */
typedef struct {
    const uint8_t *w, *x;
    int64_t row_bytes, units, K, M, N;
    void *y;
    int y_is_bf16;
    const Lanes16 *lanes;
    const Small16 *small;
    int64_t ahead; /* bytes ahead a row at a time is fetched (prefetch_ahead) */
} Job;

/* Whether a row ends in a partial unit: a small kind's K % 256 weights. */
static inline int has_partial(int kind, const Job *job) {
    return family_of(kind) == FAMILY_SMALL && job->K % 256 != 0;
}

/* Where unit u of weight row n is: in the row, or, for the last, partial unit, in `last` (a
 * zeroed copy of the row's last blocks, made by copy_last). */
static inline __attribute__((always_inline)) const uint8_t *unit_at(int kind, const Job *job, int64_t n, int64_t u,
                                                                   const uint8_t *last) {
    if (has_partial(kind, job) && u == job->units - 1) return last;
    return job->w + n * job->row_bytes + u * unit_bytes(kind, 16);
}

/* Row n's last blocks (K % 256 weights, a small kind's) into `last`, zero-padded to a unit, so
 * that a unit's loads never pass the row (the tensor's end, for its last row). */
static inline void copy_last(int kind, const Job *job, int64_t n, uint8_t *last) {
    const int64_t bytes = job->K % 256 / QK * k_block_bytes(kind);
    const uint8_t *from = job->w + n * job->row_bytes + (job->units - 1) * unit_bytes(kind, 16);
    for (int part = 0; part < 3; part++) { /* a unit is at most 192 bytes */
        const int64_t left = bytes - 64 * part;
        const __mmask64 take = left >= 64 ? ~(__mmask64)0 : left > 0 ? ((__mmask64)1 << left) - 1 : 0;
        _mm512_storeu_si512(last + 64 * part, _mm512_maskz_loadu_epi8(take, from + 64 * part));
    }
}

/* How far ahead of its reads rows16_single fetches: with tiles of K_A8_COLS rows, the next tile
 * at the same place; a row at a time, K_A8_ROW_AHEAD bytes on along the matrix (a single stream:
 * consecutive rows are contiguous). Streamed on one Zen 5 core at one row of x, Q4_K / Q6_K took
 * 1.07-1.33x / 1.09-1.23x a read of their bytes a row at a time against 1.24-1.35x in tiles of 4,
 * and Q4_0 / Q5_0 (K = 8192) 1.10-1.14x / 1.11-1.22x in tiles against 1.2-2.3x a row at a time
 * (why the small kinds stall in one stream is not understood: 30 cycles a unit where in cache it
 * is 15); 4-24 KB ahead made no difference beyond the noise. With more threads, prefetch_ahead:
 * Q6_K 2048 x 8192 streamed by 2 threads, 4 KB 42.1-44.6 GB/s against 8 KB's 40.5-42.8. */
#define K_A8_ROW_AHEAD 8192

/* A unit's bytes from `at`, one prefetch a cache line. */
static inline __attribute__((always_inline)) void prefetch_unit(int kind, const uint8_t *at) {
    for (int line = 0; line < (int)((unit_bytes(kind, 16) + 63) / 64); line++)
        _mm_prefetch((const char *)(at + 64 * line), WEIGHT_HINT);
}

/*
 * One row of x (M == 1): weight rows [n0, n1) a row at a time (the K-quants), or for the small
 * kinds in tiles of K_A8_COLS, each tile's rows decoded unit by unit into their own chains (the
 * last, partial tile a row at a time, summed alike); see K_A8_ROW_AHEAD. Each row's sum is one
 * chain of unit16_row in unit order, then one _mm512_reduce_add_ps, as in rows16_batch.
 */
static inline __attribute__((always_inline)) void rows16_single(int kind, const Job *job, int64_t n0, int64_t n1) {
    uint8_t last[K_A8_COLS][192];
    for (int64_t n = n0; n < n1;) {
        const int cols = family_of(kind) == FAMILY_SMALL && n + K_A8_COLS <= n1 ? K_A8_COLS : 1;
        if (has_partial(kind, job))
            for (int c = 0; c < cols; c++) copy_last(kind, job, n + c, last[c]);
        __m512 acc[K_A8_COLS];
        for (int c = 0; c < K_A8_COLS; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t u = 0; u < job->units; u++) {
            const uint8_t *x = job->x + u * record_bytes(kind, 16);
            if (cols == K_A8_COLS) {
#pragma GCC unroll 4
                for (int c = 0; c < K_A8_COLS; c++) {
                    const uint8_t *at = unit_at(kind, job, n + c, u, last[c]);
                    /* the next tile, at the same place */
                    prefetch_unit(kind, job->w + (n + c + K_A8_COLS) * job->row_bytes + u * unit_bytes(kind, 16));
                    const Unit16 unit = unit16(kind, at, job->lanes, job->small);
                    acc[c] = unit16_row(kind, &unit, job->lanes, x, acc[c]);
                }
            } else {
                prefetch_unit(kind, job->w + n * job->row_bytes + u * unit_bytes(kind, 16) + job->ahead);
                const Unit16 unit = unit16(kind, unit_at(kind, job, n, u, last[0]), job->lanes, job->small);
                acc[0] = unit16_row(kind, &unit, job->lanes, x, acc[0]);
            }
        }
        for (int c = 0; c < cols; c++) put_f32(job->y, job->y_is_bf16, n + c, _mm512_reduce_add_ps(acc[c]));
        n += cols;
    }
}

/* Weight rows a block of rows16_batch holds, and the units of a chunk: a chunk's records for 8
 * rows of x (8 * 8 * 320 bytes) stay in L1 while every row of the block reads them. */
#define K_A8_BLOCK 16
#define K_A8_CHUNK 8

/*
 * `rows` (1, 2, 4 or 8, a constant once inlined) rows of x from m0 against weight rows [n0, n1):
 * per block of K_A8_BLOCK weight rows and chunk of K_A8_CHUNK units, each row of the block runs
 * the chunk with its accumulators kept between chunks (so x's records of a chunk are read from
 * L1 by every row), decoding unit u + 1 before unit u's rows run (so that they need not wait for
 * it), the rows two on prefetched at the same place. Each (weight row, row of x) pair is one
 * chain of unit16_row in unit order, then one _mm512_reduce_add_ps: the sums of rows16_single.
 */
static inline __attribute__((always_inline)) void rows16_batch(int kind, const Job *job, int64_t n0, int64_t n1,
                                                               int64_t m0, int rows) {
    uint8_t last[192];
    __m512 kept[K_A8_BLOCK][K_A8_MAX_ROWS];
    const uint8_t *records = job->x + m0 * record_bytes(kind, 16);
    for (int64_t block = n0; block < n1; block += K_A8_BLOCK) {
        const int64_t block_rows = n1 - block < K_A8_BLOCK ? n1 - block : K_A8_BLOCK;
        for (int64_t i = 0; i < block_rows; i++)
            for (int r = 0; r < rows; r++) kept[i][r] = _mm512_setzero_ps();
        for (int64_t u0 = 0; u0 < job->units; u0 += K_A8_CHUNK) {
            const int64_t u1 = u0 + K_A8_CHUNK < job->units ? u0 + K_A8_CHUNK : job->units;
            for (int64_t i = 0; i < block_rows; i++) {
                const int64_t n = block + i;
                if (has_partial(kind, job) && u1 == job->units) copy_last(kind, job, n, last);
                /* two rows on, at the same place; past the block's last rows, its first rows' next
                 * chunk, or after its last chunk, the next block's first */
                int64_t ahead = n + 2, ahead_unit = u0;
                if (i + 2 >= block_rows) {
                    ahead = u1 < job->units ? block + i + 2 - block_rows : n + 2;
                    ahead_unit = u1 < job->units ? u1 : 0;
                }
                __m512 acc[K_A8_MAX_ROWS];
                for (int r = 0; r < rows; r++) acc[r] = kept[i][r];
                Unit16 unit = unit16(kind, unit_at(kind, job, n, u0, last), job->lanes, job->small);
                for (int64_t u = u0; u < u1; u++) {
                    if (ahead < job->N)
                        prefetch_unit(kind, job->w + ahead * job->row_bytes +
                                                (ahead_unit + u - u0) * unit_bytes(kind, 16));
                    const Unit16 now = unit;
                    if (u + 1 < u1) unit = unit16(kind, unit_at(kind, job, n, u + 1, last), job->lanes, job->small);
                    const uint8_t *x = records + u * job->M * record_bytes(kind, 16);
#pragma GCC unroll 8
                    for (int r = 0; r < rows; r++)
                        acc[r] = unit16_row(kind, &now, job->lanes, x + r * record_bytes(kind, 16), acc[r]);
                }
                for (int r = 0; r < rows; r++) kept[i][r] = acc[r];
            }
        }
        for (int64_t i = 0; i < block_rows; i++)
            for (int r = 0; r < rows; r++)
                put_f32(job->y, job->y_is_bf16, (m0 + r) * job->N + block + i, _mm512_reduce_add_ps(kept[i][r]));
    }
}

/* rows16_single (rows 0) or rows16_batch with the kind and rows as constants, so that their
 * loops unroll into registers. */
#define ROWS16(KIND)                                                      \
    do {                                                                  \
        switch (rows) {                                                   \
            case 0: rows16_single(KIND, job, n0, n1); return;             \
            case 1: rows16_batch(KIND, job, n0, n1, m0, 1); return;       \
            case 2: rows16_batch(KIND, job, n0, n1, m0, 2); return;       \
            case 4: rows16_batch(KIND, job, n0, n1, m0, 4); return;       \
            default: rows16_batch(KIND, job, n0, n1, m0, 8); return;      \
        }                                                                 \
    } while (0)
static void rows16(int kind, const Job *job, int64_t n0, int64_t n1, int64_t m0, int rows) {
    switch (kind) {
        case KIND_Q4_0: ROWS16(KIND_Q4_0);
        case KIND_Q5_0: ROWS16(KIND_Q5_0);
        case KIND_Q5_1: ROWS16(KIND_Q5_1);
        case KIND_Q4_K: ROWS16(KIND_Q4_K);
        case KIND_Q5_K: ROWS16(KIND_Q5_K);
        default: ROWS16(KIND_Q6_K);
    }
}
#undef ROWS16

/* The rows of x a tile of one weight row takes from `left` rows: 8, 4, 2 or 1. */
static inline int row_tile(int64_t left) { return left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1; }

/* The int8-activation matmul of the kinds held as GGUF stores them, with AVX512-VNNI: x
 * rearranged into records (unit_x), then each thread's share of the weight rows (whole tiles or
 * blocks) against every row of x. Returns 0, or -1 when x's buffer could not be allocated. */
int pd_quant_k_a8_gemm(int kind, const int8_t *q, const float *d, int64_t stride, int64_t M, int64_t K,
                       const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads) {
    const int64_t units = (K + 255) / 256;
    const int64_t x_bytes = M * units * record_bytes(kind, 16);
    uint8_t *records = (uint8_t *)malloc((size_t)(x_bytes + units * 256 + units * 16 * sizeof(int32_t)));
    if (records == NULL) return -1;
    unit_x(kind, 16, q, d, stride, M, K, units, records, (int8_t *)(records + x_bytes),
           (int32_t *)(records + x_bytes + units * 256));
    const Lanes16 lanes = lanes16(kind);
    const Small16 small = small16(family_of(kind) == FAMILY_SMALL ? kind : KIND_Q4_0);
    const Job job = {w, records, k_row_bytes(kind, K), units, K, M, N, y,
                     y_is_bf16, &lanes, &small, prefetch_ahead(K_A8_ROW_AHEAD, threads)};
    const int64_t grain = M == 1 ? K_A8_COLS : K_A8_BLOCK, pieces = (N + grain - 1) / grain;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t n0 = pieces * me / team * grain, end = pieces * (me + 1) / team * grain;
        const int64_t n1 = end < N ? end : N;
        if (M == 1)
            rows16(kind, &job, n0, n1, 0, 0);
        else
            for (int64_t m0 = 0; m0 < M; m0 += row_tile(M - m0)) rows16(kind, &job, n0, n1, m0, row_tile(M - m0));
    }
    free(records);
    return 0;
}
#endif

#if PD_HAS_AVX2 && !PD_HAS_AVX512_VNNI /* with VNNI, the kernels above take every kind */
/* Rows a tile serves: weight rows at one row of x, rows of x otherwise (16 ymm registers). */
#define K8_COLS 4
#define K8_MAX_ROWS 4
#define K8_BLOCK 16 /* weight rows a block of rows8_batch holds */
#define K8_CHUNK 16 /* units (of 128 weights) of a chunk: 4 rows' records, 10-11 KB, stay in L1 */

/* A unit of 128 weights decoded, as Unit16 in 256 bits: v[k] lane p holds weights 4k .. 4k + 3
 * of group GROUP_OF_LANE8[family][p]; scales: Q6_K's d sc per lane, else the weight scale of each
 * block (sub-block) of 32 in lanes 0-3 and its minimum in 4-7. */
typedef struct {
    __m256i v[4];
    __m256 scales;
} Unit8;

/* The permutes every unit reuses: each lane's block of 32, and Q6_K's group of 16. */
typedef struct {
    __m256i block_of_lane, group_of_lane;
} Lanes8;

static inline Lanes8 lanes8(int kind) {
    const uint8_t *group_of = GROUP_OF_LANE8[family_of(kind)];
    int32_t block[8], group[8];
    for (int p = 0; p < 8; p++) {
        block[p] = group_of[p] / 2;
        group[p] = group_of[p];
    }
    Lanes8 lanes = {_mm256_loadu_si256((const __m256i *)block), _mm256_loadu_si256((const __m256i *)group)};
    return lanes;
}

/* transpose16 in 256 bits: lane 4j + i then holds vector i's 16 bytes of 128-bit lane j. */
static inline __attribute__((always_inline)) void transpose8(__m256i *v) {
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    v[0] = _mm256_unpacklo_epi64(t0, t2);
    v[1] = _mm256_unpackhi_epi64(t0, t2);
    v[2] = _mm256_unpacklo_epi64(t1, t3);
    v[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* 16 in each byte of two blocks' nibbles whose fifth bit is set: byte t of 128-bit lane j reads
 * bit t % 8 of byte `at` + t / 8 of the lane's qh (its block's, in dword 0), llama.cpp's
 * bytes_from_bits_32 (an or with every other bit, then a compare with all ones). */
static inline __attribute__((always_inline)) __m256i fifth_bits8(__m256i qh, int at) {
    const __m256i spread = _mm256_shuffle_epi8(
        qh, _mm256_setr_epi8(at, at, at, at, at, at, at, at, at + 1, at + 1, at + 1, at + 1, at + 1, at + 1, at + 1, at + 1,
                             at, at, at, at, at, at, at, at, at + 1, at + 1, at + 1, at + 1, at + 1, at + 1, at + 1, at + 1));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                          _mm256_set1_epi8(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

/* 4 blocks of Q4_0 / Q5_0 / Q5_1 from b: two a vector, nibbles split, fifth bits added,
 * transposed; their fp16 d (and m) from the dword at each block's start. */
static inline __attribute__((always_inline)) Unit8 unit8_small(int kind, const uint8_t *b) {
    const int bytes = k_block_bytes(kind), qs = small_qs_at(kind);
    const __m256i low = _mm256_set1_epi8(15);
    Unit8 out;
    for (int pair = 0; pair < 2; pair++) {
        const uint8_t *two = b + 2 * pair * bytes;
        const __m256i raw = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(two + qs))),
                                                    _mm_loadu_si128((const __m128i *)(two + bytes + qs)), 1);
        __m256i first = _mm256_and_si256(raw, low), second = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        if (kind != KIND_Q4_0) {
            uint32_t qh[2];
            for (int j = 0; j < 2; j++) memcpy(qh + j, two + j * bytes + small_qh_at(kind), 4);
            const __m256i both = _mm256_set_m128i(_mm_cvtsi32_si128((int)qh[1]), _mm_cvtsi32_si128((int)qh[0]));
            first = _mm256_or_si256(first, fifth_bits8(both, 0));   /* weights 0-15: qh bits 0-15 */
            second = _mm256_or_si256(second, fifth_bits8(both, 2)); /* weights 16-31: bits 16-31 */
        }
        out.v[2 * pair] = first;
        out.v[2 * pair + 1] = second;
    }
    transpose8(out.v);
    uint32_t word[4]; /* d, and Q5_1's m (else two bytes past d) */
    for (int j = 0; j < 4; j++) memcpy(word + j, b + j * bytes, 4);
    const __m128i words = _mm_setr_epi32((int)word[0], (int)word[1], (int)word[2], (int)word[3]);
    const __m128i order = kind == KIND_Q5_1 ? _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)
                                            : _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12, 13);
    out.scales = _mm256_cvtph_ps(_mm_shuffle_epi8(words, order));
    if (kind != KIND_Q5_1) { /* the minimum is -offset d */
        const float offset = kind == KIND_Q4_0 ? -8.0f : -16.0f;
        out.scales = _mm256_mul_ps(out.scales, _mm256_setr_ps(1, 1, 1, 1, offset, offset, offset, offset));
    }
    return out;
}

/* Half h of a Q4_K / Q5_K super-block (sub-blocks 4h .. 4h + 3): d sc and dmin mn (subtracted),
 * qs[64h .. 64h + 63] split in four, Q5_K's fifth bits (bit s of qh[t]) shifted to 16. */
static inline __attribute__((always_inline)) Unit8 unit8_k4(int kind, const uint8_t *sb, int h) {
    const __m128i head = _mm_loadu_si128((const __m128i *)sb);
    const __m128i pick = _mm_shuffle_epi8(k4_scales_mins(head), h ? _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0)
                                                                  : _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 0, 0, 0, 0, 0, 0, 0, 0));
    const __m256 d_dmin = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(head)),
                                                   _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    Unit8 unit;
    unit.scales = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(pick)), d_dmin);
    const uint8_t *qs = sb + (kind == KIND_Q5_K ? 48 : 16) + 64 * h;
    const __m256i low = _mm256_set1_epi8(15);
    for (int half = 0; half < 2; half++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * half));
        unit.v[2 * half] = _mm256_and_si256(raw, low);
        unit.v[2 * half + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
    if (kind == KIND_Q5_K) { /* vector i is sub-block 4h + i; qh[0..15], qh[16..31] its lanes' bytes */
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(sb + 16)), sixteen = _mm256_set1_epi8(16);
        for (int i = 0; i < 4; i++) {
            const int s = 4 * h + i;
            const __m256i bit = s <= 4 ? _mm256_slli_epi16(qh, 4 - s) : _mm256_srli_epi16(qh, s - 4);
            unit.v[i] = _mm256_or_si256(unit.v[i], _mm256_and_si256(bit, sixteen));
        }
    }
    transpose8(unit.v);
    return unit;
}

/* Half h of a Q6_K super-block: weights 0-31 and 32-63 from ql's 64 bytes' low nibbles, 64-127
 * from their high ones, qh's bit pairs 0-1, 2-3, 4-5, 6-7 shifted to bits 4-5. */
static inline __attribute__((always_inline)) Unit8 unit8_k6(const uint8_t *sb, int h, const Lanes8 *lanes) {
    const __m256i low = _mm256_set1_epi8(15), bits45 = _mm256_set1_epi8(0x30);
    const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(sb + 64 * h));
    const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(sb + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * h));
    Unit8 unit;
    unit.v[0] = _mm256_or_si256(_mm256_and_si256(ql0, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45));
    unit.v[1] = _mm256_or_si256(_mm256_and_si256(ql1, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45));
    unit.v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), _mm256_and_si256(qh, bits45));
    unit.v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low),
                                _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45));
    transpose8(unit.v);
    const __m256 scales = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sb + 192 + 8 * h))));
    unit.scales = _mm256_mul_ps(_mm256_permutevar8x32_ps(scales, lanes->group_of_lane),
                                _mm256_set1_ps(fp16_to_fp32(k_u16(sb + 208))));
    return unit;
}

/* Unit h (0, 1) of the 256 weights at `at` (a super-block, or 8 small blocks). */
static inline __attribute__((always_inline)) Unit8 unit8(int kind, const uint8_t *at, int h, const Lanes8 *lanes) {
    if (family_of(kind) == FAMILY_SMALL) return unit8_small(kind, at + 4 * h * k_block_bytes(kind));
    if (family_of(kind) == FAMILY_K4) return unit8_k4(kind, at, h);
    return unit8_k6(at, h, lanes);
}

/* One unit against one row of x (its record), into acc, as unit16_row: vpmaddubsw's pairs
 * summed in int16 (at most 4 * 2 * 31 * 127 for the 4- and 5-bit kinds; Q6_K's two and two
 * widened apart), vpmaddwd to int32 lanes, then the scales. */
static inline __attribute__((always_inline)) __m256 unit8_row(int kind, const Unit8 *unit, const Lanes8 *lanes,
                                                             const uint8_t *record, __m256 acc) {
    __m256i pairs[4];
    for (int k = 0; k < 4; k++) pairs[k] = _mm256_maddubs_epi16(unit->v[k], _mm256_loadu_si256((const __m256i *)(record + 32 * k)));
    const __m256i ones = _mm256_set1_epi16(1);
    if (kind == KIND_Q6_K) {
        __m256i dot = _mm256_loadu_si256((const __m256i *)(record + 128)); /* -32 times the group's sum */
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_add_epi16(pairs[0], pairs[1]), ones));
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_add_epi16(pairs[2], pairs[3]), ones));
        const __m256 dx = _mm256_castps128_ps256(_mm_loadu_ps((const float *)(record + 160)));
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                               _mm256_mul_ps(unit->scales, _mm256_permutevar8x32_ps(dx, lanes->block_of_lane)), acc);
    }
    const __m256i sum = _mm256_add_epi16(_mm256_add_epi16(pairs[0], pairs[1]), _mm256_add_epi16(pairs[2], pairs[3]));
    const __m256 products = _mm256_mul_ps(unit->scales, _mm256_loadu_ps((const float *)(record + 128))); /* d dx, m xs */
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum, ones)),
                          _mm256_permutevar8x32_ps(products, lanes->block_of_lane), acc);
    const __m256 minima = _mm256_blend_ps(_mm256_setzero_ps(), products, 0xF0);
    return family_of(kind) == FAMILY_K4 ? _mm256_sub_ps(acc, minima) : _mm256_add_ps(acc, minima);
}

/* What every tile reads and writes (as Job): weights, x's records (M rows a unit, 2 units a
 * step of 256 weights), the output. */
typedef struct {
    const uint8_t *w, *x;
    int64_t row_bytes, steps, K, M, N;
    void *y;
    int y_is_bf16;
    const Lanes8 *lanes;
} Job8;

/* Where step s of weight row n is: in the row, or its partial last step zero-padded in `last`
 * (a small kind's K % 256 weights: made here when s is that step). */
static inline const uint8_t *step_at(int kind, const Job8 *job, int64_t n, int64_t s, uint8_t *last) {
    const uint8_t *at = job->w + n * job->row_bytes + s * unit_bytes(kind, 16);
    if (family_of(kind) != FAMILY_SMALL || job->K % 256 == 0 || s != job->steps - 1) return at;
    memset(last, 0, 192);
    memcpy(last, at, (size_t)(job->K % 256 / QK * k_block_bytes(kind)));
    return last;
}

/* One row of x: weight rows [n0, n1) in tiles of K8_COLS (the last, partial tile a row at a
 * time), the next tile prefetched at the same place; each row one chain of unit8_row in unit
 * order, then one hsum_avx2, as in rows8_batch. */
static inline __attribute__((always_inline)) void rows8_single(int kind, const Job8 *job, int64_t n0, int64_t n1) {
    uint8_t last[K8_COLS][192];
    const int64_t step = unit_bytes(kind, 16), lines = (step + 63) / 64;
    for (int64_t n = n0; n < n1;) {
        const int cols = n + K8_COLS <= n1 ? K8_COLS : 1;
        __m256 acc[K8_COLS];
        for (int c = 0; c < K8_COLS; c++) acc[c] = _mm256_setzero_ps();
        for (int64_t s = 0; s < job->steps; s++) {
            const uint8_t *at[K8_COLS];
            for (int c = 0; c < cols; c++) {
                at[c] = step_at(kind, job, n + c, s, last[c]);
                const uint8_t *next = job->w + (n + c) * job->row_bytes + s * step +
                                      (cols > 1 ? K8_COLS * job->row_bytes : ROW_PREFETCH_BYTES);
                for (int line = 0; line < lines; line++) _mm_prefetch((const char *)(next + 64 * line), WEIGHT_HINT);
            }
            for (int h = 0; h < 2; h++) {
                const uint8_t *x = job->x + (2 * s + h) * record_bytes(kind, 8);
                if (cols == K8_COLS) {
#pragma GCC unroll 4
                    for (int c = 0; c < K8_COLS; c++) {
                        const Unit8 unit = unit8(kind, at[c], h, job->lanes);
                        acc[c] = unit8_row(kind, &unit, job->lanes, x, acc[c]);
                    }
                } else {
                    const Unit8 unit = unit8(kind, at[0], h, job->lanes);
                    acc[0] = unit8_row(kind, &unit, job->lanes, x, acc[0]);
                }
            }
        }
        for (int c = 0; c < cols; c++) put_f32(job->y, job->y_is_bf16, n + c, hsum_avx2(acc[c]));
        n += cols;
    }
}

/* `rows` (1, 2 or 4) rows of x from m0 against weight rows [n0, n1), as rows16_batch: blocks of
 * K8_BLOCK weight rows, chunks of K8_CHUNK units, accumulators kept between chunks. */
static inline __attribute__((always_inline)) void rows8_batch(int kind, const Job8 *job, int64_t n0, int64_t n1,
                                                              int64_t m0, int rows) {
    uint8_t last[192];
    __m256 kept[K8_BLOCK][K8_MAX_ROWS];
    const uint8_t *records = job->x + m0 * record_bytes(kind, 8);
    for (int64_t block = n0; block < n1; block += K8_BLOCK) {
        const int64_t block_rows = n1 - block < K8_BLOCK ? n1 - block : K8_BLOCK;
        for (int64_t i = 0; i < block_rows; i++)
            for (int r = 0; r < rows; r++) kept[i][r] = _mm256_setzero_ps();
        for (int64_t s0 = 0; s0 < job->steps; s0 += K8_CHUNK / 2) {
            const int64_t s1 = s0 + K8_CHUNK / 2 < job->steps ? s0 + K8_CHUNK / 2 : job->steps;
            for (int64_t i = 0; i < block_rows; i++) {
                __m256 acc[K8_MAX_ROWS];
                for (int r = 0; r < rows; r++) acc[r] = kept[i][r];
                for (int64_t s = s0; s < s1; s++) {
                    const uint8_t *at = step_at(kind, job, block + i, s, last);
                    if (i + 2 < block_rows) /* two rows on, at the same place */
                        for (int line = 0; line < (unit_bytes(kind, 16) + 63) / 64; line++)
                            _mm_prefetch((const char *)(at + 2 * job->row_bytes + 64 * line), WEIGHT_HINT);
                    for (int h = 0; h < 2; h++) {
                        const Unit8 unit = unit8(kind, at, h, job->lanes);
                        const uint8_t *x = records + (2 * s + h) * job->M * record_bytes(kind, 8);
#pragma GCC unroll 4
                        for (int r = 0; r < rows; r++)
                            acc[r] = unit8_row(kind, &unit, job->lanes, x + r * record_bytes(kind, 8), acc[r]);
                    }
                }
                for (int r = 0; r < rows; r++) kept[i][r] = acc[r];
            }
        }
        for (int64_t i = 0; i < block_rows; i++)
            for (int r = 0; r < rows; r++)
                put_f32(job->y, job->y_is_bf16, (m0 + r) * job->N + block + i, hsum_avx2(kept[i][r]));
    }
}

/* rows8_single (rows 0) or rows8_batch with the kind and rows as constants. */
#define ROWS8(KIND)                                                  \
    do {                                                             \
        switch (rows) {                                              \
            case 0: rows8_single(KIND, job, n0, n1); return;         \
            case 1: rows8_batch(KIND, job, n0, n1, m0, 1); return;   \
            case 2: rows8_batch(KIND, job, n0, n1, m0, 2); return;   \
            default: rows8_batch(KIND, job, n0, n1, m0, 4); return;  \
        }                                                            \
    } while (0)
static void rows8(int kind, const Job8 *job, int64_t n0, int64_t n1, int64_t m0, int rows) {
    switch (kind) {
        case KIND_Q4_0: ROWS8(KIND_Q4_0);
        case KIND_Q5_0: ROWS8(KIND_Q5_0);
        case KIND_Q5_1: ROWS8(KIND_Q5_1);
        case KIND_Q4_K: ROWS8(KIND_Q4_K);
        case KIND_Q5_K: ROWS8(KIND_Q5_K);
        default: ROWS8(KIND_Q6_K);
    }
}
#undef ROWS8

/* The int8-activation matmul of the kinds held as GGUF stores them, with AVX2: x rearranged into
 * records of 128 weights (unit_x), then each thread's share of the weight rows. Returns 0, or -1
 * when x's buffer could not be allocated. */
int pd_quant_k_a8_gemm(int kind, const int8_t *q, const float *d, int64_t stride, int64_t M, int64_t K,
                       const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads) {
    const int64_t steps = (K + 255) / 256, units = 2 * steps;
    const int64_t x_bytes = M * units * record_bytes(kind, 8);
    uint8_t *records = (uint8_t *)malloc((size_t)(x_bytes + steps * 256 + steps * 16 * sizeof(int32_t)));
    if (records == NULL) return -1;
    unit_x(kind, 8, q, d, stride, M, K, units, records, (int8_t *)(records + x_bytes),
           (int32_t *)(records + x_bytes + steps * 256));
    const Lanes8 lanes = lanes8(kind);
    const Job8 job = {w, records, k_row_bytes(kind, K), steps, K, M, N, y, y_is_bf16, &lanes};
    const int64_t grain = M == 1 ? K8_COLS : K8_BLOCK, pieces = (N + grain - 1) / grain;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t n0 = pieces * me / team * grain, end = pieces * (me + 1) / team * grain;
        const int64_t n1 = end < N ? end : N;
        if (M == 1) {
            rows8(kind, &job, n0, n1, 0, 0);
        } else {
            for (int64_t m0 = 0; m0 < M;) {
                const int rows = M - m0 >= 4 ? 4 : M - m0 >= 2 ? 2 : 1;
                rows8(kind, &job, n0, n1, m0, rows);
                m0 += rows;
            }
        }
    }
    free(records);
    return 0;
}
#endif
