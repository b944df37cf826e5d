/* out[rows, n] = x[rows, k] . W^T (+ bias) with a weight-only quantized W (kernels/quantized.py:
 * W[i, j] = s[i, g] * q[i, j] + o[i, g], g = j / group_size, q unsigned 4 or 8 bits), float32
 * arithmetic throughout, for every checkpoint format (kernels/quant_linear.py packs them).
 *
 * The packed layout is in csrc/gemm_q.h.
 *
 * Two ways through a panel, by the number of rows:
 *   rows <= Q_DIRECT_ROWS (decode): the packed bytes stream from memory once, widened and
 *     multiplied in registers (csrc/gemm_q_direct.c); bf16 rows on AVX512-BF16 up to
 *     Q_DIRECT_PAIR_ROWS, widened to bf16 pairs and multiplied on vdpbf16ps;
 *   more rows: the panel is dequantized once (s * q + o, one FMA) into an fp32 scratch panel
 *     (k x Q_PANEL floats, in L2: 295 KB at k = 1536 on AVX-512) and an fp32 register tile of
 *     gemm.c's shape (8 x 48 on AVX-512, 6 x 16 on AVX2) runs every row tile over it, so the
 *     dequantization is amortised over the rows and the GEMM runs at the fp32 kernel's speed;
 *     on AVX512-BF16 with bf16 rows (and k even), the scratch panel is rounded to bf16 pairs and
 *     the tiles run on vdpbf16ps instead, at twice the multiply-adds per instruction (Q_PAIRS).
 * Threads split the panels. x rows that are bf16 (off the pairs path), or gathered through an
 * act-order perm, are converted to fp32 (or gathered as bf16) rows once per call. */
#include "gemm_q.h"

#include <stdlib.h>

#ifdef Q_HAVE_TILE

int pagedserve_quant_linear_panel(void) { return Q_PANEL; }

/* Named accumulators (not an array, which GCC keeps on the stack: see csrc/gemm.c); `mr` is a
 * literal at every call site, so the `mr > r` tests fold away and unused ones are dead code. */
#define Q_ROW_DECLARE(r) qvec c##r##0 = qv_zero(), c##r##1 = c##r##0, c##r##2 = c##r##0;
#define Q_ROW_FMA(r)                                                                        \
    if (mr > r) {                                                                           \
        qvec a = qv_set1(xk[(r) * x_stride]);                                               \
        c##r##0 = qv_fma(a, w0, c##r##0);                                                   \
        if (Q_VECS > 1) c##r##1 = qv_fma(a, w1, c##r##1);                                   \
        if (Q_VECS > 2) c##r##2 = qv_fma(a, w2, c##r##2);                                   \
    }
#define Q_ROWS_FMA                                                                          \
    Q_ROW_FMA(0) Q_ROW_FMA(1) Q_ROW_FMA(2) Q_ROW_FMA(3)                                     \
    Q_ROW_FMA(4) Q_ROW_FMA(5) Q_ROW_FMA(6) Q_ROW_FMA(7)
#define Q_ROWS_DECLARE                                                                      \
    Q_ROW_DECLARE(0) Q_ROW_DECLARE(1) Q_ROW_DECLARE(2) Q_ROW_DECLARE(3)                     \
    Q_ROW_DECLARE(4) Q_ROW_DECLARE(5) Q_ROW_DECLARE(6) Q_ROW_DECLARE(7)
#define Q_ROW_STORE(r)                                                                      \
    if (mr > r) store_row(out, out_bf16, (r) * out_stride, (qvec[3]){qv_add(c##r##0, bias0), \
                          qv_add(c##r##1, bias1), qv_add(c##r##2, bias2)}, cols);
/* The row tile's sums, plus the bias, out. */
#define Q_ROWS_STORE                                                                        \
    Q_LOAD_BIAS                                                                             \
    Q_ROW_STORE(0) Q_ROW_STORE(1) Q_ROW_STORE(2) Q_ROW_STORE(3)                             \
    Q_ROW_STORE(4) Q_ROW_STORE(5) Q_ROW_STORE(6) Q_ROW_STORE(7)

/* `mr` rows of x (fp32, x_stride apart) against one dequantized scratch panel (k x Q_PANEL). */
static inline __attribute__((always_inline)) void tile_rows(
    void *out, int out_bf16, int64_t out_stride, const float *x, int64_t x_stride,
    const float *panel, int64_t k, const int mr, int64_t cols, const float *bias) {
    Q_ROWS_DECLARE
    qvec w0 = qv_zero(), w1 = w0, w2 = w0;
    for (int64_t i = 0; i < k; i++) {
        const float *b = panel + i * Q_PANEL, *xk = x + i;
        w0 = qv_load(b);
        if (Q_VECS > 1) w1 = qv_load(b + QV);
        if (Q_VECS > 2) w2 = qv_load(b + 2 * QV);
        Q_ROWS_FMA
    }
    Q_ROWS_STORE
}

static __attribute__((noinline)) void scratch_tile(
    void *out, int out_bf16, int64_t out_stride, const float *x, int64_t x_stride,
    const float *weights, int64_t k, int mr, int64_t cols, const float *bias) {
    Q_CASES(tile_rows(out, out_bf16, out_stride, x, x_stride, weights, k, mr_, cols, bias), Q_TILE_ROWS)
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* bf16 activations on AVX512-BF16: the dequantized panel is rounded to bf16 pairs and multiplied
 * with vdpbf16ps (32 multiply-adds per instruction where an fp32 FMA does 16), fp32 sums, as
 * csrc/gemm_bf16.c does for a bf16 checkpoint. Only the weights' rounding to bf16 (2^-9 relative,
 * far below their 4- or 8-bit quantization) differs from the fp32 scratch path. */
#define Q_PAIRS 1

/* Rows 2i and 2i + 1 of an fp32 panel (k x Q_PANEL, k even) -> pair row i of a bf16 panel
 * (k / 2 x Q_PANEL x 2): each column's two values side by side in one 32-bit lane. */
static void pair_panel(uint16_t *dst, const float *src, int64_t k) {
    for (int64_t i = 0; i < k; i += 2)
        for (int c = 0; c < Q_PANEL; c += QV) {
            const float *even = src + i * Q_PANEL + c, *odd = even + Q_PANEL;
            __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(qv_load(even)));
            __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(qv_load(odd)));
            _mm512_storeu_si512(dst + (i / 2 * Q_PANEL + c) * 2,
                                _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
}

#define QP_ROW_DOT(r)                                                                       \
    if (mr > r) {                                                                           \
        int32_t pair;                                                                       \
        memcpy(&pair, x + (r) * x_stride + 2 * i, sizeof pair);                             \
        __m512bh a = (__m512bh)_mm512_set1_epi32(pair);                                     \
        c##r##0 = _mm512_dpbf16_ps(c##r##0, a, w0);                                         \
        c##r##1 = _mm512_dpbf16_ps(c##r##1, a, w1);                                         \
        c##r##2 = _mm512_dpbf16_ps(c##r##2, a, w2);                                         \
    }

/* `mr` bf16 rows of x (x_stride elements apart) against one bf16 pair panel (pairs x Q_PANEL x 2). */
static inline __attribute__((always_inline)) void pair_tile_rows(
    void *out, int out_bf16, int64_t out_stride, const uint16_t *x, int64_t x_stride,
    const uint16_t *panel, int64_t pairs, const int mr, int64_t cols, const float *bias) {
    Q_ROWS_DECLARE
    for (int64_t i = 0; i < pairs; i++) {
        const uint16_t *b = panel + i * 2 * Q_PANEL;
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(b), w1 = (__m512bh)_mm512_loadu_si512(b + 2 * QV),
                 w2 = (__m512bh)_mm512_loadu_si512(b + 4 * QV);
        QP_ROW_DOT(0) QP_ROW_DOT(1) QP_ROW_DOT(2) QP_ROW_DOT(3)
        QP_ROW_DOT(4) QP_ROW_DOT(5) QP_ROW_DOT(6) QP_ROW_DOT(7)
    }
    Q_ROWS_STORE
}

static __attribute__((noinline)) void pair_tile(
    void *out, int out_bf16, int64_t out_stride, const uint16_t *x, int64_t x_stride,
    const uint16_t *panel, int64_t pairs, int mr, int64_t cols, const float *bias) {
    Q_CASES(pair_tile_rows(out, out_bf16, out_stride, x, x_stride, panel, pairs, mr_, cols, bias),
            Q_TILE_ROWS)
}
#endif

#ifndef Q_PAIRS
#define Q_PAIRS 0
#endif

/* One panel's packed bytes -> its fp32 weights, k x Q_PANEL, for the scratch path. */
static void dequantize_panel(float *dst, const uint8_t *q, const float *so, int64_t k,
                             int64_t group_size, int bits) {
    qvec w0, w1, w2;
    for (int64_t g = 0; g < k / group_size; g++) {
        Q_LOAD_GROUP(g)
        for (int64_t i = g * group_size; i < (g + 1) * group_size; i += bits == 4 ? 2 : 1) {
            float *d = dst + i * Q_PANEL;
            if (bits == 4) {
                const uint8_t *b = q + i / 2 * Q_PANEL;
                Q_LOAD_INTS(lo, b, qv_low_nibble)
                Q_DEQUANT(lo)
                qv_store(d, w0);
                if (Q_VECS > 1) qv_store(d + QV, w1);
                if (Q_VECS > 2) qv_store(d + 2 * QV, w2);
                Q_LOAD_INTS(hi, b, qv_high_nibble)
                Q_DEQUANT(hi)
                d += Q_PANEL;
            } else {
                const uint8_t *b = q + i * Q_PANEL;
                Q_LOAD_INTS(v, b, Q_IDENTITY)
                Q_DEQUANT(v)
            }
            qv_store(d, w0);
            if (Q_VECS > 1) qv_store(d + QV, w1);
            if (Q_VECS > 2) qv_store(d + 2 * QV, w2);
        }
    }
    (void)w1, (void)w2;
}

/* x rows (fp32 or bf16, x_stride elements apart) -> contiguous fp32 rows of k, column j taken
 * from input channel perm[j] when perm is given. */
static void gather_rows(float *dst, const void *x, int x_bf16, int64_t x_stride, const int64_t *perm,
                        int64_t rows, int64_t k, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(ps_threads(rows * k, PS_GRAIN, num_threads))
    for (int64_t r = 0; r < rows; r++) {
        float *d = dst + r * k;
        if (x_bf16) {
            const uint16_t *s = (const uint16_t *)x + r * x_stride;
            if (perm) for (int64_t j = 0; j < k; j++) d[j] = ps_bf16_to_float(s[perm[j]]);
            else for (int64_t j = 0; j < k; j++) d[j] = ps_bf16_to_float(s[j]);
        } else {
            const float *s = (const float *)x + r * x_stride;
            for (int64_t j = 0; j < k; j++) d[j] = s[perm[j]];
        }
    }
}

/* bf16 x rows -> contiguous bf16 rows of k, column j taken from input channel perm[j]. */
static void gather_rows_bf16(uint16_t *dst, const uint16_t *x, int64_t x_stride, const int64_t *perm,
                             int64_t rows, int64_t k, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(ps_threads(rows * k, PS_GRAIN, num_threads))
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < k; j++) dst[r * k + j] = x[r * x_stride + perm[j]];
}

/* out: [rows, n] contiguous, fp32 or bf16 (dtypes); x: rows of k values x_stride elements apart;
 * perm: [k] input channel of each stored column (each in 0 .. k-1), or NULL; q, so: packed as
 * above; bias: [n] or NULL. Returns PS_BAD_QUANT_LAYOUT for a bits / group size the packing
 * cannot have, PS_OUT_OF_MEMORY if a scratch buffer cannot be had. */
int pagedserve_quant_linear(void *out, const void *x, int64_t x_stride, const int64_t *perm,
                            const uint8_t *q, const void *so, const void *bias, int dtypes,
                            int bits, int64_t group_size, int64_t rows, int64_t n, int64_t k,
                            int num_threads) {
    if (!(bits == 4 || bits == 8) || group_size <= 0 || k % group_size || (bits == 4 && group_size % 2)
        || rows < 0 || n < 0)
        return PS_BAD_QUANT_LAYOUT;
    if (rows == 0 || n == 0) return PS_OK;
    int out_bf16 = dtypes & PSQ_BF16_OUT, x_bf16 = dtypes & PSQ_BF16_X, so_f16 = dtypes & PSQ_F16_SO;
    const int64_t groups = k / group_size, block = psq_fold_block(group_size, bits), blocks = k / block;
    /* bf16 rows on AVX512-BF16 (k even) stay bf16 and run on pairs: on the direct path's (an even
     * fold block) up to Q_DIRECT_PAIR_ROWS, beyond on the bf16 pair panels. */
    const int pairs_ok = Q_PAIRS && x_bf16 && k % 2 == 0;
    const int direct_pairs_ok = pairs_ok && block % 2 == 0;
    const int direct = rows <= (direct_pairs_ok ? Q_DIRECT_PAIR_ROWS : Q_DIRECT_ROWS);
    const int paired = pairs_ok && !direct;
    const int direct_paired = direct_pairs_ok && direct;
    void *converted = NULL;  /* x's rows as the tiles read them, where x itself will not do */
    const float *xf = x;
    const uint16_t *x16 = x;
    if ((paired || direct_paired) && perm) {
        uint16_t *gathered = malloc((size_t)(rows * k) * sizeof *gathered);
        if (!gathered) return PS_OUT_OF_MEMORY;
        gather_rows_bf16(gathered, x, x_stride, perm, rows, k, num_threads);
        converted = gathered;
        x16 = gathered;
        x_stride = k;
    } else if (!paired && !direct_paired && (perm || x_bf16)) {
        float *widened = malloc((size_t)(rows * k) * sizeof *widened);
        if (!widened) return PS_OUT_OF_MEMORY;
        gather_rows(widened, x, x_bf16, x_stride, perm, rows, k, num_threads);
        converted = widened;
        xf = widened;
        x_stride = k;
    }
    float xsum[Q_DIRECT_PAIR_ROWS * 64], *xsum_heap = NULL, *xs = xsum;  /* [rows, blocks] */
    if (direct) {
        if (rows * blocks > Q_DIRECT_PAIR_ROWS * 64) {
            xs = xsum_heap = malloc((size_t)(rows * blocks) * sizeof *xs);
            if (!xs) {
                free(converted);
                return PS_OUT_OF_MEMORY;
            }
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t b = 0; b < blocks; b++) {
                float sum = 0.0f;
                if (direct_paired)
                    for (int64_t j = 0; j < block; j++) sum += ps_bf16_to_float(x16[r * x_stride + b * block + j]);
                else
                    for (int64_t j = 0; j < block; j++) sum += xf[r * x_stride + b * block + j];
                xs[r * blocks + b] = sum;
            }
    }
    const int64_t panels = (n + Q_PANEL - 1) / Q_PANEL;
    const int64_t panel_bytes = k * Q_PANEL * bits / 8;
    const int64_t tile_rows_max = direct ? Q_DIRECT_TILE : Q_TILE_ROWS;
    const int64_t tiles = (rows + tile_rows_max - 1) / tile_rows_max;
    /* Work in weight values touched: dequantizing costs about as much as a few rows' FMAs. */
    int threads = ps_threads(panels * k * (rows + 4), PS_GRAIN, num_threads);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scratch = direct ? NULL : malloc((size_t)(k * Q_PANEL) * (sizeof *scratch + paired * 2));
        uint16_t *pairs = scratch ? (uint16_t *)(scratch + k * Q_PANEL) : NULL;
        /* Halves widen once per panel into floats the kernels read from L1. */
        float *so_floats = so_f16 ? malloc((size_t)(groups * 2 * Q_PANEL) * sizeof *so_floats) : NULL;
        if ((!direct && !scratch) || (so_f16 && !so_floats)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if ((!direct && !scratch) || (so_f16 && !so_floats)) continue;
            int64_t first_col = p * Q_PANEL;
            int64_t cols = n - first_col < Q_PANEL ? n - first_col : Q_PANEL;
            float panel_bias[Q_PANEL] = {0};
            if (bias) {
                for (int64_t c = 0; c < cols; c++)
                    panel_bias[c] = dtypes & PSQ_BF16_BIAS
                        ? ps_bf16_to_float(((const uint16_t *)bias)[first_col + c])
                        : ((const float *)bias)[first_col + c];
            }
            const uint8_t *panel_q = q + p * panel_bytes;
            const float *panel_so = (const float *)so + p * groups * 2 * Q_PANEL;
            if (so_f16) {
                const uint16_t *h = (const uint16_t *)so + p * groups * 2 * Q_PANEL;
                for (int64_t i = 0; i < groups * 2 * Q_PANEL; i += QV) qv_store(so_floats + i, qv_load_half(h + i));
                panel_so = so_floats;
            }
            if (!direct) dequantize_panel(scratch, panel_q, panel_so, k, group_size, bits);
#if Q_PAIRS
            if (paired) pair_panel(pairs, scratch, k);
#endif
            for (int64_t t = 0, r = 0; t < tiles; t++) {
                int mr = (int)((rows - r + (tiles - t) - 1) / (tiles - t));
                char *o = (char *)out + (size_t)(r * n + first_col) * (out_bf16 ? 2 : 4);
                const float *xr = xf + r * x_stride, *pb = bias ? panel_bias : NULL;
#if Q_PAIRS
                if (paired) {
                    pair_tile(o, out_bf16, n, x16 + r * x_stride, x_stride, pairs, k / 2, mr, cols, pb);
                    r += mr;
                    continue;
                }
                if (direct_paired) {
                    (bits == 4 ? psq_direct_pair_tile4 : psq_direct_pair_tile8)(
                        o, out_bf16, n, x16 + r * x_stride, x_stride, xs + r * blocks, panel_q,
                        panel_so, k, group_size, block, mr, cols, pb);
                    r += mr;
                    continue;
                }
#endif
                if (!direct)
                    scratch_tile(o, out_bf16, n, xr, x_stride, scratch, k, mr, cols, pb);
                else if (bits == 4)
                    psq_direct_tile4(o, out_bf16, n, xr, x_stride, xs + r * blocks, panel_q, panel_so, k,
                                 group_size, block, mr, cols, pb);
                else
                    psq_direct_tile8(o, out_bf16, n, xr, x_stride, xs + r * blocks, panel_q, panel_so, k,
                                 group_size, block, mr, cols, pb);
                r += mr;
            }
        }
        free(scratch);
        free(so_floats);
    }
    free(xsum_heap);
    free(converted);
    return failed ? PS_OUT_OF_MEMORY : PS_OK;
}

#else /* no AVX2 + FMA: kernels/quant_linear.py runs the dequantized weight on the fp32 paths */

int pagedserve_quant_linear_panel(void) { return 0; }

int pagedserve_quant_linear(void *out, const void *x, int64_t x_stride, const int64_t *perm,
                            const uint8_t *q, const void *so, const void *bias, int dtypes,
                            int bits, int64_t group_size, int64_t rows, int64_t n, int64_t k,
                            int num_threads) {
    (void)out, (void)x, (void)x_stride, (void)perm, (void)q, (void)so, (void)bias, (void)dtypes;
    (void)bits, (void)group_size, (void)rows, (void)n, (void)k, (void)num_threads;
    return PS_UNSUPPORTED;
}

#endif
