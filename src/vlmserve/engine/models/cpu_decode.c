/* Decode attention on CPU, reading the paged KV cache where it lies.
 *
 * One query per head and row; each row's keys and values are read through its block table in
 * the cache's dtype (bfloat16, float16 or float32) and converted in registers, with float32
 * scores, softmax and sums (an online softmax, one block of keys at a time). Nothing is
 * gathered or copied.
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
