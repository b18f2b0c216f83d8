/* The elementwise work a bfloat16 language model does between its matrix multiplies, one pass each
 * (workers/fused_ops.py). HF's versions run several torch ops over float32 copies; at 527 rows of 512
 * on the AMD EPYC host its RMSNorm took 198-277 us (this one 71) and SiLU(gate) * up, 1376 wide, 560-582
 * (this one 373).
 *
 *   rms_norm_bf16:  out[r] = w * bf16(x[r] * rsqrt(mean(x[r]^2) + eps))     (float32 sums, bf16 out)
 *   silu_mul_bf16:  out = bf16(bf16(silu(g)) * u)
 *   rope_bf16:      out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))   (HF's apply_rotary_pos_emb)
 *
 * The roundings are where HF's ops round (each op's bf16 result), so the only differences are the order
 * of the squares' sum and the last bits of rsqrt and exp: each rounding may land one bf16 step from HF's.
 * The rotary embedding has neither: a product of two bf16 values is exact in float32, so its three
 * roundings give HF's bits.
 * Only built where the CPU has AVX512_BF16 (its rounding instruction); elsewhere HF's ops run.
 *
 *   rope_f32:       out = x * cos + rotate_half(x) * sin, float32, portable C on every host
 *
 * The same three operations an element as torch's float32 ops, none contracted into an FMA (the pragma
 * and the attribute, for clang and gcc): HF's bits. */
#include <math.h>
#include <stdint.h>

#pragma STDC FP_CONTRACT OFF
/* x: [B, H, T, D] at element strides xb, xh, xt (unit along D); cs, sn: [B, T, D] at cb, ct (cb = 0: one
 * batch row broadcast); out: [B, H, T, D] at ob, oh, ot. D even. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void rope_f32(const float *x, const float *cs, const float *sn, float *out, int64_t B, int64_t H, int64_t T,
              int64_t D, int64_t xb, int64_t xh, int64_t xt, int64_t cb, int64_t ct, int64_t ob, int64_t oh,
              int64_t ot) {
    const int64_t half = D / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++) {
                const float *restrict xr = x + b * xb + h * xh + t * xt, *restrict c = cs + b * cb + t * ct,
                            *restrict s = sn + b * cb + t * ct;
                float *restrict o = out + b * ob + h * oh + t * ot;
                for (int64_t i = 0; i < half; i++) {
                    const float lo_c = xr[i] * c[i], hi_s = -xr[half + i] * s[i];
                    const float hi_c = xr[half + i] * c[half + i], lo_s = xr[i] * s[half + i];
                    o[i] = lo_c + hi_s;
                    o[half + i] = hi_c + lo_s;
                }
            }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include "simd.h"

/* float32 -> bfloat16, round to nearest even (torch's rounding), and back */
static inline __m256i narrow(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
static inline __m512 round_bf16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow(x)), 16));
}

/* x, out: [rows, n] with row strides xs, os (elements); w: [n], the weight widened to float32 once
 * (exactly: a bf16 value is a float32 value). Rows up to 8192 wide keep their float32 copy on the stack
 * between the two passes. Returns 0, or -2 for a row wider than that. */
int rms_norm_bf16(const uint16_t *x, const float *w, uint16_t *out, int64_t rows, int64_t n,
                  int64_t xs, int64_t os, float eps) {
    float buf[8192] __attribute__((aligned(64)));
    if (n > 8192) return -2;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * xs;
        uint16_t *orow = out + r * os;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            const __m512 v = widen_bf16(xr + i, first16(n - i));
            _mm512_store_ps(buf + i, v);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)n + eps);
        const __m512 s = _mm512_set1_ps(inv);
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = first16(n - i);
            const __m512 y = round_bf16(_mm512_mul_ps(_mm512_load_ps(buf + i), s));
            _mm256_mask_storeu_epi16(orow + i, m, narrow(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + i), y)));
        }
    }
    return 0;
}

/* g, u, out: [rows, n] with row strides gs, us, os (elements). */
void silu_mul_bf16(const uint16_t *g, const uint16_t *u, uint16_t *out, int64_t rows, int64_t n,
                   int64_t gs, int64_t us, int64_t os) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = first16(n - i);
            const __m512 x = widen_bf16(g + r * gs + i, m);
            /* from e = e^-|x| (exp16 takes x <= 0): x / (1 + e) for x >= 0, as torch's x / (1 + e^-x);
             * x * e / (1 + e) below, the same value without e^-x overflowing */
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
            const __m512 num = _mm512_mask_mul_ps(x, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), x, e);
            const __m512 silu = round_bf16(_mm512_div_ps(num, _mm512_add_ps(one, e)));
            _mm256_mask_storeu_epi16(out + r * os + i, m, narrow(_mm512_mul_ps(silu, widen_bf16(u + r * us + i, m))));
        }
    }
}

/* x: [B, H, T, D] at element strides xb, xh, xt (unit along D); cs, sn: [B, T, D] at cb, ct (a batch of
 * one broadcast with cb = 0); out: [B, H, T, D] at ob, oh, ot. D even: rotate_half(x) is
 * (-x[D/2:], x[:D/2]). Each product and the sum round to bf16 as torch's bf16 ops do. */
void rope_bf16(const uint16_t *x, const uint16_t *cs, const uint16_t *sn, uint16_t *out, int64_t B, int64_t H,
               int64_t T, int64_t D, int64_t xb, int64_t xh, int64_t xt, int64_t cb, int64_t ct, int64_t ob,
               int64_t oh, int64_t ot) {
    const int64_t half = D / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++) {
                const uint16_t *xr = x + b * xb + h * xh + t * xt, *c = cs + b * cb + t * ct, *s = sn + b * cb + t * ct;
                uint16_t *o = out + b * ob + h * oh + t * ot;
                for (int64_t i = 0; i < half; i += 16) {
                    const __mmask16 m = first16(half - i);
                    const __m512 lo = widen_bf16(xr + i, m), hi = widen_bf16(xr + half + i, m);
                    const __m512 o_lo = _mm512_add_ps(round_bf16(_mm512_mul_ps(lo, widen_bf16(c + i, m))),
                                                      round_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi),
                                                                               widen_bf16(s + i, m))));
                    const __m512 o_hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(hi, widen_bf16(c + half + i, m))),
                                                      round_bf16(_mm512_mul_ps(lo, widen_bf16(s + half + i, m))));
                    _mm256_mask_storeu_epi16(o + i, m, narrow(o_lo));
                    _mm256_mask_storeu_epi16(o + half + i, m, narrow(o_hi));
                }
            }
}
#endif
