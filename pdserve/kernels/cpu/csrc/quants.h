/*
 * What the row-major quantized kernels share between their portable C (quants.c, quants_a8.c)
 * and their x86 twins (arch/x86/quants.c, arch/x86/quants_a8.c): where a block of a row is, the
 * row tiles' dispatch, and the functions one file calls in the other. Each kernel an ISA speeds
 * up is a pair with one signature: NAME in the arch file, NAME_generic (plain C) in the
 * portable one; arch_fallback.h makes NAME_generic the NAME of a build with no native NAME.
 * Block layouts: quants.c's header.
 */
#ifndef PDSERVE_QUANTS_H
#define PDSERVE_QUANTS_H
#include <stdint.h>
#include "arch_fallback.h"
#include "blocks.h"

#define ROWS_PER_TILE 8 /* rows of x one pass over a weight row serves (fp32 and bf16 routes) */

/* Where block b of a row is: Q4_1's nibbles, scale and minimum live in three regions of the row
 * (quants.c's header); a Q8_0 block is contiguous (d, then qs). */
typedef struct {
    const uint8_t *qs;
    uint16_t d, m;
} BlockRef;

static inline BlockRef block_ref(int kind, const uint8_t *w_row, int64_t K, int64_t b) {
    BlockRef ref;
    if (kind == 0) {
        const uint16_t *d = (const uint16_t *)(w_row + K / 2);
        ref.qs = w_row + b * 16;
        ref.d = d[b];
        ref.m = d[K / QK + b];
    } else {
        const uint8_t *block = w_row + b * Q8_0_BYTES;
        ref.qs = block + 2;
        ref.d = *(const uint16_t *)block;
        ref.m = 0;
    }
    return ref;
}

/* Block b of row n, of any kind: an interleaved (x16) row's block is gathered into `gathered`
 * (QK bytes) and referred to as its plain kind's (KIND_Q4_1 / KIND_Q8_0). */
static inline BlockRef block_of(int kind, const uint8_t *w, const uint8_t *w_row, int64_t K, int64_t n, int64_t b,
                                uint8_t *gathered) {
    if (!is_x16(kind)) return block_ref(kind, w_row, K, b);
    BlockRef ref;
    x16_block(kind, w, K, n, b, gathered, &ref.d, &ref.m);
    ref.qs = gathered;
    return ref;
}

/* NAME(kind, ...): FN with kind and rows (1..ROWS_PER_TILE) as constants, so that the compiler
 * unrolls FN's row loops and keeps its accumulators in registers. */
#define ROWS_CASE(FN, KIND, ROWS) \
    case ROWS:                    \
        FN(KIND, w_row, blocks, x, K, ROWS, dot); \
        break;
#define KIND_SWITCH(FN, KIND)                                                          \
    switch (rows) {                                                                    \
        ROWS_CASE(FN, KIND, 1) ROWS_CASE(FN, KIND, 2) ROWS_CASE(FN, KIND, 3) ROWS_CASE(FN, KIND, 4) \
        ROWS_CASE(FN, KIND, 5) ROWS_CASE(FN, KIND, 6) ROWS_CASE(FN, KIND, 7) ROWS_CASE(FN, KIND, 8) \
    }
#define DEFINE_ROWS_DISPATCH(NAME, FN, X_TYPE)                                                     \
    static void NAME(int kind, const uint8_t *w_row, int64_t blocks, const X_TYPE *x, int64_t K, \
                     int rows, float *dot) {                                                     \
        if (kind == 0) {                                                                         \
            KIND_SWITCH(FN, 0)                                                                   \
        } else {                                                                                 \
            KIND_SWITCH(FN, 1)                                                                   \
        }                                                                                        \
    }

/* quants.c / arch/x86/quants.c: y[M, N] = x[M, K] @ W^T over row-major blocks (kind 0: Q4_1, 1:
 * Q8_0), x fp32 or bf16, y fp32 or bf16 (y_is_bf16); pd_quant_matmul's contract (quants.c). */
void pd_quant_gemm_f32(int kind, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
                       int y_is_bf16, int threads);
void pd_quant_gemm_f32_generic(int kind, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                               void *y, int y_is_bf16, int threads);
void pd_quant_gemm_bf16(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
                        int y_is_bf16, int threads);
void pd_quant_gemm_bf16_generic(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                                void *y, int y_is_bf16, int threads);
/* pd_quant_dequant (kernels.h) and its plain C */
void pd_quant_dequant_generic(int kind, const uint8_t *w, int64_t K, const int64_t *rows, int64_t count, void *out,
                              int out_is_bf16, int threads);

/* quants_a8.c / arch/x86/quants_a8.c: x [M, K] (bf16 or fp32) quantized per block of 32 into q
 * [M, K] int8 and d, s [M, stride] fp32; then y[M, N] over row-major blocks and that q (which the
 * kernel may reorder in place). Returns 0, or -1 when a buffer could not be allocated. */
void pd_quant_a8_quantize(const void *x, int x_is_bf16, int64_t M, int64_t K, int8_t *q, float *d, float *s,
                          int64_t stride);
void pd_quant_a8_quantize_generic(const void *x, int x_is_bf16, int64_t M, int64_t K, int8_t *q, float *d,
                                  float *s, int64_t stride);
int pd_quant_a8_gemm(int kind, int8_t *q, const float *d, const float *s, int64_t stride, int64_t M, int64_t K,
                     const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads);
int pd_quant_a8_gemm_generic(int kind, int8_t *q, const float *d, const float *s, int64_t stride, int64_t M,
                             int64_t K, const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads);
#endif
