/*
 * The kinds of GGUF blocks held exactly as the file stores them, byte for byte (quants_k.c's
 * header says why), and what their portable C (quants_k.c) and x86 twins (arch/x86/quants_k.c)
 * share: where a block of a row is, and one block of 32 weights decoded to unsigned integers and
 * per-16 scales and minima.
 *
 * Every kind's 32 weights (a "sub-block": Q4_0/Q5_0/Q5_1's block, a K-quant super-block's
 * s-th 32) read as
 *     w[j] = d[h] * q[j] + m[h],   h = j / 16,   q[j] unsigned (0-15, 0-31 or 0-63)
 * with d and m exact fp32 products of the file's fp16 and integer scales:
 *   Q4_0: d,         m = -8 d         (ggml: d * (q - 8))
 *   Q5_0: d,         m = -16 d        (d * (q - 16)), the 5th bit of q in qh
 *   Q5_1: d,         m                (d * q + m)
 *   Q4_K: d sc[s],   m = -dmin mn[s]  (6-bit sc, mn per 32: ggml's get_scale_min_k4)
 *   Q5_K: as Q4_K, the 5th bit in qh
 *   Q6_K: d sc[16 h'], m = -32 d sc   (int8 sc per 16 weights)
 * so that fmaf(d, q, m) is the value ggml and the gguf package dequantize to, bit for bit: each of
 * their formulas is one rounding of the same exact number (d sc, dmin mn and 32 d sc are exact in
 * fp32: at most 19 significant bits).
 */
#ifndef PDSERVE_QUANTS_K_H
#define PDSERVE_QUANTS_K_H
#include <stdint.h>
#include <string.h>
#include "arch_fallback.h"
#include "blocks.h"

/* Bytes of a row of K weights. */
static inline int64_t k_row_bytes(int kind, int64_t K) { return K / k_block_weights(kind) * k_block_bytes(kind); }

/* One sub-block decoded: w[j] = d[j / 16] * q[j] + m[j / 16]. */
typedef struct {
    uint8_t q[32];
    float d[2], m[2];
} SubBlock;

static inline uint16_t k_u16(const uint8_t *at) {
    uint16_t v;
    memcpy(&v, at, 2);
    return v;
}

/* ggml's get_scale_min_k4: sub-block s's 6-bit scale and minimum from a K-quant's 12 bytes. */
static inline void k_scale_min(int s, const uint8_t *scales, int *sc, int *mn) {
    if (s < 4) {
        *sc = scales[s] & 63;
        *mn = scales[s + 4] & 63;
    } else {
        *sc = (scales[s + 4] & 0x0F) | ((scales[s - 4] >> 6) << 4);
        *mn = (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4);
    }
}

/* One block of 32 of Q4_0, Q5_0 or Q5_1 (d, (m), (qh), qs). */
static inline void k_small_block(int kind, const uint8_t *block, SubBlock *out) {
    const float d = fp16_to_fp32(k_u16(block));
    float m = -8.0f * d;
    const uint8_t *qs = block + 2;
    uint32_t qh = 0;
    if (kind == KIND_Q5_0) {
        memcpy(&qh, block + 2, 4);
        qs = block + 6;
        m = -16.0f * d;
    } else if (kind == KIND_Q5_1) {
        m = fp16_to_fp32(k_u16(block + 2));
        memcpy(&qh, block + 4, 4);
        qs = block + 8;
    }
    for (int j = 0; j < 16; j++) {
        out->q[j] = (uint8_t)((qs[j] & 15) | (((qh >> j) & 1) << 4));
        out->q[j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
    out->d[0] = out->d[1] = d;
    out->m[0] = out->m[1] = m;
}

/* Sub-block s (0 .. K/32 - 1) of a row of `kind`. */
static inline void k_sub_block(int kind, const uint8_t *row, int64_t s, SubBlock *out) {
    if (kind <= KIND_Q5_1) { /* one block of 32 */
        k_small_block(kind, row + s * k_block_bytes(kind), out);
        return;
    }
    const uint8_t *block = row + (s / 8) * k_block_bytes(kind);
    const int sub = (int)(s % 8);
    if (kind == KIND_Q6_K) {
        const uint8_t *ql = block, *qh = block + 128;
        const int8_t *scales = (const int8_t *)(block + 192);
        const float d = fp16_to_fp32(k_u16(block + 208));
        const int half = sub / 4, t = sub % 4; /* ggml's 128-weight half, and which of its q1..q4 */
        const uint8_t *low = ql + 64 * half + (t & 1) * 32, *high = qh + 32 * half;
        const int low_shift = (t >> 1) * 4, high_shift = 2 * t;
        for (int j = 0; j < 32; j++)
            out->q[j] = (uint8_t)(((low[j] >> low_shift) & 15) | (((high[j] >> high_shift) & 3) << 4));
        for (int h = 0; h < 2; h++) {
            out->d[h] = d * (float)scales[8 * half + 2 * t + h];
            out->m[h] = -32.0f * out->d[h];
        }
        return;
    }
    /* Q4_K, Q5_K: 32 bytes of qs per pair of sub-blocks (low nibbles the even one's, high the odd
     * one's); Q5_K's 5th bit of weight j of sub-block s is bit s of qh[j]. */
    int sc, mn;
    k_scale_min(sub, block + 4, &sc, &mn);
    const float d = fp16_to_fp32(k_u16(block)) * (float)sc;
    const float m = -(fp16_to_fp32(k_u16(block + 2)) * (float)mn);
    const uint8_t *qs = block + (kind == KIND_Q5_K ? 48 : 16) + 32 * (sub / 2);
    const int shift = (sub & 1) * 4;
    for (int j = 0; j < 32; j++) out->q[j] = (uint8_t)((qs[j] >> shift) & 15);
    if (kind == KIND_Q5_K)
        for (int j = 0; j < 32; j++) out->q[j] |= (uint8_t)(((block[16 + j] >> sub) & 1) << 4);
    out->d[0] = out->d[1] = d;
    out->m[0] = out->m[1] = m;
}

/* quants_k.c, quants_k_a8.c and their arch/x86/ twins: y[M, N] = x[M, K] @ W^T over rows of `kind` (x fp32; a bf16
 * x is widened first where no bf16 route runs), the dequantization, and the int8-activation
 * product (x quantized by quants_a8.c: q [M, K], d and s [M, stride]). Contracts at
 * quants_k.c's entry points. */
void pd_quant_k_gemm_f32(int kind, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
                         int y_is_bf16, int threads);
void pd_quant_k_gemm_f32_generic(int kind, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                                 void *y, int y_is_bf16, int threads);
void pd_quant_k_gemm_bf16(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
                          int y_is_bf16, int threads);
void pd_quant_k_gemm_bf16_generic(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                                  void *y, int y_is_bf16, int threads);
void pd_quant_k_dequant(int kind, const uint8_t *w, int64_t K, const int64_t *rows, int64_t count, void *out,
                        int out_is_bf16, int threads);
void pd_quant_k_dequant_generic(int kind, const uint8_t *w, int64_t K, const int64_t *rows, int64_t count, void *out,
                                int out_is_bf16, int threads);
int pd_quant_k_a8_gemm(int kind, const int8_t *q, const float *d, int64_t stride, int64_t M, int64_t K,
                       const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads);
int pd_quant_k_a8_gemm_generic(int kind, const int8_t *q, const float *d, int64_t stride, int64_t M, int64_t K,
                               const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads);
#endif
