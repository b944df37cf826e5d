/* The index of each row's largest value, the first where several tie and the first NaN where
 * there is one, as torch.argmax: the greedy sampler's only op on a step's [rows, vocab] logits.
 * torch's CPU argmax is slow on a large vocabulary (slower still on bf16), a visible share of a
 * decode step. Here each row is read twice, both passes vectorised: its max, then the first block
 * holding it (from cache by then). */

#include "common.h"

#define PS_ARGMAX_BLOCK 64

static inline __attribute__((always_inline)) int64_t argmax_row(const void *row, int64_t n,
                                                                const int bf16) {
    int nan;
    float max = ps_row_max(row, n, bf16, &nan);
    for (int64_t b = 0; b < n; b += PS_ARGMAX_BLOCK) {
        int64_t end = b + PS_ARGMAX_BLOCK < n ? b + PS_ARGMAX_BLOCK : n;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = b; i < end; i++) {
            float v = ps_load(row, i, bf16);
            hit |= nan ? v != v : v == max;
        }
        if (!hit) continue;
        for (int64_t i = b; i < end; i++) {
            float v = ps_load(row, i, bf16);
            if (nan ? v != v : v == max) return i;
        }
    }
    return 0;  /* n == 0 is refused by the caller; not reached otherwise */
}

int64_t ps_argmax_row(const void *row, int64_t n, int bf16) {
    return bf16 ? argmax_row(row, n, 1) : argmax_row(row, n, 0);
}

/* out[r] = argmax of x's row r (n values, rows `row_stride` elements apart; fp32, or bf16 with
 * PS_BF16_DATA). */
int pagedserve_argmax_rows(int64_t *out, const void *x, int64_t rows, int64_t n,
                           int64_t row_stride, int dtypes, int num_threads) {
    if (n < 1) return PS_UNSUPPORTED;
    int bf16 = dtypes & PS_BF16_DATA;
    int64_t elem = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(ps_threads(rows * n, PS_GRAIN, num_threads))
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)x + r * row_stride * elem;
        out[r] = ps_argmax_row(row, n, bf16);
    }
    return PS_OK;
}
