/*
 * bf16 <-> fp32 for the CPU kernels, and element access to arrays of either (included by each C source beside it; the build's cache key
 * covers this header too, pdserve/kernels/cpu_build.py).
 */
#ifndef PDSERVE_BF16_H
#define PDSERVE_BF16_H
#include <stdint.h>
#include <string.h>

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
