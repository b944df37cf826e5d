/* out[rows, n] = x[rows, k] . W^T (+ bias) with a bf16 weight, on CPUs with AVX512-BF16:
 * `vdpbf16ps` multiplies pairs of bf16 values and adds both products into one fp32 lane, so one
 * instruction does 32 multiply-adds where an fp32 FMA does 16, and the weight streams from memory
 * at half the bytes (decode steps are bound by those bytes).
 *
 * The weight is packed once (kernels/native_linear.py) into BF_PANEL-column panels of k pairs:
 * packed[n / BF_PANEL][ceil(k / 2)][BF_PANEL][2] bf16, each column's two consecutive k values side
 * by side in one 32-bit lane, zero-padded in n and in k. Activations (fp32 or bf16) are converted
 * to bf16 rows of even length once per call, zero-padded, so a tile broadcasts one 32-bit pair
 * per row; accumulation is fp32 throughout, rounded once at the end (to bf16 when asked), after
 * the bias. The products of two bf16 values are exact in fp32, so this matches an fp32 GEMM of
 * the bf16-rounded inputs to float rounding (the instruction flushes denormals to zero).
 *
 * The tile is the fp32 AVX-512 one's shape (csrc/gemm.c): 8 rows x 48 columns, 24 accumulators,
 * 3 panel vectors and a broadcast; threads split the panels. */
#include "common.h"

#include <stdlib.h>

/* Bits of `dtypes`: which of out, x and bias are bf16 (else fp32). */
enum { PS_BF16_OUT = 1, PS_BF16_X = 2, PS_BF16_BIAS = 4 };
/* Bit of `dtypes`: run the widening tile (fp32 FMAs, fp32 activations) instead of vdpbf16ps. */
enum { PS_BF16_WIDEN = 8 };

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define BF_TILE_ROWS 8
#define BF_PANEL 48
/* Pair rows of a panel prefetched ahead (64 x 192 bytes, as the fp32 tile's 12 KB). */
#define BF_PREFETCH_PAIRS 64

int pagedserve_linear_bf16_panel(void) { return BF_PANEL; }

static inline __m512i broadcast_pair(const uint16_t *p) {
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return _mm512_set1_epi32(pair);
}

#define BF_ROW_DOT(r)                                                                       \
    if (mr > r) {                                                                           \
        __m512bh a = (__m512bh)broadcast_pair((const uint16_t *)x + r * x_stride + 2 * i); \
        c##r##0 = _mm512_dpbf16_ps(c##r##0, a, b0);                                         \
        c##r##1 = _mm512_dpbf16_ps(c##r##1, a, b1);                                         \
        c##r##2 = _mm512_dpbf16_ps(c##r##2, a, b2);                                         \
    }
#define BF_ROW_DECLARE(r) __m512 c##r##0 = _mm512_setzero_ps(), c##r##1 = c##r##0, c##r##2 = c##r##0;
#define BF_ROW_STORE(r)                                                                     \
    if (mr > r) store_row(out, out_bf16, (r) * out_stride, (__m512[3]){                     \
        _mm512_add_ps(c##r##0, bias0), _mm512_add_ps(c##r##1, bias1),                       \
        _mm512_add_ps(c##r##2, bias2)}, cols);

/* Row `offset` (in elements) of out, from three vectors of fp32 sums; the first `cols` columns,
 * stored straight from the registers (a copy through a buffer per row cost a visible share of a
 * bf16 decode step). */
static inline __attribute__((always_inline)) void store_row(void *out, int out_bf16, int64_t offset,
                                                            const __m512 *v, int64_t cols) {
    for (int j = 0; j < 3; j++) {
        int64_t left = cols - 16 * j;
        if (left <= 0) break;
        __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        if (out_bf16)
            _mm256_mask_storeu_epi16((uint16_t *)out + offset + 16 * j, mask,
                                     (__m256i)_mm512_cvtneps_pbh(v[j]));
        else
            _mm512_mask_storeu_ps((float *)out + offset + 16 * j, mask, v[j]);
    }
}

/* The widening variant's inner step: the same packed pairs, each split into its even-k and odd-k
 * columns as fp32 (a shift, a mask), then fp32 FMAs with fp32 activations. Where vdpbf16ps issues
 * slowly enough to give fewer multiply-adds per second than FMAs (some CPUs issue it at a quarter
 * of their rate), this keeps fp32's compute speed with bf16's weight bytes. */
#define BW_ROW_FMA(r)                                                                       \
    if (mr > r) {                                                                           \
        const float *xr = (const float *)x + r * x_stride + 2 * i;                          \
        __m512 a0 = _mm512_set1_ps(xr[0]), a1 = _mm512_set1_ps(xr[1]);                      \
        c##r##0 = _mm512_fmadd_ps(a1, o0, _mm512_fmadd_ps(a0, e0, c##r##0));                \
        c##r##1 = _mm512_fmadd_ps(a1, o1, _mm512_fmadd_ps(a0, e1, c##r##1));                \
        c##r##2 = _mm512_fmadd_ps(a1, o2, _mm512_fmadd_ps(a0, e2, c##r##2));                \
    }
#define BW_SPLIT(j)                                                                         \
    __m512i v##j = _mm512_loadu_si512(b + 32 * j);                                          \
    __m512 e##j = _mm512_castsi512_ps(_mm512_slli_epi32(v##j, 16));                         \
    __m512 o##j = _mm512_castsi512_ps(_mm512_and_si512(v##j, high));

/* `mr` rows of x against one panel: x bf16 pairs through vdpbf16ps, or (widen) fp32 rows through
 * the widened weight. mr and widen are literals at every call site, so the `mr > r` and `widen`
 * tests fold away and the accumulators stay in registers (see csrc/gemm.c). */
static inline __attribute__((always_inline)) void tile_rows(
    void *out, int out_bf16, int64_t out_stride, const void *x, int64_t x_stride,
    const uint16_t *panel, int64_t pairs, const int mr, const int widen, int64_t cols,
    const float *bias) {
    BF_ROW_DECLARE(0) BF_ROW_DECLARE(1) BF_ROW_DECLARE(2) BF_ROW_DECLARE(3)
    BF_ROW_DECLARE(4) BF_ROW_DECLARE(5) BF_ROW_DECLARE(6) BF_ROW_DECLARE(7)
    const __m512i high = _mm512_set1_epi32((int32_t)0xffff0000u);
    for (int64_t i = 0; i < pairs; i++) {
        const uint16_t *b = panel + i * 2 * BF_PANEL;
        for (int j = 0; j < 2 * BF_PANEL; j += 32) PS_PREFETCH(b + BF_PREFETCH_PAIRS * 2 * BF_PANEL + j);
        if (widen) {
            BW_SPLIT(0) BW_SPLIT(1) BW_SPLIT(2)
            BW_ROW_FMA(0) BW_ROW_FMA(1) BW_ROW_FMA(2) BW_ROW_FMA(3)
            BW_ROW_FMA(4) BW_ROW_FMA(5) BW_ROW_FMA(6) BW_ROW_FMA(7)
        } else {
            __m512bh b0 = (__m512bh)_mm512_loadu_si512(b);
            __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + 32);
            __m512bh b2 = (__m512bh)_mm512_loadu_si512(b + 64);
            BF_ROW_DOT(0) BF_ROW_DOT(1) BF_ROW_DOT(2) BF_ROW_DOT(3)
            BF_ROW_DOT(4) BF_ROW_DOT(5) BF_ROW_DOT(6) BF_ROW_DOT(7)
        }
    }
    __m512 bias0 = _mm512_setzero_ps(), bias1 = bias0, bias2 = bias0;
    if (bias) {
        bias0 = _mm512_loadu_ps(bias);
        bias1 = _mm512_loadu_ps(bias + 16);
        bias2 = _mm512_loadu_ps(bias + 32);
    }
    BF_ROW_STORE(0) BF_ROW_STORE(1) BF_ROW_STORE(2) BF_ROW_STORE(3)
    BF_ROW_STORE(4) BF_ROW_STORE(5) BF_ROW_STORE(6) BF_ROW_STORE(7)
}

#define BF_TILE_CASE(m)                                                                     \
    case m:                                                                                 \
        if (widen) tile_rows(out, out_bf16, out_stride, x, x_stride, panel, pairs, m, 1, cols, \
                             bias);                                                         \
        else tile_rows(out, out_bf16, out_stride, x, x_stride, panel, pairs, m, 0, cols, bias); \
        break;

static void tile(void *out, int out_bf16, int64_t out_stride, const void *x, int64_t x_stride,
                 const uint16_t *panel, int64_t pairs, int mr, int widen, int64_t cols,
                 const float *bias) {
    switch (mr) {
    BF_TILE_CASE(8) BF_TILE_CASE(7) BF_TILE_CASE(6) BF_TILE_CASE(5)
    BF_TILE_CASE(4) BF_TILE_CASE(3) BF_TILE_CASE(2) BF_TILE_CASE(1)
    }
}

/* x rows (fp32 or bf16) -> fp32 rows of `width` (k rounded up to even), zero-padded. */
static void widen_rows(float *dst, int64_t width, const void *x, int x_bf16, int64_t x_stride,
                       int64_t rows, int64_t k, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(ps_threads(rows * k, PS_GRAIN, num_threads))
    for (int64_t r = 0; r < rows; r++) {
        float *d = dst + r * width;
        if (x_bf16) {
            const uint16_t *s = (const uint16_t *)x + r * x_stride;
            for (int64_t c = 0; c < k; c++) d[c] = ps_bf16_to_float(s[c]);
        } else {
            memcpy(d, (const float *)x + r * x_stride, (size_t)k * sizeof *d);
        }
        if (width > k) d[k] = 0.0f;
    }
}

/* x rows (fp32 or bf16, x_stride elements apart) -> bf16 rows of `width` (k rounded up to even),
 * zero-padded. */
static void convert_rows(uint16_t *dst, int64_t width, const void *x, int x_bf16, int64_t x_stride,
                         int64_t rows, int64_t k, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(ps_threads(rows * k, PS_GRAIN, num_threads))
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *d = dst + r * width;
        if (x_bf16) {
            memcpy(d, (const uint16_t *)x + r * x_stride, (size_t)k * sizeof *d);
        } else {
            const float *s = (const float *)x + r * x_stride;
            int64_t c = 0;
            for (; c + 16 <= k; c += 16)
                _mm256_storeu_si256((__m256i *)(d + c), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + c)));
            for (; c < k; c++) d[c] = ps_float_to_bf16(s[c]);
        }
        if (width > k) d[k] = 0;
    }
}

/* out: [rows, n] contiguous (bf16 or fp32, per dtypes); x: rows of k values x_stride elements
 * apart; packed: as above; bias: [n] or NULL. Returns PS_OUT_OF_MEMORY if the converted
 * activations do not fit. */
int pagedserve_linear_bf16(void *out, const void *x, int64_t x_stride, const uint16_t *packed,
                           const void *bias, int dtypes, int64_t rows, int64_t n, int64_t k,
                           int num_threads) {
    int out_bf16 = dtypes & PS_BF16_OUT, x_bf16 = dtypes & PS_BF16_X, widen = dtypes & PS_BF16_WIDEN;
    int64_t pairs = (k + 1) / 2, panels = (n + BF_PANEL - 1) / BF_PANEL;
    int64_t tiles = (rows + BF_TILE_ROWS - 1) / BF_TILE_ROWS;
    if (rows == 0 || n == 0) return PS_OK;
    /* Rows of the tile's activation type and even length are used in place; others converted. */
    void *converted = NULL;
    const void *xt = x;
    int64_t xt_stride = x_stride;
    if ((widen ? x_bf16 : !x_bf16) || k % 2) {
        converted = malloc((size_t)(rows * 2 * pairs) * (widen ? sizeof(float) : sizeof(uint16_t)));
        if (!converted) return PS_OUT_OF_MEMORY;
        if (widen) widen_rows(converted, 2 * pairs, x, x_bf16, x_stride, rows, k, num_threads);
        else convert_rows(converted, 2 * pairs, x, x_bf16, x_stride, rows, k, num_threads);
        xt = converted;
        xt_stride = 2 * pairs;
    }
#pragma omp parallel for schedule(static) num_threads(ps_threads(panels * rows * k, PS_GRAIN, num_threads))
    for (int64_t p = 0; p < panels; p++) {
        int64_t first_col = p * BF_PANEL;
        int64_t cols = n - first_col < BF_PANEL ? n - first_col : BF_PANEL;
        float panel_bias[BF_PANEL] = {0};
        if (bias) {
            for (int64_t c = 0; c < cols; c++)
                panel_bias[c] = dtypes & PS_BF16_BIAS ? ps_bf16_to_float(((const uint16_t *)bias)[first_col + c])
                                                      : ((const float *)bias)[first_col + c];
        }
        const uint16_t *panel = packed + p * pairs * 2 * BF_PANEL;
        for (int64_t t = 0, r = 0; t < tiles; t++) {
            int mr = (int)((rows - r + (tiles - t) - 1) / (tiles - t));
            char *o = (char *)out + (size_t)(r * n + first_col) * (out_bf16 ? 2 : 4);
            const char *xr = (const char *)xt + r * xt_stride * (widen ? sizeof(float) : sizeof(uint16_t));
            tile(o, out_bf16, n, xr, xt_stride, panel, pairs, mr, widen, cols, bias ? panel_bias : NULL);
            r += mr;
        }
    }
    free(converted);
    return PS_OK;
}

#else /* no AVX512-BF16: bf16 projections stay on oneDNN (kernels/cpu_linear.py) */

int pagedserve_linear_bf16_panel(void) { return 0; }

int pagedserve_linear_bf16(void *out, const void *x, int64_t x_stride, const uint16_t *packed,
                           const void *bias, int dtypes, int64_t rows, int64_t n, int64_t k,
                           int num_threads) {
    (void)out, (void)x, (void)x_stride, (void)packed, (void)bias, (void)dtypes, (void)rows, (void)n;
    (void)k, (void)num_threads;
    return PS_UNSUPPORTED;
}

#endif
