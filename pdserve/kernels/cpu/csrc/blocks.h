/*
 * GGUF's weight blocks as the CPU kernels hold them (the layouts are described in
 * quants.c's header), and fp16 -> fp32 for their scales. Included by each C source that
 * reads blocks; the build's cache key covers this header too (pdserve/kernels/cpu/build.py).
 */
#ifndef PDSERVE_BLOCKS_H
#define PDSERVE_BLOCKS_H
#include <stdint.h>
#include <string.h>
#include "isa.h"

#define QK 32          /* weights a block */
#define Q4_1_BYTES 20  /* fp16 d, fp16 m, 16 bytes of nibbles */
#define Q8_0_BYTES 34  /* fp16 d, 32 int8 */

/* The kinds of block rows (pdserve/kernels/cpu/quant.py's BlockKind): Q4_1 and Q8_0 as
 * quants.c's header lays them out, and the same blocks interleaved 16 rows at a time for
 * the int8-activation kernels of repack_a8.c (its header has the layout). */
enum { KIND_Q4_1 = 0, KIND_Q8_0 = 1, KIND_Q4_1_X16 = 2, KIND_Q8_0_X16 = 3 };
/* And the kinds held exactly as GGUF stores them (quants_k.h has their layouts), which
 * pd_quant_matmul, pd_quant_matmul_a8 and pd_quant_dequant hand to quants_k.c. */
enum { KIND_Q4_0 = 4, KIND_Q5_0 = 5, KIND_Q5_1 = 6, KIND_Q4_K = 7, KIND_Q5_K = 8, KIND_Q6_K = 9 };
static inline int is_k_kind(int kind) { return kind >= KIND_Q4_0 && kind <= KIND_Q6_K; }
/* And GGUF's Q4_0, Q5_0, Q5_1 and Q4_K interleaved 16 rows at a time for repack_a8.c's int8
 * kernel (its header has the layout): the int8-activation route only. */
enum { KIND_Q4_0_X16 = 10, KIND_Q5_0_X16 = 11, KIND_Q5_1_X16 = 12, KIND_Q4_K_X16 = 13 };
static inline int is_x16_gguf(int kind) { return kind >= KIND_Q4_0_X16 && kind <= KIND_Q4_K_X16; }

/* The kind held as GGUF stores them (KIND_Q4_0 ...) whose blocks an interleaved GGUF kind holds. */
static inline int x16_gguf_plain(int kind) {
    return kind == KIND_Q4_K_X16 ? KIND_Q4_K : kind - KIND_Q4_0_X16 + KIND_Q4_0;
}

/* Bytes of one block and weights it holds, per kind held as GGUF stores them (KIND_Q4_0 ...). */
static inline int k_block_bytes(int kind) {
    switch (kind) {
        case KIND_Q4_0: return 18;  /* fp16 d, 16 bytes of nibbles */
        case KIND_Q5_0: return 22;  /* fp16 d, 4 bytes qh, 16 qs */
        case KIND_Q5_1: return 24;  /* fp16 d, fp16 m, 4 qh, 16 qs */
        case KIND_Q4_K: return 144; /* fp16 d, dmin, 12 bytes of scales, 128 qs */
        case KIND_Q5_K: return 176; /* fp16 d, dmin, 12 scales, 32 qh, 128 qs */
        default: return 210;        /* Q6_K: 128 ql, 64 qh, 16 int8 scales, fp16 d */
    }
}

static inline int k_block_weights(int kind) { return kind >= KIND_Q4_K ? 256 : 32; }
#define X16 16 /* weight rows an interleaved group holds */

static inline float fp16_to_fp32(uint16_t h) {
#if PD_HAS_F16C
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

static inline int block_bytes(int kind) {
    if (is_x16_gguf(kind)) return k_block_bytes(x16_gguf_plain(kind));
    return kind == KIND_Q4_1 || kind == KIND_Q4_1_X16 ? Q4_1_BYTES : Q8_0_BYTES;
}

/* Weights of one block of an interleaved kind: Q4_K_X16's super-blocks 256, the others 32. */
static inline int x16_block_weights(int kind) { return is_x16_gguf(kind) ? k_block_weights(x16_gguf_plain(kind)) : QK; }

static inline int is_x16(int kind) { return kind == KIND_Q4_1_X16 || kind == KIND_Q8_0_X16; }

/* The row-major kind holding the same blocks (KIND_Q4_1 or KIND_Q8_0). */
static inline int plain_kind(int kind) { return is_x16(kind) ? kind - KIND_Q4_1_X16 : kind; }

/* An interleaved chunk's vectors of 64 bytes (4 bytes of each of its 16 rows' blocks), before its
 * scales: Q4_1's 16 nibble bytes a block make 4, Q8_0's 32 weights 8. */
static inline int x16_words(int kind) { return plain_kind(kind) == KIND_Q4_1 ? 4 : 8; }

/* Block b of weight row n of an interleaved (x16) matrix of K inputs, as its plain kind holds it:
 * Q4_1's 16 nibble bytes or Q8_0's 32 int8 into qs, its fp16 scale d and minimum m (0 for
 * Q8_0). Where the plain loops of repack_a8.c and repack_bf16.c and the dequantization of single
 * rows read them. */
static inline void x16_block(int kind, const uint8_t *w, int64_t K, int64_t n, int64_t b, uint8_t *qs, uint16_t *d,
                             uint16_t *m) {
    const int64_t blocks = K / QK, lane = n % X16;
    const uint8_t *chunk = w + ((n / X16) * blocks + b) * X16 * block_bytes(kind);
    const int words = x16_words(kind); /* 4-byte pieces of a row's block */
    for (int i = 0; i < words; i++) memcpy(qs + 4 * i, chunk + 64 * i + 4 * lane, 4);
    const uint8_t *scales = chunk + 64 * words;
    memcpy(d, scales + 2 * lane, 2);
    *m = 0;
    if (kind == KIND_Q4_1_X16)
        memcpy(m, scales + 2 * X16 + 2 * lane, 2);
    else
        for (int j = 0; j < QK; j++) qs[j] ^= 0x80; /* stored plus 128 (repack_a8.c) */
}
#endif
