/*
 * The int8-activation Q4_1 matmul on CPUs with AVX512-VNNI (AMD Zen 4/5, Intel Ice Lake on):
 * the arithmetic of quants_a8.c (y = sum_b dw d (q . xq) + m s, x quantized per block of
 * 32 there), four blocks a step.
 *
 * Why: vpdpbusd multiplies 64 unsigned bytes by 64 signed ones and adds each four products into
 * an int32 lane in one instruction, with no int16 stage to saturate. A Q4_1 weight is an
 * unsigned nibble (0-15) and x's int8 is signed: exactly its operands. Four blocks' 64 nibble
 * bytes are one load; their low nibbles (each block's elements 0-15) meet x's first halves,
 * the high ones its second halves, and the two vpdpbusd land every block's dot in its own four
 * int32 lanes (block i of the four in lanes 4i-4i+3), which one conversion and one fma scale by
 * that block's dw d. Per four blocks and row of x: two vpdpbusd, a conversion, a permute of the
 * scales and an fma, where the AVX2 kernel takes that for two.
 *
 * x's int8 is given in "quad order" (int8_quad_order): per four blocks, their first halves, then
 * their second halves; a row's last, partial quad padded with zeros, so that whatever the nibble
 * bytes read there are, they add nothing. Scales come 16 blocks at a time (d, and x's d and s,
 * padded with zeros to a multiple of 16 blocks); the minima's part m s is added per 16 blocks.
 *
 * Q8_0 (the LM head, and every matrix of --quantization int8-a8) runs two blocks a step: their
 * signed weights become unsigned by flipping the top bit (w + 128), and x's part of that,
 * -128 times the sum of each four of x's int8, is where the int32 lanes start (int8_q8_0_x
 * keeps it beside x), so vpdpbusd leaves the exact signed dot. A row's 16 scales are one
 * gather (they sit at the start of each 34-byte block).
 *
 * Every (weight row, row of x) pair sums in the same order whatever the tile it is computed in,
 * so a request's logits do not depend on what it is batched with.
 */
#include <stdint.h>
#include <string.h>
#include "isa.h"
#include "avx2.h"
#include "blocks.h"
#include "bf16.h"
#include "kernels.h"
#include <omp.h>

#if PD_HAS_AVX512_VNNI

/* Weight rows a tile serves at one row of x (independent chains hide the latency), and rows of x
 * a tile serves otherwise (each holds an accumulator and a scale vector: 16 of 32 registers). */
#define VNNI_COLS_PER_TILE 4
#define VNNI_ROWS_PER_TILE 8

/* x as the kernels read it: int8 q [M, q_stride] (Q4_1: quad order; Q8_0: natural order, padded,
 * with each int32 lane's starting sum in start [M, q_stride / 4]), its scales d and scaled sums s
 * [M, stride]. */
typedef struct {
    const int8_t *q;
    const int32_t *start;
    const float *d, *s;
    int64_t q_stride, stride, K;
} VnniX;

/* x's int8 [M, K] (natural order) into quad order [M, quad_stride] (see the header). */
void int8_quad_order(const int8_t *q, int64_t M, int64_t K, int8_t *out, int64_t quad_stride) {
    const int64_t blocks = K / QK;
    memset(out, 0, (size_t)(M * quad_stride));
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < blocks; b++) {
            int8_t *quad = out + r * quad_stride + (b / 4) * 4 * QK;
            const int8_t *block = q + r * K + b * QK;
            memcpy(quad + (b % 4) * 16, block, 16);
            memcpy(quad + 64 + (b % 4) * 16, block + 16, 16);
        }
}

/* The nibble bytes of `count` (1-4) blocks from qs, zero-extended to 64: plain loads (a masked
 * one, streamed from memory, was several times slower on a Zen 5), never past the blocks. */
static inline __m512i quad_bytes(const uint8_t *qs, int64_t count) {
    if (count >= 4) return _mm512_loadu_si512(qs);
    const __m256i first = count >= 2 ? _mm256_loadu_si256((const __m256i *)qs)
                                     : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    const __m256i second = count == 3 ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(qs + 32)))
                                      : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_zextsi256_si512(first), second, 1);
}

/* Lanes 4i-4i+3 read lane 4k + i of the 16 blocks' scales: quad k's four blocks. */
static inline __m512i quad_lanes(int k) {
    return _mm512_add_epi32(_mm512_set1_epi32(4 * k),
                            _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0));
}

/* `cols` weight rows (row_bytes apart) against `rows` rows of quad-ordered x: dot[c * rows + r]. */
static inline __attribute__((always_inline)) void tile_vnni(const uint8_t *w, int64_t row_bytes, VnniX x, int cols,
                                                            int rows, float *dot) {
    const int64_t K = x.K, blocks = K / QK;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[VNNI_ROWS_PER_TILE], dd[VNNI_ROWS_PER_TILE]; /* cols * rows <= VNNI_ROWS_PER_TILE */
    for (int i = 0; i < cols * rows; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < blocks; g += 16) {
        const int64_t in_group = blocks - g < 16 ? blocks - g : 16;
        const __mmask16 group_mask = (__mmask16)((1u << in_group) - 1);
#pragma GCC unroll 4
        for (int c = 0; c < cols; c++) {
            const uint8_t *w_row = w + c * row_bytes;
            const uint16_t *d_all = (const uint16_t *)(w_row + K / 2), *m_all = d_all + blocks;
            /* the rows eight tiles on (one row a tile: 4 KB on), while this tile computes: the
             * 120 layer matrices at one row of x, streamed, took 3.2-3.5 ms two tiles ahead,
             * 2.5-2.6 eight ahead (2.6-2.75 four, 2.5-2.65 sixteen; one Zen 5 core) */
            const uint8_t *next = cols > 1 ? w_row + 8 * cols * row_bytes : w_row + ROW_PREFETCH_BYTES;
            for (int line = 0; line < 4; line++) _mm_prefetch((const char *)(next + g * 16 + line * 64), _MM_HINT_T0);
            if (g % 32 == 0) {
                _mm_prefetch((const char *)(next + K / 2 + g * 2), _MM_HINT_T0);
                _mm_prefetch((const char *)(next + K / 2 + (blocks + g) * 2), _MM_HINT_T0);
            }
            const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(group_mask, d_all + g));
            const __m512 m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(group_mask, m_all + g));
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                dd[c * rows + r] = _mm512_mul_ps(dw, _mm512_loadu_ps(x.d + r * x.stride + g));
                acc[c * rows + r] = _mm512_fmadd_ps(m, _mm512_loadu_ps(x.s + r * x.stride + g), acc[c * rows + r]);
            }
        }
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            if (4 * k >= in_group) break;
            const __m512i lanes = quad_lanes(k);
#pragma GCC unroll 4
            for (int c = 0; c < cols; c++) {
                const __m512i raw = quad_bytes(w + c * row_bytes + (g + 4 * k) * 16, in_group - 4 * k);
                const __m512i first = _mm512_and_si512(raw, low);
                const __m512i second = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
#pragma GCC unroll 8
                for (int r = 0; r < rows; r++) {
                    const int8_t *xq = x.q + r * x.q_stride + (g + 4 * k) * QK;
                    __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), first, _mm512_loadu_si512(xq));
                    dots = _mm512_dpbusd_epi32(dots, second, _mm512_loadu_si512(xq + 64));
                    const __m512 scale = _mm512_permutexvar_ps(lanes, dd[c * rows + r]);
                    acc[c * rows + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), scale, acc[c * rows + r]);
                }
            }
        }
    }
    for (int i = 0; i < cols * rows; i++) dot[i] = _mm512_reduce_add_ps(acc[i]);
}

/* x's int8 [M, K] for the Q8_0 kernel: rows padded with zeros to `padded` (a multiple of 64), and
 * beside them where each int32 lane of vpdpbusd starts: -128 times the sum of its four bytes of x
 * ([M, padded / 4]), which takes back the 128 added to every weight. */
void int8_q8_0_x(const int8_t *q, int64_t M, int64_t K, int8_t *out, int32_t *start, int64_t padded) {
    memset(out, 0, (size_t)(M * padded));
    memset(start, 0, (size_t)(M * padded / 4) * sizeof(int32_t));
    for (int64_t r = 0; r < M; r++) {
        memcpy(out + r * padded, q + r * K, (size_t)K);
        for (int64_t j = 0; j < K / 4; j++) {
            const int8_t *four = q + r * K + 4 * j;
            start[r * padded / 4 + j] = -128 * (four[0] + four[1] + four[2] + four[3]);
        }
    }
}

/* The scales of `count` (1-16) Q8_0 blocks from `row`, as fp32: a gather of the dword at each
 * block's start (its fp16 d and two weights), cut to 16 bits. */
static inline __m512 q8_0_scales(const uint8_t *row, int64_t count) {
    const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(Q8_0_BYTES));
    const __mmask16 live = (__mmask16)((1u << count) - 1);
    const __m512i dwords = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets, row, 1);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dwords));
}

/* Two Q8_0 blocks' 64 weights from `block` (the second only when `both`), each plus 128. */
static inline __m512i q8_0_pair(const uint8_t *block, int both) {
    const __m256i first = _mm256_loadu_si256((const __m256i *)(block + 2));
    const __m256i second = both ? _mm256_loadu_si256((const __m256i *)(block + Q8_0_BYTES + 2)) : _mm256_setzero_si256();
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1), _mm512_set1_epi8((char)0x80));
}

/* `cols` Q8_0 weight rows against `rows` rows of padded x: dot[c * rows + r]. */
static inline __attribute__((always_inline)) void tile_q8_0_vnni(const uint8_t *w, int64_t row_bytes, VnniX x,
                                                                 int cols, int rows, float *dot) {
    const int64_t blocks = x.K / QK;
    __m512 acc[VNNI_ROWS_PER_TILE], dd[VNNI_ROWS_PER_TILE]; /* cols * rows <= VNNI_ROWS_PER_TILE */
    for (int i = 0; i < cols * rows; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < blocks; g += 16) {
        const int64_t in_group = blocks - g < 16 ? blocks - g : 16;
#pragma GCC unroll 4
        for (int c = 0; c < cols; c++) {
            const uint8_t *group = w + c * row_bytes + g * Q8_0_BYTES;
            const uint8_t *next = cols > 1 ? group + 8 * cols * row_bytes : group + ROW_PREFETCH_BYTES;
            for (int line = 0; line < 9; line++) _mm_prefetch((const char *)(next + line * 64), _MM_HINT_T0);
            const __m512 dw = q8_0_scales(group, in_group);
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) dd[c * rows + r] = _mm512_mul_ps(dw, _mm512_loadu_ps(x.d + r * x.stride + g));
        }
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            if (2 * k >= in_group) break;
            const __m512i lanes = _mm512_set_epi32(2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1,
                                                   2 * k + 1, 2 * k + 1, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k,
                                                   2 * k, 2 * k);
#pragma GCC unroll 4
            for (int c = 0; c < cols; c++) {
                const __m512i pair = q8_0_pair(w + c * row_bytes + (g + 2 * k) * Q8_0_BYTES, 2 * k + 1 < in_group);
#pragma GCC unroll 8
                for (int r = 0; r < rows; r++) {
                    const int64_t at = r * x.q_stride + (g + 2 * k) * QK;
                    const __m512i dots = _mm512_dpbusd_epi32(_mm512_loadu_si512(x.start + at / 4), pair,
                                                             _mm512_loadu_si512(x.q + at));
                    const __m512 scale = _mm512_permutexvar_ps(lanes, dd[c * rows + r]);
                    acc[c * rows + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), scale, acc[c * rows + r]);
                }
            }
        }
    }
    for (int i = 0; i < cols * rows; i++) dot[i] = _mm512_reduce_add_ps(acc[i]);
}

/* A tile of `cols` weight rows (VNNI_COLS_PER_TILE, at one row of x) or of one weight row against
 * `rows` rows of x (1-VNNI_ROWS_PER_TILE), with the kind, cols and rows as constants, so that the
 * tile's loops unroll into registers. */
static inline __attribute__((always_inline)) void tile_dispatch(int kind, const uint8_t *w, int64_t row_bytes, VnniX x,
                                                                int cols, int rows, float *dot) {
#define VNNI_TILE(COLS, ROWS)                                      \
    do {                                                           \
        if (kind == 0)                                             \
            tile_vnni(w, row_bytes, x, COLS, ROWS, dot);           \
        else                                                       \
            tile_q8_0_vnni(w, row_bytes, x, COLS, ROWS, dot);      \
        return;                                                    \
    } while (0)
    if (cols == VNNI_COLS_PER_TILE) VNNI_TILE(VNNI_COLS_PER_TILE, 1);
    switch (rows) {
        case 1: VNNI_TILE(1, 1);
        case 2: VNNI_TILE(1, 2);
        case 3: VNNI_TILE(1, 3);
        case 4: VNNI_TILE(1, 4);
        case 5: VNNI_TILE(1, 5);
        case 6: VNNI_TILE(1, 6);
        case 7: VNNI_TILE(1, 7);
        default: VNNI_TILE(1, 8);
    }
#undef VNNI_TILE
}

/* y[M, N] over weight rows w of `kind` (0: Q4_1 rows, 1: Q8_0 blocks) and x as the kind's kernel
 * reads it (see VnniX; int8_quad_order and int8_q8_0_x make it). */
void a8_vnni_matmul(int kind, const int8_t *q, const int32_t *start, int64_t q_stride, const float *d, const float *s,
                    int64_t stride, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y, int y_is_bf16,
                    int threads) {
    const int64_t row_bytes = K / QK * block_bytes(kind);
    const VnniX x = {q, start, d, s, q_stride, stride, K};
    if (M == 1) { /* tiles of VNNI_COLS_PER_TILE weight rows: independent chains hide the latency */
        const int64_t tiles = (N + VNNI_COLS_PER_TILE - 1) / VNNI_COLS_PER_TILE;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t n0 = tile * VNNI_COLS_PER_TILE;
            float dot[VNNI_COLS_PER_TILE];
            if (n0 + VNNI_COLS_PER_TILE <= N)
                tile_dispatch(kind, w + n0 * row_bytes, row_bytes, x, VNNI_COLS_PER_TILE, 1, dot);
            else /* the last, partial tile: a row at a time, summed alike */
                for (int64_t n = n0; n < N; n++) tile_dispatch(kind, w + n * row_bytes, row_bytes, x, 1, 1, dot + (n - n0));
            for (int64_t n = n0; n < N && n < n0 + VNNI_COLS_PER_TILE; n++) put_f32(y, y_is_bf16, n, dot[n - n0]);
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m0 = 0; m0 < M; m0 += VNNI_ROWS_PER_TILE) {
            const int rows = (int)(M - m0 < VNNI_ROWS_PER_TILE ? M - m0 : VNNI_ROWS_PER_TILE);
            VnniX tile = x;
            tile.q += m0 * q_stride;
            tile.start = start ? start + m0 * q_stride / 4 : NULL;
            tile.d += m0 * stride;
            tile.s += m0 * stride;
            float dot[VNNI_ROWS_PER_TILE];
            tile_dispatch(kind, w + n * row_bytes, row_bytes, tile, 1, rows, dot);
            for (int r = 0; r < rows; r++) put_f32(y, y_is_bf16, (m0 + r) * N + n, dot[r]);
        }
}
#endif
