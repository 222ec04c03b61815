/*
 * Weight-only quantized matmuls for the CPU engine: y[M, N] = x[M, K] @ W[N, K]^T with W kept
 * in GGUF's own blocks of 32 weights along K, decoded in registers and never materialised.
 *
 * Two layouts of GGUF's blocks:
 *   Q4_1: w[j] = d * q[j] + m per 32 weights, with q[j] = qs[j] & 15 and q[j + 16] = qs[j] >> 4
 *         (j < 16): GGUF's bytes (fp16 d, fp16 m, 16 qs: 20 bytes / 32 weights) regrouped per
 *         row as [all qs: K / 2 bytes][all d: K / 32 fp16][all m: K / 32 fp16], so that the
 *         nibbles of consecutive blocks, and 16 blocks' scales, are each one vector load;
 *   Q8_0: GGUF's own blocks, fp16 d then int8 qs[32] (34 bytes / 32 weights), w[j] = d * qs[j].
 * Q4_0 and Q4_K are converted to Q4_1 at load (the model loader's gguf_blocks.py).
 *
 * Three routes, each taken for every batch size it serves, so that a row's result does not
 * depend on what it is batched with:
 *   lut:  bf16 activations and Q4_1 (AVX512-BF16 CPUs): the nibbles of two blocks become their
 *         bf16 values (exact: 0-15) through one vpermw each, one vdpbf16ps per half multiplies
 *         them by x, and d and m are applied per block in fp32 (m through x's block sums): exact
 *         weights, about half the instructions of decoding to fp32; up to LUT_ROWS_PER_TILE
 *         rows of x share a decode;
 *   bf16: bf16 activations and Q8_0 (AVX512-BF16 CPUs): the decoded block rounded to bf16 (as
 *         a dense bf16 copy of the same weights holds it), then one vdpbf16ps (32
 *         multiply-adds) per row of x;
 *   fp32: x in fp32 (a bf16 x widened exactly on other CPUs), each block decoded once (one fma:
 *         d * q + m) and used against up to ROWS_PER_TILE rows with fp32 fmas: exact weights.
 * bf16 activations used to switch from the fp32 route to the bf16 one at four rows of x; a
 * row's result then depended on its batch. The LM head (Q8_0) at eight rows: 2.6-2.8 ms on the
 * bf16 route, 5-6 on the fp32 one (one Zen 5 core).
 * A decode step at batch 1-8 reads every weight once, so the point is to stream 5 (Q4_1) or 8.5
 * (Q8_0) bits a weight instead of 16 (bf16) and keep the decode cheap enough to stay near the
 * memory floor. Rows of W are split between OpenMP threads.
 *
 * On CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2/3, older Intel), fp32 activations take the
 * avx2 route: per block the nibbles (or int8s) become 4 x 8 fp32 q values lane-wise, without
 * shuffles, against x permuted once per call to match (see prepare_x_avx2); their dot with x is
 * scaled by d once per block, and m is applied through x's block sums (sum_j (d q_j + m) x_j =
 * d (q . x) + m sum x): two multiply-adds a weight fewer than decoding d q + m first.
 *
 * This file holds the entry points and the plain C that runs on any CPU; the AVX-512,
 * AVX512-BF16 and AVX2 routes are arch/x86/quants.c's. Each is the native twin of a _generic
 * function here, with its signature (quants.h); a build without one runs the twin
 * (arch_fallback.h). Built at first use with the host compiler and -march=native
 * (pdserve/kernels/cpu/quant.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "isa.h"
#include "bf16.h"
#include "blocks.h"
#include "kernels.h"
#include "quants.h"
#include "quants_k.h"
#include "repack.h"
#include <omp.h>

/* bf16 x [M, K] widened to fp32 (exactly), into a buffer the caller frees. */
static float *widen(const uint16_t *x, int64_t count) {
    float *out = (float *)malloc((size_t)count * sizeof(float));
    for (int64_t i = 0; i < count; i++) out[i] = bf16_to_fp32(x[i]);
    return out;
}

static inline void decode_scalar(int kind, BlockRef ref, float *w) {
    float d = fp16_to_fp32(ref.d);
    if (kind == 0) {
        float m = fp16_to_fp32(ref.m);
        for (int j = 0; j < 16; j++) {
            w[j] = (float)(ref.qs[j] & 15) * d + m;
            w[j + 16] = (float)(ref.qs[j] >> 4) * d + m;
        }
    } else {
        const int8_t *qs = (const int8_t *)ref.qs;
        for (int j = 0; j < QK; j++) w[j] = (float)qs[j] * d;
    }
}

/* One output row n against `rows` (<= ROWS_PER_TILE) rows of x: dot[r] = x[r] . W[n], a block
 * decoded at a time. Inlined into a switch on constant (kind, rows). */
static inline __attribute__((always_inline)) void row_dots_plain(int kind, const uint8_t *w_row, int64_t blocks,
                                                                 const float *x, int64_t K, int rows, float *dot) {
    float w[QK];
    for (int r = 0; r < rows; r++) dot[r] = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        decode_scalar(kind, block_ref(kind, w_row, K, b), w);
        for (int r = 0; r < rows; r++) {
            const float *xb = x + r * K + b * QK;
            float s = 0.0f;
            for (int j = 0; j < QK; j++) s += w[j] * xb[j];
            dot[r] += s;
        }
    }
}

DEFINE_ROWS_DISPATCH(row_dots_plain_dispatch, row_dots_plain, float)

/* The fp32 route in plain C: output rows split between threads, tiles of ROWS_PER_TILE rows of x. */
void pd_quant_gemm_f32_generic(int kind, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                               void *y, int y_is_bf16, int threads) {
    const int64_t blocks = K / QK;
    const int64_t row_bytes = blocks * block_bytes(kind);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        float dot[ROWS_PER_TILE];
        for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_TILE) {
            int rows = (int)(M - m0 < ROWS_PER_TILE ? M - m0 : ROWS_PER_TILE);
            row_dots_plain_dispatch(kind, w + n * row_bytes, blocks, x + m0 * K, K, rows, dot);
            for (int r = 0; r < rows; r++) put_f32(y, y_is_bf16, (m0 + r) * N + n, dot[r]);
        }
    }
}

/* bf16 x where no bf16 route runs (no AVX512-BF16): widened exactly, then the fp32 route. */
void pd_quant_gemm_bf16_generic(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                                void *y, int y_is_bf16, int threads) {
    float *xf = widen(x, M * K);
    pd_quant_gemm_f32(kind, xf, M, K, w, N, y, y_is_bf16, threads);
    free(xf);
}

/*
 * y[M, N] = x[M, K] @ W^T. kind 0: Q4_1 blocks, 1: Q8_0 blocks; W is [N, K / 32] blocks, row-major;
 * kinds 2 and 3 (Q4_1_X16, Q8_0_X16) the same interleaved by 16 rows, with bf16 x only; 4-9 as GGUF stores
 * them (quants_k.h); never 10-13 (interleaved GGUF blocks: pd_quant_matmul_a8). x and y are bf16 (flag 1)
 * or fp32 (flag 0), contiguous. K must be a multiple of 32. Returns 0; -1 when a buffer could
 * not be allocated, -2 for a kind and x it does not take (nothing written then).
 */
int pd_quant_matmul(int kind, const void *x, int x_is_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                    void *y, int y_is_bf16, int threads) {
    if (is_k_kind(kind)) { /* held as GGUF stores them (quants_k.c) */
        if (x_is_bf16)
            pd_quant_k_gemm_bf16(kind, (const uint16_t *)x, M, K, w, N, y, y_is_bf16, threads);
        else
            pd_quant_k_gemm_f32(kind, (const float *)x, M, K, w, N, y, y_is_bf16, threads);
        return 0;
    }
    if (is_x16_gguf(kind)) return -2; /* interleaved GGUF blocks: against int8 x only (repack_a8.c) */
    if (is_x16(kind)) /* interleaved rows: against bf16 x only (repack_bf16.c) */
        return x_is_bf16 ? pd_repack_bf16_matmul(kind, (const uint16_t *)x, M, K, w, N, y, y_is_bf16, threads) : -2;
    if (x_is_bf16)
        pd_quant_gemm_bf16(kind, (const uint16_t *)x, M, K, w, N, y, y_is_bf16, threads);
    else
        pd_quant_gemm_f32(kind, (const float *)x, M, K, w, N, y, y_is_bf16, threads);
    return 0;
}

/*
 * out[i, :] = W[rows[i], :] decoded (rows == NULL: every row in order), of any kind (an interleaved
 * row's blocks gathered first, block_of). For the embedding lookup
 * from a quantized table, and for prefill chunks, where one decode feeds a dense GEMM: a block a
 * step in 512-bit registers where the CPU has them (SmolLM2's 120 layer matrices to bf16 on one
 * Zen 5 core: 142 ms a block at a time in scalar code into fresh tensors, 85 ms so, 12 ms
 * into a reused buffer: arch/x86/quants.c's pd_quant_dequant), else in plain C (this one).
 */
void pd_quant_dequant_generic(int kind, const uint8_t *w, int64_t K, const int64_t *rows, int64_t count, void *out,
                              int out_is_bf16, int threads) {
    if (is_k_kind(kind)) {
        pd_quant_k_dequant(kind, w, K, rows, count, out, out_is_bf16, threads);
        return;
    }
    if (is_x16_gguf(kind)) {
        pd_x16_gguf_dequant(kind, w, K, rows, count, out, out_is_bf16, threads);
        return;
    }
    const int64_t blocks = K / QK;
    const int64_t row_bytes = blocks * block_bytes(kind);
    const int plain = plain_kind(kind);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && count > 64)
    for (int64_t i = 0; i < count; i++) {
        const int64_t n = rows ? rows[i] : i;
        const uint8_t *w_row = w + n * row_bytes;
        uint8_t gathered[QK]; /* an interleaved row's block, as its plain kind holds it */
        float buf[QK];
        for (int64_t b = 0; b < blocks; b++) {
            decode_scalar(plain, block_of(kind, w, w_row, K, n, b, gathered), buf);
            for (int j = 0; j < QK; j++) put_f32(out, out_is_bf16, i * K + b * QK + j, buf[j]);
        }
    }
}
