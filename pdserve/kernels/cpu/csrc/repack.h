/*
 * What the kernels over weights repacked 16 rows at a time share between their portable C
 * (repack_a8.c, repack_bf16.c) and their x86 twins (arch/x86/repack_a8.c, arch/x86/repack_bf16.c):
 * the layout's constants and the functions one file calls in the other. Each kernel an ISA speeds
 * up is a pair with one signature, NAME (arch file) and NAME_generic (plain C); arch_fallback.h
 * makes NAME_generic the NAME of a build with no native NAME. The layout: repack_a8.c's header.
 */
#ifndef PDSERVE_REPACK_H
#define PDSERVE_REPACK_H
#include <stdint.h>
#include "arch_fallback.h"
#include "blocks.h"

/* x quantized (quants_a8.c): q [M, K] natural order, d and s [M, stride], and for Q8_0
 * each block's starting sum, -128 * sum(q) ([M, blocks]). */
typedef struct {
    const int8_t *q;
    const float *d, *s;
    const int32_t *start;
    int64_t K, stride;
} X16In;

/* repack_a8.c / arch/x86/repack_a8.c: y[M, N] = x @ W^T for W interleaved (Q4_1_X16, Q8_0_X16,
 * Q4_0_X16, Q5_0_X16, Q5_1_X16), x quantized
 * to int8 by quants_a8.c (pd_quant_matmul_a8 calls pd_repack_a8_matmul). */
int pd_repack_a8_matmul(int kind, const int8_t *q, const float *d, const float *s, int64_t stride, int64_t M,
                        int64_t K, const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads);
void pd_repack_a8_gemm(int kind, X16In x, int64_t M, const uint8_t *w, int64_t N, void *y, int y_is_bf16,
                       int threads);
void pd_repack_a8_gemm_generic(int kind, X16In x, int64_t M, const uint8_t *w, int64_t N, void *y, int y_is_bf16,
                               int threads);

/* repack_a8.c: rows of an interleaved GGUF kind (Q4_0_X16 ...) decoded; pd_quant_dequant's
 * contract (quants.c's pd_quant_dequant_generic). */
void pd_x16_gguf_dequant(int kind, const uint8_t *w, int64_t K, const int64_t *rows, int64_t count, void *out,
                         int out_is_bf16, int threads);

#define Q8_0_OFFSET 128.0f /* u = q + 128 */

/* Where Q4_1's pair p (0-3) of word i starts in a block of xs (prepare_x's order): p = 0 low
 * nibbles of bytes (0, 2), 1 low of (1, 3), 2 high of (0, 2), 3 high of (1, 3). */
static inline int pair_at(int i, int p) { return 8 * i + 2 * p; }

/* repack_bf16.c / arch/x86/repack_bf16.c: y[M, N] = x @ W^T for W Q4_1_X16 or Q8_0_X16 and x bf16
 * (pd_quant_matmul calls pd_repack_bf16_matmul); the kernels read Q4_1's x reordered into xs and
 * each block's x summed in xsum [M, blocks] (repack_bf16.c's prepare_x), Q8_0's x as it is. */
int pd_repack_bf16_matmul(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
                          int y_is_bf16, int threads);
void pd_repack_bf16_gemm(int kind, const uint16_t *x, const uint16_t *xs, const float *xsum, int64_t M, int64_t K,
                         const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads);
void pd_repack_bf16_gemm_generic(int kind, const uint16_t *x, const uint16_t *xs, const float *xsum, int64_t M,
                                 int64_t K, const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads);
#endif
