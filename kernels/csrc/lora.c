/* The batched multi-LoRA delta (punica's shrink / expand) on CPU: each row of a step adds its own
 * adapter's low-rank update, out[t] += (A[s] . x[t]) . Bt[s], s = token_slots[t] (-1: none).
 * Spec: kernels/reference.py's lora_delta_reference; wrapper: kernels/lora.py.
 *
 * One call serves a whole step whatever mix of adapters it holds. Rows are first grouped by slot
 * (a counting sort of their indices), so each adapter's A and Bt are read from memory once for
 * all of its rows:
 *   shrink, h[i] = A[s, :r] . x[row i]: register tiles of a few A rows x a few x rows, A's rows
 *     outer and the slot's rows inner, so a block of A is loaded once and reused from L1;
 *   expand, out[row i] += h[i] . Bt[s, :r]: tiles of a few rows x 64 columns summed over r in
 *     registers, the slot's rows inner, so a Bt tile is read once and out touched once (one
 *     rounding for bf16).
 * Both prefetch the next block of weights as they go: with many adapters a step streams them.
 *
 * One parallel region per call (none for small calls): threads split the shrink by (slot, block
 * of A rows, group of rows), weighted by rows, then, after a barrier, the expand by columns,
 * evenly in whole vectors. Each h and each out element is summed by one thread in an order fixed
 * by the shapes alone, so results do not depend on the thread count. Rows of A or Bt past
 * ranks[s] are never read.
 *
 * With AVX-512 (BW, VL) the tiles are written with intrinsics; bf16 x with bf16 A use vdpbf16ps
 * where the build has AVX512-BF16 (bf16 products are exact in fp32). Other builds (AVX2, other
 * architectures) run `omp simd` loops in the same loop order. */
#include <stdlib.h>

#include "common.h"
#include "lora.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PS_LORA_AVX512 1
#endif

#define PS_LORA_COLS 64 /* expand tile columns: four vectors of AVX-512 */
#define PS_LORA_ROWS 4  /* rows of x (shrink) or out (expand) per register tile */
#define PS_LORA_ROW_GROUP 64 /* rows per shrink work item (a multiple of PS_LORA_ROWS) */
/* MACs per thread below which another thread costs more (its wake-up, the barrier) than it saves. */
#define PS_LORA_GRAIN 262144
/* Scratch that fits here lives on the stack: a decode step's needs, no allocation per call. */
#define PS_LORA_STACK_SCRATCH 16384

size_t ps_lora_scratch_bytes(int64_t tokens, int64_t slots, int64_t max_rank) {
    return (size_t)(slots + 1 + tokens) * sizeof(int64_t) + (size_t)(tokens * max_rank) * sizeof(float);
}

/* One call's operands and its rows grouped by slot, shared by the threads. */
typedef struct {
    void *out;
    const void *x, *lora_a, *lora_b_t;
    const int32_t *ranks;
    const int64_t *start, *order; /* slot s's rows: order[start[s]:start[s + 1]] */
    float *h;                     /* [m, max_rank], by sorted position */
    int64_t out_stride, x_stride, k, n, slots, max_rank;
    int64_t shrink_rows; /* sum over slots of rows x rank: the shrink's cost, in A-row . x-row dots */
} lora_job;

/* A rows per shrink tile for a slot with `rows` rows: more where there are few rows, so a tile
 * still has enough independent sums to hide the multiply-add latency. */
static inline int64_t rank_block(int64_t rows) { return rows <= 2 ? 8 : 4; }

#ifdef PS_LORA_AVX512

/* 16 elements of p from element i as fp32 (bf16 widened: zero-extended, shifted into the top
 * half); lanes outside mask are not read and are 0. */
static inline __attribute__((always_inline)) __m512 load16(const void *p, int64_t i, __mmask16 mask,
                                                           const int bf16) {
    if (bf16) {
        __m256i v = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    }
    return _mm512_maskz_loadu_ps(mask, (const float *)p + i);
}

/* v into the lanes of mask of p from element i, bf16 rounded to nearest even (NaN kept a quiet
 * NaN): by vcvtneps2bf16 where the build has it (as csrc/gemm_bf16.c; it flushes denormal
 * results to zero), else in integer steps, exactly as ps_float_to_bf16. */
static inline __attribute__((always_inline)) void store16(void *p, int64_t i, __m512 v, __mmask16 mask,
                                                          const int bf16) {
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)p + i, mask, v);
        return;
    }
#if defined(__AVX512BF16__)
    _mm256_mask_storeu_epi16((uint16_t *)p + i, mask, (__m256i)_mm512_cvtneps_pbh(v));
#else
    __m512i bits = _mm512_castps_si512(v), high = _mm512_srli_epi32(bits, 16);
    __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    __m512i quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
    __m512i h = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), quiet);
    _mm512_mask_cvtepi32_storeu_epi16((uint16_t *)p + i, mask, h);
#endif
}

/* The horizontal sums of v0..v3 (lane j: v_j's). One fixed tree for every lane, so an h value's
 * order of additions is the same in every tile. */
static inline __attribute__((always_inline)) __m128 sum4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
    /* 256-bit halves, then 128-bit quarters: each quarter of c holds four partial sums of one v */
    __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x44), _mm512_shuffle_f32x4(v0, v1, 0xEE));
    __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(v2, v3, 0x44), _mm512_shuffle_f32x4(v2, v3, 0xEE));
    __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
    c = _mm512_add_ps(c, _mm512_permute_ps(c, 0x4E));
    c = _mm512_add_ps(c, _mm512_permute_ps(c, 0xB1));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                          0, 0, 0, 0), c));
}

/* h[t * h_stride + j] = A row j . x row t for the rb rows of A from `a` (k elements apart) and
 * the tb rows `xr` of x: each vector of A loaded once for the tb rows, each of x once for the rb
 * rows, the rb x tb sums in registers. A rows from `valid` on are not read (the tile recomputes
 * row valid - 1 in their place) and not stored. bf16 x and A on an AVX512-BF16 build: vdpbf16ps,
 * 32 products at a time; else fp32 FMAs on 16 widened values. rb and tb are literals. */
static inline __attribute__((always_inline)) void shrink_tile(float *h, int64_t h_stride,
                                                              const char *const *xr, const char *a,
                                                              int64_t k, int64_t valid, const int rb,
                                                              const int tb, const int data_bf16,
                                                              const int weight_bf16) {
    const int64_t row_bytes = k * (weight_bf16 ? 2 : 4);
    const char *ar[8];
    __m512 acc[8][PS_LORA_ROWS];
#pragma GCC unroll 8
    for (int j = 0; j < rb; j++) {
        ar[j] = a + (j < valid ? j : valid - 1) * row_bytes;
#pragma GCC unroll 4
        for (int t = 0; t < tb; t++) acc[j][t] = _mm512_setzero_ps();
    }
#if defined(__AVX512BF16__)
    if (data_bf16 && weight_bf16) {
        for (int64_t i = 0; i < k; i += 32) {
            __mmask32 mask = k - i >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << (k - i)) - 1);
            __m512bh xv[PS_LORA_ROWS];
#pragma GCC unroll 8
            for (int j = 0; j < rb; j++) PS_PREFETCH(a + (rb + j) * row_bytes + 2 * i);
#pragma GCC unroll 4
            for (int t = 0; t < tb; t++)
                xv[t] = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const uint16_t *)xr[t] + i);
#pragma GCC unroll 8
            for (int j = 0; j < rb; j++) {
                __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const uint16_t *)ar[j] + i);
#pragma GCC unroll 4
                for (int t = 0; t < tb; t++) acc[j][t] = _mm512_dpbf16_ps(acc[j][t], av, xv[t]);
            }
        }
    } else
#endif
    {
        for (int64_t i = 0; i < k; i += 16) {
            __mmask16 mask = k - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - i)) - 1);
            __m512 xv[PS_LORA_ROWS];
#pragma GCC unroll 8
            for (int j = 0; j < rb; j++) PS_PREFETCH(a + (rb + j) * row_bytes + (weight_bf16 ? 2 : 4) * i);
#pragma GCC unroll 4
            for (int t = 0; t < tb; t++) xv[t] = load16(xr[t], i, mask, data_bf16);
#pragma GCC unroll 8
            for (int j = 0; j < rb; j++) {
                __m512 av = load16(ar[j], i, mask, weight_bf16);
#pragma GCC unroll 4
                for (int t = 0; t < tb; t++) acc[j][t] = _mm512_fmadd_ps(av, xv[t], acc[j][t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < tb; t++) {
#pragma GCC unroll 2
        for (int g = 0; g < rb; g += 4) {
            int64_t left = valid - g;
            if (left <= 0) break;
            __mmask8 mask = left >= 4 ? (__mmask8)0xF : (__mmask8)((1u << left) - 1);
            _mm_mask_storeu_ps(h + t * h_stride + g, mask,
                               sum4(acc[g][t], acc[g + 1][t], acc[g + 2][t], acc[g + 3][t]));
        }
    }
}

/* out rows `outr` (tb of them), columns [j, j + cols), cols <= 16 * nv: += sum over r < rank of
 * hr[t][r] * bt[r, col] (bt's rows n elements apart). The sums stay in registers over r, each
 * vector of Bt is loaded (and widened) once for the tb rows, out is read and written once. Where
 * pf is not NULL, the rows of the tile to come (pf + r * n elements) are prefetched on the way.
 * tb and nv are literals. */
static inline __attribute__((always_inline)) void expand_tile(char *const *outr, const float *const *hr,
                                                              const char *bt, int64_t n, int64_t rank,
                                                              int64_t j, int64_t cols, const char *pf,
                                                              const int tb, const int nv,
                                                              const int data_bf16, const int weight_bf16) {
    const int64_t row_bytes = n * (weight_bf16 ? 2 : 4);
    __mmask16 mask[4];
    __m512 acc[PS_LORA_ROWS][4];
#pragma GCC unroll 4
    for (int v = 0; v < nv; v++) {
        int64_t left = cols - 16 * v;
        mask[v] = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
#pragma GCC unroll 4
        for (int t = 0; t < tb; t++) acc[t][v] = _mm512_setzero_ps();
    }
    for (int64_t r = 0; r < rank; r++) {
        if (pf)
            for (int l = 0; l < PS_LORA_COLS * (weight_bf16 ? 2 : 4); l += 64) PS_PREFETCH(pf + r * row_bytes + l);
        __m512 b[4];
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) b[v] = load16(bt, r * n + j + 16 * v, mask[v], weight_bf16);
#pragma GCC unroll 4
        for (int t = 0; t < tb; t++) {
            __m512 hv = _mm512_set1_ps(hr[t][r]);
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) acc[t][v] = _mm512_fmadd_ps(hv, b[v], acc[t][v]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < tb; t++) {
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) {
            int64_t col = j + 16 * v;
            store16(outr[t], col, _mm512_add_ps(load16(outr[t], col, mask[v], data_bf16), acc[t][v]),
                    mask[v], data_bf16);
        }
    }
}

/* Bt's tile [rank, cols from j] applied to the rows order[first : first + rows], PS_LORA_ROWS at a
 * time (the tile stays in L1 across them); the first row tile prefetches the tile to come (pf). */
static inline __attribute__((always_inline)) void expand_block(const lora_job *job, int64_t first,
                                                               int64_t rows, int64_t rank, const char *bt,
                                                               int64_t j, int64_t cols, const char *pf,
                                                               const int data_bf16, const int weight_bf16) {
    const int64_t data_elem = data_bf16 ? 2 : 4, n = job->n, nv = (cols + 15) / 16;
    for (int64_t i = first; i < first + rows; i += PS_LORA_ROWS) {
        char *outr[PS_LORA_ROWS];
        const float *hr[PS_LORA_ROWS];
        int64_t tb = first + rows - i < PS_LORA_ROWS ? first + rows - i : PS_LORA_ROWS;
        for (int64_t t = 0; t < tb; t++) {
            outr[t] = (char *)job->out + job->order[i + t] * job->out_stride * data_elem;
            hr[t] = job->h + (i + t) * job->max_rank;
        }
        const char *tile_pf = i == first ? pf : NULL;
#define PS_EXPAND_CASE(TB, NV)                                                                     \
    if (tb == TB && nv == NV) {                                                                    \
        expand_tile(outr, hr, bt, n, rank, j, cols, tile_pf, TB, NV, data_bf16, weight_bf16);      \
        continue;                                                                                  \
    }
#define PS_EXPAND_ROWS(TB) PS_EXPAND_CASE(TB, 4) PS_EXPAND_CASE(TB, 3) PS_EXPAND_CASE(TB, 2) PS_EXPAND_CASE(TB, 1)
        PS_EXPAND_ROWS(4) PS_EXPAND_ROWS(3) PS_EXPAND_ROWS(2) PS_EXPAND_ROWS(1)
#undef PS_EXPAND_ROWS
#undef PS_EXPAND_CASE
    }
}

#define PS_LORA_VEC 16 /* columns per vector: the unit the expand's columns are split in */

#else /* portable: `omp simd` loops, vectorised by the compiler for the level's flags */

/* As the AVX-512 shrink_tile, rb rows of A against tb rows of x, each A and x element loaded once
 * per tile; the rb x tb sums are `omp simd` reductions. */
static inline __attribute__((always_inline)) void shrink_tile(float *h, int64_t h_stride,
                                                              const char *const *xr, const char *a,
                                                              int64_t k, int64_t valid, const int rb,
                                                              const int tb, const int data_bf16,
                                                              const int weight_bf16) {
    for (int64_t t0 = 0; t0 < tb; t0 += 2) {
        const char *x0 = xr[t0], *x1 = xr[t0 + 1 < tb ? t0 + 1 : t0];
        for (int64_t j0 = 0; j0 < rb && j0 < valid; j0 += 4) {
            const char *ar[4];
            for (int j = 0; j < 4; j++)
                ar[j] = a + (j0 + j < valid ? j0 + j : valid - 1) * k * (weight_bf16 ? 2 : 4);
            float s00 = 0.0f, s01 = 0.0f, s02 = 0.0f, s03 = 0.0f, s10 = 0.0f, s11 = 0.0f, s12 = 0.0f,
                  s13 = 0.0f;
#pragma omp simd reduction(+ : s00, s01, s02, s03, s10, s11, s12, s13)
            for (int64_t i = 0; i < k; i++) {
                float v0 = ps_load(x0, i, data_bf16), v1 = ps_load(x1, i, data_bf16);
                float a0 = ps_load(ar[0], i, weight_bf16), a1 = ps_load(ar[1], i, weight_bf16);
                float a2 = ps_load(ar[2], i, weight_bf16), a3 = ps_load(ar[3], i, weight_bf16);
                s00 = PS_FMA(a0, v0, s00), s01 = PS_FMA(a1, v0, s01);
                s02 = PS_FMA(a2, v0, s02), s03 = PS_FMA(a3, v0, s03);
                s10 = PS_FMA(a0, v1, s10), s11 = PS_FMA(a1, v1, s11);
                s12 = PS_FMA(a2, v1, s12), s13 = PS_FMA(a3, v1, s13);
            }
            float s[2][4] = {{s00, s01, s02, s03}, {s10, s11, s12, s13}};
            for (int t = 0; t < 2 && t0 + t < tb; t++)
                for (int j = 0; j < 4 && j0 + j < valid; j++) h[(t0 + t) * h_stride + j0 + j] = s[t][j];
        }
    }
}

/* out[col] += sum over r < rank of h[r] * bt[r, col] for the w <= PS_LORA_COLS columns from j:
 * the sums in an array the compiler keeps in registers over r (w a literal where it is the full
 * PS_LORA_COLS), out read and written once. */
static inline __attribute__((always_inline)) void expand_row(char *out, const float *h, const char *bt,
                                                             int64_t n, int64_t rank, int64_t j,
                                                             int64_t w, const int data_bf16,
                                                             const int weight_bf16) {
    float acc[PS_LORA_COLS];
#pragma omp simd
    for (int64_t c = 0; c < w; c++) acc[c] = 0.0f;
    for (int64_t r = 0; r < rank; r++) {
        float hv = h[r];
#pragma omp simd
        for (int64_t c = 0; c < w; c++) acc[c] = PS_FMA(hv, ps_load(bt, r * n + j + c, weight_bf16), acc[c]);
    }
#pragma omp simd
    for (int64_t c = 0; c < w; c++) ps_store(out, j + c, ps_load(out, j + c, data_bf16) + acc[c], data_bf16);
}

/* As the AVX-512 expand_block, one row at a time (the tile's Bt columns stay in L1 across the
 * rows). */
static inline __attribute__((always_inline)) void expand_block(const lora_job *job, int64_t first,
                                                               int64_t rows, int64_t rank, const char *bt,
                                                               int64_t j, int64_t cols, const char *pf,
                                                               const int data_bf16, const int weight_bf16) {
    const int64_t data_elem = data_bf16 ? 2 : 4;
    (void)pf;
    for (int64_t i = first; i < first + rows; i++) {
        char *out = (char *)job->out + job->order[i] * job->out_stride * data_elem;
        const float *h = job->h + i * job->max_rank;
        if (cols == PS_LORA_COLS) expand_row(out, h, bt, job->n, rank, j, PS_LORA_COLS, data_bf16, weight_bf16);
        else expand_row(out, h, bt, job->n, rank, j, cols, data_bf16, weight_bf16);
    }
}

#define PS_LORA_VEC 8

#endif

/* This thread's share of the shrink: the (slot, block of A rows, group of the slot's rows) items
 * whose midpoint, in the running sum of their cost (rows x A rows), falls in its 1/threads of the
 * total. An item's rows go through its block PS_LORA_ROWS at a time (all at once where the slot
 * has at most two); groups of PS_LORA_ROW_GROUP rows give many threads work on a long prefill. */
static inline __attribute__((always_inline)) void shrink_part(const lora_job *job, int p, int threads,
                                                              const int data_bf16, const int weight_bf16) {
    const int64_t data_elem = data_bf16 ? 2 : 4, weight_elem = weight_bf16 ? 2 : 4, k = job->k;
    int64_t done = 0;
    for (int64_t s = 0; s < job->slots; s++) {
        int64_t first = job->start[s], end = job->start[s + 1], rank = job->ranks[s];
        if (end == first || rank == 0) continue;
        int64_t rb = rank_block(end - first);
        for (int64_t r0 = 0; r0 < rank; r0 += rb) {
            int64_t valid = rank - r0 < rb ? rank - r0 : rb;
            const char *a = (const char *)job->lora_a + (s * job->max_rank + r0) * k * weight_elem;
            for (int64_t g = first; g < end; g += PS_LORA_ROW_GROUP) {
                int64_t g_end = end - g < PS_LORA_ROW_GROUP ? end : g + PS_LORA_ROW_GROUP;
                int64_t cost = (g_end - g) * valid;
                int owner = (int)((2 * done + cost) * threads / (2 * job->shrink_rows));
                done += cost;
                if (owner != p) continue;
                for (int64_t i = g; i < g_end; i += PS_LORA_ROWS) {
                    const char *xr[PS_LORA_ROWS];
                    int64_t tb = g_end - i < PS_LORA_ROWS ? g_end - i : PS_LORA_ROWS;
                    for (int64_t t = 0; t < tb; t++)
                        xr[t] = (const char *)job->x + job->order[i + t] * job->x_stride * data_elem;
                    float *h = job->h + i * job->max_rank + r0;
#define PS_SHRINK_CASE(RB, TB)                                                                     \
    if (rb == RB && tb == TB) {                                                                    \
        shrink_tile(h, job->max_rank, xr, a, k, valid, RB, TB, data_bf16, weight_bf16);            \
        continue;                                                                                  \
    }
                    PS_SHRINK_CASE(8, 1) PS_SHRINK_CASE(8, 2)
                    PS_SHRINK_CASE(4, 1) PS_SHRINK_CASE(4, 2) PS_SHRINK_CASE(4, 3) PS_SHRINK_CASE(4, 4)
#undef PS_SHRINK_CASE
                }
            }
        }
    }
}

/* The first slot from s on with rows to update (slots if none). */
static inline int64_t next_slot(const lora_job *job, int64_t s) {
    while (s < job->slots && (job->start[s + 1] == job->start[s] || job->ranks[s] == 0)) s++;
    return s;
}

/* This thread's share of the expand: the columns [c0, c1), an even share of n's vectors, for
 * every adapted row, in tiles of PS_LORA_COLS columns, each prefetching the next. */
static inline __attribute__((always_inline)) void expand_part(const lora_job *job, int p, int threads,
                                                              const int data_bf16, const int weight_bf16) {
    const int64_t weight_elem = weight_bf16 ? 2 : 4, n = job->n;
    const int64_t slot_bytes = job->max_rank * n * weight_elem;
    int64_t vecs = (n + PS_LORA_VEC - 1) / PS_LORA_VEC;
    int64_t c0 = vecs * p / threads * PS_LORA_VEC, c1 = vecs * (p + 1) / threads * PS_LORA_VEC;
    c1 = c1 < n ? c1 : n;
    if (c0 >= c1) return;
    for (int64_t s = next_slot(job, 0); s < job->slots;) {
        int64_t next = next_slot(job, s + 1);
        const char *bt = (const char *)job->lora_b_t + s * slot_bytes;
        for (int64_t j = c0; j < c1; j += PS_LORA_COLS) {
            const char *pf = j + PS_LORA_COLS < c1 ? bt + (j + PS_LORA_COLS) * weight_elem
                             : next < job->slots ? (const char *)job->lora_b_t + next * slot_bytes + c0 * weight_elem
                                                 : NULL;
            int64_t cols = c1 - j < PS_LORA_COLS ? c1 - j : PS_LORA_COLS;
            expand_block(job, job->start[s], job->start[s + 1] - job->start[s], job->ranks[s], bt, j,
                         cols, pf, data_bf16, weight_bf16);
        }
        s = next;
    }
}

/* Thread p of `threads`: its shrink, the barrier (the expand reads every thread's h), its expand. */
static inline __attribute__((always_inline)) void lora_part(const lora_job *job, int p, int threads,
                                                            const int data_bf16, const int weight_bf16) {
    shrink_part(job, p, threads, data_bf16, weight_bf16);
    if (threads > 1) {
#pragma omp barrier
    }
    expand_part(job, p, threads, data_bf16, weight_bf16);
}

/* Every (data, weight) combination, each with literal flags (see PS_ROW_DISPATCH in norm_act.c). */
#define PS_LORA_DISPATCH(fn, ...)                                                           \
    do {                                                                                    \
        if (dtypes & PS_BF16_DATA) {                                                        \
            if (dtypes & PS_BF16_WEIGHT) fn(__VA_ARGS__, 1, 1);                             \
            else fn(__VA_ARGS__, 1, 0);                                                     \
        } else if (dtypes & PS_BF16_WEIGHT) fn(__VA_ARGS__, 0, 1);                          \
        else fn(__VA_ARGS__, 0, 0);                                                         \
    } while (0)

/* All of a call's work, on `threads` threads (one parallel region), or on this one. */
static void lora_run(const lora_job *job, int dtypes, int threads) {
    if (threads <= 1) {
        PS_LORA_DISPATCH(lora_part, job, 0, 1);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
#if defined(_OPENMP)
        int p = omp_get_thread_num(), team = omp_get_num_threads();
#else
        int p = 0, team = 1;
#endif
        PS_LORA_DISPATCH(lora_part, job, p, team);
    }
}

int ps_lora_delta(void *out, int64_t out_stride, const void *x, int64_t x_stride,
                  const int32_t *token_slots, const void *lora_a, const void *lora_b_t,
                  const int32_t *ranks, int64_t tokens, int64_t k, int64_t n, int64_t slots,
                  int64_t max_rank, int dtypes, void *scratch, int num_threads) {
    for (int64_t s = 0; s < slots; s++)
        if (ranks[s] < 0 || ranks[s] > max_rank) return PS_BAD_LORA;
    for (int64_t t = 0; t < tokens; t++)
        if (token_slots[t] < -1 || token_slots[t] >= slots) return PS_BAD_LORA;
    if (tokens <= 0 || n <= 0 || slots <= 0 || max_rank <= 0) return PS_OK;

    _Alignas(64) unsigned char local[PS_LORA_STACK_SCRATCH];
    void *owned = NULL;
    size_t bytes = ps_lora_scratch_bytes(tokens, slots, max_rank);
    if (!scratch) scratch = bytes <= sizeof local ? (void *)local : (owned = malloc(bytes));
    if (!scratch) return PS_OUT_OF_MEMORY;
    int64_t *start = scratch, *order = start + slots + 1;

    memset(start, 0, (size_t)(slots + 1) * sizeof *start);
    for (int64_t t = 0; t < tokens; t++)
        if (token_slots[t] >= 0) start[token_slots[t] + 1]++;
    int64_t shrink_rows = 0; /* rows x rank, summed: the work both steps scale with */
    for (int64_t s = 0; s < slots; s++) {
        shrink_rows += start[s + 1] * ranks[s];
        start[s + 1] += start[s];
    }
    for (int64_t t = 0; t < tokens; t++)  /* start[s] walks to slot s's end ... */
        if (token_slots[t] >= 0) order[start[token_slots[t]]++] = t;
    for (int64_t s = slots; s > 0; s--) start[s] = start[s - 1];  /* ... and back to its start */
    start[0] = 0;

    if (shrink_rows > 0) {
        lora_job job = {.out = out, .x = x, .lora_a = lora_a, .lora_b_t = lora_b_t, .ranks = ranks,
                        .start = start, .order = order, .h = (float *)(order + tokens),
                        .out_stride = out_stride, .x_stride = x_stride, .k = k, .n = n,
                        .slots = slots, .max_rank = max_rank, .shrink_rows = shrink_rows};
        lora_run(&job, dtypes, ps_threads(shrink_rows * (k + n), PS_LORA_GRAIN, num_threads));
    }
    free(owned);
    return PS_OK;
}

/* The entry point: ps_lora_delta with scratch of its own. */
int pagedserve_lora_delta(void *out, int64_t out_stride, const void *x, int64_t x_stride,
                          const int32_t *token_slots, const void *lora_a, const void *lora_b_t,
                          const int32_t *ranks, int64_t tokens, int64_t k, int64_t n, int64_t slots,
                          int64_t max_rank, int dtypes, int num_threads) {
    return ps_lora_delta(out, out_stride, x, x_stride, token_slots, lora_a, lora_b_t, ranks, tokens,
                         k, n, slots, max_rank, dtypes, NULL, num_threads);
}
