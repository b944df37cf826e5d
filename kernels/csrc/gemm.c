/* out[rows, n] = x[rows, k] . W^T (+ bias) for the skinny GEMMs of decode steps (a few to a few
 * hundred rows), on a weight packed once into PANEL-column panels: packed[n / PANEL][k][PANEL],
 * zero-padded (kernels/native.py packs it, with the width pagedserve_linear_panel() reports).
 * fp32; one register tile per CPU level, chosen by the flags this file is compiled with
 * (kernels/cpu_features.py):
 *
 *   AVX2 + FMA (16 ymm): 6 rows x 16 columns, 12 accumulators (BLIS's Haswell shape).
 *   AVX-512 (32 zmm):    PS_TILE_ROWS rows x 16 * PS_TILE_VECS columns, 8 x 48 by default:
 *                        24 accumulators + 3 panel vectors + a broadcast. Other shapes can be
 *                        built (-D PS_TILE_VECS / PS_TILE_ROWS); 8 x 48 splits best over two
 *                        threads (the default model's 576 outputs are 12 panels of 48, split
 *                        evenly, but 9 of 64), and 8 divides 16, 64, 256.
 *
 * Why: at decode's row counts MKL and oneDNN stay well below the FMA peak. A register-blocked tile
 * streams each panel once from memory, sequentially (prefetched ahead), and reuses it for every
 * row tile from L1/L2. Threads split the panels, so a second thread also gets half
 * the weight bytes. */
#include "common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define PS_HAVE_TILE 1
#ifndef PS_TILE_VECS
#define PS_TILE_VECS 3
#endif
#ifndef PS_TILE_ROWS
#define PS_TILE_ROWS 8
#endif
typedef __m512 vec;
#define VEC_WIDTH 16
#define vec_zero _mm512_setzero_ps
#define vec_load _mm512_loadu_ps
#define vec_store _mm512_storeu_ps
#define vec_add _mm512_add_ps
#define vec_fma _mm512_fmadd_ps
#define vec_broadcast(p) _mm512_set1_ps(*(p))

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PS_HAVE_TILE 1
#define PS_TILE_VECS 2
#define PS_TILE_ROWS 6
typedef __m256 vec;
#define VEC_WIDTH 8
#define vec_zero _mm256_setzero_ps
#define vec_load _mm256_loadu_ps
#define vec_store _mm256_storeu_ps
#define vec_add _mm256_add_ps
#define vec_fma _mm256_fmadd_ps
#define vec_broadcast(p) _mm256_broadcast_ss(p)
#endif

#ifdef PS_HAVE_TILE

#define PANEL (VEC_WIDTH * PS_TILE_VECS)
/* Panel rows prefetched ahead (12 KB at 48 columns): the hardware prefetcher alone leaves the first
 * row tile of each panel waiting on memory, and nearer or farther distances were no better
 * (bench/cpu_ops.py times the GEMM). A prefetch past the weight's end is harmless. */
#ifndef PS_PREFETCH_K
#define PS_PREFETCH_K 64
#endif
#if PS_TILE_VECS > 4 || PS_TILE_ROWS > 14
#error "tile larger than the accumulators declared below"
#endif

int pagedserve_linear_panel(void) { return PANEL; }

/* One tile: `mr` rows of x against one panel. mr is a literal at every call site (see tile), so
 * the `mr > r` tests fold away, as do the `PS_TILE_VECS > v` ones; the accumulators are named
 * variables rather than an array, which GCC would keep on the stack (a store per FMA, several
 * times slower). Unused ones are dead code. */
#define PS_ROW_FMA(r)                                                                      \
    if (mr > r) {                                                                          \
        vec a = vec_broadcast(x + r * x_stride + i);                                       \
        c##r##0 = vec_fma(a, b0, c##r##0);                                                 \
        if (PS_TILE_VECS > 1) c##r##1 = vec_fma(a, b1, c##r##1);                           \
        if (PS_TILE_VECS > 2) c##r##2 = vec_fma(a, b2, c##r##2);                           \
        if (PS_TILE_VECS > 3) c##r##3 = vec_fma(a, b3, c##r##3);                           \
    }
#define PS_ROW_STORE(r)                                                                    \
    if (mr > r) store_row(out + r * out_stride, (vec[4]){vec_add(c##r##0, bias0),          \
                          vec_add(c##r##1, bias1), vec_add(c##r##2, bias2),                \
                          vec_add(c##r##3, bias3)}, cols);
#define PS_ROW_DECLARE(r) vec c##r##0 = vec_zero(), c##r##1 = c##r##0, c##r##2 = c##r##0,   \
                              c##r##3 = c##r##0;

static inline __attribute__((always_inline)) void store_row(float *o, const vec *v, int64_t cols) {
    if (cols == PANEL) {
        for (int j = 0; j < PS_TILE_VECS; j++) vec_store(o + j * VEC_WIDTH, v[j]);
    } else {  /* the last panel of an n that is not a multiple of PANEL */
        float row[PANEL];
        for (int j = 0; j < PS_TILE_VECS; j++) vec_store(row + j * VEC_WIDTH, v[j]);
        memcpy(o, row, (size_t)cols * sizeof *o);
    }
}

static inline __attribute__((always_inline)) void tile_rows(
    float *out, int64_t out_stride, const float *x, int64_t x_stride, const float *panel,
    int64_t k, const int mr, int64_t cols, const float *bias) {
    PS_ROW_DECLARE(0) PS_ROW_DECLARE(1) PS_ROW_DECLARE(2) PS_ROW_DECLARE(3) PS_ROW_DECLARE(4)
    PS_ROW_DECLARE(5) PS_ROW_DECLARE(6) PS_ROW_DECLARE(7) PS_ROW_DECLARE(8) PS_ROW_DECLARE(9)
    PS_ROW_DECLARE(10) PS_ROW_DECLARE(11) PS_ROW_DECLARE(12) PS_ROW_DECLARE(13)
    for (int64_t i = 0; i < k; i++) {
        const float *b = panel + i * PANEL;
        for (int j = 0; j < PANEL; j += 16) PS_PREFETCH(b + PS_PREFETCH_K * PANEL + j);
        vec b0 = vec_load(b), b1 = b0, b2 = b0, b3 = b0;
        if (PS_TILE_VECS > 1) b1 = vec_load(b + VEC_WIDTH);
        if (PS_TILE_VECS > 2) b2 = vec_load(b + 2 * VEC_WIDTH);
        if (PS_TILE_VECS > 3) b3 = vec_load(b + 3 * VEC_WIDTH);
        PS_ROW_FMA(0) PS_ROW_FMA(1) PS_ROW_FMA(2) PS_ROW_FMA(3) PS_ROW_FMA(4) PS_ROW_FMA(5)
        PS_ROW_FMA(6) PS_ROW_FMA(7) PS_ROW_FMA(8) PS_ROW_FMA(9) PS_ROW_FMA(10) PS_ROW_FMA(11)
        PS_ROW_FMA(12) PS_ROW_FMA(13)
    }
    vec bias0 = vec_zero(), bias1 = bias0, bias2 = bias0, bias3 = bias0;
    if (bias) {
        float padded[PANEL] = {0};
        memcpy(padded, bias, (size_t)cols * sizeof *bias);
        bias0 = vec_load(padded);
        if (PS_TILE_VECS > 1) bias1 = vec_load(padded + VEC_WIDTH);
        if (PS_TILE_VECS > 2) bias2 = vec_load(padded + 2 * VEC_WIDTH);
        if (PS_TILE_VECS > 3) bias3 = vec_load(padded + 3 * VEC_WIDTH);
    }
    PS_ROW_STORE(0) PS_ROW_STORE(1) PS_ROW_STORE(2) PS_ROW_STORE(3) PS_ROW_STORE(4)
    PS_ROW_STORE(5) PS_ROW_STORE(6) PS_ROW_STORE(7) PS_ROW_STORE(8) PS_ROW_STORE(9)
    PS_ROW_STORE(10) PS_ROW_STORE(11) PS_ROW_STORE(12) PS_ROW_STORE(13)
}

/* Cases beyond PS_TILE_ROWS never run; they compile to the one-row tile. */
#define PS_TILE_CASE(m)                                                                    \
    case m:                                                                                \
        tile_rows(out, out_stride, x, x_stride, panel, k, m <= PS_TILE_ROWS ? m : 1, cols, bias); \
        break;

static void tile(float *out, int64_t out_stride, const float *x, int64_t x_stride,
                 const float *panel, int64_t k, int mr, int64_t cols, const float *bias) {
    switch (mr) {
    PS_TILE_CASE(14) PS_TILE_CASE(13) PS_TILE_CASE(12) PS_TILE_CASE(11) PS_TILE_CASE(10)
    PS_TILE_CASE(9) PS_TILE_CASE(8) PS_TILE_CASE(7) PS_TILE_CASE(6) PS_TILE_CASE(5)
    PS_TILE_CASE(4) PS_TILE_CASE(3) PS_TILE_CASE(2)
    default: tile_rows(out, out_stride, x, x_stride, panel, k, 1, cols, bias); break;
    }
}

/* rows of x against one panel, in tiles of near-equal height (20 rows at 8 per tile: 7 + 7 + 6,
 * not 8 + 8 + 4), so no tile is left mostly empty. (Running the tiles over slices of k that stay
 * in L1, so the weight streams only once, was no faster.) */
static void panel_rows(float *out, int64_t n, const float *x, int64_t x_stride, const float *panel,
                       int64_t rows, int64_t k, int64_t cols, const float *bias) {
    int64_t tiles = (rows + PS_TILE_ROWS - 1) / PS_TILE_ROWS;
    for (int64_t t = 0, r = 0; t < tiles; t++) {
        int mr = (int)((rows - r + (tiles - t) - 1) / (tiles - t));
        tile(out + r * n, n, x + r * x_stride, x_stride, panel, k, mr, cols, bias);
        r += mr;
    }
}

/* out: [rows, n] contiguous; x: rows of k floats, x_stride apart; packed: [ceil(n / PANEL), k,
 * PANEL]; bias: [n] or NULL. */
int pagedserve_linear(float *out, const float *x, int64_t x_stride, const float *packed,
                      const float *bias, int64_t rows, int64_t n, int64_t k, int num_threads) {
    int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(ps_threads(panels * rows * k, PS_GRAIN, num_threads))
    for (int64_t p = 0; p < panels; p++) {
        int64_t first_col = p * PANEL;
        int64_t cols = n - first_col < PANEL ? n - first_col : PANEL;
        panel_rows(out + first_col, n, x, x_stride, packed + p * k * PANEL, rows, k, cols,
                   bias ? bias + first_col : NULL);
    }
    return PS_OK;
}

/* A mixture of experts' projections in one call: rows offsets[g] .. offsets[g + 1] - 1 of x and
 * out go through weight g, packed[g] being [ceil(n / PANEL), k, PANEL] (the groups' packings one
 * after another). One call per layer instead of one per expert, and the threads split the
 * (group, panel) pairs of the groups that have rows, so a decode step's few rows per expert keep
 * every thread streaming weights. offsets: groups + 1 non-decreasing row indices from 0. */
int pagedserve_grouped_linear(float *out, const float *x, int64_t x_stride, const float *packed,
                              const int64_t *offsets, int64_t groups, int64_t n, int64_t k,
                              int num_threads) {
    int64_t panels = (n + PANEL - 1) / PANEL, live = 0;
    for (int64_t g = 0; g < groups; g++) {
        if (offsets[g + 1] < offsets[g] || offsets[0] != 0) return PS_BAD_GROUP_OFFSETS;
        live += offsets[g + 1] > offsets[g];
    }
    if (!live) return PS_OK;
    int64_t used[live];  /* the groups with rows, in order */
    for (int64_t g = 0, i = 0; g < groups; g++)
        if (offsets[g + 1] > offsets[g]) used[i++] = g;
    int64_t rows = offsets[groups];
#pragma omp parallel for schedule(static) num_threads(ps_threads(panels * rows * k, PS_GRAIN, num_threads))
    for (int64_t item = 0; item < live * panels; item++) {
        int64_t g = used[item / panels], p = item % panels, first = offsets[g];
        int64_t first_col = p * PANEL;
        int64_t cols = n - first_col < PANEL ? n - first_col : PANEL;
        panel_rows(out + first * n + first_col, n, x + first * x_stride, x_stride,
                   packed + (g * panels + p) * k * PANEL, offsets[g + 1] - first, k, cols, NULL);
    }
    return PS_OK;
}

#else /* no AVX2 + FMA: kernels/native.py keeps projections on oneDNN / MKL */

int pagedserve_linear_panel(void) { return 0; }

int pagedserve_linear(float *out, const float *x, int64_t x_stride, const float *packed,
                      const float *bias, int64_t rows, int64_t n, int64_t k, int num_threads) {
    (void)out, (void)x, (void)x_stride, (void)packed, (void)bias, (void)rows, (void)n, (void)k;
    (void)num_threads;
    return PS_UNSUPPORTED;
}

int pagedserve_grouped_linear(float *out, const float *x, int64_t x_stride, const float *packed,
                              const int64_t *offsets, int64_t groups, int64_t n, int64_t k,
                              int num_threads) {
    (void)out, (void)x, (void)x_stride, (void)packed, (void)offsets, (void)groups, (void)n, (void)k;
    (void)num_threads;
    return PS_UNSUPPORTED;
}

#endif
