/* The quantized GEMM with int8 activations (W4A8 / W8A8), an opt-in alternative to gemm_q.c's
 * float32-activation kernel (kernels/quant_linear.py picks one at pack time; its
 * int8_activation_reference is this file's spec).
 *
 * Each row of x is quantized per block of Q8_BLOCK values, symmetric: dx = amax / 127,
 * qx = rint(x * (127 / amax)) in -127..127. The weight's unsigned q (4 or 8 bits) then meets qx in
 * integer dot products, 4 bytes per int32 lane (AVX512-VNNI vpdpbusd: u8 x s8), and each block
 * folds into the float32 sums as s * dx * sum(q qx) + o * sum(x), the offset term with the exact
 * float sum of x. That is llama.cpp's scheme for its CPU matmuls: one instruction per 64 weight
 * values against gemm_q_direct.c's widen, convert and FMA per 16, so decode (where the weights
 * sit in cache and the float path is bound by those instructions) runs several times faster. The
 * price is the activations' rounding (~0.4 % of each block's largest value).
 *
 * Packed layout (I8_PANEL = 64 columns, zero-padded in n; 4 vectors of 16 columns, lane l of
 * vector v is column 16 v + l):
 *   4 bits: q[panel][k / 8][4][16][4] bytes: byte j of a lane holds k = 8 c + j in its low nibble
 *           and k = 8 c + 4 + j in its high one;
 *   8 bits: q[panel][k / 4][4][16][4] bytes: byte j of a lane is k = 4 c + j;
 *   so[panel][k / group_size][2][I8_PANEL]: each group's scales, then its offsets, as floats, or
 *   as IEEE halves (so_f16) where they round-trip (GGUF stores them so): at 4 bits their floats
 *   were a third of the bytes a decode step streams, and out of cache that stream is the bound.
 * group_size must be a multiple of Q8_BLOCK. */
#include "common.h"

#include <stdlib.h>

#define I8_PANEL 64
#define Q8_BLOCK 32

#if defined(__AVX512F__) && defined(__AVX512BW__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define I8_TARGET __attribute__((target("avx512vnni")))

/* The CPU may lack VNNI at a level whose flags do not require it (avx512): then no panel. */
int pagedserve_quant_linear_i8_panel(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") ? I8_PANEL : 0;
}

/* One row of k floats -> qx [k] int8, dx [k / Q8_BLOCK] and xsum [k / Q8_BLOCK]. */
static void quantize_row(int8_t *qx, float *dx, float *xsum, const float *x, int64_t k) {
    for (int64_t b = 0; b < k / Q8_BLOCK; b++) {
        const float *xb = x + b * Q8_BLOCK;
        __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        __m512 amax = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
        float m = _mm512_reduce_max_ps(amax);
        float iscale = m > 0.0f ? 127.0f / m : 0.0f;
        __m512 is = _mm512_set1_ps(iscale);
        /* Round to nearest even (the default MXCSR mode), as torch.round. */
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, is));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, is));
        _mm_storeu_si128((__m128i *)(qx + b * Q8_BLOCK), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(qx + b * Q8_BLOCK + 16), _mm512_cvtsepi32_epi8(q1));
        dx[b] = m / 127.0f;
        float s = 0.0f;
        for (int j = 0; j < Q8_BLOCK; j++) s += xb[j];
        xsum[b] = s;
    }
}

static inline __attribute__((always_inline)) int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* One row against one panel: out[0 .. cols) = the row's sums (+ bias). bits a literal. */
static inline __attribute__((always_inline)) __m512 load_so(const void *so, int f16, int64_t i) {
    return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)so + i)))
               : _mm512_loadu_ps((const float *)so + i);
}

static inline __attribute__((always_inline)) I8_TARGET void panel_row(
    float *out, const int8_t *qx, const float *dx, const float *xsum, const uint8_t *q,
    const void *so, int so_f16, int64_t k, int64_t group_size, const int bits, int64_t cols,
    const float *bias) {
    __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
    const __m512i low = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < k / Q8_BLOCK; b++) {
        /* Even and odd chunks apart: eight independent chains of vpdpbusd. */
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, h0 = a0, h1 = a0, h2 = a0, h3 = a0;
        const int8_t *xb = qx + b * Q8_BLOCK;
        if (bits == 4) {
            const uint8_t *w = q + b * Q8_BLOCK * I8_PANEL / 2;
            for (int c = 0; c < Q8_BLOCK / 8; c++, w += 4 * 64) {
                PS_PREFETCH(w + 4096);
                const __m512i xl = _mm512_set1_epi32(load4(xb + 8 * c));
                const __m512i xh = _mm512_set1_epi32(load4(xb + 8 * c + 4));
                __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
                __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
                a0 = _mm512_dpbusd_epi32(a0, _mm512_and_si512(w0, low), xl);
                a1 = _mm512_dpbusd_epi32(a1, _mm512_and_si512(w1, low), xl);
                a2 = _mm512_dpbusd_epi32(a2, _mm512_and_si512(w2, low), xl);
                a3 = _mm512_dpbusd_epi32(a3, _mm512_and_si512(w3, low), xl);
                h0 = _mm512_dpbusd_epi32(h0, _mm512_and_si512(_mm512_srli_epi16(w0, 4), low), xh);
                h1 = _mm512_dpbusd_epi32(h1, _mm512_and_si512(_mm512_srli_epi16(w1, 4), low), xh);
                h2 = _mm512_dpbusd_epi32(h2, _mm512_and_si512(_mm512_srli_epi16(w2, 4), low), xh);
                h3 = _mm512_dpbusd_epi32(h3, _mm512_and_si512(_mm512_srli_epi16(w3, 4), low), xh);
            }
        } else {
            const uint8_t *w = q + b * Q8_BLOCK * I8_PANEL;
            for (int c = 0; c < Q8_BLOCK / 4; c += 2, w += 8 * 64) {
                PS_PREFETCH(w + 4096);
                PS_PREFETCH(w + 4096 + 256);
                const __m512i xe = _mm512_set1_epi32(load4(xb + 4 * c));
                const __m512i xo = _mm512_set1_epi32(load4(xb + 4 * c + 4));
                a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(w), xe);
                a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512(w + 64), xe);
                a2 = _mm512_dpbusd_epi32(a2, _mm512_loadu_si512(w + 128), xe);
                a3 = _mm512_dpbusd_epi32(a3, _mm512_loadu_si512(w + 192), xe);
                h0 = _mm512_dpbusd_epi32(h0, _mm512_loadu_si512(w + 256), xo);
                h1 = _mm512_dpbusd_epi32(h1, _mm512_loadu_si512(w + 320), xo);
                h2 = _mm512_dpbusd_epi32(h2, _mm512_loadu_si512(w + 384), xo);
                h3 = _mm512_dpbusd_epi32(h3, _mm512_loadu_si512(w + 448), xo);
            }
        }
        const int64_t sg = b * Q8_BLOCK / group_size * 2 * I8_PANEL;
        const __m512 d = _mm512_set1_ps(dx[b]), xs = _mm512_set1_ps(xsum[b]);
#define I8_FOLD(v)                                                                           \
        f##v = _mm512_fmadd_ps(_mm512_mul_ps(load_so(so, so_f16, sg + 16 * v), d),            \
                               _mm512_cvtepi32_ps(_mm512_add_epi32(a##v, h##v)), f##v);        \
        f##v = _mm512_fmadd_ps(load_so(so, so_f16, sg + I8_PANEL + 16 * v), xs, f##v);
        I8_FOLD(0) I8_FOLD(1) I8_FOLD(2) I8_FOLD(3)
#undef I8_FOLD
    }
    float row[I8_PANEL];
    _mm512_storeu_ps(row, f0);
    _mm512_storeu_ps(row + 16, f1);
    _mm512_storeu_ps(row + 32, f2);
    _mm512_storeu_ps(row + 48, f3);
    for (int64_t c = 0; c < cols; c++) out[c] = row[c] + (bias ? bias[c] : 0.0f);
}

/* One copy per bit width, so panel_row is specialized for each: a shared always_inline helper
 * taking bits cannot be inlined into the untargeted entry point below (GCC refuses to inline
 * across target("avx512vnni")). */
static I8_TARGET void panel_rows4(float *out, int64_t n, const int8_t *qx, const float *dx,
                                  const float *xsum, const uint8_t *q, const void *so, int so_f16,
                                  int64_t k, int64_t group_size, int64_t rows, int64_t cols,
                                  const float *bias) {
    for (int64_t r = 0; r < rows; r++)
        panel_row(out + r * n, qx + r * k, dx + r * (k / Q8_BLOCK), xsum + r * (k / Q8_BLOCK), q, so,
                  so_f16, k, group_size, 4, cols, bias);
}

static I8_TARGET void panel_rows8(float *out, int64_t n, const int8_t *qx, const float *dx,
                                  const float *xsum, const uint8_t *q, const void *so, int so_f16,
                                  int64_t k, int64_t group_size, int64_t rows, int64_t cols,
                                  const float *bias) {
    for (int64_t r = 0; r < rows; r++)
        panel_row(out + r * n, qx + r * k, dx + r * (k / Q8_BLOCK), xsum + r * (k / Q8_BLOCK), q, so,
                  so_f16, k, group_size, 8, cols, bias);
}

/* out: [rows, n] contiguous fp32; x: rows of k fp32 values x_stride apart; q, so: packed as above
 * (so halves if so_f16); bias: [n] fp32 or NULL. PS_BAD_QUANT_LAYOUT for a bits / group size the packing cannot have,
 * PS_UNSUPPORTED without VNNI, PS_OUT_OF_MEMORY if the quantized rows cannot be had. */
int pagedserve_quant_linear_i8(float *out, const float *x, int64_t x_stride, const uint8_t *q,
                               const void *so, int so_f16, const float *bias, int bits, int64_t group_size,
                               int64_t rows, int64_t n, int64_t k, int num_threads) {
    if (!(bits == 4 || bits == 8) || group_size <= 0 || group_size % Q8_BLOCK || k % group_size
        || rows < 0 || n < 0)
        return PS_BAD_QUANT_LAYOUT;
    if (!pagedserve_quant_linear_i8_panel()) return PS_UNSUPPORTED;
    if (rows == 0 || n == 0) return PS_OK;
    const int64_t blocks = k / Q8_BLOCK;
    /* One buffer: qx [rows, k] int8, then dx and xsum [rows, blocks] floats. */
    char stack[16384], *heap = NULL, *buf = stack;
    size_t need = (size_t)(rows * k) + 2 * (size_t)(rows * blocks) * sizeof(float) + 64;
    if (need > sizeof stack && !(buf = heap = malloc(need))) return PS_OUT_OF_MEMORY;
    int8_t *qx = (int8_t *)buf;
    float *dx = (float *)(buf + ((size_t)(rows * k) + 63) / 64 * 64), *xsum = dx + rows * blocks;
    for (int64_t r = 0; r < rows; r++)
        quantize_row(qx + r * k, dx + r * blocks, xsum + r * blocks, x + r * x_stride, k);
    const int64_t panels = (n + I8_PANEL - 1) / I8_PANEL;
    const int64_t panel_bytes = k * I8_PANEL * bits / 8, groups = k / group_size;
    /* Work in weight bytes touched, each row's pass over them costing about a fifth of the load. */
    int threads = ps_threads(panels * panel_bytes * (rows + 4) / 4, PS_GRAIN, num_threads);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        int64_t first = p * I8_PANEL, cols = n - first < I8_PANEL ? n - first : I8_PANEL;
        const uint8_t *pq = q + p * panel_bytes;
        const char *pso = (const char *)so + p * groups * 2 * I8_PANEL * (so_f16 ? 2 : 4);
        const float *pb = bias ? bias + first : NULL;
        if (bits == 4)
            panel_rows4(out + first, n, qx, dx, xsum, pq, pso, so_f16, k, group_size, rows, cols, pb);
        else
            panel_rows8(out + first, n, qx, dx, xsum, pq, pso, so_f16, k, group_size, rows, cols, pb);
    }
    free(heap);
    return PS_OK;
}

#else /* no AVX-512: kernels/quant_linear.py keeps the float32-activation kernel */

int pagedserve_quant_linear_i8_panel(void) { return 0; }

int pagedserve_quant_linear_i8(float *out, const float *x, int64_t x_stride, const uint8_t *q,
                               const void *so, int so_f16, const float *bias, int bits, int64_t group_size,
                               int64_t rows, int64_t n, int64_t k, int num_threads) {
    (void)out, (void)x, (void)x_stride, (void)q, (void)so, (void)so_f16, (void)bias, (void)bits;
    (void)group_size, (void)rows, (void)n, (void)k, (void)num_threads;
    return PS_UNSUPPORTED;
}

#endif
