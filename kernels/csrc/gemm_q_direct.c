/* The direct path of the quantized GEMM (csrc/gemm_q.c), for the few rows of decode steps: the
 * panel's packed bytes stream from memory once; each vector is widened to fp32 in registers and
 * multiplied into every row's accumulators of the fold block, sum_i x[r, i] * q[i, col], folded
 * at the block's end as s * that + o * sum_i x[r, i]: one multiply-add per weight value and row,
 * the scale and offset paid once per block. Decode is bound by weight bytes, and these are ~5x
 * fewer than fp32's. */
#include "gemm_q.h"

#ifdef Q_HAVE_TILE

/* The accumulators: per row r, vector v and parity p (even / odd k, kept apart at one or two
 * rows, where one chain of dependent FMAs per accumulator, 4 cycles each, would bound the speed),
 * sum_i x[r, i] * q[i, col] over the current fold block. */
#define QD_DECLARE(r) qvec g##r##00 = qv_zero(), g##r##10 = g##r##00, g##r##20 = g##r##00,     \
                           g##r##01 = g##r##00, g##r##11 = g##r##00, g##r##21 = g##r##00;
#define QD_ROW_FMA(r, p)                                                                    \
    if (mr > r) {                                                                           \
        qvec a = qv_set1(xk[(r) * x_stride]);                                               \
        g##r##0##p = qv_fma(a, w0, g##r##0##p);                                             \
        if (Q_VECS > 1) g##r##1##p = qv_fma(a, w1, g##r##1##p);                             \
        if (Q_VECS > 2) g##r##2##p = qv_fma(a, w2, g##r##2##p);                             \
    }
#define QD_ROWS_FMA(p)                                                                      \
    QD_ROW_FMA(0, p) QD_ROW_FMA(1, p) QD_ROW_FMA(2, p) QD_ROW_FMA(3, p)                     \
    QD_ROW_FMA(4, p) QD_ROW_FMA(5, p) QD_ROW_FMA(6, p) QD_ROW_FMA(7, p)
/* The odd k's products: into their own accumulators where split, else the even ones'. */
#define QD_ROWS_FMA_ODD                                                                     \
    if (split) { QD_ROWS_FMA(1) } else { QD_ROWS_FMA(0) }
#define QD_VEC_FOLD(r, v)                                                                   \
    if (Q_VECS > v) {                                                                       \
        qvec sum = split ? qv_add(g##r##v##0, g##r##v##1) : g##r##v##0;                     \
        qvec c = qv_fma(qv_load(sg + (v) * QV), sum, qv_load(cr + (v) * QV));               \
        qv_store(cr + (v) * QV, qv_fma(qv_load(sg + Q_PANEL + (v) * QV), xs, c));           \
        g##r##v##0 = qv_zero();                                                             \
        g##r##v##1 = g##r##v##0;                                                            \
    }
#define QD_ROW_FOLD(r)                                                                      \
    if (mr > r) {                                                                           \
        qvec xs = qv_set1(xsum[(r) * blocks + blk]);                                        \
        float *cr = sums + (r) * Q_PANEL;                                                   \
        QD_VEC_FOLD(r, 0) QD_VEC_FOLD(r, 1) QD_VEC_FOLD(r, 2)                               \
    }
#define QD_ROW_STORE(r)                                                                     \
    if (mr > r) {                                                                           \
        const float *cr = sums + (r) * Q_PANEL;                                             \
        store_row(out, out_bf16, (r) * out_stride, (qvec[3]){qv_add(qv_load(cr), bias0),    \
                  qv_add(qv_load(cr + QV % Q_PANEL), bias1),                                \
                  qv_add(qv_load(cr + 2 * QV % Q_PANEL), bias2)}, cols);                    \
    }

/* Every row's accumulators, its fold at block blk's end (with the group's scales and offsets), and
 * its sums (plus the bias) out: the fp32 and the bf16-pair tiles share them. */
#define QD_ROWS_DECLARE                                                                     \
    QD_DECLARE(0) QD_DECLARE(1) QD_DECLARE(2) QD_DECLARE(3)                                 \
    QD_DECLARE(4) QD_DECLARE(5) QD_DECLARE(6) QD_DECLARE(7)
#define QD_ROWS_FOLD                                                                        \
    {                                                                                       \
        const float *sg = so + blk * block / group_size * 2 * Q_PANEL;                      \
        QD_ROW_FOLD(0) QD_ROW_FOLD(1) QD_ROW_FOLD(2) QD_ROW_FOLD(3)                         \
        QD_ROW_FOLD(4) QD_ROW_FOLD(5) QD_ROW_FOLD(6) QD_ROW_FOLD(7)                         \
    }
#define QD_ROWS_STORE                                                                       \
    Q_LOAD_BIAS                                                                             \
    QD_ROW_STORE(0) QD_ROW_STORE(1) QD_ROW_STORE(2) QD_ROW_STORE(3)                         \
    QD_ROW_STORE(4) QD_ROW_STORE(5) QD_ROW_STORE(6) QD_ROW_STORE(7)

/* `mr` rows of x against one panel's packed bytes (bits 4 or 8), folding every `block` k values
 * (a divisor of group_size: see fold_block); xsum: [rows, k / block] sums of x over each block.
 * mr and bits are literals at every call site. */
static inline __attribute__((always_inline)) void direct_rows(
    void *out, int out_bf16, int64_t out_stride, const float *x, int64_t x_stride,
    const float *xsum, const uint8_t *q, const float *so, int64_t k, int64_t group_size,
    int64_t block, const int bits, const int mr, int64_t cols, const float *bias) {
    const int split = mr <= 2;
    const int64_t blocks = k / block;
    float sums[Q_DIRECT_TILE * Q_PANEL] = {0};
    QD_ROWS_DECLARE
    qvec w0 = qv_zero(), w1 = w0, w2 = w0;
    for (int64_t blk = 0; blk < blocks; blk++) {
        const float *xk = x + blk * block;
        const float *end = xk + block;
        if (bits == 4) {
            for (const uint8_t *b = q + blk * block / 2 * Q_PANEL; xk < end; xk += 2, b += Q_PANEL) {
                PS_PREFETCH(b + Q_PREFETCH_BYTES);
                Q_LOAD_INTS(lo, b, qv_low_nibble)
                Q_FLOATS(lo)
                QD_ROWS_FMA(0)
                Q_LOAD_INTS(hi, b, qv_high_nibble)
                Q_FLOATS(hi)
                xk += 1;
                QD_ROWS_FMA_ODD
                xk -= 1;
            }
        } else {
            const uint8_t *b = q + blk * block * Q_PANEL;
            for (; xk + 1 < end; xk += 2, b += 2 * Q_PANEL) {
                PS_PREFETCH(b + Q_PREFETCH_BYTES);
                Q_LOAD_INTS(even, b, Q_IDENTITY)
                Q_FLOATS(even)
                QD_ROWS_FMA(0)
                Q_LOAD_INTS(odd, b + Q_PANEL, Q_IDENTITY)
                Q_FLOATS(odd)
                xk += 1;
                QD_ROWS_FMA_ODD
                xk -= 1;
            }
            if (xk < end) {  /* an odd group size */
                Q_LOAD_INTS(last, b, Q_IDENTITY)
                Q_FLOATS(last)
                QD_ROWS_FMA(0)
            }
        }
        QD_ROWS_FOLD
    }
    QD_ROWS_STORE
}

#define Q_DIRECT(b) direct_rows(out, out_bf16, out_stride, x, x_stride, xsum, weights, so, k,  \
                                group_size, block, b, mr_, cols, bias)

/* One function per bits (and the scratch path's its own, in gemm_q.c): inlined into one function,
 * GCC's register allocation of the scratch tile suffered, and so did its speed. */
void psq_direct_tile4(
    void *out, int out_bf16, int64_t out_stride, const float *x, int64_t x_stride,
    const float *xsum, const uint8_t *weights, const float *so, int64_t k, int64_t group_size,
    int64_t block, int mr, int64_t cols, const float *bias) {
    Q_CASES(Q_DIRECT(4), Q_DIRECT_TILE)
}

void psq_direct_tile8(
    void *out, int out_bf16, int64_t out_stride, const float *x, int64_t x_stride,
    const float *xsum, const uint8_t *weights, const float *so, int64_t k, int64_t group_size,
    int64_t block, int mr, int64_t cols, const float *bias) {
    Q_CASES(Q_DIRECT(8), Q_DIRECT_TILE)
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* bf16 rows on AVX512-BF16: each vector of packed bytes widens to bf16 pairs (values 2c and 2c + 1
 * of its 16 columns side by side in one 32-bit lane) and meets a row's broadcast pair of x in one
 * vdpbf16ps: half the multiply instructions of the fp32 FMAs above, and the same products, exact
 * (the values are integers below 256, which bf16 holds; x is bf16 already), summed in fp32. Past a
 * row or two the FMAs, not the bytes, set a decode step's pace, so halving them pays
 * (bench/quant_gemm.py --dtype bfloat16 measures it). */

/* 4 bits: a byte holds both values of a pair, so its low nibble goes to the lane's low 16 bits, its
 * high one to the high 16 bits ((v | v << 12) & 0x000F000F), and a lookup of 16 bf16 values turns
 * each into its bf16. */
static inline __attribute__((always_inline)) __m512bh qp_pairs4(const uint8_t *p, __m512i table) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512i halves = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12),
                                               _mm512_set1_epi32(0x000F000F), 0xA8);
    return (__m512bh)_mm512_permutexvar_epi16(halves, table);
}

/* 8 bits: the two values of a pair are in consecutive rows. An integer below 256 as fp32 has its low
 * 16 bits zero, so its high 16 bits are its bf16. */
static inline __attribute__((always_inline)) __m512bh qp_pairs8(const uint8_t *even, const uint8_t *odd) {
    __m512i e = _mm512_castps_si512(_mm512_cvtepi32_ps(qv_bytes(even)));
    __m512i o = _mm512_castps_si512(_mm512_cvtepi32_ps(qv_bytes(odd)));
    return (__m512bh)_mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(e, 16), o);
}

/* bf16 of 0 .. 15 in the 16-bit words 0 .. 15: the 4-bit lookup's table. */
static inline __m512i qp_table4(void) {
    __m512i bits = _mm512_castps_si512(_mm512_cvtepi32_ps(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)));
    return _mm512_zextsi256_si512(_mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

/* At one or two rows the accumulators alternate by pair (p), as the fp32 path's by parity. */
#define QDP_ROW_DOT(r, p)                                                                   \
    if (mr > r) {                                                                           \
        int32_t pair;                                                                       \
        memcpy(&pair, xk + (r) * x_stride, sizeof pair);                                    \
        __m512bh a = (__m512bh)_mm512_set1_epi32(pair);                                     \
        g##r##0##p = _mm512_dpbf16_ps(g##r##0##p, a, w0);                                   \
        g##r##1##p = _mm512_dpbf16_ps(g##r##1##p, a, w1);                                   \
        g##r##2##p = _mm512_dpbf16_ps(g##r##2##p, a, w2);                                   \
    }
#define QDP_ROWS_DOT(p)                                                                     \
    QDP_ROW_DOT(0, p) QDP_ROW_DOT(1, p) QDP_ROW_DOT(2, p) QDP_ROW_DOT(3, p)                 \
    QDP_ROW_DOT(4, p) QDP_ROW_DOT(5, p) QDP_ROW_DOT(6, p) QDP_ROW_DOT(7, p)
#define QDP_ROWS_DOT_ALTERNATING                                                            \
    if (split && (odd ^= 1)) { QDP_ROWS_DOT(1) } else { QDP_ROWS_DOT(0) }

/* direct_rows for bf16 x (x_stride elements apart) on pairs; block is even. */
static inline __attribute__((always_inline)) void direct_pair_rows(
    void *out, int out_bf16, int64_t out_stride, const uint16_t *x, int64_t x_stride,
    const float *xsum, const uint8_t *q, const float *so, int64_t k, int64_t group_size,
    int64_t block, const int bits, const int mr, int64_t cols, const float *bias) {
    const int split = mr <= 2;
    const int64_t blocks = k / block;
    float sums[Q_DIRECT_TILE * Q_PANEL] = {0};
    QD_ROWS_DECLARE
    const __m512i table = qp_table4();
    int odd = 0;
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint16_t *xk = x + blk * block;
        const uint16_t *end = xk + block;
        if (bits == 4) {
            for (const uint8_t *b = q + blk * block / 2 * Q_PANEL; xk < end; xk += 2, b += Q_PANEL) {
                PS_PREFETCH(b + Q_PREFETCH_BYTES);
                __m512bh w0 = qp_pairs4(b, table), w1 = qp_pairs4(b + QV, table),
                         w2 = qp_pairs4(b + 2 * QV, table);
                QDP_ROWS_DOT_ALTERNATING
            }
        } else {
            for (const uint8_t *b = q + blk * block * Q_PANEL; xk < end; xk += 2, b += 2 * Q_PANEL) {
                PS_PREFETCH(b + Q_PREFETCH_BYTES);
                __m512bh w0 = qp_pairs8(b, b + Q_PANEL), w1 = qp_pairs8(b + QV, b + Q_PANEL + QV),
                         w2 = qp_pairs8(b + 2 * QV, b + Q_PANEL + 2 * QV);
                QDP_ROWS_DOT_ALTERNATING
            }
        }
        QD_ROWS_FOLD
    }
    QD_ROWS_STORE
}

#define Q_DIRECT_PAIRS(b) direct_pair_rows(out, out_bf16, out_stride, x, x_stride, xsum, weights, \
                                           so, k, group_size, block, b, mr_, cols, bias)

void psq_direct_pair_tile4(
    void *out, int out_bf16, int64_t out_stride, const uint16_t *x, int64_t x_stride,
    const float *xsum, const uint8_t *weights, const float *so, int64_t k, int64_t group_size,
    int64_t block, int mr, int64_t cols, const float *bias) {
    Q_CASES(Q_DIRECT_PAIRS(4), Q_DIRECT_TILE)
}

void psq_direct_pair_tile8(
    void *out, int out_bf16, int64_t out_stride, const uint16_t *x, int64_t x_stride,
    const float *xsum, const uint8_t *weights, const float *so, int64_t k, int64_t group_size,
    int64_t block, int mr, int64_t cols, const float *bias) {
    Q_CASES(Q_DIRECT_PAIRS(8), Q_DIRECT_TILE)
}
#endif

/* The k values the direct path sums before folding them with the group's scale and offset: the
 * group, or for groups over Q_FOLD_MAX (per-channel ones) the largest divisor of it up to that
 * (even for 4 bits). s * sum(x q) + o * sum(x) over a long group of activations with a large mean
 * cancels in its two terms: folding every 64 values keeps the error within ~1e-6 of the output's
 * scale, where a long group folded once does not. */
#define Q_FOLD_MAX 64
int64_t psq_fold_block(int64_t group_size, int bits) {
    if (group_size <= Q_FOLD_MAX) return group_size;
    for (int64_t block = Q_FOLD_MAX; block > 2; block--)
        if (group_size % block == 0 && (bits == 8 || block % 2 == 0)) return block;
    return bits == 4 ? 2 : 1;
}

#endif
