/* Row-wise RMSNorm (plain and with the residual add fused in) and SiLU-and-mul, on fp32 or bf16
 * rows (the `dtypes` bits of common.h), fp32 arithmetic inside.
 * Specs: kernels/norm_act.py's references, x * rsqrt(mean(x^2) + eps) * weight (normalised in fp32,
 * then scaled in the input dtype, as HF Llama does); vLLM's fused_add_rms_norm (residual += x;
 * x = rms_norm(residual)); silu(gate) * up. For bf16 data each step that torch rounds to bf16
 * (x + residual, the normalised row, silu(gate)) is rounded here too, so a bf16 model's norms
 * agree with torch's bf16 ones to the last bit but for expf's ulps. */
#include <math.h>

#include "common.h"

static inline float inv_rms(float sum_squares, int64_t hidden, float eps) {
    return 1.0f / sqrtf(sum_squares / (float)hidden + eps);
}

/* out[i] = x[i] * inv, rounded to the data type, times weight[i]: the reference's order. */
static inline __attribute__((always_inline)) void scale_row(void *out, const void *x, const void *weight,
                                                            int64_t hidden, float inv, const int data_bf16,
                                                            const int weight_bf16) {
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++) {
        float y = ps_load(x, i, data_bf16) * inv;
        if (data_bf16) y = ps_round_bf16(y);
        ps_store(out, i, y * ps_load(weight, i, weight_bf16), data_bf16);
    }
}

/* One row of each kernel, always inlined with data_bf16 / weight_bf16 literals (PS_ROW_DISPATCH):
 * the dispatch sits inside each entry point's parallel loop, because OpenMP outlines a parallel
 * region before inlining could fold the literals into it. */
static inline __attribute__((always_inline)) void rms_norm_row(
    void *out, const void *x, const void *weight, int64_t hidden, float eps, const int data_bf16,
    const int weight_bf16) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < hidden; i++) {
        float v = ps_load(x, i, data_bf16);
        sum += v * v;
    }
    scale_row(out, x, weight, hidden, inv_rms(sum, hidden, eps), data_bf16, weight_bf16);
}

static inline __attribute__((always_inline)) void fused_add_rms_norm_row(
    void *x, void *residual, const void *weight, int64_t hidden, float eps, const int data_bf16,
    const int weight_bf16) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < hidden; i++) {
        float v = ps_load(residual, i, data_bf16) + ps_load(x, i, data_bf16);
        if (data_bf16) v = ps_round_bf16(v);  /* the residual stream is stored in bf16 */
        ps_store(residual, i, v, data_bf16);
        sum += v * v;
    }
    scale_row(x, residual, weight, hidden, inv_rms(sum, hidden, eps), data_bf16, weight_bf16);
}

static inline __attribute__((always_inline)) void silu_and_mul_row(void *out, const void *gate,
                                                                   const void *up, int64_t inter,
                                                                   const int data_bf16, const int unused) {
    (void)unused;
#pragma omp simd
    for (int64_t i = 0; i < inter; i++) {
        float g = ps_load(gate, i, data_bf16);
        float silu = g / (1.0f + ps_expf(-g));
        if (data_bf16) silu = ps_round_bf16(silu);
        ps_store(out, i, silu * ps_load(up, i, data_bf16), data_bf16);
    }
}

/* The (data, weight) combinations the Python side passes: fp32/fp32, fp32/bf16, bf16/bf16. */
#define PS_ROW_DISPATCH(fn, ...)                                                            \
    do {                                                                                    \
        if (dtypes & PS_BF16_DATA) fn(__VA_ARGS__, 1, 1);                                   \
        else if (dtypes & PS_BF16_WEIGHT) fn(__VA_ARGS__, 0, 1);                            \
        else fn(__VA_ARGS__, 0, 0);                                                         \
    } while (0)

/* out, x: [rows, hidden]; weight: [hidden]. */
int pagedserve_rms_norm(void *out, const void *x, const void *weight, int64_t rows, int64_t hidden,
                        float eps, int dtypes, int num_threads) {
    int64_t row_bytes = hidden * (dtypes & PS_BF16_DATA ? 2 : 4);
#pragma omp parallel for num_threads(ps_threads(rows * hidden, PS_GRAIN, num_threads))
    for (int64_t r = 0; r < rows; r++)
        PS_ROW_DISPATCH(rms_norm_row, (char *)out + r * row_bytes, (const char *)x + r * row_bytes,
                        weight, hidden, eps);
    return PS_OK;
}

/* x, residual: [rows, hidden], both updated in place; weight: [hidden]. */
int pagedserve_fused_add_rms_norm(void *x, void *residual, const void *weight, int64_t rows,
                                  int64_t hidden, float eps, int dtypes, int num_threads) {
    int64_t row_bytes = hidden * (dtypes & PS_BF16_DATA ? 2 : 4);
#pragma omp parallel for num_threads(ps_threads(rows * hidden, PS_GRAIN, num_threads))
    for (int64_t r = 0; r < rows; r++)
        PS_ROW_DISPATCH(fused_add_rms_norm_row, (char *)x + r * row_bytes,
                        (char *)residual + r * row_bytes, weight, hidden, eps);
    return PS_OK;
}

/* x: [rows, 2 * inter] = [gate | up]; out: [rows, inter]; both fp32 or both bf16 (no weight:
 * PS_BF16_WEIGHT is never set, so the second case of the dispatch is unused). */
int pagedserve_silu_and_mul(void *out, const void *x, int64_t rows, int64_t inter, int dtypes,
                            int num_threads) {
    int64_t row_bytes = inter * (dtypes & PS_BF16_DATA ? 2 : 4);
#pragma omp parallel for num_threads(ps_threads(rows * inter, PS_GRAIN, num_threads))
    for (int64_t r = 0; r < rows; r++) {
        const char *gate = (const char *)x + 2 * r * row_bytes;
        PS_ROW_DISPATCH(silu_and_mul_row, (char *)out + r * row_bytes, gate, gate + row_bytes, inter);
    }
    return PS_OK;
}
