/*
 * GGUF's weight blocks as the CPU kernels hold them (the layouts are described in
 * quant_matmul.c's header), and fp16 -> fp32 for their scales. Included by each C source that
 * reads blocks; the build's cache key covers this header too (pdserve/kernels/cpu_build.py).
 */
#ifndef PDSERVE_BLOCKS_H
#define PDSERVE_BLOCKS_H
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#define QK 32          /* weights a block */
#define Q4_1_BYTES 20  /* fp16 d, fp16 m, 16 bytes of nibbles */
#define Q8_0_BYTES 34  /* fp16 d, 32 int8 */

static inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: renormalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline int block_bytes(int kind) { return kind == 0 ? Q4_1_BYTES : Q8_0_BYTES; }
#endif
