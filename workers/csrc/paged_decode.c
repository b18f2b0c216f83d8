/* Decode attention that reads the paged KV pool in place (workers/paged_decode.py builds and loads it).
 *
 * One query token per request; a float32 or a bfloat16 pool (paged_decode_bf16: each K/V row is widened
 * to float32 once as it is read, the query and output stay float32). For request g and query head h
 * (kv head h / group):
 *   out[g, h] = softmax(scale * q[g, h] . K[0:len_g]) @ V[0:len_g]
 * where key/value row t of request g lives at pool block tables[g, t / bs], offset t % bs. No gather:
 * each K and V row is read once for all the query heads that share its kv head (GQA).
 *
 * Dot products and the weighted sum run over 16 independent float lanes, so the compiler vectorises
 * them without reassociating any one sum (no -ffast-math). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define AHEAD 16 /* rows prefetched ahead: one block, so the next block's start is on its way */

/* Ask for the cache lines of the row AHEAD rows on: a request's blocks are scattered over the pool,
 * and the hardware prefetcher stops at every block's end. 1.1-1.4x on 16 requests of 650 tokens. */
static inline void prefetch_row(const char *base, int64_t elem, const int64_t *table, int64_t t, int64_t len,
                                int64_t bs, int64_t block, int64_t row) {
    if (t + AHEAD >= len) return;
    const char *next = base + (table[(t + AHEAD) / bs] * block + ((t + AHEAD) % bs) * row) * elem;
    for (int64_t o = 0; o < row * elem; o += 64) __builtin_prefetch(next + o);
}

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

static void axpy(float *y, float w, const float *x, int64_t d) {
    for (int64_t i = 0; i < d; i++) y[i] += w * x[i];
}

/* A pool row as float32: the row itself (float32 pool) or widened into `buf` (bfloat16: the top half
 * of a float's bits). */
static inline const float *row_f32(const float *base, int64_t at, float *buf, int64_t n) {
    (void)buf; (void)n;
    return base + at;
}

static inline float bf16_to_f32(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline const float *row_bf16(const uint16_t *base, int64_t at, float *buf, int64_t n) {
    const uint16_t *r = base + at;
    for (int64_t i = 0; i < n; i++) buf[i] = bf16_to_f32(r[i]);
    return buf;
}

/* q, out: [G, H, D] float32; k, v: [num_blocks, bs, KV, D] of ELEM; tables: [G, max_blocks]; lens: [G].
 * scores: caller's scratch of H * max_len floats. Returns 0, -1 for a length out of range, -2 for
 * more than 256 heads or a row over 8192 values.
 * Each request's blocks are read front to back, a whole token row (every kv head) at a time: the
 * memory streams in order, which is what keeps this at DRAM speed when the pool is far larger than
 * the caches. */
#define PAGED_DECODE(NAME, ELEM, ROW)                                                                    \
int NAME(const float *q, const ELEM *k, const ELEM *v, const int64_t *tables, const int64_t *lens,      \
         float *out, float *scores, int64_t G, int64_t H, int64_t KV, int64_t D, int64_t bs,            \
         int64_t max_blocks, int64_t max_len, float scale) {                                            \
    const int64_t per_kv = H / KV, row = KV * D, block = bs * row;                                      \
    float mx[256], sum[256], buf[8192];                                                                 \
    if (H > 256 || row > 8192) return -2;                                                               \
    for (int64_t g = 0; g < G; g++) {                                                                   \
        const int64_t len = lens[g];                                                                    \
        if (len < 1 || len > max_len || len > max_blocks * bs) return -1;                               \
        const int64_t *table = tables + g * max_blocks;                                                 \
        const float *qg = q + g * H * D;                                                                \
        float *og = out + g * H * D;                                                                    \
        for (int64_t h = 0; h < H; h++) mx[h] = -INFINITY;                                              \
        for (int64_t t = 0; t < len; t++) {                                                             \
            prefetch_row((const char *)k, sizeof(ELEM), table, t, len, bs, block, row);                 \
            const float *kr = ROW(k, table[t / bs] * block + (t % bs) * row, buf, row);                 \
            for (int64_t h = 0; h < H; h++) {                                                           \
                float s = dot(qg + h * D, kr + (h / per_kv) * D, D) * scale;                            \
                scores[h * max_len + t] = s;                                                            \
                if (s > mx[h]) mx[h] = s;                                                               \
            }                                                                                           \
        }                                                                                               \
        for (int64_t h = 0; h < H; h++) {                                                               \
            float *sh = scores + h * max_len, total = 0.0f;                                             \
            for (int64_t t = 0; t < len; t++) total += (sh[t] = expf(sh[t] - mx[h]));                   \
            sum[h] = total;                                                                             \
        }                                                                                               \
        memset(og, 0, sizeof(float) * H * D);                                                           \
        for (int64_t t = 0; t < len; t++) {                                                             \
            prefetch_row((const char *)v, sizeof(ELEM), table, t, len, bs, block, row);                 \
            const float *vr = ROW(v, table[t / bs] * block + (t % bs) * row, buf, row);                 \
            for (int64_t h = 0; h < H; h++) axpy(og + h * D, scores[h * max_len + t], vr + (h / per_kv) * D, D); \
        }                                                                                               \
        for (int64_t h = 0; h < H; h++) {                                                               \
            const float inv = 1.0f / sum[h];                                                            \
            for (int64_t i = 0; i < D; i++) og[h * D + i] *= inv;                                       \
        }                                                                                               \
    }                                                                                                   \
    return 0;                                                                                           \
}

PAGED_DECODE(paged_decode_f32, float, row_f32)
PAGED_DECODE(paged_decode_bf16, uint16_t, row_bf16)
