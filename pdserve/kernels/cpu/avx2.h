/*
 * The AVX2 routes of the CPU kernels: CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2/3, older
 * Intel). AVX2_ROUTE is defined where they are built (by -march=native's feature macros), with
 * what they share. Included by each C source beside it; the build's cache key covers it.
 */
#ifndef PDSERVE_AVX2_H
#define PDSERVE_AVX2_H
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define AVX2_ROUTE 1
#include <immintrin.h>

/* The sum of v's 8 lanes. */
static inline float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif
#endif
