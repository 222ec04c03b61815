/*
 * The x86 routes of quants.c's row-major quantized matmuls (quants.c's header describes the block
 * layouts and the routes, and why): with AVX-512, the fp32 route and the dequantization; with
 * AVX512-BF16, the lut (Q4_1) and bf16 (Q8_0) routes of bf16 activations; with AVX2 and no
 * AVX-512 (PD_ROUTE_AVX2), the avx2 route of fp32 activations. Each public function here is the
 * native twin of quants.c's NAME_generic (quants.h); where a build has none, the twin runs
 * (arch_fallback.h), and a section's code compiles to nothing.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "isa.h"
#include "prefetch.h"
#include "avx2.h"
#include "bf16.h"
#include "blocks.h"
#include "quants.h"
#include "quants_k.h"
#include "repack.h"
#include <omp.h>

#define LUT_ROWS_PER_TILE 4 /* rows of x one decode of the lut route serves */

#if PD_HAS_AVX512
/* Decode one block into two halves of 16 fp32 weights (elements 0-15 and 16-31), from its bytes:
 * Q4_1's 16 nibble bytes in `first`, or Q8_0's 32 int8 in `first` and `second`. */
static inline void decode_bytes(int kind, __m128i first, __m128i second, uint16_t d16, uint16_t m16, __m512 *lo,
                                __m512 *hi) {
    __m512 d = _mm512_set1_ps(fp16_to_fp32(d16));
    if (kind == 0) {
        __m512 m = _mm512_set1_ps(fp16_to_fp32(m16));
        __m512i bytes = _mm512_cvtepu8_epi32(first);
        __m512 q_lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
        __m512 q_hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
        *lo = _mm512_fmadd_ps(q_lo, d, m);
        *hi = _mm512_fmadd_ps(q_hi, d, m);
    } else {
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first)), d);
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(second)), d);
    }
}

static inline void decode_block(int kind, BlockRef ref, __m512 *lo, __m512 *hi) {
    const __m128i first = _mm_loadu_si128((const __m128i *)ref.qs);
    const __m128i second = kind == 0 ? _mm_setzero_si128() : _mm_loadu_si128((const __m128i *)(ref.qs + 16));
    decode_bytes(kind, first, second, ref.d, ref.m, lo, hi);
}

/* The 16 rows' bytes of four vectors whose lane r holds 4 bytes of row r (an interleaved chunk's
 * words 4k-4k+3): row[j] gets, in 128-bit lane L, the 16 bytes of row 4L + j. */
static inline void rows_of_words(const uint8_t *words, __m512i *row) {
    const __m512i v0 = _mm512_loadu_si512(words), v1 = _mm512_loadu_si512(words + 64);
    const __m512i v2 = _mm512_loadu_si512(words + 128), v3 = _mm512_loadu_si512(words + 192);
    const __m512i t0 = _mm512_unpacklo_epi32(v0, v1), t1 = _mm512_unpackhi_epi32(v0, v1);
    const __m512i t2 = _mm512_unpacklo_epi32(v2, v3), t3 = _mm512_unpackhi_epi32(v2, v3);
    row[0] = _mm512_unpacklo_epi64(t0, t2);
    row[1] = _mm512_unpackhi_epi64(t0, t2);
    row[2] = _mm512_unpacklo_epi64(t1, t3);
    row[3] = _mm512_unpackhi_epi64(t1, t3);
}

static inline __m128i lane_128(__m512i v, int lane) {
    switch (lane) {
        case 0: return _mm512_castsi512_si128(v);
        case 1: return _mm512_extracti32x4_epi32(v, 1);
        case 2: return _mm512_extracti32x4_epi32(v, 2);
        default: return _mm512_extracti32x4_epi32(v, 3);
    }
}

/* Every row of an interleaved matrix decoded, a (16-row group, block) chunk at a time: its words
 * transposed into rows in registers (rows_of_words), then decoded as the plain kind's blocks.
 * Gathering each row's block on its own took SmolLM2's 120 layer matrices 41 ms to bf16, against
 * 11 for the row-major layout (one Zen 5 core). */
static void dequant_x16_all(int kind, const uint8_t *w, int64_t K, void *out, int out_is_bf16, int64_t N, int threads) {
    const int64_t blocks = K / QK, chunk_bytes = X16 * block_bytes(kind);
    const int plain = plain_kind(kind), words = x16_words(kind);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t g = 0; g < N / X16; g++)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *chunk = w + (g * blocks + b) * chunk_bytes;
            const uint16_t *d = (const uint16_t *)(chunk + 64 * words), *m = d + X16;
            __m512i first[4], second[4];
            rows_of_words(chunk, first);
            if (plain == KIND_Q8_0) { /* the second 16 weights, and the stored +128 taken back */
                rows_of_words(chunk + 256, second);
                for (int j = 0; j < 4; j++) {
                    first[j] = _mm512_xor_si512(first[j], _mm512_set1_epi8((char)0x80));
                    second[j] = _mm512_xor_si512(second[j], _mm512_set1_epi8((char)0x80));
                }
            }
            for (int lane = 0; lane < 4; lane++)
                for (int j = 0; j < 4; j++) {
                    const int r = 4 * lane + j;
                    __m512 lo, hi;
                    decode_bytes(plain, lane_128(first[j], lane),
                                 plain == KIND_Q8_0 ? lane_128(second[j], lane) : _mm_setzero_si128(), d[r],
                                 plain == KIND_Q4_1 ? m[r] : 0, &lo, &hi);
                    put_f32x32(out, out_is_bf16, (g * X16 + r) * K + b * QK, lo, hi);
                }
        }
}

/* One output row n against `rows` (<= ROWS_PER_TILE) rows of x: dot[r] = x[r] . W[n]. Inlined
 * into a switch on constant (kind, rows), so the accumulators live in registers. */
static inline __attribute__((always_inline)) void row_dots(int kind, const uint8_t *w_row, int64_t blocks,
                                                           const float *x, int64_t K, int rows, float *dot) {
    /* Each row's sum runs the same way whatever the tile's size (two chains: weights 0-15 and
     * 16-31 of every block), so a request's logits do not depend on what it is batched with. */
    __m512 acc_lo[ROWS_PER_TILE], acc_hi[ROWS_PER_TILE];
    for (int r = 0; r < rows; r++) acc_lo[r] = acc_hi[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512 lo, hi;
        decode_block(kind, block_ref(kind, w_row, K, b), &lo, &hi);
        const float *xb = x + b * QK;
        for (int r = 0; r < rows; r++) {
            acc_lo[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb + r * K), acc_lo[r]);
            acc_hi[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + r * K + 16), acc_hi[r]);
        }
    }
    for (int r = 0; r < rows; r++) dot[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[r], acc_hi[r]));
}

DEFINE_ROWS_DISPATCH(row_dots_dispatch, row_dots, float)

/* The fp32 route with AVX-512: output rows split between threads, tiles of ROWS_PER_TILE rows. */
void pd_quant_gemm_f32(int kind, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
                       int y_is_bf16, int threads) {
    const int64_t blocks = K / QK;
    const int64_t row_bytes = blocks * block_bytes(kind);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        float dot[ROWS_PER_TILE];
        for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_TILE) {
            int rows = (int)(M - m0 < ROWS_PER_TILE ? M - m0 : ROWS_PER_TILE);
            row_dots_dispatch(kind, w + n * row_bytes, blocks, x + m0 * K, K, rows, dot);
            for (int r = 0; r < rows; r++) put_f32(y, y_is_bf16, (m0 + r) * N + n, dot[r]);
        }
    }
}

/* pd_quant_dequant (kernels.h; its contract at quants.c's pd_quant_dequant_generic): a block a step
 * in 512-bit registers, a whole interleaved matrix a 16-row chunk at a time (dequant_x16_all). */
void pd_quant_dequant(int kind, const uint8_t *w, int64_t K, const int64_t *rows, int64_t count, void *out,
                      int out_is_bf16, int threads) {
    if (is_k_kind(kind)) { /* held as GGUF stores them */
        pd_quant_k_dequant(kind, w, K, rows, count, out, out_is_bf16, threads);
        return;
    }
    if (is_x16_gguf(kind)) { /* GGUF's blocks interleaved */
        pd_x16_gguf_dequant(kind, w, K, rows, count, out, out_is_bf16, threads);
        return;
    }
    const int64_t blocks = K / QK;
    const int64_t row_bytes = blocks * block_bytes(kind);
    const int plain = plain_kind(kind);
    if (is_x16(kind) && rows == NULL) {
        dequant_x16_all(kind, w, K, out, out_is_bf16, count, threads);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && count > 64)
    for (int64_t i = 0; i < count; i++) {
        const int64_t n = rows ? rows[i] : i;
        const uint8_t *w_row = w + n * row_bytes;
        uint8_t gathered[QK]; /* an interleaved row's block, as its plain kind holds it */
        for (int64_t b = 0; b < blocks; b++) {
            __m512 lo, hi;
            decode_block(plain, block_of(kind, w, w_row, K, n, b, gathered), &lo, &hi);
            put_f32x32(out, out_is_bf16, i * K + b * QK, lo, hi);
        }
    }
}
#endif

#if PD_HAS_AVX512_BF16
/* The bf16 path: each block decoded once to bf16 (d * q + m rounded as a dense bf16 copy of the
 * same weights would be), then one vdpbf16ps (32 multiply-adds) per row of x. Twice the fp32
 * path's arithmetic per instruction, which is what batches of 2-8 rows are bound by. */
static inline __m512bh decode_bf16(int kind, BlockRef ref) {
    __m512 lo, hi;
    decode_block(kind, ref, &lo, &hi);
    return _mm512_cvtne2ps_pbh(hi, lo); /* lanes 0-15 from lo, 16-31 from hi */
}

static inline __attribute__((always_inline)) void row_dots_bf16(int kind, const uint8_t *w_row, int64_t blocks,
                                                                const uint16_t *x, int64_t K, int rows,
                                                                float *dot) {
    /* Two chains per row (even and odd blocks), the same for every tile size: a row's result
     * does not depend on what it is batched with. */
    __m512 even[ROWS_PER_TILE], odd[ROWS_PER_TILE];
    for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        __m512bh w0 = decode_bf16(kind, block_ref(kind, w_row, K, b)),
                 w1 = decode_bf16(kind, block_ref(kind, w_row, K, b + 1));
        for (int r = 0; r < rows; r++) {
            const uint16_t *xb = x + r * K + b * QK;
            even[r] = _mm512_dpbf16_ps(even[r], w0, (__m512bh)_mm512_loadu_si512(xb));
            odd[r] = _mm512_dpbf16_ps(odd[r], w1, (__m512bh)_mm512_loadu_si512(xb + QK));
        }
    }
    if (b < blocks) {
        __m512bh w = decode_bf16(kind, block_ref(kind, w_row, K, b));
        for (int r = 0; r < rows; r++)
            even[r] = _mm512_dpbf16_ps(even[r], w, (__m512bh)_mm512_loadu_si512(x + r * K + b * QK));
    }
    for (int r = 0; r < rows; r++) dot[r] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}

DEFINE_ROWS_DISPATCH(row_dots_bf16_dispatch, row_dots_bf16, uint16_t)

/* The lut route (Q4_1, bf16 x, a few rows). x is given rearranged per pair of blocks as
 * [b: 0-15][b+1: 0-15][b: 16-31][b+1: 16-31] (so one zero-extended load of two blocks' nibble
 * bytes lines up with it), and xsum[r][b] is the sum of row r's x over block b (for m). */
static inline __attribute__((always_inline)) void row_dots_lut(const uint8_t *w_row, int64_t blocks, int64_t K,
                                                               const uint16_t *xr, int64_t xr_stride,
                                                               const float *xsum, int64_t xsum_stride, int rows,
                                                               float *dot) {
    /* bf16 of 0..15: exact, so the products q * x are exact in the fp32 accumulation. */
    const __m512i lut = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150,
                                         0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080,
                                         0x4040, 0x4000, 0x3F80, 0x0000);
    const __m512i pair_lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i low_nibble = _mm512_set1_epi16(15);
    const uint16_t *d_all = (const uint16_t *)(w_row + K / 2), *m_all = d_all + blocks;
    __m512 acc[LUT_ROWS_PER_TILE], acc_m[LUT_ROWS_PER_TILE];
    for (int r = 0; r < rows; r++) acc[r] = acc_m[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < blocks; g += 16) {
        const int64_t in_group = blocks - g < 16 ? blocks - g : 16;
        const __mmask16 group_mask = (__mmask16)((1u << in_group) - 1);
        const __m512 d16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(group_mask, d_all + g));
        const __m512 m16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(group_mask, m_all + g));
        for (int r = 0; r < rows; r++)
            acc_m[r] = _mm512_fmadd_ps(m16, _mm512_maskz_loadu_ps(group_mask, xsum + r * xsum_stride + g), acc_m[r]);
        for (int64_t p = 0; p < in_group; p += 2) {
            const int64_t b = g + p;
            /* The last block of an odd row has no partner: load its 16 bytes only (x is zero there).
             * Plain loads, not a masked one: streamed from memory on a Zen 5, a masked load of
             * the nibbles made the route 5-6x slower (30 layers at one row: 20-22 ms, 3.6 now). */
            const __m256i raw = b + 1 < blocks ? _mm256_loadu_si256((const __m256i *)(w_row + b * 16))
                                               : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(w_row + b * 16)));
            const __m512i bytes = _mm512_cvtepu8_epi16(raw);
            const __m512bh q_lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(bytes, low_nibble), lut);
            const __m512bh q_hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), lut);
            const __m512 d_pair = _mm512_permutexvar_ps(_mm512_add_epi32(pair_lanes, _mm512_set1_epi32((int)p)), d16);
            for (int r = 0; r < rows; r++) {
                const uint16_t *xp = xr + r * xr_stride + b * QK;
                __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), q_lo, (__m512bh)_mm512_loadu_si512(xp));
                t = _mm512_dpbf16_ps(t, q_hi, (__m512bh)_mm512_loadu_si512(xp + QK));
                acc[r] = _mm512_fmadd_ps(t, d_pair, acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) dot[r] = _mm512_reduce_add_ps(acc[r]) + _mm512_reduce_add_ps(acc_m[r]);
}

/* x [M, K] bf16 rearranged for row_dots_lut (odd tails padded with zeros: K rounded up to 64
 * per row), and its per-block sums [M, blocks rounded up to 16]. */
static void lut_prepare(const uint16_t *x, int64_t M, int64_t K, uint16_t *xr, int64_t xr_stride, float *xsum,
                        int64_t xsum_stride) {
    const int64_t blocks = K / QK;
    memset(xr, 0, (size_t)(M * xr_stride) * sizeof(uint16_t));
    memset(xsum, 0, (size_t)(M * xsum_stride) * sizeof(float));
    for (int64_t r = 0; r < M; r++) {
        const uint16_t *row = x + r * K;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t pair = b / 2, second = b % 2;
            uint16_t *dst = xr + r * xr_stride + pair * 2 * QK;
            memcpy(dst + second * 16, row + b * QK, 16 * sizeof(uint16_t));
            memcpy(dst + QK + second * 16, row + b * QK + 16, 16 * sizeof(uint16_t));
            float sum = 0.0f;
            for (int j = 0; j < QK; j++) sum += bf16_to_fp32(row[b * QK + j]);
            xsum[r * xsum_stride + b] = sum;
        }
    }
}

static void lut_matmul(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
                       int y_is_bf16, int threads) {
    const int64_t blocks = K / QK, row_bytes = blocks * Q4_1_BYTES;
    const int64_t xr_stride = (blocks + 1) / 2 * 2 * QK, xsum_stride = (blocks + 15) / 16 * 16;
    uint16_t *xr = (uint16_t *)malloc((size_t)(M * xr_stride) * sizeof(uint16_t));
    float *xsum = (float *)malloc((size_t)(M * xsum_stride) * sizeof(float));
    lut_prepare(x, M, K, xr, xr_stride, xsum, xsum_stride);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m0 = 0; m0 < M; m0 += LUT_ROWS_PER_TILE) {
            const uint16_t *xr_tile = xr + m0 * xr_stride;
            const float *xsum_tile = xsum + m0 * xsum_stride;
            float dot[LUT_ROWS_PER_TILE];
            switch (M - m0 < LUT_ROWS_PER_TILE ? M - m0 : LUT_ROWS_PER_TILE) {
#define LUT_ROWS_CASE(ROWS)                                                                                 \
    case ROWS:                                                                                              \
        row_dots_lut(w + n * row_bytes, blocks, K, xr_tile, xr_stride, xsum_tile, xsum_stride, ROWS, dot); \
        break;
                LUT_ROWS_CASE(1) LUT_ROWS_CASE(2) LUT_ROWS_CASE(3) LUT_ROWS_CASE(4)
#undef LUT_ROWS_CASE
            }
            for (int64_t r = m0; r < M && r < m0 + LUT_ROWS_PER_TILE; r++) put_f32(y, y_is_bf16, r * N + n, dot[r - m0]);
        }
    free(xr);
    free(xsum);
}

/* bf16 activations with AVX512-BF16: the lut route for Q4_1, the bf16 route for Q8_0. */
void pd_quant_gemm_bf16(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
                        int y_is_bf16, int threads) {
    const int64_t blocks = K / QK;
    const int64_t row_bytes = blocks * block_bytes(kind);
    if (kind == 0) {
        lut_matmul(x, M, K, w, N, y, y_is_bf16, threads);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        float dot[ROWS_PER_TILE];
        for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_TILE) {
            int rows = (int)(M - m0 < ROWS_PER_TILE ? M - m0 : ROWS_PER_TILE);
            row_dots_bf16_dispatch(kind, w + n * row_bytes, blocks, x + m0 * K, K, rows, dot);
            for (int r = 0; r < rows; r++) put_f32(y, y_is_bf16, (m0 + r) * N + n, dot[r]);
        }
    }
}
#endif

#if PD_ROUTE_AVX2
/*
 * The avx2 route decodes a block's weights lane-wise, with no shuffles: its bytes are read as
 * 32-bit lanes, and each lane's nibble (or byte) is masked (or shifted) out where it lies, then
 * converted to fp32. Per 8 weights that is one and (Q4_1) or one or two shifts (Q8_0), one
 * conversion and one fma, where widening bytes (vpmovzxbd) took two shuffles more, on the
 * CPU's two shuffle ports: 3.7-4.3 ns a Q4_1 block before, on one Zen 3 core at 2.45 GHz.
 *
 * The weights a lane holds are not consecutive, so x is permuted to match once per call
 * (prepare_x_avx2; every output row reads it):
 *   Q4_1: the 16 nibble bytes broadcast to both 128-bit halves: lane l (0-7) holds dword l % 4,
 *         bytes 4 (l % 4) .. 4 (l % 4) + 3. Vector t (0-3) takes from each lane the low nibble
 *         of byte t (lanes 0-3: weight 4 (l % 4) + t) or its high nibble (lanes 4-7: weight
 *         4 (l % 4) + t + 16). The nibble is masked in place, so the lane holds q * 2^shift
 *         with shift <= 24 (vector 3 reads the dword shifted right by 4, so that no nibble
 *         reaches the sign bit): an integer below 2^28 with 4 significant bits, converted
 *         exactly. x is prescaled by 2^-shift (exact: a power of two), so each product is
 *         q * x as decoding q first gives it.
 *   Q8_0: the 32 bytes as 8 lanes; vector k (0-3) takes byte k of each lane (weight 4 l + k),
 *         sign-extended by shifting it to the top and arithmetically back.
 */
#define LANES_PER_BLOCK 32 /* 4 vectors of 8 */

/* Where lane l of vector t of a block reads its weight, and x's scale there, per kind. */
static inline int lane_weight(int kind, int t, int l) {
    return kind == 0 ? 4 * (l % 4) + t + 16 * (l / 4) : 4 * l + t;
}
static inline int lane_shift(int kind, int t, int l) {
    if (kind != 0) return 0;
    return t < 3 ? 8 * t + 4 * (l / 4) : 20 + 4 * (l / 4);
}

/* xp[r][b][t][l] = x[r][b * 32 + lane_weight(t, l)] * 2^-lane_shift(t, l). */
static void prepare_x_avx2(int kind, const float *x, int64_t M, int64_t K, float *xp) {
    int index[LANES_PER_BLOCK];
    float scale[LANES_PER_BLOCK];
    for (int t = 0; t < 4; t++)
        for (int l = 0; l < 8; l++) {
            index[t * 8 + l] = lane_weight(kind, t, l);
            scale[t * 8 + l] = 1.0f / (float)(1u << lane_shift(kind, t, l));
        }
    for (int64_t i = 0; i < M * (K / QK); i++)
        for (int e = 0; e < LANES_PER_BLOCK; e++) xp[i * QK + e] = x[i * QK + index[e]] * scale[e];
}

/* A block's weights as 4 vectors of 8 fp32, in prepare_x_avx2's lane order (scaled as there). */
static inline __attribute__((always_inline)) void q_values_avx2(int kind, const uint8_t *qs, __m256 q[4]) {
    if (kind == 0) {
        const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
        const __m256i b4 = _mm256_srli_epi32(b, 4);
        const __m256i m0 = _mm256_setr_epi32(0xF, 0xF, 0xF, 0xF, 0xF0, 0xF0, 0xF0, 0xF0);
        q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b, m0));
        q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_slli_epi32(m0, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_slli_epi32(m0, 16)));
        q[3] = _mm256_cvtepi32_ps(_mm256_and_si256(b4, _mm256_slli_epi32(m0, 20)));
    } else {
        const __m256i b = _mm256_loadu_si256((const __m256i *)qs);
        q[0] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(b, 24), 24));
        q[1] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(b, 16), 24));
        q[2] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(b, 8), 24));
        q[3] = _mm256_cvtepi32_ps(_mm256_srai_epi32(b, 24));
    }
}

/* One block of one output row against one row of prepared x: acc += d * ((q0 x0 + q1 x1) +
 * (q2 x2 + q3 x3)). Every (row of x, output row) pair sums in this order, whatever the tile it
 * is computed in, so a request's logits do not depend on what it is batched with. */
static inline __attribute__((always_inline)) __m256 block_dot_avx2(const __m256 q[4], __m256 d, const float *xr,
                                                                   __m256 acc) {
    __m256 t0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(xr));
    __m256 t1 = _mm256_mul_ps(q[2], _mm256_loadu_ps(xr + 16));
    t0 = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xr + 8), t0);
    t1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xr + 24), t1);
    return _mm256_fmadd_ps(_mm256_add_ps(t0, t1), d, acc);
}

/* The scale of block b of a row, broadcast. Q4_1's scales are converted 8 at a time into `d8`
 * (by group_start_avx2, whose window starts at block `base`) and broadcast from there in
 * registers (a store and reload of them stalled on store forwarding); Q8_0's sits in its block. */
static inline __attribute__((always_inline)) __m256 block_scale_avx2(int kind, const uint8_t *w_row, int64_t b,
                                                                     __m256 d8, int64_t base) {
    if (kind != 0) return _mm256_set1_ps(fp16_to_fp32(*(const uint16_t *)(w_row + b * Q8_0_BYTES)));
    return _mm256_permutevar8x32_ps(d8, _mm256_set1_epi32((int)(b - base)));
}

static inline const uint8_t *block_qs_avx2(int kind, const uint8_t *w_row, int64_t b) {
    return kind == 0 ? w_row + b * 16 : w_row + b * Q8_0_BYTES + 2;
}

/* `rows` rows of prepared x against one output row: dot[r] = x[r] . W[n] (Q4_1's minima
 * included through xsum). */
static inline __attribute__((always_inline)) void row_dots_avx2(int kind, const uint8_t *w_row, int64_t blocks,
                                                                const float *xp, const float *xsum,
                                                                int64_t xsum_stride, int64_t K, int rows,
                                                                float *dot) {
    __m256 acc[ROWS_PER_TILE], d8 = _mm256_setzero_ps();
    int64_t base = 0;
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if (kind == 0 && b % 8 == 0) base = group_start_avx2(w_row, K, blocks, b, xsum, xsum_stride, rows, &d8, acc);
        if (b % 2 == 0) /* the rows after this one, a cache line ahead every 32-34 weights' bytes */
            _mm_prefetch((const char *)(block_qs_avx2(kind, w_row, b) + ROW_PREFETCH_BYTES), WEIGHT_HINT);
        __m256 q[4];
        q_values_avx2(kind, block_qs_avx2(kind, w_row, b), q);
        const __m256 d = block_scale_avx2(kind, w_row, b, d8, base);
        for (int r = 0; r < rows; r++) acc[r] = block_dot_avx2(q, d, xp + r * K + b * QK, acc[r]);
    }
    for (int r = 0; r < rows; r++) dot[r] = hsum_avx2(acc[r]);
}

#define AVX2_ROWS_CASE(KIND, ROWS) \
    case ROWS:                     \
        row_dots_avx2(KIND, w_row, blocks, xp, xsum, xsum_stride, K, ROWS, dot); \
        break;
#define AVX2_KIND_SWITCH(KIND)                                                                        \
    switch (rows) {                                                                                   \
        AVX2_ROWS_CASE(KIND, 1) AVX2_ROWS_CASE(KIND, 2) AVX2_ROWS_CASE(KIND, 3) AVX2_ROWS_CASE(KIND, 4) \
        AVX2_ROWS_CASE(KIND, 5) AVX2_ROWS_CASE(KIND, 6) AVX2_ROWS_CASE(KIND, 7) AVX2_ROWS_CASE(KIND, 8) \
    }
/* row_dots_avx2 with (kind, rows) as constants, as DEFINE_ROWS_DISPATCH does for the others. */
static void row_dots_avx2_dispatch(int kind, const uint8_t *w_row, int64_t blocks, const float *xp,
                                   const float *xsum, int64_t xsum_stride, int64_t K, int rows, float *dot) {
    if (kind == 0) {
        AVX2_KIND_SWITCH(0)
    } else {
        AVX2_KIND_SWITCH(1)
    }
}

/* COLS_PER_TILE output rows at once against one or two rows of x (decode batches of one or two
 * sequences): with one output row, its single accumulator's fma latency bounds the loop; four
 * independent ones hide it, and x's loads are shared. */
#define COLS_PER_TILE 4
static inline __attribute__((always_inline)) void cols_dots_avx2(int kind, const uint8_t *w, int64_t row_bytes,
                                                                 int64_t blocks, const float *xp, const float *xsum,
                                                                 int64_t xsum_stride, int64_t K, int rows,
                                                                 float dot[COLS_PER_TILE][2]) {
    __m256 acc[COLS_PER_TILE][2], d8[COLS_PER_TILE];
    int64_t base = 0;
    for (int c = 0; c < COLS_PER_TILE; c++) acc[c][0] = acc[c][1] = d8[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        /* Unrolled, so that every column's accumulators and scales stay in registers: rolled,
         * GCC kept them on the stack (3.2 ns a block at one row; 2.5 unrolled). */
#pragma GCC unroll 4
        for (int c = 0; c < COLS_PER_TILE; c++) {
            const uint8_t *w_row = w + c * row_bytes;
            if (kind == 0 && b % 4 == 0) { /* the next tile's row, a cache line at a time: its
                                             * bytes arrive while this tile computes */
                const uint8_t *next_row = w_row + COLS_PER_TILE * row_bytes;
                _mm_prefetch((const char *)(next_row + b * 16), WEIGHT_HINT);
                if (b % 32 == 0) {
                    _mm_prefetch((const char *)(next_row + K / 2 + b * 2), WEIGHT_HINT);
                    _mm_prefetch((const char *)(next_row + K / 2 + (blocks + b) * 2), WEIGHT_HINT);
                }
            }
            if (kind == 0 && b % 8 == 0)
                base = group_start_avx2(w_row, K, blocks, b, xsum, xsum_stride, rows, &d8[c], acc[c]);
            __m256 q[4];
            q_values_avx2(kind, block_qs_avx2(kind, w_row, b), q);
            const __m256 d = block_scale_avx2(kind, w_row, b, d8[c], base);
            for (int r = 0; r < rows; r++) acc[c][r] = block_dot_avx2(q, d, xp + r * K + b * QK, acc[c][r]);
        }
    }
    for (int c = 0; c < COLS_PER_TILE; c++)
        for (int r = 0; r < rows; r++) dot[c][r] = hsum_avx2(acc[c][r]);
}

/* The avx2 route (fp32 x, no AVX-512): tiles of COLS_PER_TILE output rows at one or two rows of
 * x (Q4_1), else of ROWS_PER_TILE rows of x. */
void pd_quant_gemm_f32(int kind, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
                       int y_is_bf16, int threads) {
    const int64_t blocks = K / QK, row_bytes = blocks * block_bytes(kind), xsum_stride = (blocks + 7) / 8 * 8;
    float *xp = (float *)malloc((size_t)(M * K) * sizeof(float));
    float *xsum = (float *)calloc((size_t)(M * xsum_stride), sizeof(float));
    prepare_x_avx2(kind, x, M, K, xp);
    for (int64_t r = 0; r < M; r++) /* x's sum over each block (Q4_1's minima multiply it) */
        for (int64_t b = 0; b < blocks; b++) {
            float s = 0.0f;
            for (int j = 0; j < QK; j++) s += x[r * K + b * QK + j];
            xsum[r * xsum_stride + b] = s;
        }
    if (M <= 2 && kind == 0) {
        const int64_t tiles = (N + COLS_PER_TILE - 1) / COLS_PER_TILE;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t n0 = tile * COLS_PER_TILE;
            float dot[COLS_PER_TILE][2];
            if (n0 + COLS_PER_TILE <= N) {
                if (M == 1)
                    cols_dots_avx2(kind, w + n0 * row_bytes, row_bytes, blocks, xp, xsum, xsum_stride, K, 1, dot);
                else
                    cols_dots_avx2(kind, w + n0 * row_bytes, row_bytes, blocks, xp, xsum, xsum_stride, K, 2, dot);
            } else { /* the last, partial tile: one output row at a time, summed alike */
                for (int64_t n = n0; n < N; n++) {
                    float one[ROWS_PER_TILE];
                    row_dots_avx2_dispatch(kind, w + n * row_bytes, blocks, xp, xsum, xsum_stride, K, (int)M, one);
                    for (int64_t r = 0; r < M; r++) dot[n - n0][r] = one[r];
                }
            }
            for (int64_t n = n0; n < N && n < n0 + COLS_PER_TILE; n++)
                for (int64_t r = 0; r < M; r++) put_f32(y, y_is_bf16, r * N + n, dot[n - n0][r]);
        }
    } else {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t n = 0; n < N; n++) {
            float dot[ROWS_PER_TILE];
            for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_TILE) {
                int rows = (int)(M - m0 < ROWS_PER_TILE ? M - m0 : ROWS_PER_TILE);
                row_dots_avx2_dispatch(kind, w + n * row_bytes, blocks, xp + m0 * K, xsum + m0 * xsum_stride,
                                       xsum_stride, K, rows, dot);
                for (int r = 0; r < rows; r++) put_f32(y, y_is_bf16, (m0 + r) * N + n, dot[r]);
            }
        }
    }
    free(xp);
    free(xsum);
}
#endif
