/*
 * The x86 routes of quants_k.c: the kinds held exactly as GGUF stores them (Q4_0, Q5_0, Q5_1,
 * Q4_K, Q5_K, Q6_K; quants_k.h has the layouts and what every route computes). With AVX-512 the
 * fp32 route and the dequantization, with AVX512-BF16 the bf16 route. Each public function is
 * the native twin of quants_k.c's NAME_generic (quants_k.h); a build without the instructions
 * runs the twin (arch_fallback.h), and a section's code compiles to nothing.
 *
 * fp32 route and dequantization (AVX-512 Foundation only, so that KNL builds them too): a
 * sub-block's unsigned q become 2 x 16 int32 lanes in input order (vpmovzxbd, then shifts and
 * masks per kind: Q5's fifth bit and Q6_K's two high bits OR-ed in), converted exactly, and
 * w = fma(d, q, m) per half: fmaf's value, so the weights are the file's bit for bit. A K-quant's
 * scales are decoded once a super-block. The fp32 route keeps four chains per row of x (even and
 * odd sub-blocks, each half) so that one row is not bound by one chain's fma latency.
 *
 * bf16 route (the decode matmuls of a bf16 model): q is made its bf16 through a table, exactly
 * (integers below 64 are bf16 values), one vdpbf16ps per 32 weights per row of x, and d applied
 * in fp32 once per group of vectors whose lanes share their scales; m, where a kind has one
 * apart from its q's offset, through x's sums per 32 (sum_j (d q_j + m) x_j = d (q . x) + m sum
 * x). Q4_0, Q5_0 and Q6_K subtract their offset (8, 16, 32) in the table, so they need no m.
 * The file's exact weights and exact products: only fp32's summation rounds.
 *
 * The table lookup reads q where it lies in the block's bytes: vpermw indexes with the low 5 bits
 * of each 16-bit word, so the raw bytes, read as words, index with the even byte's low nibble
 * (the table masks off bit 4: entry i holds i & 15's value), and shifted right by 4, 8 and 12
 * with the even byte's high nibble and the odd byte's nibbles. A Q5 kind's fifth bit (Q6_K's
 * fifth and sixth) is put into the index by one vpternlogd (bit select) from its qh bytes,
 * rotated into place. So one vector of 32 bf16 costs a shift (one in four costs none) and a
 * vpermw (vpermt2w: Q6_K's 64 entries), with one select per two vectors for the Q5 kinds and
 * Q6_K. Each 32-bit lane of the result pairs weights that share a scale, and whole 128-bit lanes
 * do, so d is applied by one fma a group:
 *   Q4_K, Q5_K: a super-block's 128 nibble bytes regrouped (two vshufi64x2) so that 128-bit
 *      lane c holds bytes of chunk c: the low nibbles of four vectors are sub-blocks 0, 2, 4, 6
 *      (one per 128-bit lane), the high nibbles' four 1, 3, 5, 7: two fmas a super-block;
 *   Q6_K: ql's 64 bytes of a half: lane g's nibbles are one scale's 16 weights; two vectors a
 *      scale group, four fmas a super-block;
 *   Q4_0, Q5_0, Q5_1: four blocks' 16 nibble bytes gathered by one vpermt2w (their blocks are
 *      18, 22 or 24 bytes, so 2-byte aligned), lane g block g: four vectors and one fma per
 *      four blocks; a row's last 1-3 blocks are copied into a zeroed group of four.
 * A group's minima are one more fma against x's sums (kept in the lanes of the minima's vector).
 * The weights a vector's word holds are not in input order; x is permuted once per call to
 * match (bf16_lane_input). Rows of x share each decode, up to K_ROWS_PER_TILE of them.
 *
 * Memory. At one row of x a decode step streams the matrix from DRAM, so the point is to keep
 * up with the read: the rows are prefetched 4 KB ahead, and no load straddles into bytes a
 * second load of the same group reads (Q4_0's four blocks are 72 bytes: read as 64 + 64
 * overlapping bytes, the kernel ran at 13 GB/s from DRAM at K = 8192; as 64 + 32, at 36). At
 * eight rows the tile's x is 8 x 2 bytes an input, and re-read for every output row: at K =
 * 8192 it left L1 and the kernel ran at a third of its L1 speed, so a tile of more than one row
 * takes a row in chunks of K_CHUNK inputs, each chunk across a block of output rows (held in
 * L2) before the next. Each row keeps one accumulator across its chunks, so the sums are the
 * same in either order: a row's result does not depend on the rows batched with it.
 *
 * Rows of W are split between OpenMP threads, as in quants.c.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "isa.h"
#include "prefetch.h"
#include "bf16.h"
#include "blocks.h"
#include "quants.h"
#include "quants_k.h"
#include <omp.h>

#if PD_HAS_AVX512
/* A K-quant super-block's (or a block's) scales per half sub-block: w[j] of sub-block s is
 * d[2 s + j / 16] * q[j] + m[2 s + j / 16], each d and m exact (quants_k.h). */
typedef struct {
    float d[16], m[16];
} KScales;

/* Sub-blocks a unit holds: a super-block's 8, or one block (Q4_0, Q5_0, Q5_1). */
static inline int unit_subs(int kind) { return kind >= KIND_Q4_K ? 8 : 1; }

/* The scales of the unit at `unit`, as k_sub_block computes them. */
static inline void unit_scales(int kind, const uint8_t *unit, KScales *out) {
    if (kind <= KIND_Q5_1) {
        const float d = fp16_to_fp32(k_u16(unit));
        const float m = kind == KIND_Q4_0 ? -8.0f * d : kind == KIND_Q5_0 ? -16.0f * d : fp16_to_fp32(k_u16(unit + 2));
        out->d[0] = out->d[1] = d;
        out->m[0] = out->m[1] = m;
        return;
    }
    if (kind == KIND_Q6_K) {
        const float d = fp16_to_fp32(k_u16(unit + 208));
        for (int i = 0; i < 16; i++) {
            out->d[i] = d * (float)(int8_t)unit[192 + i];
            out->m[i] = -32.0f * out->d[i];
        }
        return;
    }
    const float d = fp16_to_fp32(k_u16(unit)), dmin = fp16_to_fp32(k_u16(unit + 2));
    for (int s = 0; s < 8; s++) {
        int sc, mn;
        k_scale_min(s, unit + 4, &sc, &mn);
        out->d[2 * s] = out->d[2 * s + 1] = d * (float)sc;
        out->m[2 * s] = out->m[2 * s + 1] = -(dmin * (float)mn);
    }
}

/* 16 bytes from `at`, zero-extended to 16 int32 lanes. */
static inline __m512i bytes_u32(const uint8_t *at) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)at)); }

/* Sub-block s (of the unit's unit_subs) of the unit at `unit`: its q, weights 0-15 in *lo and
 * 16-31 in *hi, as fp32 (exact: integers below 64). */
static inline __attribute__((always_inline)) void unit_q_f32(int kind, const uint8_t *unit, int s, __m512 *lo,
                                                             __m512 *hi) {
    const __m512i nibble = _mm512_set1_epi32(15), bit4 = _mm512_set1_epi32(16);
    __m512i q_lo, q_hi;
    if (kind <= KIND_Q5_1) {
        const int qs = kind == KIND_Q4_0 ? 2 : kind == KIND_Q5_0 ? 6 : 8;
        const __m512i bytes = bytes_u32(unit + qs);
        q_lo = _mm512_and_si512(bytes, nibble);
        q_hi = _mm512_srli_epi32(bytes, 4);
        if (kind != KIND_Q4_0) { /* bit j of qh is weight j's fifth bit: moved to bit 4 */
            uint32_t qh;
            memcpy(&qh, unit + qs - 4, 4);
            const __m512i all = _mm512_set1_epi32((int)qh);
            const __m512i j = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
            const __m512i bits_lo = _mm512_slli_epi32(_mm512_srlv_epi32(all, j), 4);
            const __m512i bits_hi = _mm512_slli_epi32(_mm512_srlv_epi32(all, _mm512_add_epi32(j, bit4)), 4);
            q_lo = _mm512_ternarylogic_epi32(q_lo, bits_lo, bit4, 0xF8); /* a | (b & c) */
            q_hi = _mm512_ternarylogic_epi32(q_hi, bits_hi, bit4, 0xF8);
        }
    } else if (kind == KIND_Q6_K) {
        const int half = s / 4, t = s % 4;
        const uint8_t *low = unit + 64 * half + (t & 1) * 32, *high = unit + 128 + 32 * half;
        const int low_shift = (t >> 1) * 4, high_shift = 2 * t;
        const __m512i three = _mm512_set1_epi32(3);
        q_lo = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi32(bytes_u32(low), low_shift), nibble),
            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(bytes_u32(high), high_shift), three), 4));
        q_hi = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi32(bytes_u32(low + 16), low_shift), nibble),
            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(bytes_u32(high + 16), high_shift), three), 4));
    } else { /* Q4_K, Q5_K: 32 bytes a pair of sub-blocks, low nibbles the even one's */
        const uint8_t *qs = unit + (kind == KIND_Q5_K ? 48 : 16) + 32 * (s / 2);
        const int shift = (s & 1) * 4;
        q_lo = _mm512_and_si512(_mm512_srli_epi32(bytes_u32(qs), shift), nibble);
        q_hi = _mm512_and_si512(_mm512_srli_epi32(bytes_u32(qs + 16), shift), nibble);
        if (kind == KIND_Q5_K) { /* bit s of qh[j] */
            const __m512i h_lo = _mm512_slli_epi32(_mm512_srli_epi32(bytes_u32(unit + 16), s), 4);
            const __m512i h_hi = _mm512_slli_epi32(_mm512_srli_epi32(bytes_u32(unit + 32), s), 4);
            q_lo = _mm512_ternarylogic_epi32(q_lo, h_lo, bit4, 0xF8);
            q_hi = _mm512_ternarylogic_epi32(q_hi, h_hi, bit4, 0xF8);
        }
    }
    *lo = _mm512_cvtepi32_ps(q_lo);
    *hi = _mm512_cvtepi32_ps(q_hi);
}

/* Sub-block s of a unit as 2 x 16 fp32 weights: fma(d, q, m) per half, fmaf's value. */
static inline __attribute__((always_inline)) void unit_weights_f32(int kind, const uint8_t *unit, const KScales *sc,
                                                                   int s, __m512 *lo, __m512 *hi) {
    __m512 q_lo, q_hi;
    unit_q_f32(kind, unit, s, &q_lo, &q_hi);
    *lo = _mm512_fmadd_ps(_mm512_set1_ps(sc->d[2 * s]), q_lo, _mm512_set1_ps(sc->m[2 * s]));
    *hi = _mm512_fmadd_ps(_mm512_set1_ps(sc->d[2 * s + 1]), q_hi, _mm512_set1_ps(sc->m[2 * s + 1]));
}

/* Rows `rows` (NULL: 0 .. count - 1) of a matrix of `kind` decoded into out [count, K]. */
static inline __attribute__((always_inline)) void dequant_rows(int kind, const uint8_t *w, int64_t K,
                                                               const int64_t *rows, int64_t count, void *out,
                                                               int out_is_bf16, int threads) {
    const int64_t row_bytes = k_row_bytes(kind, K), units = K / k_block_weights(kind);
    const int bytes = k_block_bytes(kind), subs = unit_subs(kind);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && count > 64)
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = w + (rows ? rows[i] : i) * row_bytes;
        for (int64_t u = 0; u < units; u++) {
            const uint8_t *unit = row + u * bytes;
            KScales sc;
            unit_scales(kind, unit, &sc);
            for (int s = 0; s < subs; s++) {
                __m512 lo, hi;
                unit_weights_f32(kind, unit, &sc, s, &lo, &hi);
                put_f32x32(out, out_is_bf16, i * K + (u * subs + s) * QK, lo, hi);
            }
        }
    }
}

/* The dequantization with AVX-512: quants_k.c's pd_quant_k_dequant_generic, a sub-block a step in
 * 512-bit registers, each kind's decode inlined. */
void pd_quant_k_dequant(int kind, const uint8_t *w, int64_t K, const int64_t *rows, int64_t count, void *out,
                        int out_is_bf16, int threads) {
    switch (kind) {
        case KIND_Q4_0: dequant_rows(KIND_Q4_0, w, K, rows, count, out, out_is_bf16, threads); break;
        case KIND_Q5_0: dequant_rows(KIND_Q5_0, w, K, rows, count, out, out_is_bf16, threads); break;
        case KIND_Q5_1: dequant_rows(KIND_Q5_1, w, K, rows, count, out, out_is_bf16, threads); break;
        case KIND_Q4_K: dequant_rows(KIND_Q4_K, w, K, rows, count, out, out_is_bf16, threads); break;
        case KIND_Q5_K: dequant_rows(KIND_Q5_K, w, K, rows, count, out, out_is_bf16, threads); break;
        default: dequant_rows(KIND_Q6_K, w, K, rows, count, out, out_is_bf16, threads); break;
    }
}

#define K_F32_ROWS 4 /* rows of x one decode of the fp32 route serves (four chains each) */

/* A sub-block's weights against `rows` rows of fp32 x (at the sub-block's inputs): into the
 * chains acc[r][0] (weights 0-15) and acc[r][1] (16-31). */
static inline __attribute__((always_inline)) void sub_dots_f32(__m512 lo, __m512 hi, const float *x, int64_t K,
                                                               int rows, __m512 acc[][2]) {
    for (int r = 0; r < rows; r++) {
        acc[r][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * K), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * K + 16), acc[r][1]);
    }
}

/* One output row against `rows` (<= K_F32_ROWS) rows of x: dot[r] = x[r] . W[n]. Even and odd
 * sub-blocks feed chains of their own (four a row), summed (even lo + even hi) + (odd lo + odd
 * hi) at the end, whatever `rows` is. */
static inline __attribute__((always_inline)) void row_dots_f32(int kind, const uint8_t *row, int64_t K,
                                                               const float *x, int rows, float *dot) {
    const int64_t units = K / k_block_weights(kind);
    const int bytes = k_block_bytes(kind), subs = unit_subs(kind);
    __m512 even[K_F32_ROWS][2], odd[K_F32_ROWS][2];
    for (int r = 0; r < rows; r++) even[r][0] = even[r][1] = odd[r][0] = odd[r][1] = _mm512_setzero_ps();
    for (int64_t u = 0; u < units; u++) {
        const uint8_t *unit = row + u * bytes;
        KScales sc;
        unit_scales(kind, unit, &sc);
        for (int s = 0; s < subs; s++) {
            __m512 lo, hi;
            unit_weights_f32(kind, unit, &sc, s, &lo, &hi);
            const int64_t at = (u * subs + s) * QK;
            if (((u * subs + s) & 1) == 0)
                sub_dots_f32(lo, hi, x + at, K, rows, even);
            else
                sub_dots_f32(lo, hi, x + at, K, rows, odd);
        }
    }
    for (int r = 0; r < rows; r++)
        dot[r] = _mm512_reduce_add_ps(
            _mm512_add_ps(_mm512_add_ps(even[r][0], even[r][1]), _mm512_add_ps(odd[r][0], odd[r][1])));
}

#define F32_ROWS_CASE(KIND, ROWS) \
    case ROWS:                    \
        row_dots_f32(KIND, row, K, x, ROWS, dot); \
        break;
#define F32_KIND_CASE(KIND)                                                                    \
    case KIND:                                                                                 \
        switch (rows) { F32_ROWS_CASE(KIND, 1) F32_ROWS_CASE(KIND, 2) F32_ROWS_CASE(KIND, 3) \
                        F32_ROWS_CASE(KIND, 4) }                                               \
        break;
/* row_dots_f32 with (kind, rows) as constants, so that its loops unroll into registers. */
static void row_dots_f32_dispatch(int kind, const uint8_t *row, int64_t K, const float *x, int rows, float *dot) {
    switch (kind) {
        F32_KIND_CASE(KIND_Q4_0) F32_KIND_CASE(KIND_Q5_0) F32_KIND_CASE(KIND_Q5_1)
        F32_KIND_CASE(KIND_Q4_K) F32_KIND_CASE(KIND_Q5_K) F32_KIND_CASE(KIND_Q6_K)
    }
}

/* The fp32 route with AVX-512 (quants_k.c's pd_quant_k_gemm_f32_generic): output rows split
 * between threads, tiles of K_F32_ROWS rows of x, each sub-block decoded once a tile. */
void pd_quant_k_gemm_f32(int kind, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
                         int y_is_bf16, int threads) {
    const int64_t row_bytes = k_row_bytes(kind, K);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += K_F32_ROWS) {
            const int rows = (int)(M - m0 < K_F32_ROWS ? M - m0 : K_F32_ROWS);
            float dot[K_F32_ROWS];
            row_dots_f32_dispatch(kind, row, K, x + m0 * K, rows, dot);
            for (int r = 0; r < rows; r++) put_f32(y, y_is_bf16, (m0 + r) * N + n, dot[r]);
        }
    }
}
#endif

#if PD_HAS_AVX512_BF16
#define K_ROWS_PER_TILE 8 /* rows of x one decode of the bf16 route serves */
#define K_PREFETCH 4096   /* bytes ahead a row streamed alone is prefetched */
#define K_CHUNK 2048      /* inputs a tile of rows takes at a time (8 rows of x: 32 KB) */

/* Inputs a group of the bf16 route spans: a K-quant super-block (8 vectors of 32 bf16 weights),
 * or four blocks of 32 (4 vectors). */
static inline int group_weights(int kind) { return kind >= KIND_Q4_K ? 256 : 128; }

/* Kinds whose minima are not their q's offset: m is applied through x's sums per 32. */
static inline int has_minima(int kind) { return kind == KIND_Q5_1 || kind == KIND_Q4_K || kind == KIND_Q5_K; }

/* The input (within its group) that word w (0-31) of the group's vector v holds, as the group
 * functions below decode it: x is permuted once per call to this order. Word w is in 128-bit
 * lane g = w / 8, the k = w % 8-th word of it; odd vectors take the odd byte of the word. */
static int bf16_lane_input(int kind, int v, int w) {
    const int g = w / 8, k = w % 8, odd = v & 1;
    if (kind == KIND_Q6_K) { /* half v / 4; its low (set 0) or high (set 1) nibbles of ql */
        const int half = v / 4, set = (v / 2) & 1;
        return 32 * (4 * half + 2 * set + g / 2) + 16 * (g & 1) + 2 * k + odd;
    }
    if (kind >= KIND_Q4_K) /* even sub-blocks 2g (v < 4), odd ones 2g + 1 */
        return 32 * (2 * g + v / 4) + 16 * ((v / 2) & 1) + 2 * k + odd;
    return 32 * g + 16 * (v / 2) + 2 * k + odd; /* block g */
}

/* What the bf16 route's decode reads besides the blocks, made once per call. */
typedef struct {
    __m512i lut[2]; /* table index -> bf16 (q minus the kind's offset); lut[1]: Q6_K's indices 32-63 */
    __m512i qs, d, qh_lo, qh_hi, m; /* Q4_0, Q5_0, Q5_1: vpermt2w indices of four blocks' words */
} KConsts;

/* The value table entry i stands for. Q5_0 and Q5_1 index with their fifth bit in bit 0 and the
 * nibble in bits 1-4 (group_q32); the nibble kinds' tables repeat over bit 4 (vpermw reads it). */
static int lut_value(int kind, int i) {
    switch (kind) {
        case KIND_Q4_0: return (i & 15) - 8;
        case KIND_Q5_0: return (((i >> 1) & 15) | ((i & 1) << 4)) - 16;
        case KIND_Q5_1: return ((i >> 1) & 15) | ((i & 1) << 4);
        case KIND_Q4_K: return i & 15;
        case KIND_Q5_K: return i & 31;
        default: return i - 32; /* Q6_K */
    }
}

/* The tables and vpermt2w indices of `kind`. */
static void k_consts(int kind, KConsts *c) {
    uint16_t lut[64], idx[5][32];
    for (int i = 0; i < 64; i++) lut[i] = fp32_to_bf16((float)lut_value(kind, i));
    c->lut[0] = _mm512_loadu_si512(lut);
    c->lut[1] = _mm512_loadu_si512(lut + 32);
    /* Four blocks of 2 * words bytes (group_q32): their first 32 words in the first load, their
     * last 16 in the second (which starts `second` words in). */
    const int words = k_block_bytes(kind) / 2, second = 4 * words - 16;
    const int qs = kind == KIND_Q4_0 ? 1 : kind == KIND_Q5_0 ? 3 : 4, qh = qs - 2;
    memset(idx, 0, sizeof idx);
    for (int w = 0; w < 32; w++) {
        const int g = w / 8, k = w % 8;
        const int at[5] = {words * g + qs + k, words * (w / 4), words * g + qh, words * g + qh + 1, words * (w / 4) + 1};
        for (int i = 0; i < 5; i++) idx[i][w] = (uint16_t)(at[i] < 32 ? at[i] : 32 + at[i] - second);
    }
    c->qs = _mm512_loadu_si512(idx[0]);
    c->d = _mm512_loadu_si512(idx[1]); /* words 0-15: block w / 4's d */
    c->qh_lo = _mm512_loadu_si512(idx[2]);
    c->qh_hi = _mm512_loadu_si512(idx[3]);
    c->m = _mm512_loadu_si512(idx[4]); /* words 0-15: block w / 4's m (Q5_1) */
}

/* Per bit: mask ? b : a. */
static inline __m512i select_bits(__m512i a, __m512i b, __m512i mask) { return _mm512_ternarylogic_epi32(a, b, mask, 0xD8); }

/* 32 bf16 weights from table indices: the low 5 bits of each word (lut32), or 6 (lut64: Q6_K). */
static inline __m512i lut32(const KConsts *c, __m512i index) { return _mm512_permutexvar_epi16(index, c->lut[0]); }
static inline __m512i lut64(const KConsts *c, __m512i index) {
    return _mm512_permutex2var_epi16(c->lut[0], index, c->lut[1]);
}

/* `count` vectors of bf16 weights whose lanes share the scales d, against `rows` rows of
 * permuted x (the vectors' inputs, consecutive): acc[r] += d * (v . x[r]), one vdpbf16ps a
 * vector and one fma. */
static inline __attribute__((always_inline)) void dot_set(const __m512i *v, int count, __m512 d, const uint16_t *x,
                                                          int64_t x_stride, int rows, __m512 *acc) {
    for (int r = 0; r < rows; r++) {
        const uint16_t *xv = x + r * x_stride;
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)v[0], (__m512bh)_mm512_loadu_si512(xv));
        for (int i = 1; i < count; i++)
            t = _mm512_dpbf16_ps(t, (__m512bh)v[i], (__m512bh)_mm512_loadu_si512(xv + 32 * i));
        acc[r] = _mm512_fmadd_ps(t, d, acc[r]);
    }
}

/* A Q4_K or Q5_K super-block's 8 scales and minima (ggml's get_scale_min_k4, on the 12 bytes
 * in one 128-bit register), times d and dmin: d sc per sub-block in lanes 0-7, dmin mn in 8-15. */
static inline __m512 scales_q4k(const uint8_t *block) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)(block + 4)); /* u0 u1 u2 (and 4 more bytes) */
    const __m128i sc_mn_lanes = _mm_shuffle_epi32(raw, _MM_SHUFFLE(2, 1, 2, 0)); /* u0 u2 u1 u2 */
    const __m128i high_lanes = _mm_shuffle_epi32(raw, _MM_SHUFFLE(1, 1, 0, 0));  /* u0 u0 u1 u1 */
    /* sc 0-3 = u0 & 63 (per byte), mn 0-3 = u1 & 63; sc 4-7 = (u2 & 15) | (u0 >> 6) << 4,
     * mn 4-7 = (u2 >> 4 & 15) | (u1 >> 6) << 4 */
    const __m128i low = _mm_and_si128(sc_mn_lanes, _mm_set1_epi32(0x3f3f3f3f));
    const __m128i high = _mm_ternarylogic_epi32(_mm_srlv_epi32(sc_mn_lanes, _mm_set_epi32(4, 0, 0, 0)),
                                                _mm_set1_epi32(0x0f0f0f0f),
                                                _mm_and_si128(_mm_srli_epi32(high_lanes, 2), _mm_set1_epi32(0x30303030)),
                                                0xEA); /* (a & b) | c */
    const __m128i sc_mn = _mm_blend_epi32(low, high, 0xA); /* sc 0-3, sc 4-7, mn 0-3, mn 4-7 */
    uint32_t d_dmin;
    memcpy(&d_dmin, block, 4);
    const __m512 scale = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                               _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)d_dmin))));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc_mn)), scale);
}

/* A Q4_K or Q5_K super-block: its 128 nibble bytes regrouped so that 128-bit lane c holds chunk c
 * (sub-blocks 2c and 2c + 1): the even sub-blocks' four vectors, then the odd ones'; its minima
 * (dmin mn, lanes 8-15 of the scales) against x's sums (xsum: lanes 8-15, lanes 0-7 zero). */
static inline __attribute__((always_inline)) void group_q4k_q5k(int kind, const uint8_t *block, const KConsts *c,
                                                                const uint16_t *x, int64_t x_stride,
                                                                const float *xsum, int64_t xsum_stride, int rows,
                                                                __m512 *acc) {
    const __m512 dm = scales_q4k(block);
    for (int r = 0; r < rows; r++) acc[r] = _mm512_fnmadd_ps(dm, _mm512_loadu_ps(xsum + r * xsum_stride), acc[r]);
    const __m512 d_even = _mm512_permutexvar_ps(_mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0), dm);
    const __m512 d_odd = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 7, 7, 5, 5, 5, 5, 3, 3, 3, 3, 1, 1, 1, 1), dm);
    const uint8_t *qs = block + (kind == KIND_Q5_K ? 48 : 16);
    const __m512i a = _mm512_loadu_si512(qs), b = _mm512_loadu_si512(qs + 64);
    const __m512i first = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0));  /* lane c: chunk c's bytes 0-15 */
    const __m512i second = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 1, 3, 1)); /* ... and 16-31 */
    /* Q5_K: bit s of qh[j] is weight j's fifth bit in sub-block s. Each lane's qh bytes are
     * rotated so that bit 2c (bit 2c + 1 for the odd set) of the word's even byte lands on bit 4
     * and of its odd byte on bit 12, and selected into the nibbles' words there. */
    const __m512i qh_first = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(block + 16)));
    const __m512i qh_second = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(block + 32)));
    const __m512i to_even = _mm512_set_epi32(30, 30, 30, 30, 0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4); /* 4 - 2c */
    const __m512i to_odd = _mm512_set_epi32(29, 29, 29, 29, 31, 31, 31, 31, 1, 1, 1, 1, 3, 3, 3, 3);
    for (int set = 0; set < 2; set++) { /* the even sub-blocks' low nibbles, the odd ones' high */
        __m512i lo = set ? _mm512_srli_epi16(first, 4) : first, hi = set ? _mm512_srli_epi16(second, 4) : second;
        if (kind == KIND_Q5_K) {
            const __m512i fifth = _mm512_set1_epi16(0x1010), to = set ? to_odd : to_even;
            lo = select_bits(lo, _mm512_rolv_epi32(qh_first, to), fifth);
            hi = select_bits(hi, _mm512_rolv_epi32(qh_second, to), fifth);
        }
        const __m512i v[4] = {lut32(c, lo), lut32(c, _mm512_srli_epi16(lo, 8)), lut32(c, hi),
                              lut32(c, _mm512_srli_epi16(hi, 8))};
        dot_set(v, 4, set ? d_odd : d_even, x + 128 * set, x_stride, rows, acc);
    }
}

/* A Q6_K super-block, a half (ql's 64 bytes, qh's 32) at a time: 128-bit lane g of ql holds one
 * scale's 16 weights in its low nibbles and another's in its high ones (quants_k.h's k_sub_block:
 * lanes 0-1 sub-block t = 0 or 2, lanes 2-3 t = 1 or 3), and qh's 32 bytes, broadcast to both
 * 256-bit halves, line up with them. Each set of two vectors has its own four scales. */
static inline __attribute__((always_inline)) void group_q6k(const uint8_t *block, const KConsts *c, const uint16_t *x,
                                                            int64_t x_stride, int rows, __m512 *acc) {
    const __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 192)))),
                                    _mm512_set1_ps(fp16_to_fp32(k_u16(block + 208))));
    const __m512i high_bits = _mm512_set1_epi16(0x3030);
    /* qh bits 2t, 2t + 1 to bits 4-5 (and 12-13): t = 0 | 1 for the low nibbles, 2 | 3 for the high */
    const __m512i to_low = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 4, 4, 4, 4, 4, 4, 4, 4);
    const __m512i to_high = _mm512_set_epi32(30, 30, 30, 30, 30, 30, 30, 30, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i lane = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int half = 0; half < 2; half++) {
        const __m512i ql = _mm512_loadu_si512(block + 64 * half);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(block + 128 + 32 * half)));
        __m512i v[2];
        __m512i words = select_bits(ql, _mm512_rolv_epi32(qh, to_low), high_bits);
        v[0] = lut64(c, words);
        v[1] = lut64(c, _mm512_srli_epi16(words, 8));
        __m512 d = _mm512_permutexvar_ps(_mm512_add_epi32(lane, _mm512_set1_epi32(8 * half)), sc);
        dot_set(v, 2, d, x + 128 * half, x_stride, rows, acc);
        words = select_bits(_mm512_srli_epi16(ql, 4), _mm512_rolv_epi32(qh, to_high), high_bits);
        v[0] = lut64(c, words);
        v[1] = lut64(c, _mm512_srli_epi16(words, 8));
        d = _mm512_permutexvar_ps(_mm512_add_epi32(lane, _mm512_set1_epi32(8 * half + 4)), sc);
        dot_set(v, 2, d, x + 128 * half + 64, x_stride, rows, acc);
    }
}

/* Four blocks of Q4_0, Q5_0 or Q5_1 at p (4 * block bytes; read as their first 64 bytes and
 * their last 32, which no other load overlaps: the memory note above): their nibble bytes
 * gathered by one vpermt2w (lane g: block g's 16), their d by another; Q5's fifth bits from each
 * block's qh, shifted per word to bit 0 and selected under the nibble (which moves to bits 1-4);
 * Q5_1's minima (lane 4g: block g's, the others zero) against x's sums (xsum, in the same lanes). */
static inline __attribute__((always_inline)) void group_q32(int kind, const uint8_t *p, const KConsts *c,
                                                            const uint16_t *x, int64_t x_stride, const float *xsum,
                                                            int64_t xsum_stride, int rows, __m512 *acc) {
    const __m512i first = _mm512_loadu_si512(p);
    const __m512i second = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + 4 * k_block_bytes(kind) - 32)));
    const __m512i qs = _mm512_permutex2var_epi16(first, c->qs, second);
    const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi16(first, c->d, second)));
    __m512i v[4];
    if (kind == KIND_Q4_0) {
        v[0] = lut32(c, qs);
        v[1] = lut32(c, _mm512_srli_epi16(qs, 8));
        v[2] = lut32(c, _mm512_srli_epi16(qs, 4));
        v[3] = lut32(c, _mm512_srli_epi16(qs, 12));
    } else {
        const __m512i qh_lo = _mm512_permutex2var_epi16(first, c->qh_lo, second); /* qh bits 0-15 */
        const __m512i qh_hi = _mm512_permutex2var_epi16(first, c->qh_hi, second); /* 16-31 */
        const __m512i even = _mm512_set_epi16(14, 12, 10, 8, 6, 4, 2, 0, 14, 12, 10, 8, 6, 4, 2, 0, 14, 12, 10, 8, 6,
                                              4, 2, 0, 14, 12, 10, 8, 6, 4, 2, 0); /* 2k: word k of its lane */
        const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
        const __m512i bit0 = _mm512_set1_epi16(1);
        v[0] = lut32(c, select_bits(_mm512_slli_epi16(qs, 1), _mm512_srlv_epi16(qh_lo, even), bit0));
        v[1] = lut32(c, select_bits(_mm512_srli_epi16(qs, 7), _mm512_srlv_epi16(qh_lo, odd), bit0));
        v[2] = lut32(c, select_bits(_mm512_srli_epi16(qs, 3), _mm512_srlv_epi16(qh_hi, even), bit0));
        v[3] = lut32(c, select_bits(_mm512_srli_epi16(qs, 11), _mm512_srlv_epi16(qh_hi, odd), bit0));
        if (kind == KIND_Q5_1) {
            const __m512 m = _mm512_cvtph_ps(
                _mm512_castsi512_si256(_mm512_maskz_permutex2var_epi16(0x1111, first, c->m, second)));
            for (int r = 0; r < rows; r++)
                acc[r] = _mm512_fmadd_ps(m, _mm512_loadu_ps(xsum + r * xsum_stride), acc[r]);
        }
    }
    dot_set(v, 4, d, x, x_stride, rows, acc);
}

/* What a call's row functions share: the decode constants, x prepared (prepare_x) at the
 * chunk's inputs, and each thread's room for a row's last partial group. */
typedef struct {
    const KConsts *c;
    const uint16_t *x; /* the tile's first row of permuted x, at the chunk */
    int64_t x_stride;
    const float *xsum; /* its sums at the chunk, 16 a group (kinds with minima: xsum_lane) */
    int64_t xsum_stride;
    uint8_t *tail;     /* four zeroed blocks */
    int64_t prefetch;  /* how far ahead of its reads a row is prefetched (0: not at all) */
} Tile;

/* One output row's chunk of Kc inputs against `rows` (<= K_ROWS_PER_TILE) rows of permuted x,
 * into the rows' accumulators acc[r] (in memory between chunks: one accumulator a row, whatever
 * order the chunks are taken in). */
static inline __attribute__((always_inline)) void row_dots_bf16(int kind, int rows, const uint8_t *row, int64_t Kc,
                                                                const Tile *t, __m512 *acc_mem) {
    __m512 acc[K_ROWS_PER_TILE];
    for (int r = 0; r < rows; r++) acc[r] = acc_mem[r];
    const int bytes = k_block_bytes(kind);
    const KConsts *c = t->c;
    if (kind >= KIND_Q4_K) {
        for (int64_t b = 0; b < Kc / 256; b++) {
            if (t->prefetch)
                for (int line = 0; line < bytes; line += 64)
                    _mm_prefetch((const char *)(row + b * bytes + line + t->prefetch), WEIGHT_HINT);
            if (kind == KIND_Q6_K)
                group_q6k(row + b * bytes, c, t->x + b * 256, t->x_stride, rows, acc);
            else
                group_q4k_q5k(kind, row + b * bytes, c, t->x + b * 256, t->x_stride, t->xsum + 16 * b, t->xsum_stride,
                              rows, acc);
        }
    } else {
        const int64_t blocks = Kc / QK, whole = blocks / 4;
        for (int64_t g = 0; g < whole; g++) {
            if (t->prefetch)
                for (int line = 0; line < 4 * bytes; line += 64)
                    _mm_prefetch((const char *)(row + g * 4 * bytes + line + t->prefetch), WEIGHT_HINT);
            group_q32(kind, row + g * 4 * bytes, c, t->x + g * 128, t->x_stride, t->xsum + 16 * g, t->xsum_stride,
                      rows, acc);
        }
        if (whole * 4 < blocks) { /* the last 1-3 blocks, in a group of four whose others are zero */
            memcpy(t->tail, row + whole * 4 * bytes, (size_t)((blocks - 4 * whole) * bytes));
            group_q32(kind, t->tail, c, t->x + whole * 128, t->x_stride, t->xsum + 16 * whole, t->xsum_stride, rows,
                      acc);
        }
    }
    for (int r = 0; r < rows; r++) acc_mem[r] = acc[r];
}

/* row_dots_bf16 for each (kind, rows) as a function of its own, so that each keeps its
 * accumulators in registers: ROW_DOTS[kind - KIND_Q4_0][rows - 1]. */
typedef void RowDots(const uint8_t *row, int64_t Kc, const Tile *t, __m512 *acc);
#define ROW_DOTS_FN(KIND, ROWS)                                                                       \
    static void row_dots_##KIND##_##ROWS(const uint8_t *row, int64_t Kc, const Tile *t, __m512 *acc) { \
        row_dots_bf16(KIND, ROWS, row, Kc, t, acc);                                                   \
    }
#define ROW_DOTS_KIND(KIND)                                                                     \
    ROW_DOTS_FN(KIND, 1) ROW_DOTS_FN(KIND, 2) ROW_DOTS_FN(KIND, 3) ROW_DOTS_FN(KIND, 4)         \
    ROW_DOTS_FN(KIND, 5) ROW_DOTS_FN(KIND, 6) ROW_DOTS_FN(KIND, 7) ROW_DOTS_FN(KIND, 8)
ROW_DOTS_KIND(KIND_Q4_0)
ROW_DOTS_KIND(KIND_Q5_0)
ROW_DOTS_KIND(KIND_Q5_1)
ROW_DOTS_KIND(KIND_Q4_K)
ROW_DOTS_KIND(KIND_Q5_K)
ROW_DOTS_KIND(KIND_Q6_K)
#define ROW_DOTS_ROW(KIND)                                                                    \
    {row_dots_##KIND##_1, row_dots_##KIND##_2, row_dots_##KIND##_3, row_dots_##KIND##_4,      \
     row_dots_##KIND##_5, row_dots_##KIND##_6, row_dots_##KIND##_7, row_dots_##KIND##_8}
static RowDots *const ROW_DOTS[6][K_ROWS_PER_TILE] = {ROW_DOTS_ROW(KIND_Q4_0), ROW_DOTS_ROW(KIND_Q5_0),
                                                      ROW_DOTS_ROW(KIND_Q5_1), ROW_DOTS_ROW(KIND_Q4_K),
                                                      ROW_DOTS_ROW(KIND_Q5_K), ROW_DOTS_ROW(KIND_Q6_K)};

/* Where x's sum over the 32 inputs of sub-block s of a group is kept among the group's 16
 * floats, in the lanes of the group's minima: a K-quant's in lanes 8-15 (beside its scales d sc
 * in 0-7: scales_q4k), Q5_1's four blocks' in lanes 0, 4, 8, 12 (group_q32). */
static inline int xsum_lane(int kind, int s) { return kind == KIND_Q5_1 ? 4 * s : 8 + s; }

/* x [M, K] in the order the groups' vectors hold their inputs (bf16_lane_input; a row's last
 * group zero-padded): xr [M, x_stride]; and, for kinds with minima, x's sums per 32 (fp32, the
 * same vector additions for every row), 16 floats a group (xsum_lane; the other lanes zero):
 * xsum [M, x_stride / G * 16]. */
static void prepare_x(int kind, const uint16_t *x, int64_t M, int64_t K, uint16_t *xr, int64_t x_stride, float *xsum) {
    const int G = group_weights(kind);
    const int64_t xsum_stride = x_stride / G * 16;
    int input[256];
    for (int i = 0; i < G; i++) input[i] = bf16_lane_input(kind, i / 32, i % 32);
    for (int64_t r = 0; r < M; r++) {
        const uint16_t *row = x + r * K;
        uint16_t *out = xr + r * x_stride;
        int64_t g0 = 0;
        for (; g0 + G <= K; g0 += G)
            for (int i = 0; i < G; i++) out[g0 + i] = row[g0 + input[i]];
        for (int i = 0; g0 < x_stride && i < G; i++) out[g0 + i] = g0 + input[i] < K ? row[g0 + input[i]] : 0;
        if (xsum)
            for (int64_t s = 0; s < K / QK; s++) {
                const __m512 sum = _mm512_add_ps(bf16x16_to_fp32(row + s * QK), bf16x16_to_fp32(row + s * QK + 16));
                const int64_t per_group = G / QK;
                xsum[r * xsum_stride + s / per_group * 16 + xsum_lane(kind, (int)(s % per_group))] =
                    _mm512_reduce_add_ps(sum);
            }
    }
}

/* The bf16 route with AVX512-BF16 (quants_k.c's pd_quant_k_gemm_bf16_generic widens x and takes
 * the fp32 route instead): x permuted once; output rows split between threads in blocks of
 * `block` rows; tiles of K_ROWS_PER_TILE rows of x, each group decoded once a tile. A row is
 * taken in chunks of K_CHUNK inputs: one row of x alone streams the matrix row after row (x
 * fits in L1 whole), a tile of more rows takes each chunk across its block of rows (held in L2,
 * fetched a row at a time ahead) so that the tile's chunk of x stays in L1. */
void pd_quant_k_gemm_bf16(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
                          int y_is_bf16, int threads) {
    const int G = group_weights(kind);
    const int64_t x_stride = (K + G - 1) / G * G, xsum_stride = x_stride / G * 16;
    const int64_t row_bytes = k_row_bytes(kind, K), chunks = (K + K_CHUNK - 1) / K_CHUNK;
    const int64_t chunk_bytes = k_row_bytes(kind, K_CHUNK);
    /* rows a block of a chunked tile holds in L2, their accumulators in L1 */
    const int64_t block = M == 1 || chunks == 1 ? 1 : row_bytes * 64 <= (512 << 10) ? 64 : 32;
    if (threads < 1) threads = 1;
    /* 64-byte aligned: each vector of x is one cache line (a split load costs two) */
    uint16_t *xr = (uint16_t *)aligned_alloc(64, (size_t)(M * x_stride) * sizeof(uint16_t));
    float *xsum = has_minima(kind) ? (float *)aligned_alloc(64, (size_t)(M * xsum_stride) * sizeof(float)) : NULL;
    __m512 *accs = (__m512 *)aligned_alloc(64, (size_t)(threads * block * K_ROWS_PER_TILE) * sizeof(__m512));
    if (xr == NULL || accs == NULL || (has_minima(kind) && xsum == NULL)) {
        free(xr);
        free(xsum);
        free(accs);
        pd_quant_k_gemm_bf16_generic(kind, x, M, K, w, N, y, y_is_bf16, threads);
        return;
    }
    if (xsum) memset(xsum, 0, (size_t)(M * xsum_stride) * sizeof(float));
    prepare_x(kind, x, M, K, xr, x_stride, xsum);
    KConsts c;
    k_consts(kind, &c);
    RowDots *const *row_dots = ROW_DOTS[kind - KIND_Q4_0];
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int thread = omp_get_thread_num();
        uint8_t tail[4 * 24] = {0}; /* four blocks of the largest (Q5_1) */
        __m512 *acc = accs + thread * block * K_ROWS_PER_TILE; /* [block][K_ROWS_PER_TILE] */
        Tile tile = {&c, xr, x_stride, xsum, xsum_stride, tail, block == 1 ? K_PREFETCH : 0};
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += block) {
            const int64_t n1 = n0 + block < N ? n0 + block : N;
            for (int64_t m0 = 0; m0 < M; m0 += K_ROWS_PER_TILE) {
                const int rows = (int)(M - m0 < K_ROWS_PER_TILE ? M - m0 : K_ROWS_PER_TILE);
                for (int64_t i = 0; i < (n1 - n0) * K_ROWS_PER_TILE; i++) acc[i] = _mm512_setzero_ps();
                for (int64_t ch = 0; ch < chunks; ch++) {
                    const int64_t Kc = K - ch * K_CHUNK < K_CHUNK ? K - ch * K_CHUNK : K_CHUNK;
                    tile.x = xr + m0 * x_stride + ch * K_CHUNK;
                    tile.xsum = xsum ? xsum + m0 * xsum_stride + ch * K_CHUNK / G * 16 : NULL;
                    for (int64_t n = n0; n < n1; n++) {
                        if (block > 1 && ch == 0 && m0 == 0) /* the whole row two ahead, into L2 */
                            for (int64_t at = 0; n + 2 < N && at < row_bytes; at += 64)
                                _mm_prefetch((const char *)(w + (n + 2) * row_bytes + at), _MM_HINT_T1);
                        row_dots[rows - 1](w + n * row_bytes + ch * chunk_bytes, Kc, &tile,
                                           acc + (n - n0) * K_ROWS_PER_TILE);
                    }
                }
                for (int64_t n = n0; n < n1; n++)
                    for (int r = 0; r < rows; r++)
                        put_f32(y, y_is_bf16, (m0 + r) * N + n,
                                _mm512_reduce_add_ps(acc[(n - n0) * K_ROWS_PER_TILE + r]));
            }
        }
    }
    free(xr);
    free(xsum);
    free(accs);
}
#endif
