/*
 * Q4_1 weights interleaved 16 rows at a time (kind Q4_1_X16, int8_x16.c's layout) against bf16
 * activations, on CPUs with AVX512-BF16: the decode matmuls of --quantization gguf (the default)
 * in bf16.
 *
 * Why: the row-major lut route (quant_matmul.c) leaves a block's dot in the lanes of one vector,
 * so per output row and row of x it pays a horizontal sum, and each weight row's nibbles are
 * decoded again for every tile of 4 rows of x: SmolLM2-135M's layer matrices took 15.5 ms a
 * decode step at 8 sequences on one Zen 5 core, six times the time to read them. Interleaved,
 * lane r of every vector is weight row r: one chunk's nibbles become 16 vectors of bf16 pairs
 * (two vpshufb, two and, two shifts and four vpermw through the 0-15 table per 64 bytes, shared
 * by every row of x), each multiplied by one broadcast pair of x with one vdpbf16ps that serves
 * 16 outputs, and the results leave as whole vectors.
 *
 * The arithmetic is the lut route's: per block, t = sum_j q_j x_j in fp32 (the bf16 q exact, the
 * products exact), then acc = fma(t, d, acc) and mins = fma(m, xsum, mins), y = acc + mins
 * (xsum: the block's x summed in fp32, in order); t is summed in four chains (pairs of inputs 4i
 * to 4i+3 and 16+4i to 16+4i+3 for chain i), added as (c0 + c1) + (c2 + c3), so a row's result
 * does not depend on its batch. The plain loop (CPUs without AVX512-BF16) sums in the same
 * order, up to how vdpbf16ps rounds inside a pair.
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

#define BF16_X16_ROWS 4 /* rows of x a pass over a group's blocks serves (16 weight vectors stay live) */
#define BF16_X16_PREFETCH_BYTES 4096 /* how far ahead of the chunk being read the weights are asked for */

/* xsum [M, blocks]: each block's x summed in fp32, in order. */
static void block_sums(const uint16_t *x, int64_t M, int64_t K, float *xsum) {
    const int64_t blocks = K / QK;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < blocks; b++) {
            float sum = 0.0f;
            for (int j = 0; j < QK; j++) sum += bf16_to_fp32(x[r * K + b * QK + j]);
            xsum[r * blocks + b] = sum;
        }
}

/* The plain loop: the header's sums for one (weight row, row of x) at a time (each product of a
 * 0-15 and a bf16 is exact in fp32). */
static void bf16_x16_plain(const uint16_t *x, const float *xsum, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                           void *y, int y_is_bf16, int threads) {
    const int64_t blocks = K / QK;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++)
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.0f, mins = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                uint8_t qs[QK];
                uint16_t d16, m16;
                x16_block(KIND_Q4_1_X16, w, K, n, b, qs, &d16, &m16);
                const uint16_t *xb = x + r * K + b * QK;
                float chain[4];
                for (int i = 0; i < 4; i++) { /* the vector kernel's chain i, pair by pair as vdpbf16ps adds */
                    float c = 0.0f;
                    for (int half = 0; half < 2; half++)     /* inputs 4i.. (low nibbles), 16+4i.. (high) */
                        for (int pair = 0; pair < 2; pair++) { /* (4i, 4i+1), then (4i+2, 4i+3) */
                            const int j0 = 16 * half + 4 * i + 2 * pair;
                            const uint8_t b0 = qs[4 * i + 2 * pair], b1 = qs[4 * i + 2 * pair + 1];
                            const float q0 = (float)(half ? b0 >> 4 : b0 & 15), q1 = (float)(half ? b1 >> 4 : b1 & 15);
                            c = c + (q0 * bf16_to_fp32(xb[j0]) + q1 * bf16_to_fp32(xb[j0 + 1]));
                        }
                    chain[i] = c;
                }
                const float t = (chain[0] + chain[1]) + (chain[2] + chain[3]);
                acc = fmaf(t, fp16_to_fp32(d16), acc);
                mins = fmaf(fp16_to_fp32(m16), xsum[r * blocks + b], mins);
            }
            put_f32(y, y_is_bf16, r * N + n, acc + mins);
        }
}

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* 16 weight rows (a group, from its first chunk) against `rows` rows of x: out[r], 16 outputs. */
static inline __attribute__((always_inline)) void group_bf16(const uint8_t *group, const uint16_t *x, int64_t K,
                                                             const float *xsum, int rows, __m512 *out) {
    const int64_t blocks = K / QK;
    /* bf16 of 0..15 (exact) by word index */
    const __m512i lut = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150,
                                         0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080,
                                         0x4040, 0x4000, 0x3F80, 0x0000);
    /* per 32-bit lane [b0 b1 b2 b3]: the words b0, b1 (pick_01) and b2, b3 (pick_23) */
    const __m512i pick_01 = _mm512_set4_epi32((int)0x800D800C, (int)0x80098008, (int)0x80058004, (int)0x80018000);
    const __m512i pick_23 = _mm512_set4_epi32((int)0x800F800E, (int)0x800B800A, (int)0x80078006, (int)0x80038002);
    const __m512i low = _mm512_set1_epi16(15);
    __m512 acc[BF16_X16_ROWS], mins[BF16_X16_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = mins[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *chunk = group + b * X16 * Q4_1_BYTES;
        for (int line = 0; line < 5; line++) /* a chunk's 320 bytes, BF16_X16_PREFETCH_BYTES on */
            _mm_prefetch((const char *)chunk + BF16_X16_PREFETCH_BYTES + 64 * line, _MM_HINT_T0);
        __m512bh q[4][4]; /* [word i][lo 01, lo 23, hi 01, hi 23] */
        for (int i = 0; i < 4; i++) {
            const __m512i bytes = _mm512_loadu_si512(chunk + 64 * i);
            const __m512i w01 = _mm512_shuffle_epi8(bytes, pick_01), w23 = _mm512_shuffle_epi8(bytes, pick_23);
            q[i][0] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(w01, low), lut);
            q[i][1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(w23, low), lut);
            q[i][2] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w01, 4), lut);
            q[i][3] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w23, 4), lut);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(chunk + 256)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(chunk + 288)));
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            const uint16_t *xb = x + r * K + b * QK;
            __m512 chain[4];
            for (int i = 0; i < 4; i++) { /* pairs in the plain loop's order: lo 01, lo 23, hi 01, hi 23 */
                chain[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[i][0], (__m512bh)broadcast_u32(xb + 4 * i));
                chain[i] = _mm512_dpbf16_ps(chain[i], q[i][1], (__m512bh)broadcast_u32(xb + 4 * i + 2));
                chain[i] = _mm512_dpbf16_ps(chain[i], q[i][2], (__m512bh)broadcast_u32(xb + 16 + 4 * i));
                chain[i] = _mm512_dpbf16_ps(chain[i], q[i][3], (__m512bh)broadcast_u32(xb + 16 + 4 * i + 2));
            }
            const __m512 t = _mm512_add_ps(_mm512_add_ps(chain[0], chain[1]), _mm512_add_ps(chain[2], chain[3]));
            acc[r] = _mm512_fmadd_ps(t, d, acc[r]);
            mins[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * blocks + b]), mins[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = _mm512_add_ps(acc[r], mins[r]);
}

static void bf16_x16_vector(const uint16_t *x, const float *xsum, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                            void *y, int y_is_bf16, int threads) {
    const int64_t blocks = K / QK, group_bytes = blocks * X16 * Q4_1_BYTES;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t g = 0; g < N / X16; g++)
        for (int64_t m0 = 0; m0 < M; m0 += BF16_X16_ROWS) {
            const int rows = (int)(M - m0 < BF16_X16_ROWS ? M - m0 : BF16_X16_ROWS);
            __m512 out[BF16_X16_ROWS];
            const uint16_t *xt = x + m0 * K;
            const float *st = xsum + m0 * blocks;
            switch (rows) {
                case 1: group_bf16(w + g * group_bytes, xt, K, st, 1, out); break;
                case 2: group_bf16(w + g * group_bytes, xt, K, st, 2, out); break;
                case 3: group_bf16(w + g * group_bytes, xt, K, st, 3, out); break;
                default: group_bf16(w + g * group_bytes, xt, K, st, 4, out); break;
            }
            for (int r = 0; r < rows; r++) put_f32x16(y, y_is_bf16, (m0 + r) * N + g * X16, out[r]);
        }
}
#endif

/* y[M, N] = x[M, K] @ W^T for W Q4_1_X16 and x bf16. Returns 0, or -1 when a buffer could not
 * be allocated. */
int bf16_x16_matmul(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y, int y_is_bf16,
                    int threads) {
    float *xsum = (float *)malloc((size_t)(M * (K / QK)) * sizeof(float));
    if (xsum == NULL) return -1;
    block_sums(x, M, K, xsum);
#if defined(__AVX512BF16__)
    bf16_x16_vector(x, xsum, M, K, w, N, y, y_is_bf16, threads);
#else
    bf16_x16_plain(x, xsum, M, K, w, N, y, y_is_bf16, threads);
#endif
    free(xsum);
    return 0;
}

/* 1 when bf16 x against Q4_1_X16 runs the vector kernel here (AVX512-BF16). */
int pd_quant_bf16_x16_route(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
