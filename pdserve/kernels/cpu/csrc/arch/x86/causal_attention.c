/*
 * Causal attention of a prompt chunk over its cached prefix and itself, in bf16 on CPUs with
 * AVX512-BF16: the prefill engine's attention.
 *
 * Why: torch 2.13's CPU SDPA (its flash kernel, is_causal, enable_gqa) took 1.8 ms a layer for
 * a 256-token prompt of SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64) on one Zen 5 core,
 * about 40 GFLOP/s: 29% of a bf16 prefill, whose GEMMs run near the core's bf16 peak. Here both
 * products are vdpbf16ps (32 multiply-adds an instruction, fp32 sums), with no horizontal sums:
 *   scores: K of a KV head is packed once into tiles of 16 keys (pack_keys: word (tile, pair p,
 *     key c) = key c's dims 2p and 2p+1), so that one vdpbf16ps per pair of dims, against the
 *     query's pair broadcast, adds into 16 keys' scores at once;
 *   values: V is packed as pairs of keys (pack_values: word (pair jp, dim d) = keys 2jp and
 *     2jp+1 at dim d), so that one vdpbf16ps against a broadcast pair of probabilities adds two
 *     keys' values into 16 dims.
 * Each pass serves QUERY_ROWS query rows of one head, which share the packed K/V loads, and the
 * scores take two tiles of keys a pass, so that each broadcast of a query pair serves 32 keys.
 * A 256-token prompt of SmolLM2-135M, one layer, one Zen 5 core: 0.29 ms (260 GFLOP/s), against
 * 0.42 with one tile a pass and the values' accumulators partly on the stack.
 *
 * Rounding, as torch's flash kernel does for bf16: scores in fp32 (then times `scale`), the
 * softmax in fp32 (its maximum subtracted, exp_nonpositive), the probabilities rounded to bf16
 * for the values' product, the sums in fp32, divided by the fp32 sum of the unrounded
 * probabilities, and the output rounded to bf16 (nearest even). A row's keys past its own
 * position are left out (causal), and with a sliding window W so are those W or more positions
 * before it (row i sees keys i - W < j <= i): a pass skips the tiles of keys and the key pairs
 * wholly before its first row's window, and masks the rest, so a long prompt costs O(L W), not
 * O(L^2). Without a window (W = 0) the operations are those of no window at all.
 * A chunk with a cached prefix (its queries the last Lq of L positions) is the same loop over its
 * own rows, each at its position: the prefix's keys are packed with the chunk's. torch's SDPA
 * took it with an explicit mask at 40-60 GFLOP/s, so the second 512-token chunk of a 1024-token
 * prompt cost 2.6x the first, and a 2048-token prompt prefilled at a third of a 256-token one's
 * rate (SmolLM2-135M, one Zen 5 core).
 * tests/kernels/cpu/test_causal_attention.py holds it to SDPA.
 *
 * The kernel needs AVX512-BF16: pd_causal_attention_bf16 here is the native twin of
 * causal_attention.c's pd_causal_attention_bf16_generic, which says "not here" (-2) so that the
 * caller runs SDPA; without AVX512-BF16 this file compiles to nothing (arch_fallback.h).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "isa.h"
#include "attention.h"
#include "bf16.h"
#include "kernels.h"
#include "vexp.h"
#include <omp.h>

#if PD_HAS_AVX512_BF16

#define QUERY_ROWS 4 /* query rows a pass over the packed keys and values serves */
#define MAX_DIM_VECS 8 /* head_dim up to 128: 4 rows x 8 accumulators of 16 dims */

/* K [L, stride] (one KV head's head_dim values at each row) as tiles of 16 keys (see the header);
 * keys past L are zeros. */
static void pack_keys(const uint16_t *k, int64_t stride, int64_t L, int64_t D, uint32_t *kp) {
    const int64_t tiles = (L + 15) / 16, pairs = D / 2;
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t c = 0; c < 16; c++) {
            const int64_t j = t * 16 + c;
            for (int64_t p = 0; p < pairs; p++) {
                uint32_t *word = kp + (t * pairs + p) * 16 + c;
                if (j < L)
                    memcpy(word, k + j * stride + 2 * p, 4);
                else
                    *word = 0;
            }
        }
}

/* V [L, stride] as pairs of keys (see the header); the odd key out of an odd L pairs with zeros. */
static void pack_values(const uint16_t *v, int64_t stride, int64_t L, int64_t D, uint32_t *vp) {
    for (int64_t jp = 0; jp < (L + 1) / 2; jp++)
        for (int64_t d = 0; d < D; d++) {
            const uint32_t even = v[2 * jp * stride + d], odd = 2 * jp + 1 < L ? v[(2 * jp + 1) * stride + d] : 0;
            vp[jp * D + d] = even | odd << 16;
        }
}

/* Scores of `rows` query rows (q: the first, rows q_stride apart) against key tiles t .. t +
 * count - 1 (count 1 or 2, a constant where inlined: each broadcast of a query pair serves both
 * tiles), times scale, into scores [rows][row_stride]. */
static inline __attribute__((always_inline)) void score_tiles(const uint16_t *q, int64_t q_stride, const uint32_t *kp,
                                                              int64_t pairs, int64_t t, int count, int rows,
                                                              __m512 scale_v, float *scores, int64_t row_stride) {
    __m512 acc[QUERY_ROWS][2];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < count; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh w[2];
        for (int c = 0; c < count; c++) w[c] = (__m512bh)_mm512_loadu_si512(kp + ((t + c) * pairs + p) * 16);
        for (int r = 0; r < rows; r++) {
            const __m512bh qp = (__m512bh)broadcast_u32(q + r * q_stride + 2 * p);
            for (int c = 0; c < count; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w[c], qp);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < count; c++)
            _mm512_storeu_ps(scores + r * row_stride + 16 * (t + c), _mm512_mul_ps(acc[r][c], scale_v));
}

/* Lanes lo .. hi - 1 of 16 (lo may be negative, hi > 0). */
static inline __mmask16 lanes_between(int64_t lo, int64_t hi) {
    return (__mmask16)(first_lanes(hi) & (lo > 0 ? (__mmask16)~first_lanes(lo) : (__mmask16)0xffff));
}

/* The first key row i sees: i - window + 1 with a window (> 0) shorter than i + 1 keys, else 0. */
static inline int64_t first_key(int64_t i, int64_t window) { return window > 0 && i + 1 > window ? i + 1 - window : 0; }

/* The queries at positions i0..i0+rows-1 of one query head (q: the first one's head, rows
 * q_stride apart) against keys 0..i0+rows-1 (from first_key(i0) on with a window: the tiles and
 * key pairs before it are skipped): their outputs into out (the first one's head, out_stride apart). scores [rows][keys
 * rounded up to 16] and probs [rows][keys rounded up to 2] are the caller's buffers. */
static inline __attribute__((always_inline)) void query_rows(const uint16_t *q, int64_t q_stride, const uint32_t *kp,
                                                             const uint32_t *vp, int64_t i0, int rows, int64_t D,
                                                             float scale, int64_t window, float *scores,
                                                             uint16_t *probs, int64_t row_stride, uint16_t *out,
                                                             int64_t out_stride) {
    const int64_t pairs = D / 2, keys = i0 + rows, tiles = (keys + 15) / 16, key_pairs = (keys + 1) / 2;
    const int64_t first_tile = first_key(i0, window) / 16; /* keys before it: outside every row's window */
    const __m512 scale_v = _mm512_set1_ps(scale);
    int64_t t = first_tile;
    for (; t + 2 <= tiles; t += 2) score_tiles(q, q_stride, kp, pairs, t, 2, rows, scale_v, scores, row_stride);
    if (t < tiles) score_tiles(q, q_stride, kp, pairs, t, 1, rows, scale_v, scores, row_stride);
    float inverse[QUERY_ROWS];
    for (int r = 0; r < rows; r++) { /* row i0 + r: keys from..i0 + r */
        float *s = scores + r * row_stride;
        uint16_t *pr = probs + r * row_stride;
        const int64_t n = i0 + r + 1, from = first_key(i0 + r, window);
        __m512 max = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 16 * first_tile; j < n; j += 16) {
            const __mmask16 live = lanes_between(from - j, n - j);
            max = _mm512_mask_max_ps(max, live, max, _mm512_maskz_loadu_ps(live, s + j));
        }
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(max));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 16 * first_tile; j < 2 * key_pairs; j += 16) {
            const __mmask16 live = j >= n ? 0 : lanes_between(from - j, n - j);
            const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), top)));
            sum = _mm512_add_ps(sum, e);
            const __mmask16 within = first_lanes(2 * key_pairs - j);
            _mm256_mask_storeu_epi16(pr + j, within, fp32x16_to_bf16(e)); /* zeros outside the row's keys */
        }
        inverse[r] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    const int vecs = (int)(D / 16);
    __m512 o[QUERY_ROWS][MAX_DIM_VECS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < vecs; c++) o[r][c] = _mm512_setzero_ps();
    for (int64_t jp = 8 * first_tile; jp < key_pairs; jp++) {
        __m512bh pair[QUERY_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) pair[r] = (__m512bh)broadcast_u32(probs + r * row_stride + 2 * jp);
#pragma GCC unroll 8
        for (int c = 0; c < vecs; c++) {
            const __m512bh w = (__m512bh)_mm512_loadu_si512(vp + jp * D + 16 * c);
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) o[r][c] = _mm512_dpbf16_ps(o[r][c], w, pair[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(inverse[r]);
        for (int c = 0; c < vecs; c++)
            _mm256_storeu_si256((__m256i *)(out + r * out_stride + 16 * c), fp32x16_to_bf16(_mm512_mul_ps(o[r][c], inv)));
    }
}

/* query_rows for each (rows, head_dim) as a function of its own: with both constant its
 * accumulators stay in registers. Inlined into one OpenMP body instead, the constants of every
 * instance kept registers busy and GCC left 6 of the values' 16 accumulators on the stack. */
#define QUERY_ROWS_FN(ROWS, DIM)                                                                                       \
    static __attribute__((noinline)) void query_rows_##ROWS##_##DIM(                                                 \
        const uint16_t *q, int64_t q_stride, const uint32_t *kp, const uint32_t *vp, int64_t i0, float scale,          \
        int64_t window, float *scores, uint16_t *probs, int64_t row_stride, uint16_t *out, int64_t out_stride) {       \
        query_rows(q, q_stride, kp, vp, i0, ROWS, DIM, scale, window, scores, probs, row_stride, out, out_stride);     \
    }
#define QUERY_ROWS_FNS(DIM) QUERY_ROWS_FN(1, DIM) QUERY_ROWS_FN(2, DIM) QUERY_ROWS_FN(3, DIM) QUERY_ROWS_FN(4, DIM)
QUERY_ROWS_FNS(32)
QUERY_ROWS_FNS(64)
QUERY_ROWS_FNS(96)
QUERY_ROWS_FNS(128)
#undef QUERY_ROWS_FNS
#undef QUERY_ROWS_FN

/* pd_causal_attention_bf16_generic's contract (causal_attention.c), with AVX512-BF16. */
int pd_causal_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                             const uint16_t *v, int64_t v_stride, int64_t Lq, int64_t L, int64_t Hq, int64_t Hkv,
                             int64_t D, float scale, int64_t window, uint16_t *out, int64_t out_stride, int threads) {
    if (D % 32 != 0 || D > 16 * MAX_DIM_VECS || Hkv <= 0 || Hq % Hkv != 0) return -2;
    if (Lq <= 0 || L <= 0) return 0;
    if (Lq > L) return -3;
    const int64_t prefix = L - Lq; /* query row i sits at position prefix + i */
    if (threads < 1) threads = 1;
    const int64_t group = Hq / Hkv, tiles = (L + 15) / 16, row_stride = tiles * 16;
    const int64_t key_words = tiles * 16 * (D / 2), value_words = (L + 1) / 2 * D;
    const int64_t per_thread = QUERY_ROWS * row_stride; /* a thread's scores (fp32) and probabilities (bf16) */
    uint32_t *packed = (uint32_t *)malloc((size_t)(Hkv * (key_words + value_words)) * sizeof(uint32_t));
    float *scores = (float *)malloc((size_t)(threads * per_thread) * sizeof(float));
    uint16_t *probs = (uint16_t *)malloc((size_t)(threads * per_thread) * sizeof(uint16_t));
    if (packed == NULL || scores == NULL || probs == NULL) {
        free(packed);
        free(scores);
        free(probs);
        return -1;
    }
    for (int64_t h = 0; h < Hkv; h++) {
        pack_keys(k + h * D, k_stride, L, D, packed + h * (key_words + value_words));
        pack_values(v + h * D, v_stride, L, D, packed + h * (key_words + value_words) + key_words);
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t h = 0; h < Hq; h++) {
        const uint32_t *kp = packed + (h / group) * (key_words + value_words), *vp = kp + key_words;
        float *my_scores = scores + omp_get_thread_num() * per_thread;
        uint16_t *my_probs = probs + omp_get_thread_num() * per_thread;
        for (int64_t i0 = 0; i0 < Lq; i0 += QUERY_ROWS) {
            const uint16_t *qr = q + i0 * q_stride + h * D;
            uint16_t *o = out + i0 * out_stride + h * D;
#define ROWS_CASE(ROWS, DIM)                                                                                      \
    case ROWS:                                                                                                    \
        query_rows_##ROWS##_##DIM(qr, q_stride, kp, vp, prefix + i0, scale, window, my_scores, my_probs,           \
                                  row_stride, o, out_stride);                                                     \
        break;
#define DIM_CASE(DIM)                                                                                             \
    case DIM:                                                                                                     \
        switch (rows) { ROWS_CASE(1, DIM) ROWS_CASE(2, DIM) ROWS_CASE(3, DIM) default: ROWS_CASE(4, DIM) } \
        break;
            const int rows = (int)(Lq - i0 < QUERY_ROWS ? Lq - i0 : QUERY_ROWS);
            switch (D) { DIM_CASE(32) DIM_CASE(64) DIM_CASE(96) default: DIM_CASE(128) }
#undef DIM_CASE
#undef ROWS_CASE
        }
    }
    free(scores);
    free(probs);
    free(packed);
    return 0;
}
#endif
