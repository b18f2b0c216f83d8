/* Prompt attention that reads the paged KV pool in place, in bfloat16 (workers/paged_prefill.py).
 *
 * A group of G prompt chunks of n tokens each. Chunk g's token i sits at position starts[g] + i and
 * attends causally to its request's pooled keys 0 .. starts[g] + i (its own chunk's K/V are already
 * written), block tables as in paged_decode.c:
 *   out[g, i, h] = softmax(scale * q[g, i, h] . K[0 : starts[g] + i + 1]) @ V[...]      (float32)
 * q: [G, n, H, D] bfloat16; out: [G, n, H, D] float32. With causal 0, every query sees all
 * starts[g] + n keys instead (a vision tower's attention: paged_prefill.vision_attention).
 *
 * Per request and kv head, its keys are laid out once in the pair order `vdpbf16ps` reads (K: for each
 * pair of dims, 16 tokens side by side; V: pairs of tokens side by side), then for each tile of 16 query
 * positions (times the query heads sharing the kv head): scores by broadcasting a pair of query dims
 * against 32 keys, 8 query rows at a time (exact bf16 products, float32 sums; each broadcast feeds two
 * `vdpbf16ps`, 11 % quicker than one on the AMD EPYC host of 2026-12-05), a causal float32 softmax with
 * the vectorised exp, the probabilities rounded to bfloat16, and P @ V the same way. No gather and no
 * masked padding. Only built where the CPU has AVX512_BF16; D must be a multiple of 16 (paged_prefill.usable).
 *
 * Where the build has AMX (-march=native on an Intel Xeon with AMX-BF16) and the OS lets the process use
 * its tiles, the two products run on them instead (amx_scores, amx_pv): the layouts above are the
 * ones a tile multiply reads (K's pairs of dims are its B operand for Q @ K^T, V's pairs of tokens its
 * B operand for P @ V), so only the query rows are copied, to a block of 16 rows at a fixed stride.
 * The softmax and everything else stay as they are; sums run in another order, so the output differs
 * from the vdpbf16ps path's within float32 rounding. paged_prefill_amx says whether the tiles can run
 * here (built with them, granted by the OS); paged_prefill_use_amx(0) turns them off (tests, lab). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include "simd.h"

#define QT 16 /* query positions per tile */
#define RG 8  /* query rows whose scores are computed together */
#define RO 4  /* query rows whose outputs are summed together */

static inline int64_t round32(int64_t x) { return (x + 31) / 32 * 32; }

/* The scratch, in 4-byte words, for requests up to max_len tokens (paged_prefill.py allocates it): the
 * laid-out K and V, the scores, the bf16 probabilities, and the query rows the AMX path copies. */
int64_t paged_prefill_scratch_words(int64_t H, int64_t KV, int64_t D, int64_t max_len) {
    const int64_t l = round32(max_len), rows = H / KV * QT;
    return D / 2 * l + l / 2 * D + rows * l + rows * l / 2 + rows * D / 2;
}

#include "amx.h"
#ifdef MSERVE_AMX
static int amx_wanted = 1; /* paged_prefill_use_amx(0) runs the vdpbf16ps products (tests, lab) */

/* Whether this call runs the products on AMX tiles: built with them, wanted, D a multiple of 32 (a
 * tile row is 32 bf16), and the OS granted the tile state (amx.h). */
static int amx_on(int64_t D) { return amx_wanted && D % 32 == 0 && amx_granted(); }

/* Every tile 16 rows of 64 bytes: 16 x 32 bf16 operands, 16 x 16 float32 sums. */
static void amx_prefill_tiles(void) {
    const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_configure(8, rows, colsb);
}

/* Scores of 16 query rows (qa: [16][D] bf16) against keys [0, keys) rounded up to 32 (kt's pair rows,
 * zero past the request's last token), unscaled, into s (rows of l32 floats). */
static void amx_scores(const uint16_t *qa, const uint32_t *kt, float *s, int64_t D, int64_t l32, int64_t keys) {
    if (D == 64) { /* the query's two chunks of 32 dims stay in tiles 2 and 3 across the keys */
        _tile_loadd(2, qa, D * 2);
        _tile_loadd(3, qa + 32, D * 2);
        for (int64_t t0 = 0; t0 < keys; t0 += 32) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_loadd(4, kt + t0, l32 * 4);
            _tile_loadd(5, kt + t0 + 16, l32 * 4);
            _tile_loadd(6, kt + 16 * l32 + t0, l32 * 4);
            _tile_loadd(7, kt + 16 * l32 + t0 + 16, l32 * 4);
            _tile_dpbf16ps(0, 2, 4);
            _tile_dpbf16ps(1, 2, 5);
            _tile_dpbf16ps(0, 3, 6);
            _tile_dpbf16ps(1, 3, 7);
            _tile_stored(0, s + t0, l32 * 4);
            _tile_stored(1, s + t0 + 16, l32 * 4);
        }
        return;
    }
    for (int64_t t0 = 0; t0 < keys; t0 += 32) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
            _tile_loadd(2, qa + 2 * p0, D * 2);
            _tile_loadd(4, kt + p0 * l32 + t0, l32 * 4);
            _tile_loadd(5, kt + p0 * l32 + t0 + 16, l32 * 4);
            _tile_dpbf16ps(0, 2, 4);
            _tile_dpbf16ps(1, 2, 5);
        }
        _tile_stored(0, s + t0, l32 * 4);
        _tile_stored(1, s + t0 + 16, l32 * 4);
    }
}

/* P @ V of 16 rows (pr: bf16 pairs, rows of l32/2 words) over `pairs` token pairs (a multiple of 16) for
 * dims d0 .. d0 + 16 nc (nc 2 or 4) into o ([16][64] floats). */
static void amx_pv(const uint32_t *pr, const uint32_t *vp, float *o, int64_t D, int64_t l32, int64_t pairs,
                   int64_t nc) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j0 = 0; j0 < pairs; j0 += 16) {
        const uint32_t *v = vp + j0 * D;
        _tile_loadd(4, pr + j0, l32 * 2);
        _tile_loadd(5, v, D * 4);
        _tile_loadd(6, v + 16, D * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        if (nc == 4) {
            _tile_loadd(7, v + 32, D * 4);
            _tile_loadd(5, v + 48, D * 4);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, o, 64 * 4);
    _tile_stored(1, o + 16, 64 * 4);
    if (nc == 4) {
        _tile_stored(2, o + 32, 64 * 4);
        _tile_stored(3, o + 48, 64 * 4);
    }
}

static void amx_release(void) { _tile_release(); }
int paged_prefill_amx(void) { return amx_granted(); }
void paged_prefill_use_amx(int64_t on) { amx_wanted = on != 0; }
#else /* never called: amx_on is 0 */
static int amx_on(int64_t D) { (void)D; return 0; }
static void amx_prefill_tiles(void) {}
static void amx_release(void) {}
static void amx_scores(const uint16_t *qa, const uint32_t *kt, float *s, int64_t D, int64_t l32, int64_t keys) {
    (void)qa, (void)kt, (void)s, (void)D, (void)l32, (void)keys;
}
static void amx_pv(const uint32_t *pr, const uint32_t *vp, float *o, int64_t D, int64_t l32, int64_t pairs,
                   int64_t nc) {
    (void)pr, (void)vp, (void)o, (void)D, (void)l32, (void)pairs, (void)nc;
}
int paged_prefill_amx(void) { return 0; }
void paged_prefill_use_amx(int64_t on) { (void)on; }
#endif

static inline __m512 bcast(const uint32_t *p) { return _mm512_castsi512_ps(_mm512_set1_epi32((int)*p)); }
#define DP(acc, a, b) _mm512_dpbf16_ps((acc), (__m512bh)_mm512_castps_si512(a), (__m512bh)(b))

/* e^(sc x - m) of the 16 scores at x whose first `left` are seen, 0 for the rest (sc is 1 where the
 * scores were scaled as they were stored, the scale where they come unscaled from the tiles). */
static inline __m512 row_exp(const float *x, __m512 m, int64_t left, __m512 sc) {
    if (left <= 0) return _mm512_setzero_ps();
    return _mm512_maskz_mov_ps(first16(left), exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(x), sc), m)));
}

/* P @ V for RO rows and 64 dims: acc[r][x] = sum over token pairs j of P[r, j] . V[j, 16x .. 16x + 15].
 * Every bound is a constant, so the 16 sums stay in registers (with the chunk count a variable, gcc kept
 * 12 of them on the stack, a store and a load each per vdpbf16ps). */
static inline void pv_full(__m512 acc[RO][4], const uint32_t **pr, const uint32_t *v, int64_t D,
                           int64_t pairs) {
    __m512 a[RO][4];
    for (int r = 0; r < RO; r++)
        for (int x = 0; x < 4; x++) a[r][x] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; j++, v += D) {
        const __m512i v0 = _mm512_loadu_si512(v), v1 = _mm512_loadu_si512(v + 16);
        const __m512i v2 = _mm512_loadu_si512(v + 32), v3 = _mm512_loadu_si512(v + 48);
        for (int r = 0; r < RO; r++) {
            const __m512 p = bcast(pr[r] + j);
            a[r][0] = DP(a[r][0], p, v0);
            a[r][1] = DP(a[r][1], p, v1);
            a[r][2] = DP(a[r][2], p, v2);
            a[r][3] = DP(a[r][3], p, v3);
        }
    }
    for (int r = 0; r < RO; r++)
        for (int x = 0; x < 4; x++) acc[r][x] = a[r][x];
}

/* The same for the last nc < 4 chunks of 16 dims (a head size that is not a multiple of 64). */
static void pv_part(__m512 acc[RO][4], const uint32_t **pr, const uint32_t *v, int64_t D, int64_t pairs,
                    int64_t nc) {
    for (int r = 0; r < RO; r++)
        for (int x = 0; x < 4; x++) acc[r][x] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; j++, v += D)
        for (int64_t x = 0; x < nc; x++) {
            const __m512i vv = _mm512_loadu_si512(v + 16 * x);
            for (int r = 0; r < RO; r++) acc[r][x] = DP(acc[r][x], bcast(pr[r] + j), vv);
        }
}

/* Returns 0; -1 for a length out of range; -2 for shapes the kernel does not take. */
int paged_prefill_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *tables,
                       const int64_t *starts, float *out, uint32_t *scratch, int64_t G, int64_t n, int64_t H,
                       int64_t KV, int64_t D, int64_t bs, int64_t max_blocks, int64_t max_len, int64_t causal,
                       float scale) {
    if (D % 16 || D > 256 || H % KV || n < 1) return -2;
    const int64_t per_kv = H / KV, row = KV * D, block = bs * row, pairs = D / 2, l32 = round32(max_len);
    const int64_t rows = per_kv * QT;
    uint32_t *kt = scratch;                    /* [D/2][l32]: dims 2p, 2p+1 of token t at kt[p * l32 + t] */
    uint32_t *vp = kt + pairs * l32;           /* [l32/2][D]: tokens 2j, 2j+1 of dim d at vp[j * D + d] */
    float *s = (float *)(vp + l32 / 2 * D);    /* [rows][l32] scores, then probabilities */
    uint32_t *pb = (uint32_t *)(s + rows * l32); /* [rows][l32/2] probabilities of tokens 2j, 2j+1 in bf16 */
    uint16_t *qa = (uint16_t *)(pb + rows * (l32 / 2)); /* [rows][D]: the tile's query rows (AMX) */
    float inv[QT * 256];
    if (rows > QT * 256) return -2;
    for (int64_t g = 0; g < G; g++)
        if (starts[g] < 0 || starts[g] + n > max_len || starts[g] + n > max_blocks * bs) return -1;
    const int amx = amx_on(D) && scale > 0; /* the softmax scales the tiles' max (below) */
    if (amx) amx_prefill_tiles();
    for (int64_t g = 0; g < G; g++) {
        const int64_t start = starts[g], len = start + n;
        const int64_t *table = tables + g * max_blocks, lpad = round32(len);
        for (int64_t c = 0; c < KV; c++) {
            /* this kv head's keys and values in pair order; zeros past the last token */
            for (int64_t t = 0; t < lpad; t++) {
                const uint32_t *kr = (const uint32_t *)(k + table[t < len ? t / bs : 0] * block + (t % bs) * row + c * D);
                for (int64_t p = 0; p < pairs; p++) kt[p * l32 + t] = t < len ? kr[p] : 0;
            }
            for (int64_t j = 0; j < lpad / 2; j++) {
                const int64_t t = 2 * j;
                if (t >= len) { memset(vp + j * D, 0, sizeof(uint32_t) * D); continue; }
                const uint16_t *a = v + table[t / bs] * block + (t % bs) * row + c * D;
                const uint16_t *b = t + 1 < len ? v + table[(t + 1) / bs] * block + ((t + 1) % bs) * row + c * D : NULL;
                for (int64_t d = 0; d < D; d++) vp[j * D + d] = (uint32_t)a[d] | (b ? (uint32_t)b[d] << 16 : 0u);
            }
            for (int64_t i0 = 0; i0 < n; i0 += QT) {
                const int64_t nq = n - i0 < QT ? n - i0 : QT, nr = per_kv * nq;
                const int64_t keys = causal ? start + i0 + nq : len; /* the tile's last query sees this many */
                const uint32_t *qrow[QT * 256];
                int64_t pos[QT * 256];
                for (int64_t r = 0; r < nr; r++) { /* row r: query head c*per_kv + r/nq, position i0 + r%nq */
                    const int64_t h = c * per_kv + r / nq, i = i0 + r % nq;
                    qrow[r] = (const uint32_t *)(q + ((g * n + i) * H + h) * D);
                    pos[r] = causal ? start + i : len - 1; /* the last key it sees */
                }
                if (amx) { /* scores on tiles, 16 rows at a time; rows past nr repeat the last (not kept) */
                    for (int64_t r = 0; r < (nr + 15) / 16 * 16; r++)
                        memcpy(qa + r * D, qrow[r < nr ? r : nr - 1], sizeof(uint16_t) * D);
                    for (int64_t r0 = 0; r0 < nr; r0 += 16) amx_scores(qa + r0 * D, kt, s + r0 * l32, D, l32, keys);
                }
                /* scores: RG rows at a time against 32 keys (kt is zero up to l32, so the last 32 may run past
                 * the tile's keys); rows past nr repeat the last (not kept) */
                for (int64_t r0 = 0; r0 < nr && !amx; r0 += RG) {
                    const uint32_t *qr[RG];
                    for (int64_t r = 0; r < RG; r++) qr[r] = qrow[r0 + r < nr ? r0 + r : nr - 1];
                    for (int64_t t0 = 0; t0 < keys; t0 += 32) { /* 32 keys: each broadcast query pair used twice */
                        __m512 acc[RG], acc2[RG];
                        for (int64_t r = 0; r < RG; r++) acc[r] = acc2[r] = _mm512_setzero_ps();
                        for (int64_t p = 0; p < pairs; p++) {
                            const __m512i kk = _mm512_loadu_si512(kt + p * l32 + t0);
                            const __m512i kk2 = _mm512_loadu_si512(kt + p * l32 + t0 + 16);
                            for (int64_t r = 0; r < RG; r++) {
                                const __m512 qq = bcast(qr[r] + p);
                                acc[r] = DP(acc[r], qq, kk);
                                acc2[r] = DP(acc2[r], qq, kk2);
                            }
                        }
                        for (int64_t r = 0; r < RG && r0 + r < nr; r++) {
                            _mm512_storeu_ps(s + (r0 + r) * l32 + t0, _mm512_mul_ps(acc[r], _mm512_set1_ps(scale)));
                            _mm512_storeu_ps(s + (r0 + r) * l32 + t0 + 16, _mm512_mul_ps(acc2[r], _mm512_set1_ps(scale)));
                        }
                    }
                }
                /* causal softmax per row; probabilities to bf16 pairs, zeros up to the tile's key count. The
                 * tiles' scores come unscaled: the max of the scaled ones is the scaled max (scale > 0). */
                const int64_t kpad = round32(keys);
                const float sc1 = amx ? scale : 1.0f;
                const __m512 sc = _mm512_set1_ps(sc1);
                for (int64_t r = 0; r < nr; r++) {
                    float *sr = s + r * l32;
                    const int64_t seen = pos[r] + 1;
                    __m512 mx = _mm512_set1_ps(-INFINITY);
                    for (int64_t t0 = 0; t0 < seen; t0 += 16)
                        mx = _mm512_mask_max_ps(mx, first16(seen - t0), mx, _mm512_loadu_ps(sr + t0));
                    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * sc1);
                    /* e^(score - max) of 32 keys at a time, summed in float32 and stored as bf16 pairs in one
                     * pass; keys past the row's last are 0 without an exp */
                    __m512 total = _mm512_setzero_ps();
                    for (int64_t t0 = 0; t0 < kpad; t0 += 32) {
                        const __m512 e0 = row_exp(sr + t0, m, seen - t0, sc);
                        const __m512 e1 = row_exp(sr + t0 + 16, m, seen - t0 - 16, sc);
                        total = _mm512_add_ps(_mm512_add_ps(total, e0), e1);
                        _mm512_storeu_si512(pb + r * (l32 / 2) + t0 / 2, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
                    }
                    inv[r] = 1.0f / _mm512_reduce_add_ps(total);
                }
                if (amx) { /* P @ V on tiles: 16 rows and 64 dims (or the last 32) at a time */
                    float o16[16 * 64];
                    for (int64_t r0 = 0; r0 < nr; r0 += 16)
                        for (int64_t d0 = 0; d0 < D; d0 += 64) {
                            const int64_t nc = D - d0 >= 64 ? 4 : 2;
                            amx_pv(pb + r0 * (l32 / 2), vp + d0, o16, D, l32, kpad / 2, nc);
                            for (int64_t r = 0; r < 16 && r0 + r < nr; r++) {
                                const int64_t rr = r0 + r, h = c * per_kv + rr / nq, i = i0 + rr % nq;
                                float *o = out + ((g * n + i) * H + h) * D + d0;
                                for (int64_t x = 0; x < nc; x++)
                                    _mm512_storeu_ps(o + 16 * x, _mm512_mul_ps(_mm512_loadu_ps(o16 + r * 64 + 16 * x),
                                                                               _mm512_set1_ps(inv[rr])));
                            }
                        }
                }
                /* P @ V: RO rows at a time, 16 dims a pass, pairs of tokens per vdpbf16ps */
                for (int64_t r0 = 0; r0 < nr && !amx; r0 += RO) {
                    const uint32_t *pr[RO];
                    for (int64_t r = 0; r < RO; r++) pr[r] = pb + (r0 + r < nr ? r0 + r : nr - 1) * (l32 / 2);
                    for (int64_t d0 = 0; d0 < D; d0 += 64) { /* up to 4 chunks of 16 dims in registers */
                        const int64_t nc = (D - d0) / 16 < 4 ? (D - d0) / 16 : 4;
                        __m512 acc[RO][4];
                        if (nc == 4) pv_full(acc, pr, vp + d0, D, kpad / 2);
                        else pv_part(acc, pr, vp + d0, D, kpad / 2, nc);
                        for (int64_t r = 0; r < RO && r0 + r < nr; r++) {
                            const int64_t rr = r0 + r, h = c * per_kv + rr / nq, i = i0 + rr % nq;
                            float *o = out + ((g * n + i) * H + h) * D + d0;
                            for (int64_t x = 0; x < nc; x++)
                                _mm512_storeu_ps(o + 16 * x, _mm512_mul_ps(acc[r][x], _mm512_set1_ps(inv[rr])));
                        }
                    }
                }
            }
        }
    }
    if (amx) amx_release();
    return 0;
}

#endif
