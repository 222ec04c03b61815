/*
 * The small per-layer ops of a CPU decode step, one call each instead of a chain of torch ops:
 *   - pd_rms_norm: RMSNorm, optionally after the residual add (x + delta, written back), as
 *     Hugging Face's LlamaRMSNorm computes it;
 *   - pd_rope_and_cache: RoPE on the q and k heads of the fused q/k/v projection's output, in
 *     place, then k and v written into their paged-cache slots;
 *   - pd_silu_mul: the MLP's silu(gate) * up, 16 (AVX-512) or 8 (AVX2) at a time;
 *   - pd_gelu_tanh_mul: Gemma's gelu(gate, approximate="tanh") * up, 16 at a time (AVX-512).
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
 * Unlike the kernels beside it, this file has no arch/x86 twin: its 16-lane (PD_HAS_AVX512_BW_VL)
 * and 8-lane (PD_HAS_AVX2_FMA, isa.h) branches sit inside loops whose scalar code they share
 * (RoPE's other head sizes and the KV write, SiLU's last lanes), which a twin would duplicate.
 * Built at first use with the host compiler and -march=native (pdserve/kernels/cpu/build.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "isa.h"
#include "bf16.h"
#include "kernels.h"
#include "vexp.h"

/* v rounded to the dtype (bf16 values are exact in fp32). */
static inline float round_to(int is_bf16, float v) { return is_bf16 ? bf16_to_fp32(fp32_to_bf16(v)) : v; }

#define MAX_DIM 16384

#if PD_HAS_AVX512_BW_VL
/* 16 lanes at a time: the same per-element arithmetic as the scalar loops, so the same bits. */

/* round_to for 16 lanes (bf16.h's round_bf16x16 where the dtype is bf16). */
static inline __m512 round_to16(int is_bf16, __m512 v) { return is_bf16 ? round_bf16x16(v) : v; }

/* lanes (a mask of the first n) of a[i..] as fp32; zeros elsewhere. */
static inline __m512 load_lanes16(const void *a, int is_bf16, int64_t i, __mmask16 lanes) {
    if (lanes == 0xffff) return is_bf16 ? bf16x16_to_fp32((const uint16_t *)a + i) : _mm512_loadu_ps((const float *)a + i);
    if (!is_bf16) return _mm512_maskz_loadu_ps(lanes, (const float *)a + i);
    const __m256i raw = _mm256_maskz_loadu_epi16(lanes, (const uint16_t *)a + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* v's lanes to a[i..], rounded to a's dtype (put_f32 for a vector). */
static inline void store_lanes16(void *a, int is_bf16, int64_t i, __mmask16 lanes, __m512 v) {
    if (is_bf16)
        _mm256_mask_storeu_epi16((uint16_t *)a + i, lanes, fp32x16_to_bf16(v));
    else
        _mm512_mask_storeu_ps((float *)a + i, lanes, v);
}
#endif

/*
 * out[r] = weight * norm(s[r]) for rows r of `dim`, where s = x, or s = x + delta (rounded to the
 * dtype, and written to sum_out) when delta is not NULL. HF's LlamaRMSNorm: in fp32,
 * normed = s * (1 / sqrt(mean(s^2) + eps)), then weight * normed; in bf16 the normed value is
 * rounded to bf16 before the weight multiplies it, and the product is rounded again. x, delta,
 * sum_out, weight and out share one dtype; sum_out may be x itself, out too.
 * weight_f32: the weight is fp32 whatever the dtype, and multiplies the unrounded normed value,
 * the product rounded once (HF's Gemma3RMSNorm, whose weight is 1 + w in fp32); in fp32 the same
 * as the Llama form.
 */
void pd_rms_norm(const void *x, const void *delta, void *sum_out, const void *weight, void *out, int64_t rows,
                 int64_t dim, float eps, int is_bf16, int weight_f32) {
    const int llama_bf16 = is_bf16 && !weight_f32; /* normed rounded to bf16, the weight bf16 */
    float s[MAX_DIM];
#if PD_HAS_AVX512_BW_VL
    for (int64_t r = 0; r < rows; r++) {
        const int64_t row = r * dim;
        for (int64_t j = 0; j < dim; j += 16) {
            const __mmask16 lanes = first_lanes(dim - j);
            __m512 v = load_lanes16(x, is_bf16, row + j, lanes);
            if (delta != NULL) {
                v = round_to16(is_bf16, _mm512_add_ps(v, load_lanes16(delta, is_bf16, row + j, lanes)));
                store_lanes16(sum_out, is_bf16, row + j, lanes, v);
            }
            _mm512_mask_storeu_ps(s + j, lanes, v);
        }
        __m256 lanes8 = _mm256_setzero_ps(); /* the scalar loop's 8 lanes, in its order */
        int64_t j = 0;
        for (; j + 8 <= dim; j += 8) {
            const __m256 v = _mm256_loadu_ps(s + j);
            lanes8 = _mm256_add_ps(lanes8, _mm256_mul_ps(v, v));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, lanes8);
        float sum_sq = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
        for (; j < dim; j++) sum_sq += s[j] * s[j];
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(sum_sq / (float)dim + eps));
        for (j = 0; j < dim; j += 16) {
            const __mmask16 lanes = first_lanes(dim - j);
            const __m512 normed = round_to16(llama_bf16, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, s + j), inv));
            store_lanes16(out, is_bf16, row + j, lanes, _mm512_mul_ps(load_lanes16(weight, llama_bf16, j, lanes), normed));
        }
    }
#else
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
            const float normed = round_to(llama_bf16, s[j] * inv);
            put_f32(out, is_bf16, row + j, get_f32(weight, llama_bf16, j) * normed);
        }
    }
#endif
}

/*
 * qkv: [rows, heads + 2 * kv_heads, head_dim] (the fused projection's output, contiguous), q and
 * k heads rotated in place: x * cos + rotate_half(x) * sin, with sin_signed = cat(-sin, sin) so
 * that rotate_half(x) * sin = cat(x2, x1) * sin_signed; cos and sin_signed are [rows, head_dim]
 * in qkv's dtype. As torch computes it (rotary.apply_rope: addcmul(x * cos, swapped, sin_signed)):
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
#if PD_HAS_AVX512_BW_VL
        if (half % 16 == 0 && head_dim <= 256) { /* each half whole vectors: swapped is a vector too */
            __m512 c[16], sn[16];
            const int64_t nvec = head_dim / 16, half_vecs = half / 16;
            for (int64_t v = 0; v < nvec; v++) {
                c[v] = load_lanes16(cos, is_bf16, trig + 16 * v, 0xffff);
                sn[v] = load_lanes16(sin_signed, is_bf16, trig + 16 * v, 0xffff);
            }
            for (int64_t h = 0; h < heads + kv_heads; h++) {
                const int64_t base = r * width + h * head_dim;
                __m512 xv[16];
                for (int64_t v = 0; v < nvec; v++) xv[v] = load_lanes16(qkv, is_bf16, base + 16 * v, 0xffff);
                for (int64_t v = 0; v < nvec; v++) {
                    const __m512 swapped = xv[v < half_vecs ? v + half_vecs : v - half_vecs];
                    const __m512 a = round_to16(is_bf16, _mm512_mul_ps(xv[v], c[v]));
                    store_lanes16(qkv, is_bf16, base + 16 * v, 0xffff, _mm512_fmadd_ps(swapped, sn[v], a));
                }
            }
        } else
#endif
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
        if (cache_is_bf16 == is_bf16) { /* the same dtype: the bytes as they are */
            const size_t es = is_bf16 ? 2 : 4, bytes = (size_t)(kv_heads * head_dim) * es;
            memcpy((char *)cache + (size_t)dst * es, (const char *)qkv + (size_t)k_src * es, bytes);
            memcpy((char *)cache + (size_t)(dst + half_stride) * es, (const char *)qkv + (size_t)v_src * es, bytes);
            continue;
        }
        for (int64_t e = 0; e < kv_heads * head_dim; e++) {
            put_f32(cache, cache_is_bf16, dst + e, get_f32(qkv, is_bf16, k_src + e));
            put_f32(cache, cache_is_bf16, dst + half_stride + e, get_f32(qkv, is_bf16, v_src + e));
        }
    }
}

/*
 * SiLU(gate) * up in fp32, e = exp(-|g|) so that the exp never overflows (0 below exp's clamp):
 *   g >= 0: g / (1 + e)        g < 0: g e / (1 + e)        (both equal g / (1 + exp(-g)))
 * In bf16 the SiLU is rounded to bf16 before up multiplies it, and the product again, as torch's
 * F.silu(gate) * up rounds them. The exp is vexp.h's (within 2 ulp of expf), not torch's, so in
 * fp32 a value may differ from torch's by an ulp or two, and in bf16 where that ulp crosses a
 * rounding boundary. The fused decoder layer and the per-op path (llama.LlamaMLP) both call
 * this function, so they agree bit for bit with each other.
 * Why in C: as a scalar loop over expf inside the fused layer it was 9% of an 8-sequence decode
 * step of SmolLM2-135M on one Zen 5 core (1.3 ms of 14).
 */
#if PD_HAS_AVX512_BW_VL
static inline __m512 silu_mul16(__m512 g, __m512 up, int is_bf16) {
    const __m512 minus_abs = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g));
    /* 0 where exp's clamp would leave 2^-126 (a SiLU of g < -87 is -0 in bf16, as torch has it) */
    const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(minus_abs, _mm512_set1_ps(EXP_MIN), _CMP_GE_OQ),
                                         exp_nonpositive(minus_abs));
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 silu = _mm512_div_ps(_mm512_mask_mul_ps(g, negative, g, e), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    return _mm512_mul_ps(round_to16(is_bf16, silu), up);
}
#define SILU_LANES 16
#elif PD_HAS_AVX2_FMA
static inline __m256 silu_mul8(__m256 g, __m256 up, int is_bf16) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256 minus_abs = _mm256_sub_ps(zero, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g));
    const __m256 e = _mm256_and_ps(exp_nonpositive8(minus_abs), _mm256_cmp_ps(minus_abs, _mm256_set1_ps(EXP_MIN), _CMP_GE_OQ));
    const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), _mm256_cmp_ps(g, zero, _CMP_LT_OQ));
    __m256 silu = _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    if (is_bf16) { /* round to nearest even to bf16 and back, a NaN made quiet: round_to's bits */
        const __m256i bits = _mm256_castps_si256(silu);
        const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)));
        const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(bits, bias), _mm256_set1_epi32((int)0xffff0000u));
        const __m256 quiet = _mm256_and_ps(_mm256_or_ps(silu, _mm256_castsi256_ps(_mm256_set1_epi32(0x400000))),
                                           _mm256_castsi256_ps(_mm256_set1_epi32((int)0xffff0000u)));
        silu = _mm256_blendv_ps(_mm256_castsi256_ps(rounded), quiet, _mm256_cmp_ps(silu, silu, _CMP_UNORD_Q));
    }
    return _mm256_mul_ps(silu, up);
}
#define SILU_LANES 8
#else
#define SILU_LANES 1
#endif

/*
 * act[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i] for rows r of gate_up [rows, 2 * inter]
 * (the fused gate/up projection's output: gate, then up) into act [rows, inter], both in the
 * activations' dtype (is_bf16).
 */
void pd_silu_mul(const void *gate_up, void *act, int64_t rows, int64_t inter, int is_bf16) {
    const size_t es = is_bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) {
        const char *gate = (const char *)gate_up + (size_t)(r * 2 * inter) * es, *up = gate + (size_t)inter * es;
        char *out = (char *)act + (size_t)(r * inter) * es;
        int64_t i = 0;
#if SILU_LANES == 16
        for (; i < inter; i += 16) {
            const __mmask16 lanes = first_lanes(inter - i);
            const __m512 g = load_lanes16(gate, is_bf16, i, lanes), u = load_lanes16(up, is_bf16, i, lanes);
            store_lanes16(out, is_bf16, i, lanes, silu_mul16(g, u, is_bf16));
        }
#elif SILU_LANES == 8
        for (; i < inter; i += 8) {
            const int64_t n = inter - i < 8 ? inter - i : 8;
            if (n == 8 && !is_bf16) {
                const float *g = (const float *)gate + i, *u = (const float *)up + i;
                _mm256_storeu_ps((float *)out + i, silu_mul8(_mm256_loadu_ps(g), _mm256_loadu_ps(u), 0));
                continue;
            }
            /* bf16, and the last few lanes, through a padded fp32 copy: the same arithmetic */
            float g8[8] = {0}, u8[8] = {0}, y8[8];
            for (int64_t l = 0; l < n; l++) g8[l] = get_f32(gate, is_bf16, i + l), u8[l] = get_f32(up, is_bf16, i + l);
            _mm256_storeu_ps(y8, silu_mul8(_mm256_loadu_ps(g8), _mm256_loadu_ps(u8), is_bf16));
            for (int64_t l = 0; l < n; l++) put_f32(out, is_bf16, i + l, y8[l]);
        }
#else
        for (; i < inter; i++) {
            const float g = get_f32(gate, is_bf16, i), e = expf(-fabsf(g));
            const float silu = round_to(is_bf16, (g < 0 ? g * e : g) / (1.0f + e));
            put_f32(out, is_bf16, i, silu * get_f32(up, is_bf16, i));
        }
#endif
    }
}

/*
 * GELU's tanh form times up (HF's gelu_pytorch_tanh, GeGLU): in fp32
 *   gelu(g) = 0.5 g (1 + tanh(u)),  u = sqrt(2 / pi) (g + 0.044715 g^3)
 * with tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2 |u|) (vexp.h's exp where there is
 * AVX-512, expf elsewhere; 0 below exp's clamp). 1 + tanh(u) is formed as torch forms it, so
 * that in the negative tail (g < -3, where it is 1 minus nearly 1) the values cancel as
 * torch's do: g e / (1 + e) would be nearer the exact GELU there and further from torch's,
 * which the model is held to (bf16 results unequal to torch's: 2.5% of normal(0, 4) inputs
 * this way, 13% that way, nearly all in that tail). In bf16 the GELU is
 * rounded to bf16 before up multiplies it, and the product again, as torch's
 * F.gelu(gate, approximate="tanh") * up rounds them. The exp is not torch's (Sleef's tanh), so a
 * value may differ from torch's by a rounding; the fused decoder layer and the per-op path
 * (activation.gelu_tanh_and_mul) both call this function, so they agree with each other.
 */
#define GELU_K0 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_K1 0.044715f

static inline float gelu_tanh1(float g) {
    const float u = GELU_K0 * (g + GELU_K1 * g * g * g);
    const float minus = -2.0f * fabsf(u), e = minus >= EXP_MIN ? expf(minus) : 0.0f;
    const float t = (1.0f - e) / (1.0f + e);
    return 0.5f * g * (1.0f + (u < 0 ? -t : t));
}

#if PD_HAS_AVX512_BW_VL
static inline __m512 gelu_tanh16(__m512 g) {
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(GELU_K0), _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(GELU_K1), cube)));
    const __m512 minus = _mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_abs_ps(u));
    const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(minus, _mm512_set1_ps(EXP_MIN), _CMP_GE_OQ),
                                         exp_nonpositive(minus));
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    t = _mm512_mask_sub_ps(t, _mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_setzero_ps(), t);
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, t));
}
#endif

/* act[r, i] = gelu_tanh(gate_up[r, i]) * gate_up[r, inter + i], as pd_silu_mul lays them out. */
void pd_gelu_tanh_mul(const void *gate_up, void *act, int64_t rows, int64_t inter, int is_bf16) {
    const size_t es = is_bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) {
        const char *gate = (const char *)gate_up + (size_t)(r * 2 * inter) * es, *up = gate + (size_t)inter * es;
        char *out = (char *)act + (size_t)(r * inter) * es;
#if PD_HAS_AVX512_BW_VL
        for (int64_t i = 0; i < inter; i += 16) {
            const __mmask16 lanes = first_lanes(inter - i);
            const __m512 g = load_lanes16(gate, is_bf16, i, lanes), u = load_lanes16(up, is_bf16, i, lanes);
            store_lanes16(out, is_bf16, i, lanes, _mm512_mul_ps(round_to16(is_bf16, gelu_tanh16(g)), u));
        }
#else
        for (int64_t i = 0; i < inter; i++) {
            const float gelu = round_to(is_bf16, gelu_tanh1(get_f32(gate, is_bf16, i)));
            put_f32(out, is_bf16, i, gelu * get_f32(up, is_bf16, i));
        }
#endif
    }
}
