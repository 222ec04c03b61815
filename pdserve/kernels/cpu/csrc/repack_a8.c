/*
 * The int8-activation matmuls over weights interleaved 16 rows at a time (kinds Q4_1_X16,
 * Q8_0_X16, Q4_0_X16, Q5_0_X16, Q5_1_X16 and Q4_K_X16, made at load by pdserve/kernels/cpu/quant.py's interleave_rows for
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
 *   Q4_0_X16, Q5_0_X16, Q5_1_X16 (288, 352, 384 bytes; GGUF's blocks of 32, as llama.cpp's
 *     "_M" files hold a matrix whose rows are not whole K-quant super-blocks: SmolLM2's and
 *     Qwen2.5-0.5B's Q4_K fall back to Q5_0): the 4 nibble vectors as Q4_1_X16's (GGUF's qs in
 *     the same order), then for Q5_0 / Q5_1 a vector whose lane r is row r's 32 fifth bits (qh),
 *     then the 16 rows' fp16 d, then (Q5_1) their fp16 m.
 *   Q4_K_X16 (2304 bytes, a chunk a super-block of 256 inputs): 32 vectors of the 16 rows' qs (as
 *     above, 4 bytes of each row a vector), 3 of their 12 bytes of packed 6-bit scales and
 *     minima, then the 16 rows' fp16 d, then their fp16 dmin. A sub-block s's weights are
 *     d sc[s] q - dmin m[s] (ggml's get_scale_min_k4), so a sub-block runs as Q4_1's block with
 *     scale d sc[s] and minimum -dmin m[s].
 * The bytes are the blocks' own, moved: the matrix takes exactly its plain layout's memory.
 * Q8_0's +128 is taken back by starting each block's int32 lanes at -128 times the sum of x's
 * 32 int8 there (the same integer as the signed dot); Q4_0's and Q5_0's offsets (w = d (q - 8),
 * d (q - 16)) the same way, with -8 and -16.
 *
 * Per block and row of x, in this order for every (weight row, row of x) pair, in the vector
 * kernel and in the plain loop alike (so both give the same bits, and a row's result does not
 * depend on its batch): acc = fma(float(dot), dw * d, acc); for Q4_1 and Q5_1 also
 * mins = fma(m, s, mins), y = acc + mins; for Q4_K (a block: a sub-block of 32) the minimum
 * into the same sum, acc = fma(m, s, acc) (fewer registers), y = acc.
 *
 * Why the GGUF kinds too: held as the file stores them (quants_k_a8.c), a prefill chunk decoded
 * them to bf16 for torch's GEMM (bf16 arithmetic: half of vpdpbusd's per instruction), and at 8
 * rows of x their 16-row transposes cost what the dots do. Interleaved, a fifth bit is one
 * vpermd of a 16-entry table away (FIFTH_BITS in arch/x86/repack_a8.c).
 *
 * This file holds the entry, the route query and the plain loop (CPUs without AVX512-VNNI: correct,
 * slow); the vpdpbusd kernel is arch/x86/repack_a8.c's pd_repack_a8_gemm, the native twin of
 * pd_repack_a8_gemm_generic here (repack.h, arch_fallback.h).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "isa.h"
#include "bf16.h"
#include "blocks.h"
#include "kernels.h"
#include "repack.h"
#include "quants_k.h"
#include <omp.h>

/* Block b of weight row n of an interleaved GGUF kind (Q4_0_X16 ...), as the file held it, into
 * `block` (its plain kind's k_block_bytes; a super-block for Q4_K_X16). */
static void x16_gguf_block(int kind, const uint8_t *w, int64_t K, int64_t n, int64_t b, uint8_t *block) {
    const int64_t blocks = K / x16_block_weights(kind), lane = n % X16;
    const int bytes = block_bytes(kind);
    const uint8_t *chunk = w + ((n / X16) * blocks + b) * X16 * bytes;
    if (kind == KIND_Q4_K_X16) { /* d, dmin, 12 bytes of scales, 128 of qs */
        const uint8_t *scales = chunk + 32 * 64;
        memcpy(block, scales + 192 + 2 * lane, 2);
        memcpy(block + 2, scales + 192 + 2 * X16 + 2 * lane, 2);
        for (int i = 0; i < 3; i++) memcpy(block + 4 + 4 * i, scales + 64 * i + 4 * lane, 4);
        for (int i = 0; i < 32; i++) memcpy(block + 16 + 4 * i, chunk + 64 * i + 4 * lane, 4);
        return;
    }
    const int has_qh = kind != KIND_Q4_0_X16;
    const uint8_t *scales = chunk + 256 + 64 * has_qh;
    memcpy(block, scales + 2 * lane, 2); /* d */
    int at = 2;
    if (kind == KIND_Q5_1_X16) {
        memcpy(block + at, scales + 2 * X16 + 2 * lane, 2); /* m */
        at += 2;
    }
    if (has_qh) {
        memcpy(block + at, chunk + 256 + 4 * lane, 4);
        at += 4;
    }
    for (int i = 0; i < 4; i++) memcpy(block + at + 4 * i, chunk + 64 * i + 4 * lane, 4);
}

/* Sub-block s (of 32 weights) of weight row n of an interleaved GGUF kind, decoded as quants_k.h
 * decodes the file's bytes. */
static void x16_gguf_sub_block(int kind, const uint8_t *w, int64_t K, int64_t n, int64_t s, SubBlock *sb) {
    uint8_t block[256]; /* room for any kind's block (k_sub_block reads by kind) */
    const int per = x16_block_weights(kind) / QK;
    x16_gguf_block(kind, w, K, n, s / per, block);
    k_sub_block(x16_gguf_plain(kind), block, s % per, sb);
}

/* What Q4_0's and Q5_0's stored integers are above the weights' (8, 16); Q8_0_X16's +128. */
static inline int x16_offset(int kind) {
    return kind == KIND_Q8_0_X16 ? 128 : kind == KIND_Q4_0_X16 ? 8 : kind == KIND_Q5_0_X16 ? 16 : 0;
}

/* The plain loop of the interleaved GGUF kinds: each block put back as the file held it and read
 * as quants_k.h reads it, the sums in the header's order. */
static void gguf_gemm_generic(int kind, X16In x, int64_t M, const uint8_t *w, int64_t N, void *y, int y_is_bf16,
                              int threads) {
    const int64_t blocks = x.K / QK;
    const int offset = x16_offset(kind), has_min = kind == KIND_Q5_1_X16 || kind == KIND_Q4_K_X16;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++)
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.0f, mins = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                SubBlock sb;
                x16_gguf_sub_block(kind, w, x.K, n, b, &sb);
                const int8_t *xq = x.q + r * x.K + b * QK;
                int32_t dot = 0;
                for (int j = 0; j < QK; j++) dot += (sb.q[j] - offset) * xq[j];
                acc = fmaf((float)dot, sb.d[0] * x.d[r * x.stride + b], acc);
                if (kind == KIND_Q4_K_X16) /* the minima into the same sum (Q4_K's kernel) */
                    acc = fmaf(sb.m[0], x.s[r * x.stride + b], acc);
                else if (has_min)
                    mins = fmaf(sb.m[0], x.s[r * x.stride + b], mins);
            }
            put_f32(y, y_is_bf16, r * N + n, has_min ? acc + mins : acc);
        }
}

/* The plain loop: one (weight row, row of x) at a time through x16_block, in the header's order. */
void pd_repack_a8_gemm_generic(int kind, X16In x, int64_t M, const uint8_t *w, int64_t N, void *y, int y_is_bf16,
                               int threads) {
    if (is_x16_gguf(kind)) {
        gguf_gemm_generic(kind, x, M, w, N, y, y_is_bf16, threads);
        return;
    }
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

/* y[M, N] = x @ W^T for W of an interleaved kind (N a multiple of 16) and x quantized by
 * quants_a8.c (q [M, K], d and s [M, stride]). Returns 0, or -1 when a buffer could not be
 * allocated. */
int pd_repack_a8_matmul(int kind, const int8_t *q, const float *d, const float *s, int64_t stride, int64_t M,
                        int64_t K, const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads) {
    const int64_t blocks = K / QK;
    const int offset = x16_offset(kind);
    int32_t *start = NULL;
    if (offset) {
        start = (int32_t *)malloc((size_t)(M * blocks) * sizeof(int32_t));
        if (start == NULL) return -1;
        for (int64_t i = 0; i < M * blocks; i++) {
            int32_t sum = 0;
            for (int j = 0; j < QK; j++) sum += q[i * QK + j];
            start[i] = -offset * sum;
        }
    }
    const X16In x = {q, d, s, start, K, stride};
    pd_repack_a8_gemm(kind, x, M, w, N, y, y_is_bf16, threads);
    free(start);
    return 0;
}

/* 1 when the interleaved kinds run the vector kernel here (else the plain loop: correct, slow),
 * so that the loader interleaves only where that pays. */
int pd_repack_a8_route(void) {
#if PD_HAS_AVX512_VNNI
    return 1;
#else
    return 0;
#endif
}

/* out[i, :] = W[rows[i], :] decoded (rows == NULL: every row in order) for W of an interleaved
 * GGUF kind: each block put back as the file held it, then w = fma(d, q, m) as quants_k.h's
 * header says (the values ggml and the gguf package give, bit for bit). For the tied
 * embedding's lookups, and a prefill chunk whose projection mixes these with kinds the int8 GEMM
 * does not take (pd_quant_dequant hands them here). */
void pd_x16_gguf_dequant(int kind, const uint8_t *w, int64_t K, const int64_t *rows, int64_t count, void *out,
                         int out_is_bf16, int threads) {
    const int64_t blocks = K / QK;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && count > 64)
    for (int64_t i = 0; i < count; i++) {
        const int64_t n = rows ? rows[i] : i;
        for (int64_t b = 0; b < blocks; b++) {
            SubBlock sb;
            x16_gguf_sub_block(kind, w, K, n, b, &sb);
            for (int j = 0; j < QK; j++)
                put_f32(out, out_is_bf16, i * K + b * QK + j, fmaf(sb.d[j / 16], (float)sb.q[j], sb.m[j / 16]));
        }
    }
}
