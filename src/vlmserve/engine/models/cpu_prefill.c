/* Causal prefill attention on CPU for bfloat16 models, where the CPU has AVX512-BF16.
 *
 * torch's CPU flash attention computes a bfloat16 prompt's attention in float32 arithmetic,
 * at about a third of the speed of a bfloat16 matmul on the same cores; at 2,000 tokens it
 * was 40% of a prefill's time. Here both products run on vdpbf16ps, which multiplies pairs
 * of bfloat16 numbers exactly and sums them in float32:
 *
 *   scores = q . k (bfloat16 inputs, float32 sums) x scale, an online softmax in float32,
 *   out += p . v with p rounded to bfloat16 (as torch's kernel does for bfloat16 inputs),
 *   out / l rounded to bfloat16 (round to nearest even).
 *
 * Work: the keys and values of the prompt are first packed per KV head into tiles of KT
 * keys in the pair-interleaved order vdpbf16ps reads; then each unit -- QB query tokens of
 * one KV head's rep query heads -- runs over the tiles up to its last token. A unit's result
 * depends on nothing but its own queries and the keys before them, so a row's attention is
 * the same alone or beside others. Built with cpu_decode.c into one library
 * (cpu_attention.py); without AVX512-BF16 `prefill_attention` returns -1 and the caller uses
 * torch's kernel.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define QB 16 /* query tokens a unit */
#define KT 32 /* keys a tile */
#define MAX_ROWS 128 /* query heads x QB in a unit */
#define MAX_PDIM 256

static inline float exp_neg1(float x) {
    return _mm512_cvtss_f32(exp_neg16(_mm512_set1_ps(x)));
}

/* k [L][.. kv_heads][dim] (token stride ks) -> kp [kv_heads][tiles][dim/2][KT][2];
 * v alike -> vp [kv_heads][tiles][KT/2][dim][2]. Keys past L are zeros. */
static void pack(const uint16_t *k, const uint16_t *v, int64_t ks, int64_t vs, int64_t L,
                 int64_t kv_heads, int64_t dim, uint16_t *kp, uint16_t *vp, int threads) {
    const int64_t tiles = (L + KT - 1) / KT, per = dim * KT;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < kv_heads * tiles; u++) {
        const int64_t g = u / tiles, t = u % tiles;
        uint16_t *kt = kp + u * per, *vt = vp + u * per;
        for (int64_t j = 0; j < KT; j++) {
            const int64_t tok = t * KT + j;
            for (int64_t d = 0; d < dim; d++) {
                kt[((d / 2) * KT + j) * 2 + d % 2] = tok < L ? k[tok * ks + g * dim + d] : 0;
                vt[((j / 2) * dim + d) * 2 + j % 2] = tok < L ? v[tok * vs + g * dim + d] : 0;
            }
        }
    }
}

/* One unit: query tokens q0..q0+QB-1 (those < T; at positions first + q0 ..) of KV head
 * g's rep query heads. */
static inline __attribute__((always_inline)) void
unit(const uint16_t *q, int64_t qs, const uint16_t *kp, const uint16_t *vp, uint16_t *out,
     int64_t os, int64_t T, int64_t first, int causal, int64_t g, int64_t rep, const int64_t dim,
     int64_t q0, int64_t tiles, float scale) {
    const int64_t nq = T - q0 < QB ? T - q0 : QB, rows = rep * QB;
    uint16_t qr[MAX_ROWS * MAX_PDIM] __attribute__((aligned(64)));
    float o[MAX_ROWS * MAX_PDIM] __attribute__((aligned(64)));
    float s[MAX_ROWS * KT] __attribute__((aligned(64)));
    uint16_t pb[MAX_ROWS * KT] __attribute__((aligned(64)));
    float m[MAX_ROWS], l[MAX_ROWS], shrink[MAX_ROWS];
    for (int64_t r = 0; r < rows; r++) { /* row r: head g * rep + r / QB, token q0 + r % QB */
        const int64_t i = r % QB, h = g * rep + r / QB;
        if (i < nq)
            memcpy(qr + r * dim, q + (q0 + i) * qs + h * dim, (size_t)dim * 2);
        else
            memset(qr + r * dim, 0, (size_t)dim * 2);
        m[r] = -3.0e38f;
        l[r] = 0.0f;
    }
    memset(o, 0, (size_t)(rows * dim) * 4);
    /* the last key any row of the unit sees: its last query's, or every key */
    const int64_t last = causal ? first + q0 + nq - 1 : first + T - 1, used = last / KT + 1;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t t = 0; t < used; t++) {
        const uint16_t *kt = kp + (g * tiles + t) * dim * KT;
        const uint16_t *vt = vp + (g * tiles + t) * dim * KT;
        /* scores: 8 rows x 32 keys a block */
        for (int64_t rb = 0; rb < rows; rb += 8) {
            __m512 acc[8][2];
            for (int r = 0; r < 8; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
            for (int64_t d2 = 0; d2 < dim / 2; d2++) {
                const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + d2 * KT * 2);
                const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + d2 * KT * 2 + 32);
                for (int r = 0; r < 8; r++) {
                    int32_t pair;
                    memcpy(&pair, qr + (rb + r) * dim + 2 * d2, 4);
                    const __m512bh qd = (__m512bh)_mm512_set1_epi32(pair);
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qd, k0);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qd, k1);
                }
            }
            const __m512 sc = _mm512_set1_ps(scale);
            for (int r = 0; r < 8; r++) {
                _mm512_store_ps(s + (rb + r) * KT, _mm512_mul_ps(acc[r][0], sc));
                _mm512_store_ps(s + (rb + r) * KT + 16, _mm512_mul_ps(acc[r][1], sc));
            }
        }
        /* online softmax: keys after a row's token are masked */
        for (int64_t r = 0; r < rows; r++) {
            const int64_t see = (causal ? first + q0 + r % QB : last) - t * KT; /* keys 0..see */
            const __mmask16 v0 = _mm512_cmple_epi32_mask(lane, _mm512_set1_epi32((int32_t)see));
            const __mmask16 v1 =
                _mm512_cmple_epi32_mask(lane, _mm512_set1_epi32((int32_t)(see - 16)));
            const __m512 floor = _mm512_set1_ps(-3.0e38f);
            const __m512 s0 = _mm512_mask_blend_ps(v0, floor, _mm512_load_ps(s + r * KT));
            const __m512 s1 = _mm512_mask_blend_ps(v1, floor, _mm512_load_ps(s + r * KT + 16));
            float top = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
            top = top > m[r] ? top : m[r];
            const __m512 tv = _mm512_set1_ps(top);
            const __m512 p0 = _mm512_maskz_mov_ps(v0, exp_neg16(_mm512_sub_ps(s0, tv)));
            const __m512 p1 = _mm512_maskz_mov_ps(v1, exp_neg16(_mm512_sub_ps(s1, tv)));
            shrink[r] = exp_neg1(m[r] - top);
            l[r] = l[r] * shrink[r] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
            m[r] = top;
            _mm512_store_si512(pb + r * KT, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        /* out = out x shrink + p . v: 4 rows x 4 chunks of 16 dims a block */
        for (int64_t rb = 0; rb < rows; rb += 4)
            for (int64_t c0 = 0; c0 < dim / 16; c0 += 4) {
                const int64_t cn = dim / 16 - c0 < 4 ? dim / 16 - c0 : 4;
                __m512 acc[4][4];
                for (int r = 0; r < 4; r++) {
                    const __m512 f = _mm512_set1_ps(shrink[rb + r]);
                    for (int c = 0; c < cn; c++)
                        acc[r][c] = _mm512_mul_ps(_mm512_load_ps(o + (rb + r) * dim + (c0 + c) * 16), f);
                }
                for (int64_t j2 = 0; j2 < KT / 2; j2++) {
                    __m512bh vv[4];
                    for (int c = 0; c < cn; c++)
                        vv[c] = (__m512bh)_mm512_load_si512(vt + (j2 * dim + (c0 + c) * 16) * 2);
                    for (int r = 0; r < 4; r++) {
                        int32_t pair;
                        memcpy(&pair, pb + (rb + r) * KT + 2 * j2, 4);
                        const __m512bh pd = (__m512bh)_mm512_set1_epi32(pair);
                        for (int c = 0; c < cn; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pd, vv[c]);
                    }
                }
                for (int r = 0; r < 4; r++)
                    for (int c = 0; c < cn; c++)
                        _mm512_store_ps(o + (rb + r) * dim + (c0 + c) * 16, acc[r][c]);
            }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = r % QB, h = g * rep + r / QB;
        if (i >= nq) continue;
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        for (int64_t c = 0; c < dim / 16; c++) {
            const __m256bh b = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o + r * dim + c * 16), inv));
            _mm256_storeu_si256((__m256i *)(out + (q0 + i) * os + h * dim + c * 16), (__m256i)b);
        }
    }
}
#endif

/* q [T][heads][dim]: the tokens at positions first..first+T-1; k and v [L][kv_heads][dim],
 * L = first + T: every key up to the last query (token strides qs, ks, vs: elements); out
 * [T][heads][dim] (token stride os); all bfloat16. scratch: 2 x L' x kv_heads x dim
 * bfloat16 (L' = L rounded up to 32) for the packed keys and values. causal: the query at
 * position p attends to keys 0..p; else every query to all L keys (a vision tower's).
 * Returns 0, or -1 where this build has no AVX512-BF16 or the layout is past the kernel's
 * buffers (dim not a multiple of 16 or over 256, rep x 16 over 128 rows). */
int prefill_attention(const void *q, const void *k, const void *v, void *out, void *scratch,
                      int64_t T, int64_t first, int causal, int64_t heads, int64_t kv_heads,
                      int64_t dim, int64_t qs, int64_t ks, int64_t vs, int64_t os, float scale,
                      int threads) {
#if defined(__AVX512BF16__)
    const int64_t rep = heads / kv_heads;
    if (dim % 16 != 0 || dim > MAX_PDIM || rep * QB > MAX_ROWS || rep * QB % 8 != 0) return -1;
    const int64_t keys = first + T, tiles = (keys + KT - 1) / KT, blocks = (T + QB - 1) / QB;
    uint16_t *kp = (uint16_t *)scratch, *vp = kp + kv_heads * tiles * KT * dim;
    pack((const uint16_t *)k, (const uint16_t *)v, ks, vs, keys, kv_heads, dim, kp, vp, threads);
    /* the longest units (the last query blocks) first, so the threads finish together */
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t u = 0; u < kv_heads * blocks; u++) {
        const int64_t b = blocks - 1 - u / kv_heads, g = u % kv_heads;
        if (dim == 64)
            unit((const uint16_t *)q, qs, kp, vp, (uint16_t *)out, os, T, first, causal, g, rep, 64, b * QB,
                 tiles, scale);
        else if (dim == 128)
            unit((const uint16_t *)q, qs, kp, vp, (uint16_t *)out, os, T, first, causal, g, rep, 128, b * QB,
                 tiles, scale);
        else
            unit((const uint16_t *)q, qs, kp, vp, (uint16_t *)out, os, T, first, causal, g, rep, dim, b * QB,
                 tiles, scale);
    }
    return 0;
#else
    (void)q, (void)k, (void)v, (void)out, (void)scratch, (void)T, (void)first, (void)causal;
    (void)heads, (void)kv_heads;
    (void)dim, (void)qs, (void)ks, (void)vs, (void)os, (void)scale, (void)threads;
    return -1;
#endif
}

/* 1 where this build has the prefill kernel (AVX512-BF16), else 0. */
int has_prefill(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
