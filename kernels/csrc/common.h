/* What the CPU kernels share: status codes, thread counts, an exp that vectorises. */
#ifndef PAGEDSERVE_COMMON_H
#define PAGEDSERVE_COMMON_H

#include <stdint.h>
#include <string.h>

/* Returned by every entry point; kernels/native.py turns them into exceptions. */
enum {
    PS_OK = 0,
    PS_BAD_QUERY_START_LOC = 1,
    PS_BAD_SEQ_LEN = 2,
    PS_BAD_BLOCK_ID = 3,
    PS_OUT_OF_MEMORY = 4,
    PS_UNSUPPORTED = 5,
};

/* A hint only: compilers without the builtin lose speed, not correctness. */
#if defined(__GNUC__) || defined(__clang__)
#define PS_PREFETCH(p) __builtin_prefetch(p)
#else
#define PS_PREFETCH(p) ((void)(p))
#endif

/* Elements per thread below which waking another thread costs more than it saves (ATen's grain). */
#define PS_GRAIN 32768

static inline int ps_threads(int64_t work_items, int64_t grain, int num_threads) {
    int64_t useful = (work_items + grain - 1) / grain;
    if (useful < num_threads) return useful < 1 ? 1 : (int)useful;
    return num_threads < 1 ? 1 : num_threads;
}

/* b where take_b, else a, without a branch. A plain `x < lo ? lo : x` clamp gets compiled into a
 * branch, each side of which GCC constant-folds separately, and then the loop no longer vectorises. */
static inline float ps_select(int take_b, float a, float b) {
    int32_t ai, bi, mask = -(int32_t)take_b;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    ai = (ai & ~mask) | (bi & mask);
    memcpy(&a, &ai, sizeof a);
    return a;
}

/* exp(x) for use inside `omp simd` loops: libm's expf only vectorises under -ffast-math.
 * Cephes' expf polynomial after a Cody-Waite reduction, about 2 ulp. The input is clamped to
 * [-87.3, 88.3] so that 2^n stays a normal float: below, results are ~1e-38 instead of smaller
 * (nothing next to a softmax max of 1, or in silu); above, ~2e38 instead of inf. */
static inline float ps_expf(float x) {
    x = ps_select(x < -87.3f, x, -87.3f);
    x = ps_select(x > 88.3f, x, 88.3f);
    float n = (float)(int32_t)(x * 1.44269504088896341f + (x < 0.0f ? -0.5f : 0.5f));
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* tanh(x) from ps_expf, vectorisable like it: 1 - 2 / (e^2x + 1), within ~1e-7 of libm's tanhf
 * in absolute terms (the logits soft cap scales it by the cap). Saturates to +-1 at large |x|. */
static inline float ps_tanhf(float x) {
    return 1.0f - 2.0f / (ps_expf(2.0f * x) + 1.0f);
}

#endif
