/*
 * Decode attention over the paged KV cache for the CPU engine: one query token per sequence,
 * read straight from each sequence's blocks.
 *
 * The torch reference gathers every sequence's blocks into a contiguous buffer (a copy of all
 * the K and V a step reads), pads each group of sequences to its longest, and calls SDPA. Here
 * two passes read a sequence's keys, then its values, in place from the cache:
 *   1. scores[h][t] = scale * q[h] . k[t]  (fp32 sums), and each head's maximum;
 *   2. out[h] = sum_t exp(scores[h][t] - max[h]) * v[t] / sum_t exp(...).
 * bf16 or fp32 caches; sums and the softmax in fp32, the result rounded to the query's dtype
 * (round to nearest even, as torch does).
 *
 * With a sliding window W (> 0: Mistral's, Gemma 3's local layers) a token at position p attends
 * to positions p - W < k <= p only (transformers' and llama.cpp's mask): every pass starts at the
 * window's first position (window_first), whole blocks before it are never read and the
 * positions before it in its block are skipped, so a long context costs its window. W = 0 (or a
 * window holding the whole context) runs the same operations as full attention, bit for bit.
 *
 * With AVX-512 and head_dim a multiple of 16 (decode_seq_avx512), a sequence is one task and its
 * positions are read in cache order: a position's rows of every KV head lie together, and a
 * block's K (or V) half is one run of positions, so each block is one sequential read and each
 * row serves every query head that shares it (GQA). Reading one KV head at a time instead
 * (every third 128 bytes of a block, three times over) made the same attention 1.8x slower in
 * the engine's cache, whose blocks lie a whole block of every layer apart. With AVX512-BF16 and
 * a bf16 query and cache, the scores take one vdpbf16ps per 32 elements of the bf16 values as
 * they are, and 16 positions' sums are reduced together (dots_bf16). With AVX2 and FMA but no
 * AVX-512 (AMD Zen 2/3, older Intel), the same passes with 8-wide vectors (decode_seq_avx2), for
 * head_dim a multiple of 8. Elsewhere, a portable loop (one task per sequence and KV head, `omp simd` reductions). Tasks are split
 * between OpenMP threads.
 *
 * This file holds the portable loop (pd_paged_decode_attention_generic) and the query of the
 * vector width; the AVX-512 and AVX2 paths are arch/x86/paged_attention.c's
 * pd_paged_decode_attention, which runs the portable loop for a head_dim its vectors do not
 * divide, and without which the portable loop is pd_paged_decode_attention (arch_fallback.h).
 *
 * Cache layout (the engine's kv_layout.py): a layer's view [num_blocks, 2 (K, V), block_size,
 * num_kv_heads, head_dim], contiguous within a block. Built at first use with the host compiler
 * and -march=native (pdserve/kernels/cpu/build.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "isa.h"
#include "attention.h"
#include "bf16.h"
#include "kernels.h"
#include <omp.h>

/* for (t = start; t < len; t++) with `offset` the element offset of position t's row in the
 * cache (its block from the table, plus `extra`): walked block by block, without a division per
 * position (a 64-bit division costs more than the position's arithmetic). Ends in two loops'
 * headers, so the body follows in braces. */
#define FOR_EACH_POSITION(t, offset, table, start, len, block_size, block_stride, token_stride, extra)         \
    for (int64_t t##_block = (start) / (block_size), t = (start); t < (len); t##_block++)                      \
        for (int64_t offset = (int64_t)(table)[t##_block] * (block_stride) +                                   \
                              (t - t##_block * (block_size)) * (token_stride) + (extra),                      \
                     t##_end = (t##_block + 1) * (block_size) < (len) ? (t##_block + 1) * (block_size) : (len); \
             t < t##_end; t++, offset += (token_stride))

/* The vector width of the sequence-at-a-time path (16: AVX-512, 8: AVX2), 0 where only the
 * portable loop was built; head_dim must be a multiple of it. */
int pd_paged_attention_vector_lanes(void) {
#if PD_HAS_AVX512
    return 16;
#elif PD_ROUTE_AVX2
    return 8;
#else
    return 0;
#endif
}

/*
 * q:   [num_seqs, num_heads, head_dim]; out: the same shape and dtype (q_is_bf16).
 * kv:  the layer's cache (kv_is_bf16), laid out as above within each block; block_stride: the
 *      elements from one block to the next (the engine's cache holds every layer of a block
 *      together, so a layer's view steps over the other layers' K and V).
 * block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (context incl. the
 * new token, whose K/V are already in the cache). window: the sliding window W, 0 for none (see
 * the header). scratch: threads * (max_len + 2 * head_dim) * num_heads floats, max_len at least
 * the most positions a sequence attends to (its context, or W if shorter). The portable loop;
 * the vector paths: arch/x86/paged_attention.c.
 */
void pd_paged_decode_attention_generic(const void *q, int q_is_bf16, const void *kv, int kv_is_bf16,
                                       int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                       int64_t block_size, int64_t block_stride, const int32_t *block_tables,
                                       int64_t max_blocks, const int32_t *seq_lens, int64_t window, float scale,
                                       void *out, float *scratch, int64_t max_len, int threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;       /* one position, all KV heads */
    const int64_t half_stride = block_size * token_stride;      /* a block's K (or V) */
    const int64_t tasks = num_seqs * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && tasks > 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t s = task / num_kv_heads, kvh = task % num_kv_heads;
        const int64_t len = seq_lens[s], start = window_first(len, window), n = len - start;
        const int32_t *table = block_tables + s * max_blocks;
        float *scores = scratch + (int64_t)omp_get_thread_num() * max_len * group; /* [group][n] */
        float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], row[MAX_HEAD_DIM];
        float maxes[MAX_GROUP], sums[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) {
            const int64_t qoff = (s * num_heads + kvh * group + g) * head_dim;
            load_row(q, q_is_bf16, qoff, (int)head_dim, qf[g]);
            for (int64_t d = 0; d < head_dim; d++) qf[g][d] *= scale;
            maxes[g] = -INFINITY;
            sums[g] = 0.0f;
            memset(acc[g], 0, (size_t)head_dim * sizeof(float));
        }
        /* Pass 1: scores, keys read once for the whole group. */
        FOR_EACH_POSITION(t, offset, table, start, len, block_size, block_stride, token_stride, kvh * head_dim) {
            load_row(kv, kv_is_bf16, offset, (int)head_dim, row);
            for (int64_t g = 0; g < group; g++) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; d++) dot += qf[g][d] * row[d];
                scores[g * n + t - start] = dot;
                if (dot > maxes[g]) maxes[g] = dot;
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float sum = 0.0f, *sg = scores + g * n;
            for (int64_t t = 0; t < n; t++) {
                sg[t] = expf(sg[t] - maxes[g]);
                sum += sg[t];
            }
            sums[g] = sum;
        }
        /* Pass 2: values, weighted by the probabilities. */
        FOR_EACH_POSITION(t, offset, table, start, len, block_size, block_stride, token_stride,
                          half_stride + kvh * head_dim) {
            load_row(kv, kv_is_bf16, offset, (int)head_dim, row);
            for (int64_t g = 0; g < group; g++) {
                const float p = scores[g * n + t - start];
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * row[d];
            }
        }
        for (int64_t g = 0; g < group; g++) {
            const float inv = 1.0f / sums[g];
            const int64_t ooff = (s * num_heads + kvh * group + g) * head_dim;
            if (q_is_bf16) {
                uint16_t *dst = (uint16_t *)out + ooff;
                for (int64_t d = 0; d < head_dim; d++) dst[d] = fp32_to_bf16(acc[g][d] * inv);
            } else {
                float *dst = (float *)out + ooff;
                for (int64_t d = 0; d < head_dim; d++) dst[d] = acc[g][d] * inv;
            }
        }
    }
}
