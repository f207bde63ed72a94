/* Decode attention on CPU, reading the paged KV cache where it lies.
 *
 * One query per head and row; each row's keys and values are read through its block table in
 * the cache's dtype (bfloat16, float16 or float32) and converted in registers, with float32
 * scores, softmax and sums (an online softmax, one block of keys at a time). Nothing is
 * gathered or copied. A bfloat16 cache on a CPU with AVX512-BF16 is not converted at all:
 * both products run on the bfloat16 dot-product instruction (tiles_bf16, below).
 *
 * Work is split between OpenMP threads by (row, KV head) pairs; everything about one pair --
 * every reduction over its keys -- runs on one thread in one fixed order, so a row's output
 * does not depend on its companions in the batch nor on the thread count (batch invariance).
 * The OpenMP runtime is the process's own: torch's libgomp is loaded first and a library
 * asking for libgomp.so.1 gets that one, so torch's team runs these loops too.
 *
 * Built by cpu_attention.py with the system C compiler (-O3, the host's ISA) and loaded
 * with ctypes, which releases the GIL for the call.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include "cpu_bf16.h"

static inline uint16_t bf16_store(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* e^x for x <= 0 (a score less the running maximum): Cephes' polynomial on x - n ln2, times
 * 2^n; written without calls or branches so the compiler vectorises the loops using it.
 * NaN stays NaN (a poisoned cache must poison the output). */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = (int32_t)n + 127;
    uint32_t bits = (uint32_t)e << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

enum { F32 = 0, BF16 = 1, F16 = 2 };

/* dim elements of the cache or query at p (element offset) -> float32 dst. */
static inline void load(const void *p, int64_t offset, int kind, float *restrict dst,
                        int64_t dim) {
    if (kind == BF16) {
        const uint16_t *src = (const uint16_t *)p + offset;
        uint32_t *restrict bits = (uint32_t *)dst; /* built with -fno-strict-aliasing */
        for (int64_t d = 0; d < dim; d++) bits[d] = (uint32_t)src[d] << 16;
    } else if (kind == F32) {
        memcpy(dst, (const float *)p + offset, (size_t)dim * 4);
    }
#ifdef __FLT16_MAX__
    else {
        const _Float16 *src = (const _Float16 *)p + offset;
        for (int64_t d = 0; d < dim; d++) dst[d] = (float)src[d];
    }
#endif
}

static inline void store(void *p, int64_t offset, int kind, const float *restrict src,
                         int64_t dim) {
    if (kind == BF16) {
        uint16_t *dst = (uint16_t *)p + offset;
        for (int64_t d = 0; d < dim; d++) dst[d] = bf16_store(src[d]);
    } else if (kind == F32) {
        memcpy((float *)p + offset, src, (size_t)dim * 4);
    }
#ifdef __FLT16_MAX__
    else {
        _Float16 *dst = (_Float16 *)p + offset;
        for (int64_t d = 0; d < dim; d++) dst[d] = (_Float16)src[d];
    }
#endif
}

#define MAX_REP 32
#define MAX_DIM 512
#define MAX_BLOCK 128
#define MAX_HEADS_DIM 8192 /* query heads x dim in one work unit */
#define MAX_HEADS 128 /* query heads in one work unit */
#define TILE 16 /* keys a step of the tiled path: a block holds whole tiles */

/* One (row, KV head): rep query heads q[rep][dim] (float32), the row's table and length ->
 * out[rep][dim] (float32). A block of keys is converted to float32 first (kf, vf: L1), then
 * each query head runs over it with its query, and later its output, held in registers.
 * always_inline: the callers pass dim as a constant where they can, so the loops over it
 * are unrolled. */
static inline __attribute__((always_inline)) void
pair(const float *restrict q, const void *k, const void *v, int kind, const int64_t *table,
     int64_t length, int64_t rep, const int64_t dim, int64_t block, int64_t token_stride,
     int64_t block_stride, int64_t first, float scale, float *restrict out) {
    float m[MAX_REP], l[MAX_REP], shrinks[MAX_REP];
    float s[MAX_REP * MAX_BLOCK] __attribute__((aligned(64)));
    float kf[MAX_BLOCK * MAX_DIM] __attribute__((aligned(64)));
    for (int64_t r = 0; r < rep; r++) {
        m[r] = -3.0e38f;
        l[r] = 0.0f;
    }
    for (int64_t x = 0; x < rep * dim; x++) out[x] = 0.0f;
    for (int64_t start = 0; start < length; start += block) {
        const int64_t n = length - start < block ? length - start : block;
        const int64_t base = table[start / block] * block_stride + first;
        for (int64_t i = 0; i < n; i++) load(k, base + i * token_stride, kind, kf + i * dim, dim);
        for (int64_t r = 0; r < rep; r++) {
            const float *restrict qr = q + r * dim;
            float *restrict sr = s + r * MAX_BLOCK;
            for (int64_t i = 0; i < n; i++) {
                const float *restrict ki = kf + i * dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < dim; d++) dot += qr[d] * ki[d];
                sr[i] = dot * scale;
            }
            float top = m[r];
            for (int64_t i = 0; i < n; i++) top = sr[i] > top ? sr[i] : top;
            const float shrink = exp_neg(m[r] - top);
            float sum = 0.0f;
            m[r] = top;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < n; i++) {
                sr[i] = exp_neg(sr[i] - top);
                sum += sr[i];
            }
            l[r] = l[r] * shrink + sum;
            shrinks[r] = shrink;
        }
        for (int64_t i = 0; i < n; i++) load(v, base + i * token_stride, kind, kf + i * dim, dim);
        for (int64_t r = 0; r < rep; r++) {
            const float *restrict sr = s + r * MAX_BLOCK;
            const float shrink = shrinks[r];
            float acc[MAX_DIM] __attribute__((aligned(64)));
            float *restrict o = out + r * dim;
            for (int64_t d = 0; d < dim; d++) acc[d] = o[d] * shrink;
            for (int64_t i = 0; i < n; i++) {
                const float p = sr[i];
                const float *restrict vi = kf + i * dim;
                for (int64_t d = 0; d < dim; d++) acc[d] += p * vi[d];
            }
            for (int64_t d = 0; d < dim; d++) o[d] = acc[d];
        }
    }
    for (int64_t r = 0; r < rep; r++) {
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < dim; d++) out[r * dim + d] *= inv;
    }
}

/* The tiled path (dim and block multiples of 8): keys in tiles of 8, eight-float vectors
 * (GCC/Clang vector extensions: AVX2 or AVX-512 registers, NEON pairs). A tile's 8 dot
 * products per query head are summed across lanes together (a shuffle tree, no horizontal
 * sum per key) and its softmax and value sums run on those 8 scores at once. */
typedef float v8 __attribute__((vector_size(32)));
typedef uint32_t w8 __attribute__((vector_size(32)));
typedef uint16_t h8 __attribute__((vector_size(16)));

#if defined(__clang__)
#define SHUF(x, y, a, b, c, d, e, f, g, h) __builtin_shufflevector(x, y, a, b, c, d, e, f, g, h)
#else
#define SHUF(x, y, a, b, c, d, e, f, g, h) __builtin_shuffle(x, y, (w8){a, b, c, d, e, f, g, h})
#endif

static inline v8 load8(const void *p, int64_t offset, int kind) {
    v8 f = {0};
    if (kind == BF16) {
#if defined(__AVX2__) /* two instructions; the generic conversion compiles to many more */
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + offset));
        f = (v8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
        h8 h;
        memcpy(&h, (const uint16_t *)p + offset, sizeof h);
        w8 w = __builtin_convertvector(h, w8) << 16;
        memcpy(&f, &w, sizeof f);
#endif
    } else if (kind == F32) {
        memcpy(&f, (const float *)p + offset, sizeof f);
    }
#if defined(__F16C__) && defined(__AVX2__)
    else {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + offset));
        f = (v8)_mm256_cvtph_ps(h);
    }
#elif defined(__FLT16_MAX__)
    else {
        typedef _Float16 f16x8 __attribute__((vector_size(16)));
        f16x8 h;
        memcpy(&h, (const _Float16 *)p + offset, sizeof h);
        f = __builtin_convertvector(h, v8);
    }
#endif
    return f;
}

typedef int32_t i8 __attribute__((vector_size(32)));

/* mask ? a : b, lane by lane (mask lanes all ones or zeros, as comparisons give them). */
static inline v8 select8(i8 mask, v8 a, v8 b) { return (v8)(((i8)a & mask) | ((i8)b & ~mask)); }

/* exp_neg on 8 lanes, in vector operations (the same steps and constants). */
static inline v8 exp_neg8(v8 x) {
    const v8 low = x * 0.0f - 87.0f;
    x = select8(x < low, low, x);
    const v8 t = x * 1.44269504088896341f;
    const v8 n = (t + 12582912.0f) - 12582912.0f;
    v8 r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const i8 bits = (__builtin_convertvector(n, i8) + 127) << 23;
    return p * (v8)bits;
}

/* The largest of 8 lanes, or floor where all are below it (NaN lanes never win). */
static inline float max8(v8 a, float floor) {
    a = select8(a > SHUF(a, a, 4, 5, 6, 7, 0, 1, 2, 3), a, SHUF(a, a, 4, 5, 6, 7, 0, 1, 2, 3));
    a = select8(a > SHUF(a, a, 2, 3, 0, 1, 6, 7, 4, 5), a, SHUF(a, a, 2, 3, 0, 1, 6, 7, 4, 5));
    a = select8(a > SHUF(a, a, 1, 0, 3, 2, 5, 4, 7, 6), a, SHUF(a, a, 1, 0, 3, 2, 5, 4, 7, 6));
    return a[0] > floor ? a[0] : floor;
}

/* a[j]'s 8 lanes summed -> lane j, for j = 0..7 (pairwise, in a fixed order). */
static inline v8 sum_lanes(const v8 *a) {
    v8 b[4], c[2];
    for (int j = 0; j < 4; j++)
        b[j] = SHUF(a[2 * j], a[2 * j + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               SHUF(a[2 * j], a[2 * j + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int j = 0; j < 2; j++)
        c[j] = SHUF(b[2 * j], b[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUF(b[2 * j], b[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Prefetch tokens j0..j1-1 of one KV head's keys and values at element offset at (a tile to
 * come) into L2 only: prefetched into L1 they evict the tile at work's floats, slower than
 * none (measured). */
static inline void prefetch_tokens(const void *k, const void *v, int64_t at, int64_t j0,
                                   int64_t j1, int64_t token_stride, int64_t bytes,
                                   int64_t esize) {
    for (int64_t j = j0; j < j1; j++)
        for (int64_t b = 0; b < bytes; b += 64) {
            __builtin_prefetch((const char *)k + (at + j * token_stride) * esize + b, 0, 1);
            __builtin_prefetch((const char *)v + (at + j * token_stride) * esize + b, 0, 1);
        }
}

/* o (nc vectors) = o * shrink + the sum over the tile's keys j of p[j] * vt[j]. */
static inline __attribute__((always_inline)) void
add_values(const v8 *restrict vt, const v8 *p, float shrink, v8 *restrict o, const int64_t nc) {
    v8 x[MAX_DIM / 8];
    for (int64_t c = 0; c < nc; c++) x[c] = o[c] * shrink;
    for (int64_t j = 0; j < TILE; j++) /* nc independent sums a key: no chain */
        for (int64_t c = 0; c < nc; c++) x[c] += p[j / 8][j % 8] * vt[j * nc + c];
    for (int64_t c = 0; c < nc; c++) o[c] = x[c];
}

/* add_values for two query heads in one pass over the values (each head's sums in the same
 * order as alone), where both heads' nc sums fit the registers. */
static inline __attribute__((always_inline)) void
add_values2(const v8 *restrict vt, const v8 *p0, const v8 *p1, float s0, float s1,
            v8 *restrict o0, v8 *restrict o1, const int64_t nc) {
    v8 x0[MAX_DIM / 8], x1[MAX_DIM / 8];
    for (int64_t c = 0; c < nc; c++) {
        x0[c] = o0[c] * s0;
        x1[c] = o1[c] * s1;
    }
    for (int64_t j = 0; j < TILE; j++) {
        const float a = p0[j / 8][j % 8], b = p1[j / 8][j % 8];
        for (int64_t c = 0; c < nc; c++) {
            x0[c] += a * vt[j * nc + c];
            x1[c] += b * vt[j * nc + c];
        }
    }
    for (int64_t c = 0; c < nc; c++) {
        o0[c] = x0[c];
        o1[c] = x1[c];
    }
}

/* A row's KV heads g0..g1-1 on the tiled path: q [heads][nc] vectors (their rep query heads
 * each, nc = dim / 8) -> out, alike. A tile is 16 tokens (two groups of 8 lanes) of one
 * block, converted to float32 one KV head at a time. Each step runs for all of that KV head's
 * query heads before the next (scores, then softmax updates, then value sums): their chains
 * are independent, so the core overlaps them. The next tile's keys and values are
 * prefetched a few tokens per query head, spread over the work instead of in one burst
 * (measured: 30% faster from DRAM at 8 rows x 4,096 tokens). */
static inline __attribute__((always_inline)) void
tiles(const v8 *restrict q, const void *k, const void *v, int kind, const int64_t *table,
      int64_t length, int64_t g0, int64_t g1, int64_t rep, const int64_t nc, int64_t block,
      int64_t token_stride, int64_t block_stride, float scale, v8 *restrict out) {
    const int64_t heads = (g1 - g0) * rep, esize = kind == F32 ? 4 : 2;
    const int64_t spread = (TILE + rep - 1) / rep; /* next-tile tokens prefetched a head */
    float m[MAX_HEADS], l[MAX_HEADS], shrinks[MAX_REP];
    /* a tile's keys and values in float32, rows of nc vectors side by side: rows strided by
     * the largest dim instead (2 KiB apart) fall into the same few L1 sets and evict each
     * other (measured: 20% of the kernel's time) */
    v8 kt[TILE * MAX_DIM / 8] __attribute__((aligned(64)));
    v8 vt[TILE * MAX_DIM / 8] __attribute__((aligned(64)));
    v8 sc[MAX_REP][2], p[MAX_REP][2];
    const v8 zero = {0}, floor = zero - 3.0e38f;
    const i8 lanes = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int64_t h = 0; h < heads; h++) {
        m[h] = -3.0e38f;
        l[h] = 0.0f;
    }
    for (int64_t x = 0; x < heads * nc; x++) out[x] = zero;
    for (int64_t start = 0; start < length; start += TILE) {
        const int64_t n = length - start < TILE ? length - start : TILE;
        const i8 valid[2] = {lanes < (int32_t)n, lanes + 8 < (int32_t)n};
        const int64_t tile = table[start / block] * block_stride + (start % block) * token_stride;
        const int64_t next = start + TILE, ahead = length - next < TILE ? length - next : TILE;
        const int64_t at =
            ahead > 0 ? table[next / block] * block_stride + (next % block) * token_stride : 0;
        for (int64_t g = g0; g < g1; g++) {
            const int64_t base = tile + g * nc * 8, h0 = (g - g0) * rep;
            for (int64_t j = 0; j < TILE; j++)
                for (int64_t c = 0; c < nc; c++) {
                    const int64_t x = base + j * token_stride + c * 8;
                    kt[j * nc + c] = j < n ? load8(k, x, kind) : zero; /* past the row: zeros */
                    vt[j * nc + c] = j < n ? load8(v, x, kind) : zero;
                }
            for (int64_t r = 0; r < rep; r++) { /* scores */
                const int64_t j0 = r * spread < ahead ? r * spread : ahead;
                const int64_t j1 = j0 + spread < ahead ? j0 + spread : ahead;
                prefetch_tokens(k, v, at + g * nc * 8, j0, j1, token_stride, nc * 8 * esize, esize);
                const v8 *restrict qh = q + (h0 + r) * nc;
                v8 acc[TILE];
                for (int64_t j = 0; j < TILE; j++) {
                    v8 a = qh[0] * kt[j * nc];
                    for (int64_t c = 1; c < nc; c++) a += qh[c] * kt[j * nc + c];
                    acc[j] = a;
                }
                for (int half = 0; half < 2; half++)
                    sc[r][half] = select8(valid[half], sum_lanes(acc + 8 * half) * scale, floor);
            }
            for (int64_t r = 0; r < rep; r++) { /* online softmax updates */
                const int64_t h = h0 + r;
                const float top = max8(sc[r][1], max8(sc[r][0], m[h]));
                shrinks[r] = exp_neg(m[h] - top);
                for (int half = 0; half < 2; half++)
                    p[r][half] = select8(valid[half], exp_neg8(sc[r][half] - top), zero);
                const v8 both = p[r][0] + p[r][1];
                const float sum =
                    ((both[0] + both[1]) + (both[2] + both[3])) + ((both[4] + both[5]) + (both[6] + both[7]));
                l[h] = l[h] * shrinks[r] + sum;
                m[h] = top;
            }
            int64_t r = 0; /* value sums */
            if (nc <= 8) /* two heads' sums fit the registers */
                for (; r + 1 < rep; r += 2)
                    add_values2(vt, p[r], p[r + 1], shrinks[r], shrinks[r + 1],
                                out + (h0 + r) * nc, out + (h0 + r + 1) * nc, nc);
            for (; r < rep; r++) add_values(vt, p[r], shrinks[r], out + (h0 + r) * nc, nc);
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        const float inv = 1.0f / l[h];
        for (int64_t c = 0; c < nc; c++) out[h * nc + c] *= inv;
    }
}

#if defined(__AVX512BF16__)
/* The bfloat16 path, where the CPU has AVX512-BF16: both products on vdpbf16ps, which
 * multiplies pairs of bfloat16 numbers exactly and sums them in float32, so the cache's keys
 * and values are never converted to float32 (the tiled path's conversions and float32
 * products were most of its instructions). Tiles of 16 tokens of one block:
 *
 *   keys: 16 tokens x 16 key pairs transposed in registers (a pair's 16 tokens in one
 *   vector), so a query head's 16 scores are its query pairs broadcast against them, with no
 *   horizontal sums;
 *   values: two tokens' values interleaved in pairs (vpunpck[lh]wd, within 128-bit lanes),
 *   against the two tokens' probabilities rounded to bfloat16 (as torch's attention rounds
 *   them for bfloat16 inputs); the sums come out in that interleaved order of dimensions and
 *   are put back in order once, at the end.
 *
 * Tokens past the row's length are zeros (masked scores, zero values), as on the tiled
 * path; the online softmax is the same, in float32. */
#define BT 16 /* keys a tile */
#define MAX_BDIM 256

/* 16 rows of 16 32-bit elements -> their transpose, in place. */
static inline void transpose16(__m512i r[16]) {
    __m512i a[16], b[16], c[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        b[4 * i + 0] = _mm512_unpacklo_epi64(a[4 * i + 0], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i + 0], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            c[8 * i + j] = _mm512_shuffle_i32x4(b[8 * i + j], b[8 * i + 4 + j], 0x88);
            c[8 * i + 4 + j] = _mm512_shuffle_i32x4(b[8 * i + j], b[8 * i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(c[j], c[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(c[j], c[j + 8], 0xdd);
    }
}

/* Two query heads' 16 scores each: their dim / 2 query pairs (q0, q1) against the tile's
 * transposed key pairs, four independent sums a head combined in a fixed order (a head's
 * scores do not depend on the other head). */
static inline __attribute__((always_inline)) void
scores16x2(const uint32_t *q0, const uint32_t *q1, const __m512i *kt, const int64_t pairs,
           __m512 *s0, __m512 *s1) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
#define DP(acc, qq, x) acc = _mm512_dpbf16_ps(acc, (__m512bh)kt[x], (__m512bh)_mm512_set1_epi32((int32_t)qq[x]))
    for (int64_t x = 0; x < pairs; x += 4) {
        DP(a0, q0, x);
        DP(b0, q1, x);
        DP(a1, q0, x + 1);
        DP(b1, q1, x + 1);
        DP(a2, q0, x + 2);
        DP(b2, q1, x + 2);
        DP(a3, q0, x + 3);
        DP(b3, q1, x + 3);
    }
#undef DP
    *s0 = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
    *s1 = _mm512_add_ps(_mm512_add_ps(b0, b1), _mm512_add_ps(b2, b3));
}

/* o (nv vectors, interleaved order) = o x shrink + the tile's 8 token pairs of values (vi)
 * against one query head's probability pairs (pp). */
static inline __attribute__((always_inline)) void
values16(const __m512i *vi, const uint32_t *pp, float shrink, float *restrict o,
         const int64_t nv) {
    __m512 acc[MAX_BDIM / 16];
    const __m512 f = _mm512_set1_ps(shrink);
    for (int64_t c = 0; c < nv; c++) acc[c] = _mm512_mul_ps(_mm512_load_ps(o + c * 16), f);
    for (int64_t i = 0; i < BT / 2; i++) {
        const __m512bh pd = (__m512bh)_mm512_set1_epi32((int32_t)pp[i]);
        for (int64_t c = 0; c < nv; c++)
            acc[c] = _mm512_dpbf16_ps(acc[c], pd, (__m512bh)vi[i * nv + c]);
    }
    for (int64_t c = 0; c < nv; c++) _mm512_store_ps(o + c * 16, acc[c]);
}

/* values16 for two query heads in one pass (each head's sums in the same order as alone). */
static inline __attribute__((always_inline)) void
values16x2(const __m512i *vi, const uint32_t *p0, const uint32_t *p1, float s0, float s1,
           float *restrict o0, float *restrict o1, const int64_t nv) {
    __m512 a0[MAX_BDIM / 16], a1[MAX_BDIM / 16];
    const __m512 f0 = _mm512_set1_ps(s0), f1 = _mm512_set1_ps(s1);
    for (int64_t c = 0; c < nv; c++) {
        a0[c] = _mm512_mul_ps(_mm512_load_ps(o0 + c * 16), f0);
        a1[c] = _mm512_mul_ps(_mm512_load_ps(o1 + c * 16), f1);
    }
    for (int64_t i = 0; i < BT / 2; i++) {
        const __m512bh d0 = (__m512bh)_mm512_set1_epi32((int32_t)p0[i]);
        const __m512bh d1 = (__m512bh)_mm512_set1_epi32((int32_t)p1[i]);
        for (int64_t c = 0; c < nv; c++) {
            a0[c] = _mm512_dpbf16_ps(a0[c], d0, (__m512bh)vi[i * nv + c]);
            a1[c] = _mm512_dpbf16_ps(a1[c], d1, (__m512bh)vi[i * nv + c]);
        }
    }
    for (int64_t c = 0; c < nv; c++) {
        _mm512_store_ps(o0 + c * 16, a0[c]);
        _mm512_store_ps(o1 + c * 16, a1[c]);
    }
}

/* A row's KV heads g0..g1-1 on the bfloat16 path (dim a multiple of 32, at most 256; block a
 * multiple of 16): q [heads][dim] bfloat16 (the row's query heads from KV head g0's first)
 * -> out [heads][dim] float32, in order. */
static inline __attribute__((always_inline)) void
tiles_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *table,
           int64_t length, int64_t g0, int64_t g1, int64_t rep, const int64_t dim,
           int64_t block, int64_t token_stride, int64_t block_stride, float scale,
           float *restrict out) {
    const int64_t heads = (g1 - g0) * rep, pairs = dim / 2, nv = dim / 16;
    const int64_t spread = (2 * BT + rep - 1) / rep; /* next-tile rows prefetched a head */
    float m[MAX_HEADS], l[MAX_HEADS], shrinks[MAX_REP];
    float o[MAX_HEADS_DIM] __attribute__((aligned(64))); /* interleaved order */
    __m512i kt[MAX_BDIM / 2]; /* key pair x: the tile's 16 tokens */
    __m512i vi[BT / 2 * MAX_BDIM / 16]; /* token pair i, dims c: interleaved values */
    uint32_t pp[MAX_REP][BT / 2] __attribute__((aligned(64)));
    __m512 sv[MAX_REP];
    const __m512 floor = _mm512_set1_ps(-3.0e38f), sc = _mm512_set1_ps(scale);
    for (int64_t h = 0; h < heads; h++) {
        m[h] = -3.0e38f;
        l[h] = 0.0f;
    }
    memset(o, 0, (size_t)(heads * dim) * 4);
    for (int64_t start = 0; start < length; start += BT) {
        const int64_t n = length - start < BT ? length - start : BT;
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        const int64_t tile = table[start / block] * block_stride + (start % block) * token_stride;
        const int64_t next = start + BT, ahead = length - next < BT ? length - next : BT;
        const int64_t at =
            ahead > 0 ? table[next / block] * block_stride + (next % block) * token_stride : 0;
        for (int64_t g = g0; g < g1; g++) {
            const int64_t base = tile + g * dim, h0 = (g - g0) * rep;
            for (int64_t x = 0; x < pairs; x += 16) { /* keys: 16 pairs at a time */
                __m512i r[16];
                for (int64_t j = 0; j < BT; j++)
                    r[j] = j < n ? _mm512_loadu_si512(k + base + j * token_stride + 2 * x)
                                 : _mm512_setzero_si512();
                transpose16(r);
                for (int j = 0; j < 16; j++) kt[x + j] = r[j];
            }
            for (int64_t i = 0; i < BT / 2; i++) /* values: token pairs interleaved */
                for (int64_t c = 0; c < nv / 2; c++) {
                    const int64_t j = 2 * i;
                    const __m512i a = j < n ? _mm512_loadu_si512(v + base + j * token_stride + 32 * c)
                                            : _mm512_setzero_si512();
                    const __m512i b = j + 1 < n
                                          ? _mm512_loadu_si512(v + base + (j + 1) * token_stride + 32 * c)
                                          : _mm512_setzero_si512();
                    vi[i * nv + 2 * c] = _mm512_unpacklo_epi16(a, b);
                    vi[i * nv + 2 * c + 1] = _mm512_unpackhi_epi16(a, b);
                }
            for (int64_t r = 0; r < rep; r += 2) { /* scores, two heads at a time */
                const int64_t r1 = r + 1 < rep ? r + 1 : r; /* an odd last head: twice */
                scores16x2((const uint32_t *)(q + (h0 + r) * dim),
                           (const uint32_t *)(q + (h0 + r1) * dim), kt, pairs, &sv[r], &sv[r1]);
            }
            for (int64_t r = 0; r < rep; r++) { /* online softmax updates */
                const int64_t h = h0 + r;
                const int64_t j0 = r * spread < 2 * ahead ? r * spread : 2 * ahead;
                const int64_t j1 = j0 + spread < 2 * ahead ? j0 + spread : 2 * ahead;
                for (int64_t j = j0; j < j1; j++) /* the next tile's key rows, then value rows */
                    for (int64_t b = 0; b < dim * 2; b += 64)
                        __builtin_prefetch((const char *)((j < ahead ? k : v) + at + g * dim +
                                                          (j % ahead) * token_stride) + b, 0, 1);
                const __m512 s = _mm512_mask_blend_ps(valid, floor, _mm512_mul_ps(sv[r], sc));
                float top = _mm512_reduce_max_ps(s);
                top = top > m[h] ? top : m[h];
                const __m512 p = _mm512_maskz_mov_ps(valid, exp_neg16(_mm512_sub_ps(s, _mm512_set1_ps(top))));
                shrinks[r] = exp_neg(m[h] - top);
                l[h] = l[h] * shrinks[r] + _mm512_reduce_add_ps(p);
                m[h] = top;
                _mm256_store_si256((__m256i *)pp[r], (__m256i)_mm512_cvtneps_pbh(p));
            }
            int64_t r = 0; /* value sums */
            if (nv <= 8)
                for (; r + 1 < rep; r += 2)
                    values16x2(vi, pp[r], pp[r + 1], shrinks[r], shrinks[r + 1],
                               o + (h0 + r) * dim, o + (h0 + r + 1) * dim, nv);
            for (; r < rep; r++) values16(vi, pp[r], shrinks[r], o + (h0 + r) * dim, nv);
        }
    }
    for (int64_t h = 0; h < heads; h++) { /* divide by l; back to the dimensions' order */
        const float inv = 1.0f / l[h];
        const float *oh = o + h * dim;
        float *dst = out + h * dim;
        for (int64_t c = 0; c < nv / 2; c++)
            for (int64_t lane4 = 0; lane4 < 4; lane4++)
                for (int64_t i = 0; i < 4; i++) {
                    dst[32 * c + 8 * lane4 + i] = oh[(2 * c) * 16 + 4 * lane4 + i] * inv;
                    dst[32 * c + 8 * lane4 + 4 + i] = oh[(2 * c + 1) * 16 + 4 * lane4 + i] * inv;
                }
    }
}
#endif

/* q [rows, heads, dim]; k, v [blocks, block, kv_heads, dim] (one layer, contiguous); tables
 * [rows, width] block ids; lengths [rows] keys each row attends to (>= 1); out like q; kind
 * the element type of all four (F32, BF16, F16). Returns 0, or -1 for a shape past the
 * kernel's fixed buffers (rep > MAX_REP, dim > MAX_DIM, rep * dim > MAX_HEADS_DIM,
 * block > MAX_BLOCK).
 *
 * Work units are a row's KV heads in groups: a whole row where there are rows enough for
 * the threads, else fewer heads a unit so that every thread has work. A KV head's result
 * is the same in any group (its loops do not depend on the others'). */
int paged_decode(const void *q, const void *k, const void *v, const int64_t *tables,
                 const int64_t *lengths, void *out, int64_t rows, int64_t heads,
                 int64_t kv_heads, int64_t dim, int64_t block, int64_t width, float scale,
                 int kind, int threads) {
    const int64_t rep = heads / kv_heads;
    const int64_t token_stride = kv_heads * dim, block_stride = block * token_stride;
    const int tiled = dim % 8 == 0 && block % TILE == 0;
    if (rep > MAX_REP || dim > MAX_DIM || rep * dim > MAX_HEADS_DIM || block > MAX_BLOCK)
        return -1;
    int64_t per = kv_heads; /* KV heads a unit */
    if (rows < 2 * threads) {
        const int64_t want = (2 * threads + rows - 1) / rows; /* units a row */
        per = (kv_heads + want - 1) / want;
    }
    while (per * rep * dim > MAX_HEADS_DIM || per * rep > MAX_HEADS) per--;
    const int64_t groups = (kv_heads + per - 1) / per, units = rows * groups;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t u = 0; u < units; u++) {
        const int64_t b = u / groups, g0 = u % groups * per;
        const int64_t g1 = g0 + per < kv_heads ? g0 + per : kv_heads;
        v8 qv[MAX_HEADS_DIM / 8] __attribute__((aligned(64)));
        v8 ov[MAX_HEADS_DIM / 8] __attribute__((aligned(64)));
        float *qf = (float *)qv, *of = (float *)ov; /* built with -fno-strict-aliasing */
        const int64_t head = (b * heads + g0 * rep) * dim, span = (g1 - g0) * rep * dim;
        const int64_t *table = tables + b * width;
#if defined(__AVX512BF16__)
        if (kind == BF16 && dim % 32 == 0 && dim <= MAX_BDIM && block % BT == 0) {
            const uint16_t *qb = (const uint16_t *)q + head;
            const uint16_t *kb = (const uint16_t *)k, *vb = (const uint16_t *)v;
            if (dim == 64)
                tiles_bf16(qb, kb, vb, table, lengths[b], g0, g1, rep, 64, block, token_stride,
                           block_stride, scale, of);
            else if (dim == 128)
                tiles_bf16(qb, kb, vb, table, lengths[b], g0, g1, rep, 128, block, token_stride,
                           block_stride, scale, of);
            else
                tiles_bf16(qb, kb, vb, table, lengths[b], g0, g1, rep, dim, block, token_stride,
                           block_stride, scale, of);
            store(out, head, kind, of, span);
            continue;
        }
#endif
        load(q, head, kind, qf, span);
        if (dim == 64 && tiled)
            tiles(qv, k, v, kind, table, lengths[b], g0, g1, rep, 8, block, token_stride,
                  block_stride, scale, ov);
        else if (dim == 128 && tiled)
            tiles(qv, k, v, kind, table, lengths[b], g0, g1, rep, 16, block, token_stride,
                  block_stride, scale, ov);
        else if (tiled)
            tiles(qv, k, v, kind, table, lengths[b], g0, g1, rep, dim / 8, block, token_stride,
                  block_stride, scale, ov);
        else
            for (int64_t g = g0; g < g1; g++)
                pair(qf + (g - g0) * rep * dim, k, v, kind, table, lengths[b], rep, dim, block,
                     token_stride, block_stride, g * dim, scale, of + (g - g0) * rep * dim);
        store(out, head, kind, of, span);
    }
    return 0;
}

/* 1 when paged_decode takes float16 (the compiler has _Float16), else 0. */
int has_float16(void) {
#ifdef __FLT16_MAX__
    return 1;
#else
    return 0;
#endif
}
