/* What the AVX512-BF16 kernels share (cpu_decode.c's bf16 path, cpu_prefill.c). */
#ifndef VLMSERVE_CPU_BF16_H
#define VLMSERVE_CPU_BF16_H
#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <stdint.h>

typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

/* e^x for x <= 0 (a score less the running maximum) on 16 lanes: cpu_decode.c's exp_neg,
 * Cephes' polynomial on x - n ln2 times 2^n, in the same steps and constants. NaN stays
 * NaN (a poisoned cache must poison the output). */
static inline __m512 exp_neg16(__m512 v) {
    vf16 x = (vf16)v;
    const vf16 low = x * 0.0f - 87.0f;
    x = (vf16)_mm512_mask_blend_ps(_mm512_cmp_ps_mask((__m512)x, (__m512)low, _CMP_LT_OQ),
                                   (__m512)x, (__m512)low);
    const vf16 t = x * 1.44269504088896341f;
    const vf16 n = (t + 12582912.0f) - 12582912.0f;
    vf16 r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    vf16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
    return (__m512)(p * (vf16)bits);
}
#endif
#endif
