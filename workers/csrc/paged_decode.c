/* Decode attention that reads the paged KV pool in place (workers/paged_decode.py builds and loads it).
 *
 * One query token per request; a float32 or a bfloat16 pool, with the query in the pool's dtype. For
 * request g and query head h (kv head h / group):
 *   out[g, h] = softmax(scale * q[g, h] . K[0:len_g]) @ V[0:len_g]        (out: float32)
 * where key/value row t of request g lives at pool block tables[g, t / bs], offset t % bs. No gather:
 * each request's blocks are read front to back, a whole token row (every kv head) at a time, once for
 * all the query heads that share a kv head (GQA). Scores, softmax and sums are float32.
 *
 * Two builds of the same function, chosen by what the compiler targets (-march=native):
 * - AVX-512 (x86 hosts with AVX512F/BW): the scores of 16 tokens at a time are reduced together, one
 *   transpose-and-add tree for 16 dot products instead of a serial sum each; exp is a vectorised
 *   polynomial (within 2 ulp); a bfloat16 query and key meet in `vdpbf16ps` where the CPU has
 *   AVX512_BF16 (bf16 products are exact in float32), and V rows are widened to float32 in registers.
 *   P @ V keeps each head's sums in registers over a tile of 16 rows (two heads sharing a kv head at
 *   once), adding row after row in the order the portable build does.
 * - AVX2 and FMA without AVX-512 (paged_decode_avx2.h): the AVX-512 build's method 8 lanes wide, for
 *   head sizes that are a multiple of 8 (the portable code below takes the others).
 * - portable C: 16 independent float lanes per dot product, which the compiler vectorises without
 *   reassociating any one sum (no -ffast-math); the softmax's exp is the same polynomial 8 lanes at a
 *   time where the host has AVX2 and FMA, libm's expf elsewhere.
 * All compute the same attention; they differ in summation order and exp's last bits (within 1e-6). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define AHEAD 32 /* rows prefetched ahead: two blocks, so the next blocks' starts are on their way */
#define TILE 16  /* tokens whose scores are reduced together, and whose V rows are summed together (AVX-512) */

/* Ask for the cache lines of the row AHEAD rows on: a request's blocks are scattered over the pool,
 * and the hardware prefetcher stops at every block's end. Into L2 (locality 1), not L1: on the AMD EPYC
 * host, prefetching into L1 left a step at ~9 GB/s (likely L1's few miss buffers held until each line
 * arrives); into L2, 16 requests of 670 tokens (8 layers, bf16) went from 10.1 to 6.1 ms with the
 * register sums below (bench/README.md, "bf16 on the CPU"). */
static inline void prefetch_row(const char *base, int64_t elem, const int64_t *table, int64_t t, int64_t len,
                                int64_t bs, int64_t block, int64_t row) {
    if (t + AHEAD >= len) return;
    const char *next = base + (table[(t + AHEAD) / bs] * block + ((t + AHEAD) % bs) * row) * elem;
    for (int64_t o = 0; o < row * elem; o += 64) __builtin_prefetch(next + o, 0, 1);
}

/* The scores' row stride: the length rounded up to whole tiles (paged_decode.py sizes the scratch so). */
static inline int64_t score_stride(int64_t max_len) { return (max_len + TILE - 1) / TILE * TILE; }

/* Each head's weighted sum of V rows divided by its softmax total. */
static inline void normalise(float *og, const float *sum, int64_t H, int64_t D) {
    for (int64_t h = 0; h < H; h++) {
        const float inv = 1.0f / sum[h];
        for (int64_t i = 0; i < D; i++) og[h * D + i] *= inv;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "simd.h"

/* lane j of the result = the sum of v[j]'s 16 lanes. */
static inline __m512 sum16(const __m512 *v) {
    __m512 w[8], z[4];
    for (int i = 0; i < 8; i++)  /* lanes 0,2 of each 128-bit quarter: v[2i]; 1,3: v[2i+1] */
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* each quarter: v[4i..4i+3], over that quarter's lanes */
        __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        z[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
    __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], even), _mm512_shuffle_f32x4(z[0], z[1], odd));
    __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], even), _mm512_shuffle_f32x4(z[2], z[3], odd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, even), _mm512_shuffle_f32x4(y0, y1, odd));
}

/* 16 values of a row as float32 (lanes past n read as 0). */
static inline __m512 load16_f32(const float *p, int64_t n) { return _mm512_maskz_loadu_ps(first16(n), p); }
static inline __m512 load16_bf16(const uint16_t *p, int64_t n) { return widen_bf16(p, first16(n)); }

/* Lanes whose sum is q . k over d values. */
static inline __m512 dot_f32(const float *q, const float *k, int64_t d) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) a = _mm512_fmadd_ps(load16_f32(q + i, d - i), load16_f32(k + i, d - i), a);
    return a;
}
static inline __m512 dot_bf16(const uint16_t *q, const uint16_t *k, int64_t d) {
    __m512 a = _mm512_setzero_ps();
#ifdef __AVX512BF16__
    for (int64_t i = 0; i < d; i += 32) {
        const __mmask32 m = d - i >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (d - i)) - 1);
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(m, q + i), (__m512bh)_mm512_maskz_loadu_epi16(m, k + i));
    }
#else
    for (int64_t i = 0; i < d; i += 16) a = _mm512_fmadd_ps(load16_bf16(q + i, d - i), load16_bf16(k + i, d - i), a);
#endif
    return a;
}

/* The body takes D as an argument so that NAME's switch can inline it with common head sizes as
 * constants: then the dot products unroll, need no masks, and keep the query in registers. */
#define PAGED_DECODE(NAME, ELEM, DOT, LOAD16)                                                            \
/* o[0:D] (and, with two, the next head's o[D:2D], same kv head) += w[j] * V row j, for the n rows of  \
 * a tile: the sums stay in registers across the tile, added token after token in the same order as   \
 * one row at a time into memory would (the same bits), 256 dims at a time.                             \
 * w: the first head's weights; the second's are ws further on. */                                      \
static inline __attribute__((always_inline)) void NAME##_pv(                                              \
        float *o, const float *w, int64_t ws, const ELEM *const *rows, int64_t at, int64_t n,           \
        const int64_t D, const int two) {                                                               \
    for (int64_t d0 = 0; d0 < D; d0 += 256) {                                                           \
        const int64_t dn = D - d0 < 256 ? D - d0 : 256;                                                 \
        __m512 a[16], b[16];                                                                            \
        for (int64_t i = 0; i < dn; i += 16) {                                                          \
            a[i / 16] = _mm512_maskz_loadu_ps(first16(dn - i), o + d0 + i);                             \
            if (two) b[i / 16] = _mm512_maskz_loadu_ps(first16(dn - i), o + D + d0 + i);                \
        }                                                                                               \
        for (int64_t j = 0; j < n; j++) {                                                               \
            const __m512 wa = _mm512_set1_ps(w[j]), wb = _mm512_set1_ps(two ? w[ws + j] : 0.0f);       \
            for (int64_t i = 0; i < dn; i += 16) {                                                      \
                const __m512 x = LOAD16(rows[j] + at + d0 + i, dn - i);                                 \
                a[i / 16] = _mm512_fmadd_ps(wa, x, a[i / 16]);                                          \
                if (two) b[i / 16] = _mm512_fmadd_ps(wb, x, b[i / 16]);                                 \
            }                                                                                           \
        }                                                                                               \
        for (int64_t i = 0; i < dn; i += 16) {                                                          \
            _mm512_mask_storeu_ps(o + d0 + i, first16(dn - i), a[i / 16]);                             \
            if (two) _mm512_mask_storeu_ps(o + D + d0 + i, first16(dn - i), b[i / 16]);                 \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
static inline __attribute__((always_inline)) int NAME##_body(                                            \
         const ELEM *q, const ELEM *k, const ELEM *v, const int64_t *tables, const int64_t *lens,       \
         float *out, float *scores, int64_t G, int64_t H, int64_t KV, const int64_t D, int64_t bs,      \
         int64_t max_blocks, int64_t max_len, float scale) {                                            \
    const int64_t per_kv = H / KV, row = KV * D, block = bs * row, stride = score_stride(max_len);      \
    __m512 part[TILE], mx[256];                                                                          \
    const ELEM *rows[TILE];                                                                    \
    float sum[256];                                                                                      \
    if (H > 256 || row > 8192) return -2;                                                               \
    for (int64_t g = 0; g < G; g++) {                                                                   \
        const int64_t len = lens[g];                                                                    \
        if (len < 1 || len > max_len || len > max_blocks * bs) return -1;                               \
        const int64_t *table = tables + g * max_blocks;                                                 \
        const ELEM *qg = q + g * H * D;                                                                 \
        float *og = out + g * H * D;                                                                    \
        for (int64_t h = 0; h < H; h++) mx[h] = _mm512_set1_ps(-INFINITY);                              \
        for (int64_t t0 = 0; t0 < len; t0 += TILE) {                                                    \
            const int64_t n = len - t0 < TILE ? len - t0 : TILE;                                        \
            for (int64_t j = 0; j < n; j++) rows[j] = k + table[(t0 + j) / bs] * block + ((t0 + j) % bs) * row; \
            for (int64_t h = 0; h < H; h++) { /* the tile's rows stay in L1 across the heads */          \
                for (int64_t j = h * n / H; j < (h + 1) * n / H; j++) /* the next tile's, spread out */ \
                    prefetch_row((const char *)k, sizeof(ELEM), table, t0 + j, len, bs, block, row);   \
                const ELEM *qh = qg + h * D;                                                            \
                const int64_t at = (h / per_kv) * D;                                                   \
                if (n == TILE)                                                                          \
                    for (int64_t j = 0; j < TILE; j++) part[j] = DOT(qh, rows[j] + at, D);              \
                else                                                                                    \
                    for (int64_t j = 0; j < TILE; j++) part[j] = j < n ? DOT(qh, rows[j] + at, D) : _mm512_setzero_ps(); \
                const __m512 s = _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale));                     \
                _mm512_storeu_ps(scores + h * stride + t0, s);                                          \
                mx[h] = _mm512_mask_max_ps(mx[h], first16(n), mx[h], s);                                \
            }                                                                                           \
        }                                                                                               \
        for (int64_t h = 0; h < H; h++) {                                                               \
            float *sh = scores + h * stride;                                                            \
            const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx[h]));                               \
            __m512 total = _mm512_setzero_ps();                                                         \
            for (int64_t t0 = 0; t0 < len; t0 += TILE) {                                                \
                const __m512 e = _mm512_maskz_mov_ps(first16(len - t0), exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + t0), m))); \
                _mm512_storeu_ps(sh + t0, e);                                                           \
                total = _mm512_add_ps(total, e);                                                        \
            }                                                                                           \
            sum[h] = _mm512_reduce_add_ps(total);                                                       \
        }                                                                                               \
        memset(og, 0, sizeof(float) * H * D);                                                           \
        for (int64_t t0 = 0; t0 < len; t0 += TILE) { /* the tile's V rows stay in L1 across the heads */    \
            const int64_t n = len - t0 < TILE ? len - t0 : TILE;                                        \
            for (int64_t j = 0; j < n; j++) rows[j] = v + table[(t0 + j) / bs] * block + ((t0 + j) % bs) * row; \
            for (int64_t h = 0; h < H;) {                                                               \
                for (int64_t j = h * n / H; j < (h + 1 + (per_kv % 2 == 0 && D <= 128)) * n / H; j++)   \
                    prefetch_row((const char *)v, sizeof(ELEM), table, t0 + j, len, bs, block, row);   \
                const int64_t at = (h / per_kv) * D;                                                    \
                const float *w = scores + h * stride + t0;                                              \
                if (per_kv % 2 == 0 && D <= 128) {                                                      \
                    NAME##_pv(og + h * D, w, stride, rows, at, n, D, 1);                                \
                    h += 2;                                                                             \
                } else {                                                                                \
                    NAME##_pv(og + h * D, w, stride, rows, at, n, D, 0);                                \
                    h += 1;                                                                             \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        normalise(og, sum, H, D);                                                                       \
    }                                                                                                   \
    return 0;                                                                                           \
}                                                                                                       \
int NAME(const ELEM *q, const ELEM *k, const ELEM *v, const int64_t *tables, const int64_t *lens,        \
         float *out, float *scores, int64_t G, int64_t H, int64_t KV, int64_t D, int64_t bs,            \
         int64_t max_blocks, int64_t max_len, float scale) {                                            \
    switch (D) {                                                                                        \
    case 64: return NAME##_body(q, k, v, tables, lens, out, scores, G, H, KV, 64, bs, max_blocks, max_len, scale); \
    case 80: return NAME##_body(q, k, v, tables, lens, out, scores, G, H, KV, 80, bs, max_blocks, max_len, scale); \
    case 128: return NAME##_body(q, k, v, tables, lens, out, scores, G, H, KV, 128, bs, max_blocks, max_len, scale); \
    default: return NAME##_body(q, k, v, tables, lens, out, scores, G, H, KV, D, bs, max_blocks, max_len, scale); \
    }                                                                                                   \
}

PAGED_DECODE(paged_decode_f32, float, dot_f32, load16_f32)
PAGED_DECODE(paged_decode_bf16, uint16_t, dot_bf16, load16_bf16)

#else /* portable C, and the AVX2 build over it */

#define LANES 16

static float dot(const float *a, const float *b, int64_t d) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (int j = 0; j < LANES; j++) s += acc[j];
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* e^x for x <= 0, 8 lanes: 2^n * p(r), r = x - n ln2, p of degree 7 (simd.h's exp16; within 2 ulp). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* s[t] = e^(s[t] - mx) for t < len; returns their sum. */
static inline float exp_sum(float *s, int64_t len, float mx) {
    float total = 0.0f;
    int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    const __m256 m = _mm256_set1_ps(mx);
    for (; t + 8 <= len; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; j++) total += lanes[j];
#endif
    for (; t < len; t++) total += (s[t] = expf(s[t] - mx));
    return total;
}

static void axpy(float *y, float w, const float *x, int64_t d) {
    for (int64_t i = 0; i < d; i++) y[i] += w * x[i];
}

static inline float bf16_to_f32(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A pool row (or the query) as float32: itself (float32) or widened into `buf` (bfloat16: the top
 * half of a float's bits). */
static inline const float *row_f32(const float *r, float *buf, int64_t n) {
    (void)buf; (void)n;
    return r;
}
static inline const float *row_bf16(const uint16_t *r, float *buf, int64_t n) {
    for (int64_t i = 0; i < n; i++) buf[i] = bf16_to_f32(r[i]);
    return buf;
}

#define PAGED_DECODE(NAME, ELEM, ROW)                                                                    \
static int NAME##_c(const ELEM *q, const ELEM *k, const ELEM *v, const int64_t *tables, const int64_t *lens,      \
         float *out, float *scores, int64_t G, int64_t H, int64_t KV, int64_t D, int64_t bs,            \
         int64_t max_blocks, int64_t max_len, float scale) {                                            \
    const int64_t per_kv = H / KV, row = KV * D, block = bs * row, stride = score_stride(max_len);      \
    float mx[256], sum[256], buf[8192], qbuf[8192];                                                     \
    if (H > 256 || row > 8192 || H * D > 8192) return -2;                                               \
    for (int64_t g = 0; g < G; g++) {                                                                   \
        const int64_t len = lens[g];                                                                    \
        if (len < 1 || len > max_len || len > max_blocks * bs) return -1;                               \
        const int64_t *table = tables + g * max_blocks;                                                 \
        const float *qg = ROW(q + g * H * D, qbuf, H * D);                                              \
        float *og = out + g * H * D;                                                                    \
        for (int64_t h = 0; h < H; h++) mx[h] = -INFINITY;                                              \
        for (int64_t t = 0; t < len; t++) {                                                             \
            prefetch_row((const char *)k, sizeof(ELEM), table, t, len, bs, block, row);                 \
            const float *kr = ROW(k + table[t / bs] * block + (t % bs) * row, buf, row);                \
            for (int64_t h = 0; h < H; h++) {                                                           \
                float s = dot(qg + h * D, kr + (h / per_kv) * D, D) * scale;                            \
                scores[h * stride + t] = s;                                                             \
                if (s > mx[h]) mx[h] = s;                                                               \
            }                                                                                           \
        }                                                                                               \
        for (int64_t h = 0; h < H; h++) sum[h] = exp_sum(scores + h * stride, len, mx[h]);              \
        memset(og, 0, sizeof(float) * H * D);                                                           \
        for (int64_t t = 0; t < len; t++) {                                                             \
            prefetch_row((const char *)v, sizeof(ELEM), table, t, len, bs, block, row);                 \
            const float *vr = ROW(v + table[t / bs] * block + (t % bs) * row, buf, row);                \
            for (int64_t h = 0; h < H; h++) axpy(og + h * D, scores[h * stride + t], vr + (h / per_kv) * D, D); \
        }                                                                                               \
        normalise(og, sum, H, D);                                                                       \
    }                                                                                                   \
    return 0;                                                                                           \
}

PAGED_DECODE(paged_decode_f32, float, row_f32)
PAGED_DECODE(paged_decode_bf16, uint16_t, row_bf16)

#if defined(__AVX2__) && defined(__FMA__)
#include "paged_decode_avx2.h"
#else
#define PORTABLE(NAME, ELEM)                                                                             \
int NAME(const ELEM *q, const ELEM *k, const ELEM *v, const int64_t *tables, const int64_t *lens,        \
         float *out, float *scores, int64_t G, int64_t H, int64_t KV, int64_t D, int64_t bs,            \
         int64_t max_blocks, int64_t max_len, float scale) {                                            \
    return NAME##_c(q, k, v, tables, lens, out, scores, G, H, KV, D, bs, max_blocks, max_len, scale);   \
}
PORTABLE(paged_decode_f32, float)
PORTABLE(paged_decode_bf16, uint16_t)
#endif

#endif
