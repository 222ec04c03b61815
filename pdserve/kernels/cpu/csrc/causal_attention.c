/*
 * Causal attention of a prompt chunk over its cached prefix and itself, in bf16: the prefill
 * engine's attention, where the CPU has AVX512-BF16. The kernel (both products on vdpbf16ps,
 * rounding as torch's flash SDPA kernel does for bf16) is arch/x86/causal_attention.c's, whose header says
 * how and why. There is no plain C version of it: the twin here answers "not here" (-2), and the
 * caller (pdserve/kernels/cpu/causal_attention.py) keeps torch's SDPA; arch_fallback.h makes it
 * the entry point of a build without AVX512-BF16.
 */
#include <stdint.h>
#include "isa.h"
#include "attention.h"
#include "kernels.h"

/*
 * out[Lq, Hq, D] = causal softmax(scale * q k^T) v per query head, GQA (query head h reads KV head
 * h / (Hq / Hkv)); q [Lq, Hq, D] the queries at the last Lq of the L positions (Lq = L: a chunk
 * with no cached prefix), k and v [L, Hkv, D], all bf16 with rows q_stride, k_stride, v_stride
 * and out_stride elements apart (each row's heads contiguous). window: a sliding window W (the
 * query at position i sees keys i - W < j <= i: transformers' and llama.cpp's sliding window),
 * 0 for none.
 * Returns 0; -1 when a buffer could not be allocated; -2 where it does not run (no AVX512-BF16,
 * D not a multiple of 32 or over 128): nothing is written then.
 */
int pd_causal_attention_bf16_generic(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                                     const uint16_t *v, int64_t v_stride, int64_t Lq, int64_t L, int64_t Hq,
                                     int64_t Hkv, int64_t D, float scale, int64_t window, uint16_t *out,
                                     int64_t out_stride, int threads) {
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)Lq, (void)L, (void)Hq, (void)Hkv;
    (void)D;
    (void)scale, (void)window, (void)out, (void)out_stride, (void)threads;
    return -2;
}
