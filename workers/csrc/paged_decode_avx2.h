/* The AVX2 build of decode attention (paged_decode.c includes it on hosts with AVX2 and FMA but no
 * AVX-512: the AMD EPYCs without AVX-512 this project meets). The AVX-512 build's method, 8 lanes wide:
 * - the scores of 8 tokens at a time are reduced together (one hadd-and-permute tree for 8 dot products,
 *   instead of a serial sum each), the query chunk loaded once for the tile's 8 keys;
 * - P @ V keeps each head's sums in registers over a tile of 8 rows, 64 dims at a time (two heads that
 *   share a kv head: 32 dims of each, every V value loaded once for both), adding row after row in the
 *   order the portable build does.
 * The softmax's exp is exp8 (paged_decode.c). Head sizes that are not a multiple of 8 run the portable
 * build. It uses paged_decode.c's AHEAD, score_stride, normalise and exp8, so it is included after them,
 * and defines NAME (the exported function) over NAME##_c (the portable one).
 *
 * On the AVX2-only AMD EPYC (lab.decode_kernel, 16 requests of 640-700 tokens, 8 layers, blocks
 * scattered): bfloat16 20-24 -> 11-12 ms a step against the portable build, float32 21-24 -> 19-21.
 * Float32 is held by memory, not arithmetic: the same step on rows already in cache takes ~9 ms, and
 * plain reads of the same rows ~6; a tile's compute and its next rows' misses hardly overlap there
 * (software prefetches that only start each 4 KiB page, no prefetches, and reading rows front to back
 * instead of a kv head at a time were each slower or no quicker: bench/README.md). */
#include <immintrin.h>

#define TILE8 8 /* tokens whose scores are reduced together, and whose V rows are summed together */

/* lane j of the result = the sum of v[j]'s 8 lanes. */
static inline __m256 sum8(const __m256 *v) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* u0: lanes 0-3 the low halves' sums of v[0..3], lanes 4-7 their high halves'; u1 the same of v[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* All ones in the first n of 8 lanes. */
static inline __m256 first8(int64_t n) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

static inline float hmax8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float hsum8(__m256 x) {
    float lanes[8], s = 0.0f;
    _mm256_storeu_ps(lanes, x);
    for (int j = 0; j < 8; j++) s += lanes[j];
    return s;
}

/* The offsets (in elements) of rows t0 .. t0+n-1 in the pool: one division a tile, not one a row. Rows
 * past n (a short tile) repeat the last. */
static inline void tile_rows(int64_t *at, const int64_t *table, int64_t t0, int64_t n, int64_t bs, int64_t block,
                             int64_t row) {
    int64_t b = t0 / bs, o = t0 % bs;
    for (int64_t j = 0; j < TILE8; j++) {
        at[j] = table[b] * block + o * row;
        if (j + 1 < n && ++o == bs) { o = 0; b++; }
    }
}

/* Ask for the rows of the tile AHEAD rows on (a request's blocks are scattered over the pool, and the
 * hardware prefetcher stops at every block's end), a share of them at a time: the share of head h. */
static inline void prefetch_share(const char *base, int64_t elem, const int64_t *next, int64_t n, int64_t h,
                                  int64_t H, int64_t row) {
    for (int64_t j = h * n / H; j < (h + 1) * n / H; j++)
        for (int64_t o = 0; o < row * elem; o += 64) __builtin_prefetch(base + next[j] * elem + o, 0, 1);
}

/* 8 values of a row as float32 (a bfloat16 value is a float32's top half, so exactly). */
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* D is an argument so that NAME's switch inlines the body with common head sizes as constants: the
 * loops over D then unroll into registers. D is a multiple of 8. */
#define PAGED_DECODE_AVX2(NAME, ELEM, LOAD8)                                                             \
/* o[0:D] (and, with two, the next head's o[D:2D]) += w[j] * V row j for the tile's n rows, the sums   \
 * in registers across the tile. w: the first head's weights; the second's are ws further on. */       \
static inline __attribute__((always_inline)) void NAME##_pv8(                                            \
        float *o, const float *w, int64_t ws, const ELEM *const *rows, int64_t at, int64_t n,           \
        const int64_t D, const int two) {                                                               \
    const int64_t chunk = two ? 32 : 64;                                                                \
    for (int64_t d0 = 0; d0 < D; d0 += chunk) {                                                         \
        const int64_t dn = D - d0 < chunk ? D - d0 : chunk;                                             \
        __m256 a[8], b[4];                                                                              \
        for (int64_t i = 0; i < dn; i += 8) {                                                           \
            a[i / 8] = _mm256_loadu_ps(o + d0 + i);                                                     \
            if (two) b[i / 8] = _mm256_loadu_ps(o + D + d0 + i);                                        \
        }                                                                                               \
        for (int64_t j = 0; j < n; j++) {                                                               \
            const __m256 wa = _mm256_set1_ps(w[j]), wb = _mm256_set1_ps(two ? w[ws + j] : 0.0f);        \
            for (int64_t i = 0; i < dn; i += 8) {                                                       \
                const __m256 x = LOAD8(rows[j] + at + d0 + i);                                          \
                a[i / 8] = _mm256_fmadd_ps(wa, x, a[i / 8]);                                            \
                if (two) b[i / 8] = _mm256_fmadd_ps(wb, x, b[i / 8]);                                   \
            }                                                                                           \
        }                                                                                               \
        for (int64_t i = 0; i < dn; i += 8) {                                                           \
            _mm256_storeu_ps(o + d0 + i, a[i / 8]);                                                     \
            if (two) _mm256_storeu_ps(o + D + d0 + i, b[i / 8]);                                        \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
static inline __attribute__((always_inline)) int NAME##_avx2(                                            \
         const ELEM *q, const ELEM *k, const ELEM *v, const int64_t *tables, const int64_t *lens,       \
         float *out, float *scores, int64_t G, int64_t H, int64_t KV, const int64_t D, int64_t bs,      \
         int64_t max_blocks, int64_t max_len, float scale) {                                            \
    const int64_t per_kv = H / KV, row = KV * D, block = bs * row, stride = score_stride(max_len);      \
    const int two = per_kv % 2 == 0;                                                                    \
    __m256 part[TILE8], mx[256];                                                                        \
    const ELEM *rows[TILE8];                                                                            \
    int64_t at[TILE8], ahead[TILE8];                                                                    \
    float sum[256];                                                                                     \
    for (int64_t g = 0; g < G; g++) {                                                                   \
        const int64_t len = lens[g];                                                                    \
        if (len < 1 || len > max_len || len > max_blocks * bs) return -1;                               \
        const int64_t *table = tables + g * max_blocks;                                                 \
        const ELEM *qg = q + g * H * D;                                                                 \
        float *og = out + g * H * D;                                                                    \
        for (int64_t h = 0; h < H; h++) mx[h] = _mm256_set1_ps(-INFINITY);                              \
        for (int64_t t0 = 0; t0 < len; t0 += TILE8) {                                                   \
            const int64_t n = len - t0 < TILE8 ? len - t0 : TILE8;                                      \
            const int64_t na = t0 + AHEAD < len ? (len - t0 - AHEAD < TILE8 ? len - t0 - AHEAD : TILE8) : 0; \
            tile_rows(at, table, t0, n, bs, block, row);                                                \
            if (na) tile_rows(ahead, table, t0 + AHEAD, na, bs, block, row);                            \
            for (int64_t j = 0; j < TILE8; j++) rows[j] = k + at[j];                                    \
            const __m256 valid = first8(n);                                                             \
            for (int64_t h = 0; h < H; h++) { /* the tile's rows stay in L1 across the heads */          \
                prefetch_share((const char *)k, sizeof(ELEM), ahead, na, h, H, row);                    \
                const ELEM *qh = qg + h * D;                                                            \
                const int64_t c = (h / per_kv) * D;                                                    \
                for (int j = 0; j < TILE8; j++) part[j] = _mm256_setzero_ps();                         \
                for (int64_t i = 0; i < D; i += 8) {                                                    \
                    const __m256 qv = LOAD8(qh + i);                                                    \
                    for (int j = 0; j < TILE8; j++)                                                     \
                        part[j] = _mm256_fmadd_ps(qv, LOAD8(rows[j] + c + i), part[j]);                 \
                }                                                                                       \
                const __m256 s = _mm256_mul_ps(sum8(part), _mm256_set1_ps(scale));                      \
                _mm256_storeu_ps(scores + h * stride + t0, s);                                          \
                mx[h] = _mm256_max_ps(mx[h], _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, valid));    \
            }                                                                                           \
        }                                                                                               \
        for (int64_t h = 0; h < H; h++) {                                                               \
            float *sh = scores + h * stride;                                                            \
            const __m256 m = _mm256_set1_ps(hmax8(mx[h]));                                               \
            __m256 total = _mm256_setzero_ps();                                                         \
            for (int64_t t0 = 0; t0 < len; t0 += TILE8) {                                               \
                const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + t0), m)), first8(len - t0)); \
                _mm256_storeu_ps(sh + t0, e);                                                           \
                total = _mm256_add_ps(total, e);                                                        \
            }                                                                                           \
            sum[h] = hsum8(total);                                                                      \
        }                                                                                               \
        memset(og, 0, sizeof(float) * H * D);                                                           \
        for (int64_t t0 = 0; t0 < len; t0 += TILE8) { /* the tile's V rows stay in L1 across the heads */ \
            const int64_t n = len - t0 < TILE8 ? len - t0 : TILE8;                                      \
            const int64_t na = t0 + AHEAD < len ? (len - t0 - AHEAD < TILE8 ? len - t0 - AHEAD : TILE8) : 0; \
            tile_rows(at, table, t0, n, bs, block, row);                                                \
            if (na) tile_rows(ahead, table, t0 + AHEAD, na, bs, block, row);                            \
            for (int64_t j = 0; j < TILE8; j++) rows[j] = v + at[j];                                    \
            for (int64_t h = 0; h < H; h += 1 + two) {                                                  \
                prefetch_share((const char *)v, sizeof(ELEM), ahead, na, h / (1 + two), H / (1 + two), row); \
                if (two) /* a constant `two` in each call: the chunk loops unroll into registers */    \
                    NAME##_pv8(og + h * D, scores + h * stride + t0, stride, rows, (h / per_kv) * D, n, D, 1); \
                else                                                                                    \
                    NAME##_pv8(og + h * D, scores + h * stride + t0, stride, rows, (h / per_kv) * D, n, D, 0); \
            }                                                                                           \
        }                                                                                               \
        normalise(og, sum, H, D);                                                                       \
    }                                                                                                   \
    return 0;                                                                                           \
}                                                                                                       \
int NAME(const ELEM *q, const ELEM *k, const ELEM *v, const int64_t *tables, const int64_t *lens,        \
         float *out, float *scores, int64_t G, int64_t H, int64_t KV, int64_t D, int64_t bs,            \
         int64_t max_blocks, int64_t max_len, float scale) {                                            \
    if (D % 8 != 0 || H > 256) return NAME##_c(q, k, v, tables, lens, out, scores, G, H, KV, D, bs, max_blocks, max_len, scale); \
    switch (D) {                                                                                        \
    case 64: return NAME##_avx2(q, k, v, tables, lens, out, scores, G, H, KV, 64, bs, max_blocks, max_len, scale); \
    case 80: return NAME##_avx2(q, k, v, tables, lens, out, scores, G, H, KV, 80, bs, max_blocks, max_len, scale); \
    case 128: return NAME##_avx2(q, k, v, tables, lens, out, scores, G, H, KV, 128, bs, max_blocks, max_len, scale); \
    default: return NAME##_avx2(q, k, v, tables, lens, out, scores, G, H, KV, D, bs, max_blocks, max_len, scale); \
    }                                                                                                   \
}

PAGED_DECODE_AVX2(paged_decode_f32, float, load8_f32)
PAGED_DECODE_AVX2(paged_decode_bf16, uint16_t, load8_bf16)
