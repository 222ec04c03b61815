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

/* Rows of x one pass over a group's blocks serves: each holds one or two accumulators beside the
 * block's 8 weight vectors. */
#define X16_ROWS 8

/* x quantized (quants_a8.c): q [M, K] natural order, d and s [M, stride], and for Q8_0
 * each block's starting sum, -128 * sum(q) ([M, blocks]). */
typedef struct {
    const int8_t *q;
    const float *d, *s;
    const int32_t *start;
    int64_t K, stride;
} X16In;

/* The plain loop: one (weight row, row of x) at a time through x16_block, in the header's order. */
static void x16_plain(int kind, X16In x, int64_t M, const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads) {
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

#if PD_HAS_AVX512_VNNI

/* Bytes ahead of the block being read that are asked for (the groups follow each other). In a
 * whole decode step at one sequence (bench step, gguf-a8 bf16, one Zen 5 core): 8 KB 3.32-3.46
 * ms, 16 KB 3.42-3.49, 24 KB 3.43-3.45; in a loop over the matrices alone 16 KB did best. */
#define X16_PREFETCH_BYTES 8192

/* 16 weight rows (one group: `group` points at its first chunk) against `rows` rows of x:
 * out[r] = the 16 outputs of row r. */
static inline __attribute__((always_inline)) void group_q4_1(const uint8_t *group, X16In x, int rows, __m512 *out) {
    const int64_t blocks = x.K / QK;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[X16_ROWS], mins[X16_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = mins[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *chunk = group + b * X16 * Q4_1_BYTES;
        for (int line = 0; line < 5; line++) _mm_prefetch((const char *)chunk + X16_PREFETCH_BYTES + 64 * line, _MM_HINT_T0);
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
            __m512i first = _mm512_setzero_si512(), second = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) {
                first = _mm512_dpbusd_epi32(first, lo[i], broadcast_u32(xq + 4 * i));
                second = _mm512_dpbusd_epi32(second, hi[i], broadcast_u32(xq + 16 + 4 * i));
            }
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[r * x.stride + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(first, second)), scale, acc[r]);
            mins[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[r * x.stride + b]), mins[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = _mm512_add_ps(acc[r], mins[r]);
}

static inline __attribute__((always_inline)) void group_q8_0(const uint8_t *group, X16In x, int rows, __m512 *out) {
    const int64_t blocks = x.K / QK;
    __m512 acc[X16_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *chunk = group + b * X16 * Q8_0_BYTES;
        for (int line = 0; line < 9; line++) _mm_prefetch((const char *)chunk + X16_PREFETCH_BYTES + 64 * line, _MM_HINT_T0);
        __m512i weights[8];
        for (int i = 0; i < 8; i++) weights[i] = _mm512_loadu_si512(chunk + 64 * i);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(chunk + 512)));
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const int8_t *xq = x.q + r * x.K + b * QK;
            __m512i first = _mm512_set1_epi32(x.start[r * (x.K / QK) + b]), second = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) {
                first = _mm512_dpbusd_epi32(first, weights[i], broadcast_u32(xq + 4 * i));
                second = _mm512_dpbusd_epi32(second, weights[4 + i], broadcast_u32(xq + 16 + 4 * i));
            }
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[r * x.stride + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(first, second)), scale, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = acc[r];
}

/* group_q4_1 / group_q8_0 with the rows a constant, so that the loops unroll into registers. */
static inline void group_dispatch(int kind, const uint8_t *group, X16In x, int rows, __m512 *out) {
#define X16_GROUP(ROWS)                                                                 \
    do {                                                                                \
        if (kind == KIND_Q4_1_X16)                                                      \
            group_q4_1(group, x, ROWS, out);                                            \
        else                                                                            \
            group_q8_0(group, x, ROWS, out);                                            \
        return;                                                                         \
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

static void x16_vnni(int kind, X16In x, int64_t M, const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads) {
    const int64_t group_bytes = x.K / QK * X16 * block_bytes(kind);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t g = 0; g < N / X16; g++)
        for (int64_t m0 = 0; m0 < M; m0 += X16_ROWS) { /* further rows read the group from cache */
            const int rows = (int)(M - m0 < X16_ROWS ? M - m0 : X16_ROWS);
            X16In tile = x;
            tile.q += m0 * x.K;
            tile.d += m0 * x.stride;
            tile.s += m0 * x.stride;
            if (x.start) tile.start += m0 * (x.K / QK);
            __m512 out[X16_ROWS];
            group_dispatch(kind, w + g * group_bytes, tile, rows, out);
            for (int r = 0; r < rows; r++) put_f32x16(y, y_is_bf16, (m0 + r) * N + g * X16, out[r]);
        }
}
#endif

int a8_x16_matmul(int kind, const int8_t *q, const float *d, const float *s, int64_t stride, int64_t M, int64_t K,
                  const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads) {
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
#if PD_HAS_AVX512_VNNI
    x16_vnni(kind, x, M, w, N, y, y_is_bf16, threads);
#else
    x16_plain(kind, x, M, w, N, y, y_is_bf16, threads);
#endif
    free(start);
    return 0;
}

/* 1 when the interleaved kinds run the vector kernel here (else the plain loop: correct, slow),
 * so that the loader interleaves only where that pays. */
int pd_quant_x16_route(void) {
#if PD_HAS_AVX512_VNNI
    return 1;
#else
    return 0;
#endif
}
