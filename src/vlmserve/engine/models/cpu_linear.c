/* A decode step's linear layers in bfloat16 on AVX512-BF16: y = x W^T (+ bias) for a few
 * rows x [rows, in] against a plain weight W [out, in], reading W once at memory speed.
 *
 * With one to a few rows a linear layer is a read of its weight: every weight byte is used
 * once per row. oneDNN's packed product reads the weights of a 2-core Zen 4 at 23-27 GB/s
 * where a plain read runs at 35-40; this kernel streams them at 31-37 GB/s. Each thread
 * takes a contiguous range of output rows, four at a time (their weights are 4 x in
 * contiguous bf16), and each 64-byte piece of weight meets the matching piece of up to four
 * input rows on vdpbf16ps (pairs of bf16 products, exact in float32, added to float32
 * sums). The four weight rows are four interleaved streams, which the hardware prefetcher
 * follows badly; each load is therefore paired with a software prefetch into L2 of the
 * same place a fixed distance ahead (PREFETCH_BYTES), measured best at about 256 KiB.
 *
 * Invariance: every output y[m, n] is its 16-lane sum over `in` in one order (piece by
 * piece), reduced across lanes in one order, plus the bias, rounded once to bf16 (nearest
 * even); which rows it shares a call or a register block with, and the thread count, change
 * nothing. So a row's result is the same alone and in any batch.
 *
 * Built with cpu_decode.c into one library (cpu_attention.py); without AVX512-BF16 the
 * entry point refuses (has_linear() == 0) and the caller keeps torch's product.
 */
#include <stdint.h>

#define OUT_BLOCK 4                    /* output rows a block: their sums stay in registers */
#define ROW_BLOCK 4                    /* input rows a pass over a block's weights */
#define PREFETCH_BYTES (256 * 1024)    /* how far ahead of the loads the weights are fetched */

#if defined(__AVX512BF16__)
#include <immintrin.h>

static inline uint16_t round_bf16(float f) {
    return (uint16_t)_mm_cvtsi128_si32((__m128i)_mm_cvtneps_pbh(_mm_set1_ps(f)));
}

static inline float from_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

/* Outputs n0..n0+nn-1 (nn <= OUT_BLOCK) of input rows m0..m0+R-1; `ahead` elements past
 * each load is prefetched. R is a compile-time constant, so the sums are R x OUT_BLOCK
 * registers. */
#define BLOCK(R)                                                                              \
    static void block##R(const uint16_t *x, int64_t xs, const uint16_t *w, int64_t in,     \
                         const uint16_t *bias, uint16_t *y, int64_t ys, int64_t n0, int nn, \
                         int64_t m0, int64_t ahead) {                                       \
        __m512 sum[OUT_BLOCK][R];                                                            \
        const uint16_t *row[OUT_BLOCK];                                                      \
        for (int i = 0; i < OUT_BLOCK; i++) {                                                \
            row[i] = w + (n0 + (i < nn ? i : 0)) * in;                                       \
            for (int j = 0; j < R; j++) sum[i][j] = _mm512_setzero_ps();                     \
        }                                                                                    \
        for (int64_t k = 0; k < in; k += 32) {                                               \
            __m512bh xv[R];                                                                  \
            for (int j = 0; j < R; j++)                                                      \
                xv[j] = (__m512bh)_mm512_loadu_si512(x + (m0 + j) * xs + k);                 \
            for (int i = 0; i < OUT_BLOCK; i++) {                                            \
                _mm_prefetch((const char *)(row[i] + k + ahead), _MM_HINT_T1);               \
                __m512bh wv = (__m512bh)_mm512_loadu_si512(row[i] + k);                      \
                for (int j = 0; j < R; j++) sum[i][j] = _mm512_dpbf16_ps(sum[i][j], wv, xv[j]); \
            }                                                                                \
        }                                                                                    \
        for (int i = 0; i < nn; i++)                                                         \
            for (int j = 0; j < R; j++) {                                                    \
                float s = _mm512_reduce_add_ps(sum[i][j]);                                   \
                if (bias) s += from_bf16(bias[n0 + i]);                                      \
                y[(m0 + j) * ys + n0 + i] = round_bf16(s);                                   \
            }                                                                                \
    }
BLOCK(1)
BLOCK(2)
BLOCK(3)
BLOCK(4)

/* y[m, n] = bf16(sum_k x[m, k] w[n, k] + bias[n]) for m < rows, n < out. x rows `xs`
 * elements apart, y rows `ys` apart; w [out, in] contiguous; bias [out] or NULL. -> 0, or
 * 1 where `in` is not a multiple of 32 (nothing written). */
int linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                int64_t rows, int64_t out, int64_t in, int64_t xs, int64_t ys, int threads) {
    if (in % 32 != 0 || in <= 0)
        return 1;
    int64_t ahead = PREFETCH_BYTES / 2 / in / OUT_BLOCK * OUT_BLOCK; /* whole blocks of rows */
    if (ahead < OUT_BLOCK)
        ahead = OUT_BLOCK;
    ahead *= in; /* in elements */
    const int64_t blocks = (out + OUT_BLOCK - 1) / OUT_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * OUT_BLOCK;
        const int nn = out - n0 < OUT_BLOCK ? (int)(out - n0) : OUT_BLOCK;
        for (int64_t m0 = 0; m0 < rows; m0 += ROW_BLOCK) {
            switch (rows - m0 < ROW_BLOCK ? rows - m0 : ROW_BLOCK) {
            case 1: block1(x, xs, w, in, bias, y, ys, n0, nn, m0, ahead); break;
            case 2: block2(x, xs, w, in, bias, y, ys, n0, nn, m0, ahead); break;
            case 3: block3(x, xs, w, in, bias, y, ys, n0, nn, m0, ahead); break;
            default: block4(x, xs, w, in, bias, y, ys, n0, nn, m0, ahead);
            }
        }
    }
    return 0;
}

int has_linear(void) { return 1; }

#else /* no AVX512-BF16 in this build: torch's product */

int linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                int64_t rows, int64_t out, int64_t in, int64_t xs, int64_t ys, int threads) {
    (void)x, (void)w, (void)bias, (void)y, (void)rows, (void)out, (void)in, (void)xs;
    (void)ys, (void)threads;
    return 1;
}

int has_linear(void) { return 0; }
#endif
