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
 * - the vector build (paged_decode_simd.h), 16 lanes wide with AVX-512 (x86 hosts with AVX512F/BW/VL)
 *   and 8 with AVX2 and FMA: a tile of tokens' scores reduced together, a vectorised exp, P @ V's sums
 *   in registers over a tile of rows, and `vdpbf16ps` for bfloat16 scores where the CPU has AVX512_BF16;
 * - portable C (below; also the vector build's fallback for the head sizes it does not take): 16
 *   independent float lanes per dot product, which the compiler vectorises without reassociating any one
 *   sum (no -ffast-math); the softmax's exp is the vector build's polynomial 8 lanes at a time where the
 *   host has AVX2 and FMA, libm's expf elsewhere.
 * All compute the same attention; they differ in summation order and exp's last bits (within 1e-6). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define AHEAD 32 /* rows prefetched ahead: two blocks, so the next blocks' starts are on their way */
#define TILE 16  /* the scores' rows are padded to whole tiles of the widest vector build (16 lanes) */

/* Ask for the cache lines of the row AHEAD rows on: a request's blocks are scattered over the pool,
 * and the hardware prefetcher stops at every block's end. Into L2 (locality 1), not L1: on the AMD EPYC
 * host, prefetching into L1 left a step at ~9 GB/s (likely L1's few miss buffers held until each line
 * arrives); into L2, 16 requests of 670 tokens (8 layers, bf16) went from 10.1 to 6.1 ms with the
 * vector build's register sums (bench/README.md, "bf16 on the CPU"). */
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

/* The portable C: what a host without AVX2 runs, and the vector build's fallback (head sizes it does not
 * take, more than 256 heads). */

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

/* The sum of x's 8 lanes, first to last. */
static inline float hsum8(__m256 x) {
    float lanes[8], s = 0.0f;
    _mm256_storeu_ps(lanes, x);
    for (int j = 0; j < 8; j++) s += lanes[j];
    return s;
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
    total = hsum8(acc);
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

#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)) || (defined(__AVX2__) && defined(__FMA__))
#include "paged_decode_simd.h"
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
