/*
 * How far ahead of its reads a decode kernel that streams a matrix asks for the bytes: the
 * distance tuned on one core, over the threads of the call (at least PREFETCH_MIN_BYTES). The
 * threads share the memory's bandwidth, so each stream is slower and keeps its bytes in flight for
 * less long; a distance tuned on one core then holds too many lines. On a 2-core Zen 5 VM, at one
 * row of x from memory: the interleaved Q4_K kernel (arch/x86/repack_a8.c) 8 KB ahead 34.5-36.0
 * GB/s, 4 KB 37.7-39.0; the row-major Q6_K one (arch/x86/quants_k_a8.c) 40.5-42.8 and 42.1-44.6.
 */
#ifndef PDSERVE_ARCH_X86_PREFETCH_H
#define PDSERVE_ARCH_X86_PREFETCH_H
#include <stdint.h>

#define PREFETCH_MIN_BYTES 2048

/* The hint a decode kernel asks for a matrix's bytes with. A step reads every weight once, about
 * 100 MB for the bundled model, far more than any cache holds, so nothing gains from keeping them:
 * non-temporal, the lines come to L1 and leave without filling the caches behind it. The shared
 * L3 then keeps what the other processes on the box run on (the router, the other engine; the
 * KV cache). The kernels stream as fast either way; served, the router and one stream gain a little
 * (docs/performance.md, bench step: "Weights asked for non-temporal"). */
#define WEIGHT_HINT _MM_HINT_NTA

static inline int64_t prefetch_ahead(int64_t one_core_bytes, int threads) {
    const int64_t ahead = one_core_bytes / (threads > 1 ? threads : 1);
    return ahead > PREFETCH_MIN_BYTES ? ahead : PREFETCH_MIN_BYTES;
}
#endif
