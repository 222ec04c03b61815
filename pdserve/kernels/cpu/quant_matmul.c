/*
 * Weight-only quantized matmuls for the CPU engine: y[M, N] = x[M, K] @ W[N, K]^T with W kept
 * in GGUF's own blocks of 32 weights along K, decoded in registers and never materialised.
 *
 * Two block layouts (the ones llama.cpp writes, byte for byte):
 *   Q4_1: fp16 d, fp16 m, uint8 qs[16]   w[j] = d * q[j] + m, q[j] = qs[j] & 15 (j < 16),
 *                                        q[j + 16] = qs[j] >> 4           (20 bytes / 32 weights)
 *   Q8_0: fp16 d, int8 qs[32]            w[j] = d * qs[j]                (34 bytes / 32 weights)
 * Q4_0 and Q4_K are converted to Q4_1 at load (see pdserve/engine/model/gguf_blocks.py).
 *
 * Activations are computed in fp32: a bf16 x is widened exactly, and each weight block is decoded
 * to fp32 once (one fma: d * q + m) and used against up to ROWS_PER_TILE rows of x. A decode
 * step at batch 1-8 reads every weight once, so the point is to stream 5 (Q4_1) or 8.5 (Q8_0)
 * bits a weight instead of 16 (bf16) and keep the decode cheap enough to stay near the memory
 * floor. Rows of W are split between OpenMP threads.
 *
 * Built at first use with the host compiler and -march=native (pdserve/kernels/cpu_quant.py);
 * the AVX-512 path is chosen by the compiler's own feature macros, and plain C (auto-vectorised)
 * runs anywhere else.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define QK 32
#define Q4_1_BYTES 20
#define Q8_0_BYTES 34
#define ROWS_PER_TILE 8

static inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: renormalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline float bf16_to_fp32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t fp32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

/* x as fp32 [M, K]: a copy when x is bf16, x itself when it is fp32. */
static const float *widen(const void *x, int x_is_bf16, int64_t count, float **owned) {
    *owned = NULL;
    if (!x_is_bf16) return (const float *)x;
    float *out = (float *)malloc((size_t)count * sizeof(float));
    const uint16_t *src = (const uint16_t *)x;
    for (int64_t i = 0; i < count; i++) out[i] = bf16_to_fp32(src[i]);
    *owned = out;
    return out;
}

static inline void store(void *out, int out_is_bf16, int64_t index, float value) {
    if (out_is_bf16)
        ((uint16_t *)out)[index] = fp32_to_bf16(value);
    else
        ((float *)out)[index] = value;
}

/* Decode one block into two halves of 16 fp32 weights (elements 0-15 and 16-31). */
#if defined(__AVX512F__)
static inline void decode_q4_1(const uint8_t *block, __m512 *lo, __m512 *hi) {
    const uint16_t *head = (const uint16_t *)block;
    __m512 d = _mm512_set1_ps(fp16_to_fp32(head[0]));
    __m512 m = _mm512_set1_ps(fp16_to_fp32(head[1]));
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 4)));
    __m512 q_lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
    __m512 q_hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
    *lo = _mm512_fmadd_ps(q_lo, d, m);
    *hi = _mm512_fmadd_ps(q_hi, d, m);
}

static inline void decode_q8_0(const uint8_t *block, __m512 *lo, __m512 *hi) {
    __m512 d = _mm512_set1_ps(fp16_to_fp32(*(const uint16_t *)block));
    __m512i q_lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 2)));
    __m512i q_hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 18)));
    *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(q_lo), d);
    *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(q_hi), d);
}
#endif

static inline void decode_scalar(int kind, const uint8_t *block, float *w) {
    if (kind == 0) {
        const uint16_t *head = (const uint16_t *)block;
        float d = fp16_to_fp32(head[0]), m = fp16_to_fp32(head[1]);
        const uint8_t *qs = block + 4;
        for (int j = 0; j < 16; j++) {
            w[j] = (float)(qs[j] & 15) * d + m;
            w[j + 16] = (float)(qs[j] >> 4) * d + m;
        }
    } else {
        float d = fp16_to_fp32(*(const uint16_t *)block);
        const int8_t *qs = (const int8_t *)(block + 2);
        for (int j = 0; j < QK; j++) w[j] = (float)qs[j] * d;
    }
}

static inline int block_bytes(int kind) { return kind == 0 ? Q4_1_BYTES : Q8_0_BYTES; }

/* One output row n against `rows` (<= ROWS_PER_TILE) rows of x: dot[r] = x[r] . W[n]. Inlined
 * into a switch on constant (kind, rows), so the accumulators live in registers. */
static inline __attribute__((always_inline)) void row_dots(int kind, const uint8_t *w_row, int64_t blocks,
                                                           const float *x, int64_t K, int rows, float *dot) {
    const int bytes = block_bytes(kind);
#if defined(__AVX512F__)
    if (rows == 1) {
        /* Four independent accumulators so the fma latency, not the chain, sets the pace. */
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        int64_t b = 0;
        for (; b + 1 < blocks; b += 2) {
            __m512 lo0, hi0, lo1, hi1;
            if (kind == 0) {
                decode_q4_1(w_row + b * bytes, &lo0, &hi0);
                decode_q4_1(w_row + (b + 1) * bytes, &lo1, &hi1);
            } else {
                decode_q8_0(w_row + b * bytes, &lo0, &hi0);
                decode_q8_0(w_row + (b + 1) * bytes, &lo1, &hi1);
            }
            const float *xb = x + b * QK;
            a0 = _mm512_fmadd_ps(lo0, _mm512_loadu_ps(xb), a0);
            a1 = _mm512_fmadd_ps(hi0, _mm512_loadu_ps(xb + 16), a1);
            a2 = _mm512_fmadd_ps(lo1, _mm512_loadu_ps(xb + 32), a2);
            a3 = _mm512_fmadd_ps(hi1, _mm512_loadu_ps(xb + 48), a3);
        }
        for (; b < blocks; b++) {
            __m512 lo, hi;
            if (kind == 0)
                decode_q4_1(w_row + b * bytes, &lo, &hi);
            else
                decode_q8_0(w_row + b * bytes, &lo, &hi);
            a0 = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + b * QK), a0);
            a1 = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + b * QK + 16), a1);
        }
        dot[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        return;
    }
    __m512 acc_lo[ROWS_PER_TILE], acc_hi[ROWS_PER_TILE];
    for (int r = 0; r < rows; r++) acc_lo[r] = acc_hi[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512 lo, hi;
        if (kind == 0)
            decode_q4_1(w_row + b * bytes, &lo, &hi);
        else
            decode_q8_0(w_row + b * bytes, &lo, &hi);
        const float *xb = x + b * QK;
        for (int r = 0; r < rows; r++) {
            acc_lo[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb + r * K), acc_lo[r]);
            acc_hi[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + r * K + 16), acc_hi[r]);
        }
    }
    for (int r = 0; r < rows; r++) dot[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[r], acc_hi[r]));
#else
    float w[QK];
    for (int r = 0; r < rows; r++) dot[r] = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        decode_scalar(kind, w_row + b * bytes, w);
        for (int r = 0; r < rows; r++) {
            const float *xb = x + r * K + b * QK;
            float s = 0.0f;
            for (int j = 0; j < QK; j++) s += w[j] * xb[j];
            dot[r] += s;
        }
    }
#endif
}

#if defined(__AVX512BF16__)
/* The bf16 path: each block decoded once to bf16 (d * q + m rounded as a dense bf16 copy of the
 * same weights would be), then one vdpbf16ps (32 multiply-adds) per row of x. Twice the fp32
 * path's arithmetic per instruction, which is what batches of 2-8 rows are bound by. */
static inline __m512bh decode_bf16(int kind, const uint8_t *block) {
    __m512 lo, hi;
    if (kind == 0)
        decode_q4_1(block, &lo, &hi);
    else
        decode_q8_0(block, &lo, &hi);
    return _mm512_cvtne2ps_pbh(hi, lo); /* lanes 0-15 from lo, 16-31 from hi */
}

static inline __attribute__((always_inline)) void row_dots_bf16(int kind, const uint8_t *w_row, int64_t blocks,
                                                                const uint16_t *x, int64_t K, int rows,
                                                                float *dot) {
    const int bytes = block_bytes(kind);
    if (rows == 1) {
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        int64_t b = 0;
        for (; b + 1 < blocks; b += 2) {
            __m512bh w0 = decode_bf16(kind, w_row + b * bytes), w1 = decode_bf16(kind, w_row + (b + 1) * bytes);
            a0 = _mm512_dpbf16_ps(a0, w0, (__m512bh)_mm512_loadu_si512(x + b * QK));
            a1 = _mm512_dpbf16_ps(a1, w1, (__m512bh)_mm512_loadu_si512(x + (b + 1) * QK));
        }
        for (; b < blocks; b++)
            a0 = _mm512_dpbf16_ps(a0, decode_bf16(kind, w_row + b * bytes), (__m512bh)_mm512_loadu_si512(x + b * QK));
        dot[0] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
        return;
    }
    __m512 acc[ROWS_PER_TILE];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512bh w = decode_bf16(kind, w_row + b * bytes);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_loadu_si512(x + r * K + b * QK));
    }
    for (int r = 0; r < rows; r++) dot[r] = _mm512_reduce_add_ps(acc[r]);
}

#define ROWS_CASE_BF16(KIND, ROWS) \
    case ROWS:                     \
        row_dots_bf16(KIND, w_row, blocks, x, K, ROWS, dot); \
        break;

static void row_dots_bf16_dispatch(int kind, const uint8_t *w_row, int64_t blocks, const uint16_t *x, int64_t K,
                                   int rows, float *dot) {
    if (kind == 0) {
        switch (rows) {
            ROWS_CASE_BF16(0, 1) ROWS_CASE_BF16(0, 2) ROWS_CASE_BF16(0, 3) ROWS_CASE_BF16(0, 4)
            ROWS_CASE_BF16(0, 5) ROWS_CASE_BF16(0, 6) ROWS_CASE_BF16(0, 7) ROWS_CASE_BF16(0, 8)
        }
    } else {
        switch (rows) {
            ROWS_CASE_BF16(1, 1) ROWS_CASE_BF16(1, 2) ROWS_CASE_BF16(1, 3) ROWS_CASE_BF16(1, 4)
            ROWS_CASE_BF16(1, 5) ROWS_CASE_BF16(1, 6) ROWS_CASE_BF16(1, 7) ROWS_CASE_BF16(1, 8)
        }
    }
}
#endif

#define ROWS_CASE(KIND, ROWS) \
    case ROWS:                \
        row_dots(KIND, w_row, blocks, x, K, ROWS, dot); \
        break;

/* row_dots with kind and rows as constants (the compiler unrolls the row loops). */
static void row_dots_dispatch(int kind, const uint8_t *w_row, int64_t blocks, const float *x, int64_t K,
                              int rows, float *dot) {
    if (kind == 0) {
        switch (rows) {
            ROWS_CASE(0, 1) ROWS_CASE(0, 2) ROWS_CASE(0, 3) ROWS_CASE(0, 4)
            ROWS_CASE(0, 5) ROWS_CASE(0, 6) ROWS_CASE(0, 7) ROWS_CASE(0, 8)
        }
    } else {
        switch (rows) {
            ROWS_CASE(1, 1) ROWS_CASE(1, 2) ROWS_CASE(1, 3) ROWS_CASE(1, 4)
            ROWS_CASE(1, 5) ROWS_CASE(1, 6) ROWS_CASE(1, 7) ROWS_CASE(1, 8)
        }
    }
}

/*
 * y[M, N] = x[M, K] @ W^T. kind 0: Q4_1 blocks, 1: Q8_0 blocks; W is [N, K / 32] blocks, row-major.
 * x and y are bf16 (flag 1) or fp32 (flag 0), contiguous. K must be a multiple of 32.
 */
void pd_quant_matmul(int kind, const void *x, int x_is_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                     void *y, int y_is_bf16, int threads) {
    const int64_t blocks = K / QK;
    const int64_t row_bytes = blocks * block_bytes(kind);
#if defined(__AVX512BF16__)
    if (x_is_bf16) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t n = 0; n < N; n++) {
            float dot[ROWS_PER_TILE];
            for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_TILE) {
                int rows = (int)(M - m0 < ROWS_PER_TILE ? M - m0 : ROWS_PER_TILE);
                row_dots_bf16_dispatch(kind, w + n * row_bytes, blocks, (const uint16_t *)x + m0 * K, K, rows, dot);
                for (int r = 0; r < rows; r++) store(y, y_is_bf16, (m0 + r) * N + n, dot[r]);
            }
        }
        return;
    }
#endif
    float *owned;
    const float *xf = widen(x, x_is_bf16, M * K, &owned);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        float dot[ROWS_PER_TILE];
        for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_TILE) {
            int rows = (int)(M - m0 < ROWS_PER_TILE ? M - m0 : ROWS_PER_TILE);
            row_dots_dispatch(kind, w + n * row_bytes, blocks, xf + m0 * K, K, rows, dot);
            for (int r = 0; r < rows; r++) store(y, y_is_bf16, (m0 + r) * N + n, dot[r]);
        }
    }
    free(owned);
}

/*
 * out[i, :] = W[rows[i], :] decoded (rows == NULL: every row in order). For the embedding lookup
 * from a quantized table, and for prefill chunks, where one decode feeds a dense GEMM.
 */
void pd_quant_dequant(int kind, const uint8_t *w, int64_t K, const int64_t *rows, int64_t count, void *out,
                      int out_is_bf16, int threads) {
    const int64_t blocks = K / QK;
    const int64_t row_bytes = blocks * block_bytes(kind);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && count > 64)
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *w_row = w + (rows ? rows[i] : i) * row_bytes;
        float buf[QK];
        for (int64_t b = 0; b < blocks; b++) {
            decode_scalar(kind, w_row + b * block_bytes(kind), buf);
            for (int j = 0; j < QK; j++) store(out, out_is_bf16, i * K + b * QK + j, buf[j]);
        }
    }
}
