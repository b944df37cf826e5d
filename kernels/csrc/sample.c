/* One random token per row from softmax(x * scale), by inverse CDF: the first index at which the
 * running sum of exp((x - max) * scale) passes u * (the row's whole sum), u uniform in [0, 1)
 * drawn by the caller (kernels/native_sample.py: one draw per row, from the row's own generator
 * when it is seeded). Zero-probability entries (-inf after top-k / top-p / min-p) are never
 * taken: the sum must grow past the target.
 *
 * Why: the exponential race it replaces (argmax of probs / q, q = -log U, one uniform per vocab
 * entry) costs a random number and a log per entry, which made a sampling decode step much slower
 * than a greedy one. Here each row is read twice, both passes vectorised: its max, then its exps
 * in blocks (their sums kept); the walk finds the block in the block sums and recomputes only that
 * block's exps (bench/sampler.py times the two).
 *
 * Sums run in double across blocks (a block's 64 exps in float), so u keeps 53 bits: a token of
 * probability 1e-9 is still drawn at its rate. Where rounding leaves the target unreached after
 * the last entry, the last entry of positive probability is taken.
 *
 * Rows holding a NaN take their first NaN, rows whose max is +inf their first +inf, rows with no
 * finite value index 0: the greedy argmax's answer there (csrc/argmax.c). */
#include <math.h>
#include <stdlib.h>

#include "common.h"

#define PS_SAMPLE_BLOCK 64

/* exp((x[i] - max) * scale) for i in [begin, end), into e; returns their float sum. */
static inline __attribute__((always_inline)) float block_exps(float *e, const void *row, int64_t begin,
                                                              int64_t end, float max, float scale,
                                                              const int bf16) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = begin; i < end; i++) {
        float v = ps_expf((ps_load(row, i, bf16) - max) * scale);
        /* ps_expf clamps its input: an -inf entry must still weigh nothing. */
        v = ps_select(ps_load(row, i, bf16) == -INFINITY, v, 0.0f);
        e[i - begin] = v;
        sum += v;
    }
    return sum;
}

static inline __attribute__((always_inline)) int64_t sample_row(const void *row, int64_t n, float scale,
                                                                double u, float *block_sums,
                                                                const int bf16) {
    int nan;
    float max = ps_row_max(row, n, bf16, &nan);
    if (nan || max == INFINITY || max == -INFINITY) return ps_argmax_row(row, n, bf16);
    float e[PS_SAMPLE_BLOCK];
    int64_t blocks = (n + PS_SAMPLE_BLOCK - 1) / PS_SAMPLE_BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        int64_t begin = b * PS_SAMPLE_BLOCK, end = begin + PS_SAMPLE_BLOCK < n ? begin + PS_SAMPLE_BLOCK : n;
        block_sums[b] = block_exps(e, row, begin, end, max, scale, bf16);
        total += block_sums[b];
    }
    double target = u * total, acc = 0.0;
    int64_t last = -1; /* the last block of positive sum */
    for (int64_t b = 0; b < blocks; b++) {
        if (block_sums[b] <= 0.0f) continue;
        last = b;
        if (acc + block_sums[b] <= target) {
            acc += block_sums[b];
            continue;
        }
        int64_t begin = b * PS_SAMPLE_BLOCK, end = begin + PS_SAMPLE_BLOCK < n ? begin + PS_SAMPLE_BLOCK : n;
        block_exps(e, row, begin, end, max, scale, bf16);
        int64_t positive = -1;
        for (int64_t i = begin; i < end; i++) {
            if (e[i - begin] <= 0.0f) continue;
            positive = i;
            acc += e[i - begin];
            if (acc > target) return i;
        }
        return positive; /* the block's own sum passed the target; its walk, in another order, not */
    }
    /* Rounding left the target past every block: the last entry of positive probability. */
    int64_t begin = last * PS_SAMPLE_BLOCK, end = begin + PS_SAMPLE_BLOCK < n ? begin + PS_SAMPLE_BLOCK : n;
    block_exps(e, row, begin, end, max, scale, bf16);
    for (int64_t i = end - 1; i > begin; i--)
        if (e[i - begin] > 0.0f) return i;
    return begin;
}

/* out[r] = a sample from softmax(x[r] * scales[r]) (scales NULL: 1) at uniforms[r] in [0, 1);
 * x rows of n values `row_stride` elements apart, fp32 or (PS_BF16_DATA) bf16. */
int pagedserve_sample_rows(int64_t *out, const void *x, const double *uniforms, const float *scales,
                           int64_t rows, int64_t n, int64_t row_stride, int dtypes, int num_threads) {
    if (n < 1) return PS_UNSUPPORTED;
    int bf16 = dtypes & PS_BF16_DATA;
    int64_t elem = bf16 ? 2 : 4, blocks = (n + PS_SAMPLE_BLOCK - 1) / PS_SAMPLE_BLOCK;
    float *block_sums = malloc((size_t)(rows * blocks) * sizeof *block_sums);
    if (!block_sums) return PS_OUT_OF_MEMORY;
#pragma omp parallel for schedule(dynamic) num_threads(ps_threads(rows * n, PS_GRAIN, num_threads))
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)x + r * row_stride * elem;
        float scale = scales ? scales[r] : 1.0f;
        out[r] = bf16 ? sample_row(row, n, scale, uniforms[r], block_sums + r * blocks, 1)
                      : sample_row(row, n, scale, uniforms[r], block_sums + r * blocks, 0);
    }
    free(block_sums);
    return PS_OK;
}
