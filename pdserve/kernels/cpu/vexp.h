/*
 * exp for softmax, 16 at a time (AVX-512): shared by the decode attention (paged_attention.c) and
 * the prefill one (causal_attention.c). Included by each C source beside it; the build's cache
 * key covers this header too (pdserve/kernels/cpu_build.py).
 */
#ifndef PDSERVE_VEXP_H
#define PDSERVE_VEXP_H
#if defined(__AVX512F__)
#include <immintrin.h>

/* exp(x) for x <= 0 (scores minus their maximum), 16 at a time: Cephes' expf (x = n ln2 + r,
 * |r| <= ln2 / 2, a degree-6 polynomial for e^r, then 2^n by vscalefps), within 2 ulp of expf;
 * below -87.3 the result is 0's neighbour 2^-126 or less, as expf's would be. */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif
#endif
