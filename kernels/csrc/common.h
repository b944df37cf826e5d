/* What the CPU kernels share: status codes, thread counts, an exp that vectorises. */
#ifndef PAGEDSERVE_COMMON_H
#define PAGEDSERVE_COMMON_H

#include <stdint.h>
#include <string.h>

#include "api.h"

/* Returned by every entry point; kernels/native.py turns them into exceptions. */
enum {
    PS_OK = 0,
    PS_BAD_QUERY_START_LOC = 1,
    PS_BAD_SEQ_LEN = 2,
    PS_BAD_BLOCK_ID = 3,
    PS_OUT_OF_MEMORY = 4,
    PS_UNSUPPORTED = 5,
    PS_BAD_QUANT_LAYOUT = 6,
    PS_BAD_GROUP_OFFSETS = 7,
    PS_BAD_SLOT = 8,
    PS_BAD_LORA = 9,
};

/* One sequence's metadata as the attention kernels check it before following it: a seq_len of at
 * least min_len that its block table can hold, and the table's entries for the blocks from
 * position `first` on (those the kernel reads) inside the cache. */
static inline int ps_check_context(const int32_t *table, int64_t table_width, int64_t seq_len,
                                   int64_t min_len, int64_t first, int64_t block_size,
                                   int64_t num_blocks) {
    if (seq_len < min_len || seq_len > table_width * block_size) return PS_BAD_SEQ_LEN;
    for (int64_t b = first / block_size; b < (seq_len + block_size - 1) / block_size; b++)
        if (table[b] < 0 || table[b] >= num_blocks) return PS_BAD_BLOCK_ID;
    return PS_OK;
}

/* A hint only: compilers without the builtin lose speed, not correctness. PS_PREFETCH_L2 stops at
 * L2 (prefetcht2): for rows fetched far ahead from scattered addresses, where L1's few misses in
 * flight, not DRAM, would set the pace (see paged_attention.c). */
#if defined(__GNUC__) || defined(__clang__)
#define PS_PREFETCH(p) __builtin_prefetch(p)
#define PS_PREFETCH_L2(p) __builtin_prefetch(p, 0, 1)
#else
#define PS_PREFETCH(p) ((void)(p))
#define PS_PREFETCH_L2(p) ((void)(p))
#endif

/* a * b + c in one rounding where the CPU has FMA. -std=c11 (ISO C) turns GCC's contraction of
 * `a * b + c` off, so loops that are multiply-adds say so; __builtin_fmaf vectorises. */
#if defined(__FMA__)
#define PS_FMA(a, b, c) __builtin_fmaf((a), (b), (c))
#else
#define PS_FMA(a, b, c) ((a) * (b) + (c))
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

/* bf16 <-> fp32, written so `omp simd` loops vectorise them on every level (AVX2 included; no
 * AVX512-BF16 instruction needed): a bf16 is the top half of an fp32. */
static inline float ps_bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, NaN kept a (quiet) NaN: what torch's .to(torch.bfloat16) does. */
static inline uint16_t ps_float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    uint32_t quiet = (bits >> 16) | 0x40u;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

/* What a bf16 tensor op returns for an fp32 result: rounded to bf16, widened back. */
static inline float ps_round_bf16(float f) { return ps_bf16_to_float(ps_float_to_bf16(f)); }

/* Bits of the `dtypes` argument of the norm, activation and attention entry points: which
 * operands are bf16 (else fp32). Arithmetic is fp32 throughout. */
enum { PS_BF16_DATA = 1, PS_BF16_WEIGHT = 2, PS_BF16_KV = 4 };

/* Element i of an fp32 or bf16 array, as fp32; and the store back (rounding to bf16). `bf16` is a
 * literal at every call site of the always-inlined kernels, so the test folds away before the
 * loop is vectorised. */
static inline __attribute__((always_inline)) float ps_load(const void *p, int64_t i, int bf16) {
    return bf16 ? ps_bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void ps_store(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = ps_float_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* A row's largest value (NaNs skipped) and whether it holds a NaN, in one vectorised pass: the
 * first pass of both the greedy argmax (csrc/argmax.c) and the random draw (csrc/sample.c). */
static inline __attribute__((always_inline)) float ps_row_max(const void *row, int64_t n, const int bf16,
                                                              int *has_nan) {
    float max = -__builtin_inff();
    int nan = 0;
#pragma omp simd reduction(max : max) reduction(| : nan)
    for (int64_t i = 0; i < n; i++) {
        float v = ps_load(row, i, bf16);
        max = v > max ? v : max;
        nan |= v != v;
    }
    *has_nan = nan;
    return max;
}

/* torch.argmax of one row (csrc/argmax.c): also the random draw's answer for a row without a
 * distribution. */
int64_t ps_argmax_row(const void *row, int64_t n, int bf16);

/* tanh(x) from ps_expf, vectorisable like it: 1 - 2 / (e^2x + 1), within ~1e-7 of libm's tanhf
 * in absolute terms (the logits soft cap scales it by the cap). Saturates to +-1 at large |x|. */
static inline float ps_tanhf(float x) {
    return 1.0f - 2.0f / (ps_expf(2.0f * x) + 1.0f);
}

#endif
