/*
 * What the CPU kernels' AVX2 code shares (PD_HAS_AVX2, isa.h: AVX-512 CPUs use it too): the
 * quantized kernels' fp32 route of CPUs without AVX-512 (PD_ROUTE_AVX2) and their int8-activation
 * kernels, and the paged attention's AVX2 route. Included by the C sources that use it; the
 * build's cache key covers it.
 */
#ifndef PDSERVE_AVX2_H
#define PDSERVE_AVX2_H
#include <stdint.h>
#include "isa.h"

/* How far ahead of its reads a pass along one weight row prefetches: the LM head (Q8_0, one
 * output row at a time, 30 MB streamed) took 3.8 ns a block without, 3.1-3.2 with 4-8 KB ahead
 * (512 B: no change); one core of the Zen 3 here, best of 3. */
#define ROW_PREFETCH_BYTES 4096

#if PD_HAS_AVX2
#include "blocks.h"

/* All ones from lane `skip` on (skip 0-8): loadu of LANE_MASKS + 8 - skip (the window of 8
 * Q4_1 blocks moved back at a row's end masks out the blocks already counted). */
static const int32_t LANE_MASKS[16] = {0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1, -1, -1, -1, -1};

/* The sum of v's 8 lanes. */
static inline float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* At Q4_1 block b, a multiple of 8: the scales of blocks b.. into d8, and their minima's part
 * (sum m[b] * xsum[b], see quants.c's header) into each row's accumulator, so that no second pass
 * over the row is needed (it cost a fifth of the time at one row of x). Returns the block that
 * d8's lane 0 holds. Near the row's end the window of 8 is moved back to end at its last
 * block, inside the row (reading past it could read past the tensor), with the blocks already
 * counted masked out of the minima; only rows of fewer than 8 blocks copy their scales out
 * (the copy's reload stalls on store forwarding, which small rows can afford). */
static inline __attribute__((always_inline)) int64_t group_start_avx2(const uint8_t *w_row, int64_t K,
                                                                      int64_t blocks, int64_t b, const float *xsum,
                                                                      int64_t xsum_stride, int rows, __m256 *d8,
                                                                      __m256 *acc) {
    const uint16_t *d_all = (const uint16_t *)(w_row + K / 2), *m_all = d_all + blocks;
    __m256 m8;
    int64_t base = b;
    if (blocks < 8) {
        uint16_t d_copy[8] = {0}, m_copy[8] = {0};
        memcpy(d_copy, d_all, (size_t)blocks * sizeof(uint16_t));
        memcpy(m_copy, m_all, (size_t)blocks * sizeof(uint16_t));
        *d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d_copy));
        m8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)m_copy));
    } else {
        if (b + 8 > blocks) base = blocks - 8;
        *d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d_all + base)));
        m8 = _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m_all + base))),
                           _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(LANE_MASKS + 8 - (b - base)))));
    }
    for (int r = 0; r < rows; r++)
        acc[r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xsum + r * xsum_stride + base), acc[r]);
    return base;
}
#endif
#endif
