/*
 * bf16 <-> fp32 for the CPU kernels, element access to arrays of either, and (AVX-512) their
 * 16-wide loads, stores and broadcasts (included by each C source beside it; the build's cache
 * key covers this header too, pdserve/kernels/cpu/build.py).
 */
#ifndef PDSERVE_BF16_H
#define PDSERVE_BF16_H
#include <stdint.h>
#include <string.h>
#include "isa.h"

static inline float bf16_to_fp32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t fp32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}
#if PD_HAS_AVX512
/* 16 bf16 from src as fp32 (exact: the bits moved up). */
static inline __m512 bf16x16_to_fp32(const uint16_t *src) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
}

/* The first n lanes of a vector (all 16 from n = 16 on; n >= 1). */
static inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

/* 16 fp32 rounded as fp32_to_bf16 rounds one (to nearest even; a NaN made quiet), the bf16 in
 * the high half of each lane and the rounding's carry left in the low half. */
static inline __m512i bf16x16_high_bits(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i rounded = _mm512_add_epi32(
        bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1))));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)); /* (bits >> 16) | 0x40 */
    return _mm512_mask_blend_epi32(nan, rounded, quiet);
}

/* 16 fp32 rounded to bf16 and back, in place: bf16_to_fp32(fp32_to_bf16(v)) for a vector. */
static inline __m512 round_bf16x16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(bf16x16_high_bits(v), _mm512_set1_epi32((int)0xffff0000u)));
}

/* 16 fp32 as bf16, each rounded as fp32_to_bf16 rounds one. */
static inline __m256i fp32x16_to_bf16(__m512 v) {
    const __m512i chosen = bf16x16_high_bits(v);
#if PD_HAS_AVX512_BW
    /* The high halves gathered by one vpermw rather than vpmovdw, which GCC folds into the store
     * (a slow form on AMD Zen 4/5): SiLU x up of 512 rows in bf16 on one Zen 5 core, 365 -> 346 us. */
    const __m512i high_halves = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 31, 29, 27,
                                                 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi16(high_halves, chosen));
#else
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(chosen, 16));
#endif
}

/* The 4 bytes at `at` (any alignment) in every 32-bit lane: a pair of bf16 or four int8 of x,
 * against 16 rows at once in one vdpbf16ps or vpdpbusd. */
static inline __m512i broadcast_u32(const void *at) {
    uint32_t word;
    memcpy(&word, at, 4);
    return _mm512_set1_epi32((int)word);
}

/* 16 fp32 to a[i..i+15] of an fp32 or bf16 array (rounded to nearest even): put_f32 for a vector. */
static inline void put_f32x16(void *a, int is_bf16, int64_t i, __m512 v) {
    if (is_bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)a + i), fp32x16_to_bf16(v));
    else
        _mm512_storeu_ps((float *)a + i, v);
}

/* 32 decoded weights (lo: the first 16, hi: the next) to a[i..i+31] of an fp32 or bf16 array,
 * rounded to nearest even once: the dequantizations' store. With AVX512-BF16 one
 * vcvtne2ps2bf16 for the 32; it flushes denormals, which no weight is (fp16 scales times
 * integers make every weight 0 or a multiple of 2^-24), so the bits are put_f32x16's. SmolLM2's
 * 120 layer matrices into fresh bf16 buffers, one Zen 5 core: 17.4 -> 16.0 ms (the writes bound
 * it). */
static inline void put_f32x32(void *a, int is_bf16, int64_t i, __m512 lo, __m512 hi) {
#if PD_HAS_AVX512_BF16
    if (is_bf16) {
        _mm512_storeu_si512((uint16_t *)a + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        return;
    }
#endif
    put_f32x16(a, is_bf16, i, lo);
    put_f32x16(a, is_bf16, i + 16, hi);
}
#endif

/* Element i of a bf16 (is_bf16) or fp32 array, as fp32. */
static inline float get_f32(const void *a, int is_bf16, int64_t i) {
    return is_bf16 ? bf16_to_fp32(((const uint16_t *)a)[i]) : ((const float *)a)[i];
}

/* a[i] = v, rounded to the array's dtype. */
static inline void put_f32(void *a, int is_bf16, int64_t i, float v) {
    if (is_bf16)
        ((uint16_t *)a)[i] = fp32_to_bf16(v);
    else
        ((float *)a)[i] = v;
}
#endif
