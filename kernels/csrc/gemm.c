/* out[rows, n] = x[rows, k] . W^T (+ bias) for the skinny GEMMs of decode steps (a few to a few
 * hundred rows), on a weight packed once into 16-column panels: packed[n / 16][k][16], zero-padded
 * (kernels/native.py packs it). fp32, AVX2 + FMA.
 *
 * Why: at 2-64 rows MKL and oneDNN reach 25-50 % of this CPU's FMA peak. A register-blocked
 * 6 x 16 tile (12 accumulators; BLIS's Haswell shape) streams each panel once from memory,
 * sequentially (the hardware prefetcher keeps up), and reuses it for every 6-row tile from L1/L2.
 * Threads split the panels, so a second thread also gets half the weight bytes. */
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define PANEL 16
#define MAX_ROWS_PER_TILE 6

int pagedserve_linear_supported(void) { return 1; }

/* One tile: `mr` rows of x against one panel. mr is a literal at every call site (see tile), so
 * the `mr > r` tests fold away; the accumulators are named variables rather than an array, which
 * GCC would keep on the stack (a store per FMA, measured 3x slower). */
#define PS_ROW_FMA(r)                                                                      \
    if (mr > r) {                                                                          \
        __m256 a = _mm256_broadcast_ss(x + r * x_stride + i);                              \
        c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                                         \
        c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);                                         \
    }
#define PS_ROW_STORE(r)                                                                    \
    if (mr > r) store_row(out + r * out_stride, _mm256_add_ps(c##r##0, bias0),             \
                          _mm256_add_ps(c##r##1, bias1), cols);

static inline void store_row(float *o, __m256 lo, __m256 hi, int64_t cols) {
    if (cols == PANEL) {
        _mm256_storeu_ps(o, lo);
        _mm256_storeu_ps(o + 8, hi);
    } else {  /* the last panel of an n that is not a multiple of 16 */
        float row[PANEL];
        _mm256_storeu_ps(row, lo);
        _mm256_storeu_ps(row + 8, hi);
        memcpy(o, row, (size_t)cols * sizeof *o);
    }
}

static inline __attribute__((always_inline)) void tile_rows(
    float *out, int64_t out_stride, const float *x, int64_t x_stride, const float *panel,
    int64_t k, const int mr, int64_t cols, const float *bias) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t i = 0; i < k; i++) {
        __m256 b0 = _mm256_loadu_ps(panel + i * PANEL);
        __m256 b1 = _mm256_loadu_ps(panel + i * PANEL + 8);
        PS_ROW_FMA(0) PS_ROW_FMA(1) PS_ROW_FMA(2) PS_ROW_FMA(3) PS_ROW_FMA(4) PS_ROW_FMA(5)
    }
    __m256 bias0 = _mm256_setzero_ps(), bias1 = bias0;
    if (bias) {
        float padded[PANEL] = {0};
        memcpy(padded, bias, (size_t)cols * sizeof *bias);
        bias0 = _mm256_loadu_ps(padded);
        bias1 = _mm256_loadu_ps(padded + 8);
    }
    PS_ROW_STORE(0) PS_ROW_STORE(1) PS_ROW_STORE(2) PS_ROW_STORE(3) PS_ROW_STORE(4) PS_ROW_STORE(5)
}

static void tile(float *out, int64_t out_stride, const float *x, int64_t x_stride,
                 const float *panel, int64_t k, int mr, int64_t cols, const float *bias) {
    switch (mr) {
    case 6: tile_rows(out, out_stride, x, x_stride, panel, k, 6, cols, bias); break;
    case 5: tile_rows(out, out_stride, x, x_stride, panel, k, 5, cols, bias); break;
    case 4: tile_rows(out, out_stride, x, x_stride, panel, k, 4, cols, bias); break;
    case 3: tile_rows(out, out_stride, x, x_stride, panel, k, 3, cols, bias); break;
    case 2: tile_rows(out, out_stride, x, x_stride, panel, k, 2, cols, bias); break;
    default: tile_rows(out, out_stride, x, x_stride, panel, k, 1, cols, bias); break;
    }
}

/* out: [rows, n] contiguous; x: rows of k floats, x_stride apart; packed: [ceil(n / 16), k, 16];
 * bias: [n] or NULL. */
int pagedserve_linear(float *out, const float *x, int64_t x_stride, const float *packed,
                      const float *bias, int64_t rows, int64_t n, int64_t k, int num_threads) {
    int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(ps_threads(panels * rows * k, PS_GRAIN, num_threads))
    for (int64_t p = 0; p < panels; p++) {
        int64_t first_col = p * PANEL;
        int64_t cols = n - first_col < PANEL ? n - first_col : PANEL;
        const float *panel = packed + p * k * PANEL;
        for (int64_t r = 0; r < rows; r += MAX_ROWS_PER_TILE) {
            int mr = rows - r < MAX_ROWS_PER_TILE ? (int)(rows - r) : MAX_ROWS_PER_TILE;
            tile(out + r * n + first_col, n, x + r * x_stride, x_stride, panel, k, mr, cols,
                 bias ? bias + first_col : NULL);
        }
    }
    return PS_OK;
}

#else /* no AVX2 + FMA: kernels/native.py keeps projections on oneDNN / MKL */

int pagedserve_linear_supported(void) { return 0; }

int pagedserve_linear(float *out, const float *x, int64_t x_stride, const float *packed,
                      const float *bias, int64_t rows, int64_t n, int64_t k, int num_threads) {
    (void)out, (void)x, (void)x_stride, (void)packed, (void)bias, (void)rows, (void)n, (void)k;
    (void)num_threads;
    return PS_UNSUPPORTED;
}

#endif
