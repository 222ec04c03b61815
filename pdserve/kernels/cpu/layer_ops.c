/*
 * The small per-layer ops of a CPU decode step, one call each instead of a chain of torch ops:
 *   - pd_rms_norm: RMSNorm, optionally after the residual add (x + delta, written back), as
 *     Hugging Face's LlamaRMSNorm computes it;
 *   - pd_rope_and_cache: RoPE on the q and k heads of the fused q/k/v projection's output, in
 *     place, then k and v written into their paged-cache slots.
 * At one or a few rows these ops are all overhead: torch's fp32 rms_norm is eight ops (pow,
 * mean, add, rsqrt, two muls, casts), ~100 us a norm on the AMD EPYC (Zen 3) here, 61 norms a
 * step; RoPE and the KV write are a cat, three arithmetic ops and two index_puts a layer.
 *
 * Numerics follow the torch ops they replace: fp32 products and sums rounded as torch rounds
 * them (this file is built with -std=c11, where GCC does not contract a * b + c into an fma
 * unless asked with fmaf), bf16 results rounded to nearest even once where torch rounds them.
 * The one difference is the order of RMSNorm's sum of squares in fp32 (torch's vectorised
 * reduction, whose lanes depend on the CPU, vs 8 lanes here): the scale may differ by a
 * rounding. In bf16 the norm is bit-identical (its rounding to bf16 absorbs that).
 *
 * Built at first use with the host compiler and -march=native (pdserve/kernels/cpu_build.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "bf16.h"
#include "kernels.h"

/* v rounded to the dtype (bf16 values are exact in fp32). */
static inline float round_to(int is_bf16, float v) { return is_bf16 ? bf16_to_fp32(fp32_to_bf16(v)) : v; }

#define MAX_DIM 16384

/*
 * out[r] = weight * norm(s[r]) for rows r of `dim`, where s = x, or s = x + delta (rounded to the
 * dtype, and written to sum_out) when delta is not NULL. HF's LlamaRMSNorm: in fp32,
 * normed = s * (1 / sqrt(mean(s^2) + eps)), then weight * normed; in bf16 the normed value is
 * rounded to bf16 before the weight multiplies it, and the product is rounded again. x, delta,
 * sum_out, weight and out share one dtype; sum_out may be x itself.
 */
void pd_rms_norm(const void *x, const void *delta, void *sum_out, const void *weight, void *out, int64_t rows,
                 int64_t dim, float eps, int is_bf16) {
    float s[MAX_DIM];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t row = r * dim;
        for (int64_t j = 0; j < dim; j++) {
            float v = get_f32(x, is_bf16, row + j);
            if (delta != NULL) {
                v = round_to(is_bf16, v + get_f32(delta, is_bf16, row + j));
                put_f32(sum_out, is_bf16, row + j, v);
            }
            s[j] = v;
        }
        float lanes[8] = {0};
        int64_t j = 0;
        for (; j + 8 <= dim; j += 8)
            for (int l = 0; l < 8; l++) lanes[l] += s[j + l] * s[j + l];
        float sum_sq = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
        for (; j < dim; j++) sum_sq += s[j] * s[j];
        const float inv = 1.0f / sqrtf(sum_sq / (float)dim + eps);
        for (j = 0; j < dim; j++) {
            const float normed = round_to(is_bf16, s[j] * inv);
            put_f32(out, is_bf16, row + j, get_f32(weight, is_bf16, j) * normed);
        }
    }
}

/*
 * qkv: [rows, heads + 2 * kv_heads, head_dim] (the fused projection's output, contiguous), q and
 * k heads rotated in place: x * cos + rotate_half(x) * sin, with sin_signed = cat(-sin, sin) so
 * that rotate_half(x) * sin = cat(x2, x1) * sin_signed; cos and sin_signed are [rows, head_dim]
 * in qkv's dtype. As torch computes it (llama.apply_rope: addcmul(x * cos, swapped, sin_signed)):
 * x * cos rounded to the dtype, then addcmul's fused multiply-add swapped * sin_signed + that in
 * fp32, rounded to the dtype once (bit-identical to torch's in fp32 and bf16, tested).
 * Then row r's k and v heads go to cache slot slots[r] (skipped when negative) of the layer's
 * view: block slots[r] / block_size at block_stride elements a block, K at offset 0 and V at
 * half_stride within it, position slots[r] % block_size at kv_heads * head_dim elements each.
 */
void pd_rope_and_cache(void *qkv, int is_bf16, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       const void *cos, const void *sin_signed, void *cache, int cache_is_bf16,
                       const int64_t *slots, int64_t block_size, int64_t block_stride, int64_t half_stride) {
    const int64_t width = (heads + 2 * kv_heads) * head_dim, half = head_dim / 2;
    float x[MAX_DIM];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t trig = r * head_dim;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            const int64_t base = r * width + h * head_dim;
            for (int64_t d = 0; d < head_dim; d++) x[d] = get_f32(qkv, is_bf16, base + d);
            for (int64_t d = 0; d < head_dim; d++) {
                const float c = get_f32(cos, is_bf16, trig + d), sn = get_f32(sin_signed, is_bf16, trig + d);
                const float swapped = x[d < half ? d + half : d - half];
                const float a = round_to(is_bf16, x[d] * c);
                put_f32(qkv, is_bf16, base + d, fmaf(swapped, sn, a));
            }
        }
        const int64_t slot = slots[r];
        if (slot < 0) continue;
        const int64_t dst = (slot / block_size) * block_stride + (slot % block_size) * kv_heads * head_dim;
        const int64_t k_src = r * width + heads * head_dim, v_src = k_src + kv_heads * head_dim;
        for (int64_t e = 0; e < kv_heads * head_dim; e++) {
            put_f32(cache, cache_is_bf16, dst + e, get_f32(qkv, is_bf16, k_src + e));
            put_f32(cache, cache_is_bf16, dst + half_stride + e, get_f32(qkv, is_bf16, v_src + e));
        }
    }
}
