/* Row-wise RMSNorm (plain and with the residual add fused in) and SiLU-and-mul, fp32.
 * Specs: RMSNorm in replicas/models/llama.py, x * rsqrt(mean(x^2) + eps) * weight; vLLM's
 * fused_add_rms_norm (residual += x; x = rms_norm(residual)); silu(gate) * up. */
#include <math.h>

#include "common.h"

static inline float inv_rms(float sum_squares, int64_t hidden, float eps) {
    return 1.0f / sqrtf(sum_squares / (float)hidden + eps);
}

/* out, x: [rows, hidden]; weight: [hidden]. */
int pagedserve_rms_norm(float *out, const float *x, const float *weight, int64_t rows,
                        int64_t hidden, float eps, int num_threads) {
#pragma omp parallel for num_threads(ps_threads(rows * hidden, PS_GRAIN, num_threads))
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * hidden;
        float *o = out + r * hidden;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; i++) sum += xr[i] * xr[i];
        float inv = inv_rms(sum, hidden, eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) o[i] = xr[i] * inv * weight[i];
    }
    return PS_OK;
}

/* x, residual: [rows, hidden], both updated in place; weight: [hidden]. */
int pagedserve_fused_add_rms_norm(float *x, float *residual, const float *weight, int64_t rows,
                                  int64_t hidden, float eps, int num_threads) {
#pragma omp parallel for num_threads(ps_threads(rows * hidden, PS_GRAIN, num_threads))
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * hidden;
        float *res = residual + r * hidden;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; i++) {
            res[i] += xr[i];
            sum += res[i] * res[i];
        }
        float inv = inv_rms(sum, hidden, eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) xr[i] = res[i] * inv * weight[i];
    }
    return PS_OK;
}

/* x: [rows, 2 * inter] = [gate | up]; out: [rows, inter]. */
int pagedserve_silu_and_mul(float *out, const float *x, int64_t rows, int64_t inter,
                            int num_threads) {
#pragma omp parallel for num_threads(ps_threads(rows * inter, PS_GRAIN, num_threads))
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * inter, *up = gate + inter;
        float *o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = gate[i] / (1.0f + ps_expf(-gate[i])) * up[i];
    }
    return PS_OK;
}
