/* The vector build of decode attention: one body, 16 lanes wide with AVX-512 and 8 with AVX2 and FMA
 * (paged_decode.c includes it on either; the lane operations below are all that differ).
 * - The scores of one lane-width of tokens (a tile) are reduced together: one transpose-and-add tree
 *   for the tile's dot products instead of a serial sum each, each query chunk loaded once for the
 *   tile's keys. A bfloat16 query and key meet in `vdpbf16ps` where the CPU has AVX512_BF16 (bf16
 *   products are exact in float32); elsewhere bf16 rows are widened to float32 in registers.
 * - The softmax's exp is a vectorised polynomial (within 2 ulp).
 * - P @ V keeps each head's sums in registers over a tile of rows (two heads that share a kv head at
 *   once, every V value loaded once for both), adding row after row in the order the portable build does.
 * - One block-table division a tile for the tile's rows; the rows AHEAD on are prefetched (prefetch_row),
 *   a share a head. (Offsets of the rows ahead made a tile at a time, as the tile's own are, were 4-10 %
 *   slower with AVX-512 and in float32 with AVX2 on an AMD EPYC with AVX-512: bench/README.md.)
 * AVX-512 takes every head size (masked loads); AVX2 those that are a multiple of 8, and the portable
 * code the rest. It uses paged_decode.c's AHEAD, prefetch_row, score_stride, normalise, exp8 and hsum8, so it is included
 * after them, and defines NAME (the exported function) over NAME##_c (the portable one).
 *
 * On an AVX2-only AMD EPYC (lab.decode_kernel, 16 requests of 640-700 tokens, 8 layers, blocks
 * scattered): bfloat16 20-24 -> 11-12 ms a step against the portable build, float32 21-24 -> 19-21.
 * Float32 is held by memory there, not arithmetic: the same step on rows already in cache takes ~9 ms,
 * and plain reads of the same rows ~6 (bench/README.md, "Decode attention in AVX2"). */
#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "simd.h"
#define W 16        /* lanes: the tokens of a tile */
#define PV_REGS 16  /* P @ V sums held in registers: 16 vectors of one head, or 8 of each of two */
typedef __m512 vf;
#define vzero() _mm512_setzero_ps()
#define vset1(x) _mm512_set1_ps(x)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vsub(a, b) _mm512_sub_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vloadu(p) _mm512_loadu_ps(p)
#define vstoreu(p, x) _mm512_storeu_ps(p, x)
#define vload_first(p, n) _mm512_maskz_loadu_ps(first16(n), p)      /* lanes past n read as 0 */
#define vstore_first(p, x, n) _mm512_mask_storeu_ps(p, first16(n), x)
#define vkeep_first(x, n) _mm512_maskz_mov_ps(first16(n), x)          /* lanes past n set to 0 */
#define vmax_first(m, x, n) _mm512_mask_max_ps(m, first16(n), m, x)   /* max over the first n lanes */
#define vexp(x) exp16(x)
#define vhmax(x) _mm512_reduce_max_ps(x)
#define vhsum(x) _mm512_reduce_add_ps(x)
#define VECTOR_TAKES(D) ((D) > 0)

/* lane j of the result = the sum of v[j]'s 16 lanes. */
static inline vf sum_lanes(const vf *v) {
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

/* W values of a row from p as float32, exactly (a bfloat16 value is a float32's top half); lanes past n
 * read as 0. */
static inline vf load_f32(const float *p, int64_t n) { return _mm512_maskz_loadu_ps(first16(n), p); }
static inline vf load_bf16(const uint16_t *p, int64_t n) { return widen_bf16(p, first16(n)); }

/* a + q . k over the next BF16_STEP values (n of them left): `vdpbf16ps` where the CPU has it. */
#ifdef __AVX512BF16__
#define BF16_STEP 32
static inline vf kdot_bf16(vf a, const uint16_t *q, const uint16_t *k, int64_t n) {
    const __mmask32 m = n >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << n) - 1);
    return _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(m, q), (__m512bh)_mm512_maskz_loadu_epi16(m, k));
}
#endif

#else /* AVX2 and FMA */
#define W 8
#define PV_REGS 8
typedef __m256 vf;
#define vzero() _mm256_setzero_ps()
#define vset1(x) _mm256_set1_ps(x)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vsub(a, b) _mm256_sub_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vloadu(p) _mm256_loadu_ps(p)
#define vstoreu(p, x) _mm256_storeu_ps(p, x)
#define vload_first(p, n) _mm256_loadu_ps(p)  /* D is a multiple of 8 here: never a short vector */
#define vstore_first(p, x, n) _mm256_storeu_ps(p, x)
#define vkeep_first(x, n) _mm256_and_ps(x, first8(n))
#define vmax_first(m, x, n) _mm256_max_ps(m, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, first8(n)))
#define vexp(x) exp8(x)
#define vhmax(x) hmax8(x)
#define vhsum(x) hsum8(x)
#define VECTOR_TAKES(D) ((D) > 0 && (D) % 8 == 0)

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

/* lane j of the result = the sum of v[j]'s 8 lanes. */
static inline vf sum_lanes(const vf *v) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* u0: lanes 0-3 the low halves' sums of v[0..3], lanes 4-7 their high halves'; u1 the same of v[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline vf load_f32(const float *p, int64_t n) { (void)n; return _mm256_loadu_ps(p); }
static inline vf load_bf16(const uint16_t *p, int64_t n) {
    (void)n;
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

/* a + q . k over the next W values (n of them left), in float32. */
#define F32_STEP W
static inline vf kdot_f32(vf a, const float *q, const float *k, int64_t n) {
    return vfma(load_f32(q, n), load_f32(k, n), a);
}
#ifndef BF16_STEP
#define BF16_STEP W
static inline vf kdot_bf16(vf a, const uint16_t *q, const uint16_t *k, int64_t n) {
    return vfma(load_bf16(q, n), load_bf16(k, n), a);
}
#endif

/* The offsets (in elements) of rows t0 .. t0+n-1 in the pool: one division a tile, not one a row. Rows
 * past n (a short tile) repeat the last. */
static inline void tile_rows(int64_t *at, const int64_t *table, int64_t t0, int64_t n, int64_t bs, int64_t block,
                             int64_t row) {
    int64_t b = t0 / bs, o = t0 % bs;
    for (int64_t j = 0; j < W; j++) {
        at[j] = table[b] * block + o * row;
        if (j + 1 < n && ++o == bs) { o = 0; b++; }
    }
}

/* D is an argument so that NAME's switch inlines the body with common head sizes as constants: the
 * loops over D then unroll into registers and need no masks. */
#define PAGED_DECODE_SIMD(NAME, ELEM, LOAD, KDOT, STEP)                                                  \
/* o[0:D] (and, with two, the next head's o[D:2D], same kv head) += w[j] * V row j for the tile's n    \
 * rows, the sums in registers across the tile, added token after token in the order one row at a     \
 * time into memory would (the same bits). w: the first head's weights; the second's are ws further. */ \
static inline __attribute__((always_inline)) void NAME##_pv(                                              \
        float *o, const float *w, int64_t ws, const ELEM *const *rows, int64_t at, int64_t n,           \
        const int64_t D, const int two) {                                                               \
    const int64_t chunk = (two ? PV_REGS / 2 : PV_REGS) * W;                                            \
    for (int64_t d0 = 0; d0 < D; d0 += chunk) {                                                         \
        const int64_t dn = D - d0 < chunk ? D - d0 : chunk;                                             \
        vf a[PV_REGS], b[PV_REGS / 2];                                                                  \
        for (int64_t i = 0; i < dn; i += W) {                                                           \
            a[i / W] = vload_first(o + d0 + i, dn - i);                                                 \
            if (two) b[i / W] = vload_first(o + D + d0 + i, dn - i);                                    \
        }                                                                                               \
        for (int64_t j = 0; j < n; j++) {                                                               \
            const vf wa = vset1(w[j]), wb = vset1(two ? w[ws + j] : 0.0f);                              \
            for (int64_t i = 0; i < dn; i += W) {                                                       \
                const vf x = LOAD(rows[j] + at + d0 + i, dn - i);                                       \
                a[i / W] = vfma(wa, x, a[i / W]);                                                       \
                if (two) b[i / W] = vfma(wb, x, b[i / W]);                                              \
            }                                                                                           \
        }                                                                                               \
        for (int64_t i = 0; i < dn; i += W) {                                                           \
            vstore_first(o + d0 + i, a[i / W], dn - i);                                                 \
            if (two) vstore_first(o + D + d0 + i, b[i / W], dn - i);                                    \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
static inline __attribute__((always_inline)) int NAME##_simd(                                            \
         const ELEM *q, const ELEM *k, const ELEM *v, const int64_t *tables, const int64_t *lens,       \
         float *out, float *scores, int64_t G, int64_t H, int64_t KV, const int64_t D, int64_t bs,      \
         int64_t max_blocks, int64_t max_len, float scale) {                                            \
    const int64_t per_kv = H / KV, row = KV * D, block = bs * row, stride = score_stride(max_len);      \
    const int two = per_kv % 2 == 0;                                                                    \
    vf part[W], mx[256];                                                                                \
    const ELEM *rows[W];                                                                                \
    int64_t at[W];                                                                                      \
    float sum[256];                                                                                     \
    for (int64_t g = 0; g < G; g++) {                                                                   \
        const int64_t len = lens[g];                                                                    \
        if (len < 1 || len > max_len || len > max_blocks * bs) return -1;                               \
        const int64_t *table = tables + g * max_blocks;                                                 \
        const ELEM *qg = q + g * H * D;                                                                 \
        float *og = out + g * H * D;                                                                    \
        for (int64_t h = 0; h < H; h++) mx[h] = vset1(-INFINITY);                                       \
        for (int64_t t0 = 0; t0 < len; t0 += W) {                                                       \
            tile_rows(at, table, t0, len - t0 < W ? len - t0 : W, bs, block, row);                      \
            for (int64_t j = 0; j < W; j++) rows[j] = k + at[j];                                        \
            for (int64_t h = 0; h < H; h++) { /* the tile's rows stay in L1 across the heads */          \
                for (int64_t j = h * W / H; j < (h + 1) * W / H; j++) /* the next rows', a share a head */ \
                    prefetch_row((const char *)k, sizeof(ELEM), table, t0 + j, len, bs, block, row);   \
                const ELEM *qh = qg + h * D;                                                            \
                const int64_t c = (h / per_kv) * D;                                                     \
                for (int j = 0; j < W; j++) part[j] = vzero();                                          \
                for (int64_t i = 0; i < D; i += STEP)                                                   \
                    for (int j = 0; j < W; j++) part[j] = KDOT(part[j], qh + i, rows[j] + c + i, D - i); \
                const vf s = vmul(sum_lanes(part), vset1(scale));                                       \
                vstoreu(scores + h * stride + t0, s);                                                   \
                mx[h] = vmax_first(mx[h], s, len - t0);                                                 \
            }                                                                                           \
        }                                                                                               \
        for (int64_t h = 0; h < H; h++) {                                                               \
            float *sh = scores + h * stride;                                                            \
            const vf m = vset1(vhmax(mx[h]));                                                           \
            vf total = vzero();                                                                         \
            for (int64_t t0 = 0; t0 < len; t0 += W) {                                                   \
                const vf e = vkeep_first(vexp(vsub(vloadu(sh + t0), m)), len - t0);                     \
                vstoreu(sh + t0, e);                                                                    \
                total = vadd(total, e);                                                                 \
            }                                                                                           \
            sum[h] = vhsum(total);                                                                      \
        }                                                                                               \
        memset(og, 0, sizeof(float) * H * D);                                                           \
        for (int64_t t0 = 0; t0 < len; t0 += W) { /* the tile's V rows stay in L1 across the heads */   \
            const int64_t n = len - t0 < W ? len - t0 : W;                                              \
            tile_rows(at, table, t0, n, bs, block, row);                                                \
            for (int64_t j = 0; j < W; j++) rows[j] = v + at[j];                                        \
            for (int64_t h = 0; h < H; h += 1 + two) {                                                  \
                for (int64_t j = h * W / H; j < (h + 1 + two) * W / H; j++)                             \
                    prefetch_row((const char *)v, sizeof(ELEM), table, t0 + j, len, bs, block, row);   \
                if (two) /* a constant `two` in each call: the chunk loops unroll into registers */    \
                    NAME##_pv(og + h * D, scores + h * stride + t0, stride, rows, (h / per_kv) * D, n, D, 1); \
                else                                                                                    \
                    NAME##_pv(og + h * D, scores + h * stride + t0, stride, rows, (h / per_kv) * D, n, D, 0); \
            }                                                                                           \
        }                                                                                               \
        normalise(og, sum, H, D);                                                                       \
    }                                                                                                   \
    return 0;                                                                                           \
}                                                                                                       \
int NAME(const ELEM *q, const ELEM *k, const ELEM *v, const int64_t *tables, const int64_t *lens,        \
         float *out, float *scores, int64_t G, int64_t H, int64_t KV, int64_t D, int64_t bs,            \
         int64_t max_blocks, int64_t max_len, float scale) {                                            \
    if (!VECTOR_TAKES(D) || H > 256)                                                                    \
        return NAME##_c(q, k, v, tables, lens, out, scores, G, H, KV, D, bs, max_blocks, max_len, scale); \
    switch (D) {                                                                                        \
    case 64: return NAME##_simd(q, k, v, tables, lens, out, scores, G, H, KV, 64, bs, max_blocks, max_len, scale); \
    case 80: return NAME##_simd(q, k, v, tables, lens, out, scores, G, H, KV, 80, bs, max_blocks, max_len, scale); \
    case 128: return NAME##_simd(q, k, v, tables, lens, out, scores, G, H, KV, 128, bs, max_blocks, max_len, scale); \
    default: return NAME##_simd(q, k, v, tables, lens, out, scores, G, H, KV, D, bs, max_blocks, max_len, scale); \
    }                                                                                                   \
}

PAGED_DECODE_SIMD(paged_decode_f32, float, load_f32, kdot_f32, F32_STEP)
PAGED_DECODE_SIMD(paged_decode_bf16, uint16_t, load_bf16, kdot_bf16, BF16_STEP)
