/* What the quantized GEMM's two files (gemm_q.c: entry point and scratch path; gemm_q_direct.c:
 * the direct path) share: the packed layout, the vector type of the CPU level, the macros that
 * widen packed bytes, and the direct path's entry points.
 *
 * Packed once at load into Q_PANEL-column panels (the fp32 GEMM's widths, csrc/gemm.c: 48 on
 * AVX-512, 16 on AVX2), zero-padded in n:
 *   4 bits: q[panel][k / 2][Q_PANEL] bytes, byte (c, col) = value 2c of col in the low nibble and
 *           2c + 1 in the high one (QuantWeight's own byte, transposed), so one load of a vector's
 *           bytes widens to the values of two consecutive k for its columns;
 *   8 bits: q[panel][k][Q_PANEL] bytes;
 *   so[panel][k / group_size][2][Q_PANEL] floats (or halves: PSQ_F16_SO): each group's scales,
 *           then its offsets. */
#ifndef PAGEDSERVE_GEMM_Q_H
#define PAGEDSERVE_GEMM_Q_H

#include "common.h"

/* Bits of `dtypes`: which of out, x and bias are bf16 (else fp32), and whether so holds IEEE
 * halves (packed so where they round-trip, as GGUF's do: fewer bytes a step streams). */
enum { PSQ_BF16_OUT = 1, PSQ_BF16_X = 2, PSQ_BF16_BIAS = 4, PSQ_F16_SO = 8 };

#if defined(__AVX512F__)
#include <immintrin.h>
#define Q_HAVE_TILE 1
#define QV 16 /* floats per vector */
#define Q_VECS 3
#define Q_TILE_ROWS 8
typedef __m512 qvec;
typedef __m512i qivec;
#define qv_zero _mm512_setzero_ps
#define qv_load _mm512_loadu_ps
#define qv_store _mm512_storeu_ps
#define qv_add _mm512_add_ps
#define qv_fma _mm512_fmadd_ps
#define qv_set1 _mm512_set1_ps
#define qv_float _mm512_cvtepi32_ps
#define qv_low_nibble(v) _mm512_and_si512(v, _mm512_set1_epi32(15))
#define qv_high_nibble(v) _mm512_srli_epi32(v, 4)
#define qv_load_half(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
/* QV bytes -> QV int32 lanes. */
static inline __attribute__((always_inline)) qivec qv_bytes(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define Q_HAVE_TILE 1
#define QV 8
#define Q_VECS 2
#define Q_TILE_ROWS 6
typedef __m256 qvec;
typedef __m256i qivec;
#define qv_zero _mm256_setzero_ps
#define qv_load _mm256_loadu_ps
#define qv_store _mm256_storeu_ps
#define qv_add _mm256_add_ps
#define qv_fma _mm256_fmadd_ps
#define qv_set1 _mm256_set1_ps
#define qv_float _mm256_cvtepi32_ps
#define qv_low_nibble(v) _mm256_and_si256(v, _mm256_set1_epi32(15))
#define qv_high_nibble(v) _mm256_srli_epi32(v, 4)
#define qv_load_half(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
static inline __attribute__((always_inline)) qivec qv_bytes(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
#endif

#ifdef Q_HAVE_TILE

#define Q_PANEL (QV * Q_VECS)
/* Up to Q_DIRECT_ROWS rows the panel is dequantized in registers, in tiles of Q_DIRECT_TILE rows
 * (what fits the registers beside the widened weights); beyond, through the scratch panel. Both
 * read the same packed bytes. The defaults are the largest tiles and row counts where the direct
 * path still beat smaller tiles and the scratch path (bench/quant_gemm.py). */
#if QV == 16
#define Q_DIRECT_DEFAULT_ROWS 16
#define Q_DIRECT_DEFAULT_TILE 8
#else
#define Q_DIRECT_DEFAULT_ROWS 8
#define Q_DIRECT_DEFAULT_TILE 6
#endif
#ifndef Q_DIRECT_ROWS
#define Q_DIRECT_ROWS Q_DIRECT_DEFAULT_ROWS
#endif
#ifndef Q_DIRECT_TILE
#define Q_DIRECT_TILE Q_DIRECT_DEFAULT_TILE
#endif
/* bf16 rows on AVX512-BF16 take the direct path's pairs (gemm_q_direct.c) up to this many rows,
 * where it still beats the bf16 pair panels (bench/quant_gemm.py --dtype bfloat16). */
#ifndef Q_DIRECT_PAIR_ROWS
#define Q_DIRECT_PAIR_ROWS (Q_DIRECT_ROWS > 32 ? Q_DIRECT_ROWS : 32)
#endif
#if Q_DIRECT_TILE > 8 || Q_TILE_ROWS > 8
#error "tile larger than the accumulators declared in gemm_q.c / gemm_q_direct.c"
#endif
/* Bytes of packed weight prefetched ahead in the direct path. */
#ifndef Q_PREFETCH_BYTES
#define Q_PREFETCH_BYTES 4096
#endif

#define Q_LOAD_BIAS                                                                         \
    qvec bias0 = qv_zero(), bias1 = bias0, bias2 = bias0;                                   \
    if (bias) {                                                                             \
        bias0 = qv_load(bias);                                                              \
        if (Q_VECS > 1) bias1 = qv_load(bias + QV);                                         \
        if (Q_VECS > 2) bias2 = qv_load(bias + 2 * QV);                                     \
    }
/* Widened ints of one row of packed bytes, `op` picking the nibble. */
#define Q_LOAD_INTS(name, p, op)                                                            \
    qivec name##0 = op(qv_bytes(p)), name##1 = name##0, name##2 = name##0;                  \
    if (Q_VECS > 1) name##1 = op(qv_bytes((p) + QV));                                       \
    if (Q_VECS > 2) name##2 = op(qv_bytes((p) + 2 * QV));
#define Q_IDENTITY(v) (v)
#define Q_FLOATS(ints)                                                                      \
    w0 = qv_float(ints##0);                                                                 \
    if (Q_VECS > 1) w1 = qv_float(ints##1);                                                 \
    if (Q_VECS > 2) w2 = qv_float(ints##2);
#define Q_DEQUANT(ints)                                                                     \
    w0 = qv_fma(qv_float(ints##0), s0, o0);                                                 \
    if (Q_VECS > 1) w1 = qv_fma(qv_float(ints##1), s1, o1);                                 \
    if (Q_VECS > 2) w2 = qv_fma(qv_float(ints##2), s2, o2);
#define Q_LOAD_GROUP(g)                                                                     \
    const float *sg = so + (g) * 2 * Q_PANEL;                                               \
    qvec s0 = qv_load(sg), s1 = s0, s2 = s0, o0 = qv_load(sg + Q_PANEL), o1 = o0, o2 = o0;  \
    if (Q_VECS > 1) s1 = qv_load(sg + QV), o1 = qv_load(sg + Q_PANEL + QV);                 \
    if (Q_VECS > 2) s2 = qv_load(sg + 2 * QV), o2 = qv_load(sg + Q_PANEL + 2 * QV);

/* Row `offset` (in elements) of out from Q_VECS vectors of sums: its first `cols` columns. */
static inline __attribute__((always_inline)) void store_row(void *out, int out_bf16, int64_t offset,
                                                            const qvec *v, int64_t cols) {
    float row[Q_PANEL];
    if (!out_bf16 && cols == Q_PANEL) {
        for (int j = 0; j < Q_VECS; j++) qv_store((float *)out + offset + j * QV, v[j]);
        return;
    }
    for (int j = 0; j < Q_VECS; j++) qv_store(row + j * QV, v[j]);
    if (out_bf16) {
        for (int64_t c = 0; c < cols; c++) ((uint16_t *)out)[offset + c] = ps_float_to_bf16(row[c]);
    } else {
        memcpy((float *)out + offset, row, (size_t)cols * sizeof *row);
    }
}

/* Cases beyond the tile's height never run: they compile to the one-row tile. */
#define Q_CASE(m, call, max)                                                                \
    case m: { const int mr_ = m <= max ? m : 1; call; } break;
#define Q_CASES(call, max)                                                                  \
    switch (mr) {                                                                           \
    Q_CASE(8, call, max) Q_CASE(7, call, max) Q_CASE(6, call, max) Q_CASE(5, call, max)     \
    Q_CASE(4, call, max) Q_CASE(3, call, max) Q_CASE(2, call, max)                          \
    default: Q_CASE(1, call, max)                                                           \
    }

/* The direct path (gemm_q_direct.c): `mr` rows of x (fp32, x_stride apart; xsum their sums over
 * each fold block) against one panel's packed bytes; and the fold block for a group size. */
#define PSQ_INTERNAL __attribute__((visibility("hidden")))
PSQ_INTERNAL void psq_direct_tile4(void *out, int out_bf16, int64_t out_stride, const float *x,
                                   int64_t x_stride, const float *xsum, const uint8_t *q,
                                   const float *so, int64_t k, int64_t group_size, int64_t block,
                                   int mr, int64_t cols, const float *bias);
PSQ_INTERNAL void psq_direct_tile8(void *out, int out_bf16, int64_t out_stride, const float *x,
                                   int64_t x_stride, const float *xsum, const uint8_t *q,
                                   const float *so, int64_t k, int64_t group_size, int64_t block,
                                   int mr, int64_t cols, const float *bias);
PSQ_INTERNAL int64_t psq_fold_block(int64_t group_size, int bits);
#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* The direct path for bf16 rows (x bf16, even k and fold block): pairs on vdpbf16ps. */
PSQ_INTERNAL void psq_direct_pair_tile4(void *out, int out_bf16, int64_t out_stride,
                                        const uint16_t *x, int64_t x_stride, const float *xsum,
                                        const uint8_t *q, const float *so, int64_t k,
                                        int64_t group_size, int64_t block, int mr, int64_t cols,
                                        const float *bias);
PSQ_INTERNAL void psq_direct_pair_tile8(void *out, int out_bf16, int64_t out_stride,
                                        const uint16_t *x, int64_t x_stride, const float *xsum,
                                        const uint8_t *q, const float *so, int64_t k,
                                        int64_t group_size, int64_t block, int mr, int64_t cols,
                                        const float *bias);
#endif

#endif
#endif
