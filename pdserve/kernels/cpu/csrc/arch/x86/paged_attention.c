/*
 * The vector paths of paged_attention.c's decode attention (its header says what they compute and
 * why they read the cache as they do): a sequence a task, its positions in cache order, with
 * AVX-512 (16 lanes: decode_seq_avx512, its scores on vdpbf16ps where the CPU has AVX512-BF16 and
 * the query and cache are bf16) or, without AVX-512, with AVX2 and FMA (8 lanes:
 * decode_seq_avx2). pd_paged_decode_attention here runs them for a head_dim their lanes divide,
 * and paged_attention.c's portable loop (pd_paged_decode_attention_generic) otherwise; a build
 * with neither compiles this file to nothing, and the portable loop is the entry point
 * (arch_fallback.h). With a sliding window, a sequence's passes start at its window's first
 * position (`start`, window_first): its blocks before that one are never read, and the
 * positions before it in that block are skipped; its scores are kept for positions start ..
 * len - 1 only.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "isa.h"
#include "attention.h"
#include "avx2.h"
#include "bf16.h"
#include "kernels.h"
#include "vexp.h"
#include <omp.h>

#if PD_HAS_AVX512 || PD_ROUTE_AVX2
/* Ask for `bytes` from `from` on. The next block is anywhere in the cache (the engine's blocks
 * lie a block of every layer apart), where the hardware prefetcher cannot guess it: asked for a
 * block's work ahead, it is on its way before it is read (8 sequences x 257 tokens, 30 layers
 * of the engine's cache, one core: 7.0-8.2 ms with, 8.2-8.5 ms without, 4.3 ms for the same
 * work on a cache that fits in L3). */
static inline void prefetch_bytes(const char *from, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(from + line, _MM_HINT_T0);
}

/* Share `part` (0 to parts - 1) of `bytes` from `from` on, into L1 (HINT = _MM_HINT_T0) or L2
 * (_MM_HINT_T1): a block's prefetch spread over the steps of the block before it. A macro, so
 * that each use keeps its own loop where it stands: as an inline function, GCC 12 left two
 * prefetch instructions in the whole file (one shared loop) and the attention below took
 * 5.1-5.3 ms instead of 2.8. */
#define PREFETCH_SHARE(from, bytes, part, parts, HINT)                                                     \
    do {                                                                                                   \
        const int64_t lines_ = ((bytes) + 63) / 64, per_ = (lines_ + (parts) - 1) / (parts);              \
        for (int64_t line_ = (part) * per_; line_ < lines_ && line_ < ((part) + 1) * per_; line_++)        \
            _mm_prefetch((const char *)(from) + line_ * 64, HINT);                                        \
    } while (0)

/* Where the scores pass over a block spreads its prefetches (prefetch_keys_step): the next block's
 * keys (NULL after the last block), into L1, and this block's values, into L2 for the values
 * pass. Asked for a whole block at once, the 96 lines of SmolLM2's 6 KB halves outran the
 * prefetches the core keeps in flight, and the key loads waited on memory: 8 sequences x 272
 * positions over 30 layers of the engine's cache, one Zen 5 core, 5.7 ms so, 2.5-2.9 ms spread
 * (2.1-2.3 ms for the same work in cache). */
typedef struct {
    const char *next_keys, *values;
    int64_t bytes;
} BlockPrefetch;

static inline BlockPrefetch block_prefetch(const void *kv, int64_t elem, const int32_t *table, int64_t block,
                                           int64_t num_blocks, int64_t block_stride, int64_t half_stride) {
    const char *cache = (const char *)kv;
    BlockPrefetch p;
    p.next_keys = block + 1 < num_blocks ? cache + (int64_t)table[block + 1] * block_stride * elem : NULL;
    p.values = cache + ((int64_t)table[block] * block_stride + half_stride) * elem;
    p.bytes = half_stride * elem;
    return p;
}

/* Step `step` of `steps` of the scores pass over a block: its share of both prefetches. */
static inline __attribute__((always_inline)) void prefetch_keys_step(BlockPrefetch p, int64_t step, int64_t steps) {
    if (p.next_keys != NULL) PREFETCH_SHARE(p.next_keys, p.bytes, step, steps, _MM_HINT_T0);
    PREFETCH_SHARE(p.values, p.bytes, step, steps, _MM_HINT_T1);
}

/* Prefetch the half (K: extra 0, V: extra half_stride) of the block after `block`, if any. */
static inline void prefetch_next_half(const void *kv, int64_t elem, const int32_t *table, int64_t block,
                                      int64_t num_blocks, int64_t block_stride, int64_t extra, int64_t half_stride) {
    if (block + 1 < num_blocks)
        prefetch_bytes((const char *)kv + ((int64_t)table[block + 1] * block_stride + extra) * elem, half_stride * elem);
}

#if PD_HAS_AVX512
#define MAX_VECS (MAX_HEAD_DIM / 16)
#define MAX_SPECIAL_SUMS 24 /* registers the special cases of values_of_block keep their sums in */


/* One position's K or V row of nvec * 16 values as fp32 vectors. */
static inline __attribute__((always_inline)) void load_vecs(const void *cache, int is_bf16, int64_t offset, int nvec,
                                                            __m512 *v) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)cache + offset;
        for (int i = 0; i < nvec; i++) v[i] = bf16x16_to_fp32(src + 16 * i);
    } else {
        const float *src = (const float *)cache + offset;
        for (int i = 0; i < nvec; i++) v[i] = _mm512_loadu_ps(src + 16 * i);
    }
}

#if PD_HAS_AVX512_BF16
/* The 16 sums of lanes of p[0..15], in order: a transposed reduction (48 adds and shuffles for
 * 16 sums, against about 8 each for _mm512_reduce_add_ps). */
static inline __m512 sum_lanes_16(__m512 *p) {
    __m512 a[8], b[4];
    for (int k = 0; k < 8; k++) /* per 128-bit lane: pairs of elements added, two rows interleaved */
        a[k] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * k], p[2 * k + 1]), _mm512_unpackhi_ps(p[2 * k], p[2 * k + 1]));
    for (int k = 0; k < 4; k++) /* per 128-bit lane: rows 4k..4k+3, each summed over the lane */
        b[k] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(d01, d23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* q . k[o] for up to 16 positions o of one block and one KV head, bf16 both: one vdpbf16ps per 32
 * elements (products exact in fp32, summed in fp32), then the 16 sums at once. Inlined where it
 * is called with head_dim 64 as a constant, so that its loops unroll into registers. */
static inline __attribute__((always_inline)) __m512 dots_bf16(const uint16_t *k, int64_t positions, int64_t token_stride, const uint16_t *q,
                               int64_t head_dim) {
    __m512 p[16];
    for (int64_t o = 0; o < 16; o++) {
        __m512 sum = _mm512_setzero_ps();
        if (o < positions)
            for (int64_t d = 0; d < head_dim; d += 32)
                sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(k + o * token_stride + d),
                                       (__m512bh)_mm512_loadu_si512(q + d));
        p[o] = sum;
    }
    return sum_lanes_16(p);
}
#endif

/* acc[g] += sum over a block's positions o of p[g * p_stride + o] * v[o], for the `group` query
 * heads of one KV head. With `group` and `nvec` constants (values_of_block's cases) the sums
 * stay in registers over the block; otherwise they are read and written in acc each position. */
static inline __attribute__((always_inline)) void values_of_block_as(const void *kv, int kv_is_bf16, int64_t base,
                                                                    int64_t positions, int64_t token_stride,
                                                                    const float *p, int64_t p_stride, float *acc,
                                                                    const int group, const int nvec) {
    const int64_t head_dim = (int64_t)nvec * 16;
    __m512 sums[MAX_SPECIAL_SUMS], row[MAX_VECS];
    for (int g = 0; g < group; g++)
        for (int i = 0; i < nvec; i++) sums[g * nvec + i] = _mm512_loadu_ps(acc + g * head_dim + 16 * i);
    for (int64_t o = 0; o < positions; o++) {
        load_vecs(kv, kv_is_bf16, base + o * token_stride, nvec, row);
        for (int g = 0; g < group; g++) {
            const __m512 weight = _mm512_set1_ps(p[g * p_stride + o]);
            for (int i = 0; i < nvec; i++) sums[g * nvec + i] = _mm512_fmadd_ps(weight, row[i], sums[g * nvec + i]);
        }
    }
    for (int g = 0; g < group; g++)
        for (int i = 0; i < nvec; i++) _mm512_storeu_ps(acc + g * head_dim + 16 * i, sums[g * nvec + i]);
}

static void values_of_block(const void *kv, int kv_is_bf16, int64_t base, int64_t positions, int64_t token_stride,
                            const float *p, int64_t p_stride, float *acc, int group, int nvec) {
#define VALUES_CASE(G, V)                                                                                        \
    case (G) * 100 + (V):                                                                                        \
        values_of_block_as(kv, kv_is_bf16, base, positions, token_stride, p, p_stride, acc, G, V);               \
        return;
    switch (group * 100 + nvec) { /* the shapes of common models: head_dim 64 or 128, GQA 1-8 */
        VALUES_CASE(1, 4) VALUES_CASE(2, 4) VALUES_CASE(3, 4) VALUES_CASE(4, 4) VALUES_CASE(5, 4)
        VALUES_CASE(6, 4) VALUES_CASE(1, 8) VALUES_CASE(2, 8) VALUES_CASE(3, 8)
    }
#undef VALUES_CASE
    const int64_t head_dim = (int64_t)nvec * 16;
    __m512 row[MAX_VECS];
    for (int64_t o = 0; o < positions; o++) {
        load_vecs(kv, kv_is_bf16, base + o * token_stride, nvec, row);
        for (int g = 0; g < group; g++) {
            const __m512 weight = _mm512_set1_ps(p[g * p_stride + o]);
            float *ag = acc + g * head_dim;
            for (int i = 0; i < nvec; i++)
                _mm512_storeu_ps(ag + 16 * i, _mm512_fmadd_ps(weight, row[i], _mm512_loadu_ps(ag + 16 * i)));
        }
    }
}

/* The task of one sequence, every head, with head_dim a multiple of 16. A position's K (or V)
 * rows of all KV heads are one contiguous run in its block, and a block's K half is one
 * contiguous run of positions: read in that order, each block is a sequential stream, and each
 * row is read once for the query heads that share it. */
static void decode_seq_avx512(const float *qf /* [num_heads][head_dim], scaled */,
                              const uint16_t *qbf /* the same unscaled in bf16, or NULL */, float scale,
                              int64_t num_heads,
                              int64_t num_kv_heads, int nvec, const void *kv, int kv_is_bf16, const int32_t *table,
                              int64_t start, int64_t len, int64_t block_size, int64_t block_stride,
                              int64_t half_stride, int64_t token_stride,
                              float *scores /* [num_heads][len - start] */, float *acc /* [num_heads][head_dim] */) {
    const int64_t head_dim = (int64_t)nvec * 16, group = num_heads / num_kv_heads;
    const int64_t n = len - start, first_block = start / block_size; /* positions start .. len - 1 */
    float maxes[MAX_HEADS];
    for (int64_t h = 0; h < num_heads; h++) maxes[h] = -INFINITY;
    __m512 row[MAX_VECS];
    const int64_t num_blocks = (len + block_size - 1) / block_size, elem = kv_is_bf16 ? 2 : 4;
#if PD_HAS_AVX512_BF16
    if (qbf != NULL && kv_is_bf16 && head_dim % 32 == 0) {
        /* bf16 query and keys: vdpbf16ps on them as they are, 16 positions' dots summed at once. */
        __m512 max_of[MAX_HEADS];
        for (int64_t h = 0; h < num_heads; h++) max_of[h] = _mm512_set1_ps(-INFINITY);
        const __m512 scale_v = _mm512_set1_ps(scale);
        for (int64_t block = first_block, first = first_block * block_size; first < len; block++, first += block_size) {
            const int64_t base = (int64_t)table[block] * block_stride, lo = first < start ? start - first : 0;
            const int64_t steps = (block_size - lo + 15) / 16 * num_heads; /* (16 positions, head) */
            const BlockPrefetch ahead = block_prefetch(kv, elem, table, block, num_blocks, block_stride, half_stride);
            for (int64_t o = lo, step = 0; o < block_size && first + o < len; o += 16) {
                const int64_t positions = min64(min64(16, len - first - o), block_size - o);
                const __mmask16 live = first_lanes(positions);
                for (int64_t h = 0; h < num_heads; h++, step++) {
                    prefetch_keys_step(ahead, step, steps);
                    const uint16_t *k = (const uint16_t *)kv + base + o * token_stride + (h / group) * head_dim;
                    const __m512 raw = head_dim == 64 ? dots_bf16(k, positions, token_stride, qbf + h * head_dim, 64)
                                                      : dots_bf16(k, positions, token_stride, qbf + h * head_dim, head_dim);
                    const __m512 dots = _mm512_mul_ps(raw, scale_v);
                    _mm512_mask_storeu_ps(scores + h * n + first + o - start, live, dots);
                    max_of[h] = _mm512_mask_max_ps(max_of[h], live, max_of[h], dots);
                }
            }
        }
        for (int64_t h = 0; h < num_heads; h++) maxes[h] = _mm512_reduce_max_ps(max_of[h]);
    } else
#else
    (void)qbf, (void)scale; /* the bf16 scores' arguments: unused without AVX512-BF16 */
#endif
    for (int64_t block = first_block, first = first_block * block_size; first < len; block++, first += block_size) {
        const int64_t positions = min64(len - first, block_size), base = (int64_t)table[block] * block_stride;
        const BlockPrefetch ahead = block_prefetch(kv, elem, table, block, num_blocks, block_stride, half_stride);
        const int64_t lo = first < start ? start - first : 0;
        for (int64_t o = lo; o < positions; o++) {
            prefetch_keys_step(ahead, o - lo, block_size - lo);
            for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
                load_vecs(kv, kv_is_bf16, base + o * token_stride + kvh * head_dim, nvec, row);
                for (int64_t h = kvh * group; h < (kvh + 1) * group; h++) {
                    const float *qh = qf + h * head_dim;
                    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qh), row[0]);
                    for (int i = 1; i < nvec; i++) sum = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * i), row[i], sum);
                    const float dot = _mm512_reduce_add_ps(sum);
                    scores[h * n + first + o - start] = dot;
                    if (dot > maxes[h]) maxes[h] = dot;
                }
            }
        }
    }
    for (int64_t h = 0; h < num_heads; h++) {
        float *sh = scores + h * n;
        const __m512 max = _mm512_set1_ps(maxes[h]);
        __m512 sums = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t += 16) {
            const __mmask16 live = first_lanes(n - t);
            const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sh + t), max));
            _mm512_mask_storeu_ps(sh + t, live, e);
            sums = _mm512_mask_add_ps(sums, live, sums, e);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sums));
        for (int64_t t = 0; t < n; t += 16) {
            const __mmask16 live = first_lanes(n - t);
            _mm512_mask_storeu_ps(sh + t, live, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, sh + t), inv));
        }
        memset(acc + h * head_dim, 0, (size_t)head_dim * sizeof(float));
    }
    /* Values block by block, one KV head at a time within a block (its V half, a few KB, stays in
     * L1 for the next head). */
    for (int64_t block = first_block, first = first_block * block_size; first < len; block++, first += block_size) {
        const int64_t lo = first < start ? start - first : 0, positions = min64(len - first, block_size) - lo;
        const int64_t base = (int64_t)table[block] * block_stride + half_stride + lo * token_stride;
        prefetch_next_half(kv, elem, table, block, num_blocks, block_stride, half_stride, half_stride);
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++)
            values_of_block(kv, kv_is_bf16, base + kvh * head_dim, positions, token_stride,
                            scores + kvh * group * n + first + lo - start, n, acc + kvh * group * head_dim, (int)group,
                            nvec);
    }
}
#endif

#if PD_ROUTE_AVX2
#define MAX_VECS8 (MAX_HEAD_DIM / 8)

/* One position's K or V row of nvec * 8 values as fp32 vectors. */
static inline __attribute__((always_inline)) void load_vecs8(const void *cache, int is_bf16, int64_t offset, int nvec,
                                                             __m256 *v) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)cache + offset;
        for (int i = 0; i < nvec; i++)
            v[i] = _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 8 * i))), 16));
    } else {
        const float *src = (const float *)cache + offset;
        for (int i = 0; i < nvec; i++) v[i] = _mm256_loadu_ps(src + 8 * i);
    }
}

/* acc += sum over a block's positions o of p[o] * v[o], for one query head: with nvec a constant
 * (head_dim 32, 64 or 128) the sums stay in registers over the block. */
static inline __attribute__((always_inline)) void values_of_block8_as(const void *kv, int kv_is_bf16, int64_t base,
                                                                     int64_t positions, int64_t token_stride,
                                                                     const float *p, float *acc, const int nvec) {
    __m256 sums[MAX_VECS8], row[MAX_VECS8];
    for (int i = 0; i < nvec; i++) sums[i] = _mm256_loadu_ps(acc + 8 * i);
    for (int64_t o = 0; o < positions; o++) {
        load_vecs8(kv, kv_is_bf16, base + o * token_stride, nvec, row);
        const __m256 weight = _mm256_set1_ps(p[o]);
        for (int i = 0; i < nvec; i++) sums[i] = _mm256_fmadd_ps(weight, row[i], sums[i]);
    }
    for (int i = 0; i < nvec; i++) _mm256_storeu_ps(acc + 8 * i, sums[i]);
}

static void values_of_block8(const void *kv, int kv_is_bf16, int64_t base, int64_t positions, int64_t token_stride,
                             const float *p, float *acc, int nvec) {
    switch (nvec) {
        case 4: values_of_block8_as(kv, kv_is_bf16, base, positions, token_stride, p, acc, 4); return;
        case 8: values_of_block8_as(kv, kv_is_bf16, base, positions, token_stride, p, acc, 8); return;
        case 16: values_of_block8_as(kv, kv_is_bf16, base, positions, token_stride, p, acc, 16); return;
        default: values_of_block8_as(kv, kv_is_bf16, base, positions, token_stride, p, acc, nvec); return;
    }
}

/* The 8 sums of lanes of p[0..7], in order: a transposed reduction (6 horizontal adds, 2 lane
 * permutes, 1 add for 8 sums, where one sum at a time costs 4 shuffles and adds each). */
static inline __m256 sum_lanes_8(const __m256 *p) {
    const __m256 t0 = _mm256_hadd_ps(p[0], p[1]), t1 = _mm256_hadd_ps(p[2], p[3]);
    const __m256 t2 = _mm256_hadd_ps(p[4], p[5]), t3 = _mm256_hadd_ps(p[6], p[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* [0..3 low | 0..3 high], [4..7 ...] */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* scores[o] = q . k[o] for 8 positions of one KV head (rows token_stride apart), as one vector:
 * eight independent fma chains over head_dim, reduced together (sum_lanes_8). With nvec a
 * constant the sums stay in registers. */
static inline __attribute__((always_inline)) __m256 dots8_as(const void *kv, int kv_is_bf16, int64_t offset,
                                                             int64_t token_stride, const float *q, const int nvec) {
    __m256 sums[8];
    for (int j = 0; j < 8; j++) sums[j] = _mm256_setzero_ps();
    for (int i = 0; i < nvec; i++) {
        const __m256 qv = _mm256_loadu_ps(q + 8 * i);
        for (int j = 0; j < 8; j++) {
            __m256 k;
            load_vecs8(kv, kv_is_bf16, offset + j * token_stride + 8 * i, 1, &k);
            sums[j] = _mm256_fmadd_ps(qv, k, sums[j]);
        }
    }
    return sum_lanes_8(sums);
}

static __m256 dots8(const void *kv, int kv_is_bf16, int64_t offset, int64_t token_stride, const float *q, int nvec) {
    switch (nvec) {
        case 4: return dots8_as(kv, kv_is_bf16, offset, token_stride, q, 4);
        case 8: return dots8_as(kv, kv_is_bf16, offset, token_stride, q, 8);
        case 16: return dots8_as(kv, kv_is_bf16, offset, token_stride, q, 16);
        default: return dots8_as(kv, kv_is_bf16, offset, token_stride, q, nvec);
    }
}

/* The task of one sequence, every head, with head_dim a multiple of 8: decode_seq_avx512's
 * passes with 8-wide vectors (a block's positions read in cache order, 8 at a time for each
 * query head sharing their KV head; probabilities; values block by block). */
static void decode_seq_avx2(const float *qf /* [num_heads][head_dim], scaled */, int64_t num_heads,
                            int64_t num_kv_heads, int nvec, const void *kv, int kv_is_bf16, const int32_t *table,
                            int64_t start, int64_t len, int64_t block_size, int64_t block_stride,
                            int64_t half_stride, int64_t token_stride,
                            float *scores /* [num_heads][len - start] */, float *acc /* [num_heads][head_dim] */) {
    const int64_t head_dim = (int64_t)nvec * 8, group = num_heads / num_kv_heads;
    const int64_t n = len - start, first_block = start / block_size; /* positions start .. len - 1 */
    float maxes[MAX_HEADS];
    __m256 max8[MAX_HEADS];
    for (int64_t h = 0; h < num_heads; h++) {
        maxes[h] = -INFINITY;
        max8[h] = _mm256_set1_ps(-INFINITY);
    }
    __m256 row[MAX_VECS8];
    const int64_t num_blocks = (len + block_size - 1) / block_size, elem = kv_is_bf16 ? 2 : 4;
    for (int64_t block = first_block, first = first_block * block_size; first < len; block++, first += block_size) {
        const int64_t positions = min64(len - first, block_size), base = (int64_t)table[block] * block_stride;
        const int64_t lo = first < start ? start - first : 0;
        const BlockPrefetch ahead = block_prefetch(kv, elem, table, block, num_blocks, block_stride, half_stride);
        int64_t o = lo;
        for (; o + 8 <= positions; o += 8) /* 8 positions at a time: a KV head's rows stay in L1 */
            for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
                prefetch_keys_step(ahead, (o - lo) / 8 * num_kv_heads + kvh, (block_size - lo + 7) / 8 * num_kv_heads);
                for (int64_t h = kvh * group; h < (kvh + 1) * group; h++) {
                    const __m256 dots = dots8(kv, kv_is_bf16, base + o * token_stride + kvh * head_dim,
                                              token_stride, qf + h * head_dim, nvec);
                    _mm256_storeu_ps(scores + h * n + first + o - start, dots);
                    max8[h] = _mm256_max_ps(max8[h], dots);
                }
            }
        for (; o < positions; o++) { /* the block's last positions, one at a time */
            for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
                load_vecs8(kv, kv_is_bf16, base + o * token_stride + kvh * head_dim, nvec, row);
                for (int64_t h = kvh * group; h < (kvh + 1) * group; h++) {
                    const float *qh = qf + h * head_dim;
                    __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(qh), row[0]);
                    for (int i = 1; i < nvec; i++) sum = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * i), row[i], sum);
                    const float dot = hsum_avx2(sum);
                    scores[h * n + first + o - start] = dot;
                    if (dot > maxes[h]) maxes[h] = dot;
                }
            }
        }
    }
    for (int64_t h = 0; h < num_heads; h++) { /* the 8-at-a-time maxima into the scalar ones */
        float lanes[8];
        _mm256_storeu_ps(lanes, max8[h]);
        for (int i = 0; i < 8; i++) maxes[h] = lanes[i] > maxes[h] ? lanes[i] : maxes[h];
    }
    for (int64_t h = 0; h < num_heads; h++) {
        float *sh = scores + h * n;
        const __m256 max = _mm256_set1_ps(maxes[h]);
        __m256 sums = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) {
            const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sh + t), max));
            _mm256_storeu_ps(sh + t, e);
            sums = _mm256_add_ps(sums, e);
        }
        float sum = hsum_avx2(sums);
        for (; t < n; t++) { /* the tail through the same polynomial, one lane used */
            const float e = _mm256_cvtss_f32(exp_nonpositive8(_mm256_set1_ps(sh[t] - maxes[h])));
            sh[t] = e;
            sum += e;
        }
        const float inv = 1.0f / sum;
        for (t = 0; t < n; t++) sh[t] *= inv;
        memset(acc + h * head_dim, 0, (size_t)head_dim * sizeof(float));
    }
    for (int64_t block = first_block, first = first_block * block_size; first < len; block++, first += block_size) {
        const int64_t lo = first < start ? start - first : 0, positions = min64(len - first, block_size) - lo;
        const int64_t base = (int64_t)table[block] * block_stride + half_stride + lo * token_stride;
        prefetch_next_half(kv, elem, table, block, num_blocks, block_stride, half_stride, half_stride);
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++)
            for (int64_t g = 0; g < group; g++) /* a KV head's rows of a block stay in L1 between heads */
                values_of_block8(kv, kv_is_bf16, base + kvh * head_dim, positions, token_stride,
                                 scores + (kvh * group + g) * n + first + lo - start,
                                 acc + (kvh * group + g) * head_dim, nvec);
    }
}
#endif

/* pd_paged_decode_attention_generic's contract (paged_attention.c), on the vector paths. */
void pd_paged_decode_attention(const void *q, int q_is_bf16, const void *kv, int kv_is_bf16, int64_t num_seqs,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                               int64_t block_stride, const int32_t *block_tables, int64_t max_blocks,
                               const int32_t *seq_lens, int64_t window, float scale, void *out, float *scratch,
                               int64_t max_len, int threads) {
    const int64_t token_stride = num_kv_heads * head_dim;       /* one position, all KV heads */
    const int64_t half_stride = block_size * token_stride;      /* a block's K (or V) */
#if PD_HAS_AVX512
    const int64_t lanes = 16;
#else
    const int64_t lanes = 8;
#endif
    if (head_dim % lanes == 0) {
        const int64_t elem = kv_is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && num_seqs > 1)
        for (int64_t s = 0; s < num_seqs; s++) {
            float *mine = scratch + (int64_t)omp_get_thread_num() * (max_len + 2 * head_dim) * num_heads;
            float *qs = mine + max_len * num_heads, *accs = qs + num_heads * head_dim;
            if (s + 1 < num_seqs && seq_lens[s + 1] > 0) { /* the next sequence's first keys, into L2 meanwhile */
                const int64_t next = (s + 1) * max_blocks + window_first(seq_lens[s + 1], window) / block_size;
                PREFETCH_SHARE((const char *)kv + (int64_t)block_tables[next] * block_stride * elem, half_stride * elem,
                               0, 1, _MM_HINT_T1);
            }
            const int64_t len = seq_lens[s], start = window_first(len, window);
            for (int64_t h = 0; h < num_heads; h++) {
                load_row(q, q_is_bf16, (s * num_heads + h) * head_dim, (int)head_dim, qs + h * head_dim);
                for (int64_t d = 0; d < head_dim; d++) qs[h * head_dim + d] *= scale;
            }
#if PD_HAS_AVX512
            decode_seq_avx512(qs, q_is_bf16 ? (const uint16_t *)q + s * num_heads * head_dim : NULL, scale, num_heads, num_kv_heads, (int)(head_dim / 16), kv, kv_is_bf16,
                              block_tables + s * max_blocks, start, len, block_size, block_stride, half_stride,
                              token_stride, mine, accs);
#else
            decode_seq_avx2(qs, num_heads, num_kv_heads, (int)(head_dim / 8), kv, kv_is_bf16,
                            block_tables + s * max_blocks, start, len, block_size, block_stride, half_stride,
                            token_stride, mine, accs);
#endif
            for (int64_t h = 0; h < num_heads; h++) {
                const int64_t ooff = (s * num_heads + h) * head_dim;
                if (q_is_bf16) {
                    uint16_t *dst = (uint16_t *)out + ooff;
                    for (int64_t d = 0; d < head_dim; d++) dst[d] = fp32_to_bf16(accs[h * head_dim + d]);
                } else {
                    memcpy((float *)out + ooff, accs + h * head_dim, (size_t)head_dim * sizeof(float));
                }
            }
        }
        return;
    }
    pd_paged_decode_attention_generic(q, q_is_bf16, kv, kv_is_bf16, num_seqs, num_heads, num_kv_heads, head_dim,
                                      block_size, block_stride, block_tables, max_blocks, seq_lens, window, scale,
                                      out, scratch, max_len, threads);
}
#endif
