/*
 * Quantized-weight matmuls with int8 activations: y[M, N] = x[M, K] @ W[N, K]^T, W in GGUF's
 * blocks (the layouts of quants.c), x quantized per block of 32 first. Opt-in
 * (--quantization gguf-a8 / int8-a8): pd_quant_matmul keeps x in its dtype.
 *
 * Why: on a CPU without AVX-512 (the AMD Zen 3 here) the fp32-activation kernel is bound by its
 * arithmetic, not by memory: per 8 weights it converts them to fp32 and does an fp32 fma, 2.7-2.9
 * ns a Q4_1 block against 1.3 ns to stream the block's 20 bytes. With x in int8, vpmaddubsw
 * multiplies 32 weights by 32 activations and adds them in pairs in one instruction, and the
 * block's sum is one vpmaddwd and one conversion away: llama.cpp's Q4_1 x Q8_1 dot, the reason
 * its decode outran ours at one stream.
 *
 * x's quantization is llama.cpp's Q8_1, with its scale kept in fp32: for each row and block of
 * 32, d = max|x| / 127, q = x * (1 / d) rounded to the nearest integer, ties to even (0 where d
 * is 0), and s = d * sum(q). Then
 *   Q4_1: sum_j (dw q_j + m) (d xq_j) ~= dw d (q . xq) + m s
 *   Q8_0: sum_j (dw q_j) (d xq_j)     ~= dw d (q . xq)
 * with the integer dots exact. The error is x's rounding only (relative 1/254 of the block's
 * largest activation at worst, per element); tests/engine/model/test_quality_quant.py measures what it costs.
 *
 * Q4_1 runs two blocks a step (pair_q4_1_a8, x stored in the order it reads them): one load and
 * one vpmaddwd/conversion/fma for two blocks. At one row of x, SmolLM2's layer matrices in cache
 * went from 1.88 to 1.25 ns a block; streamed from memory, from 1.5-1.6x to 1.33-1.43x the time of
 * a pure read of their bytes (one core of the AMD EPYC Zen 3 here).
 *
 * On CPUs with AVX512-VNNI both run on 512-bit vpdpbusd instead (arch/x86/quants_a8.c): Q4_1 four blocks
 * a step, Q8_0 two.
 *
 * A row's sum runs the same way whatever M is (one chain of fmas a block; Q4_1's minima into
 * it 8 blocks at a time), so a request's logits do not depend on what it is batched with.
 * Built into the quantized-matmul library (pdserve/kernels/cpu/quant.py) at first use with
 * -march=native; CPUs without AVX2 run the plain C loop at the end.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "isa.h"
#include "arch/x86/avx2.h"
#include "bf16.h"
#include "blocks.h"
#include "kernels.h"
#include <omp.h>

/* Rows of x one pass over a weight row serves (each holds an accumulator and its scales), and
 * weight rows one pass serves at M == 1 (four independent chains hide the fma latency). */
#define A8_ROWS_PER_TILE 4
#define A8_COLS_PER_TILE 4

/* x [M, K] (bf16 or fp32) per block of 32: q [M, K] int8, d and s [M, stride] fp32 (zero past
 * the row's blocks, so that loads of 8 or 16 blocks' scales stay in bounds), as the header says.
 * With AVX-512 a block is two vectors, with the same operations in the same order as the plain
 * loop (IEEE division and product, rounding to nearest even), so both give the same bits. */
static void quantize_rows(const void *x, int x_is_bf16, int64_t M, int64_t K, int8_t *q, float *d, float *s,
                          int64_t stride) {
    const int64_t blocks = K / QK;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t first = r * K + b * QK;
#if PD_HAS_AVX512
            __m512 lo, hi;
            if (x_is_bf16) {
                lo = bf16x16_to_fp32((const uint16_t *)x + first);
                hi = bf16x16_to_fp32((const uint16_t *)x + first + 16);
            } else {
                lo = _mm512_loadu_ps((const float *)x + first);
                hi = _mm512_loadu_ps((const float *)x + first + 16);
            }
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
            const __m512 inv = _mm512_set1_ps(inverse);
            const __m512i q_lo = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(lo, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            const __m512i q_hi = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(hi, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            _mm_storeu_si128((__m128i *)(q + first), _mm512_cvtepi32_epi8(q_lo));
            _mm_storeu_si128((__m128i *)(q + first + 16), _mm512_cvtepi32_epi8(q_hi));
            const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi));
#else
            float values[QK], amax = 0.0f;
            for (int j = 0; j < QK; j++) values[j] = get_f32(x, x_is_bf16, first + j);
            for (int j = 0; j < QK; j++) { /* not fmaxf: a library call per element, not vectorised */
                const float magnitude = fabsf(values[j]);
                amax = magnitude > amax ? magnitude : amax;
            }
            const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
            int sum = 0;
            for (int j = 0; j < QK; j++) {
                const int v = (int)nearbyintf(values[j] * inverse); /* ties to even: the default mode */
                q[first + j] = (int8_t)v;
                sum += v;
            }
#endif
            d[r * stride + b] = scale;
            s[r * stride + b] = scale * (float)sum;
        }
}

#if PD_HAS_AVX2 && !PD_HAS_AVX512_VNNI /* with VNNI, arch/x86/quants_a8.c takes both kinds */
/* x's int8 [M, K] in the order pair_q4_1_a8 reads two Q4_1 blocks in: for blocks 2p and 2p + 1,
 * their first halves (elements 0-15 of each), then their second halves (16-31). A row's last
 * block, when its count is odd, stays as it is. */
static void pair_order(int8_t *q, int64_t M, int64_t K) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t p = 0; p + 2 * QK <= K; p += 2 * QK) {
            int8_t *pair = q + r * K + p, middle[16];
            memcpy(middle, pair + 16, 16);      /* block 2p's second half */
            memcpy(pair + 16, pair + 32, 16);   /* block 2p + 1's first half */
            memcpy(pair + 32, middle, 16);
        }
}

/* A Q4_1 block's 32 nibbles as bytes 0-15 in element order: the low nibbles are elements 0-15,
 * the high ones 16-31 (GGUF's order), so one and over both halves lines them up with x. */
static inline __m256i q4_1_bytes(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
}

/* The exact integer dot of 32 unsigned weights (0-15) with 32 int8 x, as 8 fp32 partial sums. */
static inline __m256 dot_u8(__m256i w, const int8_t *xq) {
    const __m256i pairs = _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)xq));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* The same for 32 signed weights (Q8_0): vpmaddubsw takes |w| and x with w's sign (pairs stay
 * within int16: 2 * 128 * 127). */
static inline __m256 dot_s8(__m256i w, const int8_t *xq) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)xq);
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* The quantized x the kernels read: q [M, K], d and s [M, stride]. */
typedef struct {
    const int8_t *q;
    const float *d, *s;
    int64_t stride, K;
} QuantizedX;

/* Q8_0 block b of one weight row against one row of x (xq: its int8, xd: its scales), into acc:
 * acc += dw d * (q . xq). */
static inline __attribute__((always_inline)) __m256 block_q8_0_a8(const uint8_t *w_row, int64_t b, const int8_t *xq,
                                                                  const float *xd, __m256 acc) {
    const uint8_t *block = w_row + b * Q8_0_BYTES;
    const __m256 scale = _mm256_set1_ps(fp16_to_fp32(*(const uint16_t *)block) * xd[b]);
    return _mm256_fmadd_ps(dot_s8(_mm256_loadu_si256((const __m256i *)(block + 2)), xq + b * QK), scale, acc);
}

/* Q4_1 blocks b and b + 1 (b even) of one weight row against x's pair of blocks there (in pair
 * order, see pair_order), into acc: lanes 0-3 take block b's products with dw d from lane `lane`
 * of dd, lanes 4-7 block b + 1's with lane `lane` + 1. Two blocks' 32 nibble bytes are one load:
 * their low nibbles meet x's first halves, the high ones its second halves, and the two
 * vpmaddubsw results add in int16 (at most 2 * 2 * 15 * 127) before one vpmaddwd, one
 * conversion and one fma: half the instructions of a block at a time. */
static inline __attribute__((always_inline)) __m256 pair_q4_1_a8(const uint8_t *w_row, int64_t b, __m256 dd,
                                                                 int lane, const int8_t *xq, __m256 acc) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(w_row + b * 16)), low = _mm256_set1_epi8(15);
    const __m256i first = _mm256_and_si256(raw, low), second = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    const int8_t *x = xq + b * QK;
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(first, _mm256_loadu_si256((const __m256i *)x)),
                                           _mm256_maddubs_epi16(second, _mm256_loadu_si256((const __m256i *)(x + 32))));
    const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    const __m256i lanes = _mm256_set_epi32(lane + 1, lane + 1, lane + 1, lane + 1, lane, lane, lane, lane);
    return _mm256_fmadd_ps(dots, _mm256_permutevar8x32_ps(dd, lanes), acc);
}

/* A Q4_1 row's last block when the row has an odd count (x in natural order there), lane `lane`
 * of dd: a block at a time. */
static inline __attribute__((always_inline)) __m256 last_q4_1_a8(const uint8_t *w_row, int64_t b, __m256 dd,
                                                                 int lane, const int8_t *xq, __m256 acc) {
    const __m256 scale = _mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(lane));
    return _mm256_fmadd_ps(dot_u8(q4_1_bytes(w_row + b * 16), xq + b * QK), scale, acc);
}

/* At Q4_1 block b (a multiple of 8): each row's products of scales dw * d for the window of 8
 * blocks into dd, and the window's minima (m s) into each row's accumulator. Returns the window's
 * first block (group_start_avx2 moves it back at the row's end). */
static inline __attribute__((always_inline)) int64_t q4_1_group(const uint8_t *w_row, int64_t blocks, int64_t b,
                                                                QuantizedX x, int rows, __m256 *dd, __m256 *acc) {
    __m256 dw;
    const int64_t base = group_start_avx2(w_row, x.K, blocks, b, x.s, x.stride, rows, &dw, acc);
    for (int r = 0; r < rows; r++) dd[r] = _mm256_mul_ps(dw, _mm256_loadu_ps(x.d + r * x.stride + base));
    return base;
}

/* The cache lines of the 8 blocks from b of the row `ahead` rows on (tiles of 4 rows: two tiles
 * on), fetched while this tile computes; with one weight row a tile, the bytes ROW_PREFETCH_BYTES
 * on. Two tiles ahead: SmolLM2's 120 layer matrices at one row of x took 1.33-1.37x a pure read
 * of their bytes, against 1.37-1.49x one tile ahead (three and eight tiles: no better). */
static inline __attribute__((always_inline)) void prefetch_group(int kind, const uint8_t *w_row, int64_t row_bytes,
                                                                 int64_t K, int64_t blocks, int64_t b, int ahead) {
    const uint8_t *next = ahead ? w_row + ahead * row_bytes : w_row + ROW_PREFETCH_BYTES;
    if (kind == 0) { /* 128 bytes of nibbles; the scales and minima every 32 blocks */
        _mm_prefetch((const char *)(next + b * 16), _MM_HINT_T0);
        _mm_prefetch((const char *)(next + b * 16 + 64), _MM_HINT_T0);
        if (b % 32 == 0) {
            _mm_prefetch((const char *)(next + K / 2 + b * 2), _MM_HINT_T0);
            _mm_prefetch((const char *)(next + K / 2 + (blocks + b) * 2), _MM_HINT_T0);
        }
    } else { /* 272 bytes */
        for (int line = 0; line < 5; line++)
            _mm_prefetch((const char *)(next + b * Q8_0_BYTES + line * 64), _MM_HINT_T0);
    }
}

/*
 * `cols` weight rows (from w, row_bytes apart) against `rows` rows of x, cols * rows <= 4 (both
 * constants once inlined): dot[c * rows + r]. Each pair sums in one chain of fmas, in order (Q4_1:
 * two blocks a step, its minima added at the start of each window of 8; Q8_0: a block a step): the
 * same operations in the same order whatever the tile, so a row's logits do not depend on its
 * batch. Whole windows run unrolled with their scales' lanes as constants (a lane index moved
 * from a general register per block cost more than the block's arithmetic); the rest of the row
 * runs a step at a time.
 */
static inline __attribute__((always_inline)) void tile_a8(int kind, const uint8_t *w, int64_t row_bytes,
                                                          int64_t blocks, QuantizedX x, int cols, int rows,
                                                          float *dot) {
    __m256 acc[4], dd[4];
    for (int i = 0; i < cols * rows; i++) acc[i] = dd[i] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8) {
#pragma GCC unroll 4
        for (int c = 0; c < cols; c++) {
            const uint8_t *w_row = w + c * row_bytes;
            prefetch_group(kind, w_row, row_bytes, x.K, blocks, b, cols > 1 ? 2 * cols : 0); /* two tiles on */
            if (kind == 0) q4_1_group(w_row, blocks, b, x, rows, dd + c * rows, acc + c * rows);
        }
        if (kind == 0) {
#pragma GCC unroll 4
            for (int k = 0; k < 8; k += 2)
#pragma GCC unroll 4
                for (int c = 0; c < cols; c++)
#pragma GCC unroll 4
                    for (int r = 0; r < rows; r++)
                        acc[c * rows + r] = pair_q4_1_a8(w + c * row_bytes, b + k, dd[c * rows + r], k,
                                                         x.q + r * x.K, acc[c * rows + r]);
        } else {
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++)
#pragma GCC unroll 4
                for (int c = 0; c < cols; c++)
#pragma GCC unroll 4
                    for (int r = 0; r < rows; r++)
                        acc[c * rows + r] = block_q8_0_a8(w + c * row_bytes, b + k, x.q + r * x.K,
                                                          x.d + r * x.stride, acc[c * rows + r]);
        }
    }
    if (b < blocks) { /* the last blocks, fewer than 8: Q4_1's window is moved back (q4_1_group) */
        int64_t base = b;
        for (int c = 0; c < cols; c++)
            if (kind == 0) base = q4_1_group(w + c * row_bytes, blocks, b, x, rows, dd + c * rows, acc + c * rows);
        for (; b < blocks; b += kind == 0 && b + 1 < blocks ? 2 : 1)
            for (int c = 0; c < cols; c++)
                for (int r = 0; r < rows; r++) {
                    __m256 *sum = acc + c * rows + r;
                    const uint8_t *w_row = w + c * row_bytes;
                    if (kind != 0)
                        *sum = block_q8_0_a8(w_row, b, x.q + r * x.K, x.d + r * x.stride, *sum);
                    else if (b + 1 < blocks)
                        *sum = pair_q4_1_a8(w_row, b, dd[c * rows + r], (int)(b - base), x.q + r * x.K, *sum);
                    else
                        *sum = last_q4_1_a8(w_row, b, dd[c * rows + r], (int)(b - base), x.q + r * x.K, *sum);
                }
    }
    for (int i = 0; i < cols * rows; i++) dot[i] = hsum_avx2(acc[i]);
}

#define A8_TILE_CASE(KIND, COLS, ROWS) \
    case ROWS:                         \
        tile_a8(KIND, w, row_bytes, blocks, x, COLS, ROWS, dot); \
        break;
/* tile_a8 with (kind, cols, rows) as constants, so its loops unroll into registers: a tile of
 * A8_COLS_PER_TILE Q4_1 weight rows at one row of x, else one weight row at 1-A8_ROWS_PER_TILE
 * (Q8_0 at one row too: the LM head, bound by memory, was no faster in tiles of 4). */
static void tile_a8_dispatch(int kind, const uint8_t *w, int64_t row_bytes, int64_t blocks, QuantizedX x, int cols,
                             int rows, float *dot) {
    if (cols == A8_COLS_PER_TILE) {
        tile_a8(0, w, row_bytes, blocks, x, A8_COLS_PER_TILE, 1, dot);
    } else if (kind == 0) {
        switch (rows) { A8_TILE_CASE(0, 1, 1) A8_TILE_CASE(0, 1, 2) A8_TILE_CASE(0, 1, 3) A8_TILE_CASE(0, 1, 4) }
    } else {
        switch (rows) { A8_TILE_CASE(1, 1, 1) A8_TILE_CASE(1, 1, 2) A8_TILE_CASE(1, 1, 3) A8_TILE_CASE(1, 1, 4) }
    }
}

static void matmul_a8(int kind, QuantizedX x, int64_t M, const uint8_t *w, int64_t N, void *y, int y_is_bf16,
                      int threads) {
    const int64_t blocks = x.K / QK, row_bytes = blocks * block_bytes(kind);
    if (M == 1 && kind == 0) { /* tiles of A8_COLS_PER_TILE weight rows: independent chains hide the fma latency */
        const int64_t tiles = (N + A8_COLS_PER_TILE - 1) / A8_COLS_PER_TILE;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t n0 = tile * A8_COLS_PER_TILE;
            float dot[A8_COLS_PER_TILE];
            if (n0 + A8_COLS_PER_TILE <= N)
                tile_a8_dispatch(kind, w + n0 * row_bytes, row_bytes, blocks, x, A8_COLS_PER_TILE, 1, dot);
            else /* the last, partial tile: a row at a time, summed alike */
                for (int64_t n = n0; n < N; n++)
                    tile_a8_dispatch(kind, w + n * row_bytes, row_bytes, blocks, x, 1, 1, dot + (n - n0));
            for (int64_t n = n0; n < N && n < n0 + A8_COLS_PER_TILE; n++) put_f32(y, y_is_bf16, n, dot[n - n0]);
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        float dot[A8_ROWS_PER_TILE];
        for (int64_t m0 = 0; m0 < M; m0 += A8_ROWS_PER_TILE) {
            const int rows = (int)(M - m0 < A8_ROWS_PER_TILE ? M - m0 : A8_ROWS_PER_TILE);
            QuantizedX tile = x;
            tile.q += m0 * x.K;
            tile.d += m0 * x.stride;
            tile.s += m0 * x.stride;
            tile_a8_dispatch(kind, w + n * row_bytes, row_bytes, blocks, tile, 1, rows, dot);
            for (int r = 0; r < rows; r++) put_f32(y, y_is_bf16, (m0 + r) * N + n, dot[r]);
        }
    }
}
#elif !PD_HAS_AVX512_VNNI
/* Without AVX2: the same arithmetic, a block at a time in plain C. */
static void matmul_a8_plain(int kind, const int8_t *q, const float *d, const float *s, int64_t stride, int64_t M,
                            int64_t K, const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads) {
    const int64_t blocks = K / QK, row_bytes = blocks * block_bytes(kind);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *w_row = w + n * row_bytes;
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                const int8_t *xq = q + r * K + b * QK;
                int dot = 0;
                float dw, m = 0.0f;
                if (kind == 0) {
                    const uint16_t *scales = (const uint16_t *)(w_row + K / 2);
                    const uint8_t *qs = w_row + b * 16;
                    for (int j = 0; j < 16; j++) dot += (qs[j] & 15) * xq[j] + (qs[j] >> 4) * xq[j + 16];
                    dw = fp16_to_fp32(scales[b]);
                    m = fp16_to_fp32(scales[blocks + b]);
                } else {
                    const uint8_t *block = w_row + b * Q8_0_BYTES;
                    const int8_t *qs = (const int8_t *)(block + 2);
                    for (int j = 0; j < QK; j++) dot += qs[j] * xq[j];
                    dw = fp16_to_fp32(*(const uint16_t *)block);
                }
                acc += (float)dot * (dw * d[r * stride + b]) + m * s[r * stride + b];
            }
            put_f32(y, y_is_bf16, r * N + n, acc);
        }
    }
}
#endif

#if PD_HAS_AVX512_VNNI
/* The 512-bit vpdpbusd kernels of arch/x86/quants_a8.c over x quantized into q (natural order), d and s:
 * Q4_1 reads x in quad order, Q8_0 padded, with its lanes' starting sums. Returns 0, or -1 when
 * a buffer could not be allocated. */
static int matmul_a8_vnni(int kind, const int8_t *q, const float *d, const float *s, int64_t stride, int64_t M,
                          int64_t K, const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads) {
    const int64_t blocks = K / QK;
    if (kind == 0) {
        const int64_t quad_stride = (blocks + 3) / 4 * 4 * QK;
        int8_t *quads = (int8_t *)malloc((size_t)(M * quad_stride));
        if (quads == NULL) return -1;
        int8_quad_order(q, M, K, quads, quad_stride);
        a8_vnni_matmul(0, quads, NULL, quad_stride, d, s, stride, M, K, w, N, y, y_is_bf16, threads);
        free(quads);
        return 0;
    }
    const int64_t padded = (blocks + 1) / 2 * 2 * QK;
    int8_t *xq = (int8_t *)malloc((size_t)(M * padded));
    int32_t *start = (int32_t *)malloc((size_t)(M * padded / 4) * sizeof(int32_t));
    if (xq == NULL || start == NULL) {
        free(xq);
        free(start);
        return -1;
    }
    int8_q8_0_x(q, M, K, xq, start, padded);
    a8_vnni_matmul(1, xq, start, padded, d, s, stride, M, K, w, N, y, y_is_bf16, threads);
    free(xq);
    free(start);
    return 0;
}
#endif

/*
 * y[M, N] = x[M, K] @ W^T with x quantized to int8 per block of 32 (the header). kind 0: Q4_1
 * rows, 1: Q8_0 blocks, as pd_quant_matmul takes them, 2 and 3 the same interleaved by 16 rows
 * (repack_a8.c; N a multiple of 16); x and y bf16 (flag 1) or fp32 (flag 0),
 * contiguous; K a multiple of 32. Returns 0, or -1 when its buffers could not be allocated
 * (nothing written then).
 */
int pd_quant_matmul_a8(int kind, const void *x, int x_is_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                       void *y, int y_is_bf16, int threads) {
    const int64_t blocks = K / QK, stride = (blocks + 15) / 16 * 16; /* arch/x86/quants_a8.c reads 16 at a time */
    if (M <= 0 || N <= 0) return 0; /* nothing to compute (and malloc(0) may return NULL) */
    int8_t *q = (int8_t *)malloc((size_t)(M * K));
    float *d = (float *)calloc((size_t)(M * stride), sizeof(float));
    float *s = (float *)calloc((size_t)(M * stride), sizeof(float));
    if (q == NULL || d == NULL || s == NULL) {
        free(q);
        free(d);
        free(s);
        return -1;
    }
    quantize_rows(x, x_is_bf16, M, K, q, d, s, stride);
    int status = 0;
    if (is_x16(kind)) { /* rows interleaved by 16 (repack_a8.c) */
        status = a8_x16_matmul(kind, q, d, s, stride, M, K, w, N, y, y_is_bf16, threads);
    } else {
#if PD_HAS_AVX512_VNNI
        status = matmul_a8_vnni(kind, q, d, s, stride, M, K, w, N, y, y_is_bf16, threads);
#elif PD_HAS_AVX2
        if (kind == 0) pair_order(q, M, K);
        const QuantizedX quantized = {q, d, s, stride, K};
        matmul_a8(kind, quantized, M, w, N, y, y_is_bf16, threads);
#else
        matmul_a8_plain(kind, q, d, s, stride, M, K, w, N, y, y_is_bf16, threads);
#endif
    }
    free(q);
    free(d);
    free(s);
    return status;
}
