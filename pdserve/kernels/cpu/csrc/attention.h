/*
 * What the attention kernels share between their portable C (paged_attention.c,
 * causal_attention.c) and their x86 twins (arch/x86/paged_attention.c,
 * arch/x86/causal_attention.c): the paged attention's limits and row loads, and each entry
 * point's portable twin, NAME_generic, which arch_fallback.h makes the entry point (kernels.h) of
 * a build with no native one.
 */
#ifndef PDSERVE_ATTENTION_H
#define PDSERVE_ATTENTION_H
#include <stdint.h>
#include <string.h>
#include "arch_fallback.h"
#include "bf16.h"

#define MAX_GROUP 16  /* query heads per KV head */
#define MAX_HEADS 128
#define MAX_HEAD_DIM 256

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The first position a decode token at position len - 1 attends to: with a sliding window W
 * (> 0) it sees positions len - W .. len - 1 (p - W < k <= p: transformers' and llama.cpp's
 * sliding window), else 0 .. len - 1. */
static inline int64_t window_first(int64_t len, int64_t window) { return window > 0 && len > window ? len - window : 0; }

/* One position's row of `dim` values (K or V of one KV head) widened to fp32. */
static inline void load_row(const void *cache, int is_bf16, int64_t offset, int dim, float *row) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)cache + offset;
#pragma omp simd
        for (int d = 0; d < dim; d++) row[d] = bf16_to_fp32(src[d]);
    } else {
        memcpy(row, (const float *)cache + offset, (size_t)dim * sizeof(float));
    }
}

/* paged_attention.c: pd_paged_decode_attention's portable loop (every head_dim). */
void pd_paged_decode_attention_generic(const void *q, int q_is_bf16, const void *kv, int kv_is_bf16,
                                       int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                       int64_t block_size, int64_t block_stride, const int32_t *block_tables,
                                       int64_t max_blocks, const int32_t *seq_lens, int64_t window, float scale,
                                       void *out, float *scratch, int64_t max_len, int threads);

/* causal_attention.c: pd_causal_attention_bf16 where it does not run (returns -2). */
int pd_causal_attention_bf16_generic(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                                     const uint16_t *v, int64_t v_stride, int64_t Lq, int64_t L, int64_t Hq,
                                     int64_t Hkv, int64_t D, float scale, int64_t window, uint16_t *out,
                                     int64_t out_stride, int threads);
#endif
