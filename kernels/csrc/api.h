/* Every entry point of the library, in one place: each kernel's file includes this (through
 * common.h), so its definition is checked against the prototype, and csrc/python_entry.c calls
 * them through it. kernels/native.py declares the same list to ctypes. */
#ifndef PAGEDSERVE_API_H
#define PAGEDSERVE_API_H

#include <stdint.h>

int pagedserve_paged_decode_attention(void *out, const void *query, int64_t query_row_stride,
                                      const void *kv_cache, int64_t num_blocks, int64_t block_size,
                                      const int32_t *block_tables, int64_t table_width,
                                      const int32_t *seq_lens, const int32_t *query_start_loc,
                                      int64_t num_seqs, int64_t num_tokens, int64_t num_heads,
                                      int64_t num_kv_heads, int64_t head_dim, float scale,
                                      int64_t sliding_window, float logits_soft_cap, int dtypes,
                                      int num_threads);
int pagedserve_paged_prefill_attention(void *out, const void *query, int64_t query_row_stride,
                                       const void *kv_cache, int64_t num_blocks, int64_t block_size,
                                       const int32_t *block_tables, int64_t table_width,
                                       const int32_t *seq_lens, const int32_t *query_start_loc,
                                       int64_t num_seqs, int64_t num_tokens, int64_t num_heads,
                                       int64_t num_kv_heads, int64_t head_dim, float scale,
                                       int64_t sliding_window, float logits_soft_cap, int dtypes,
                                       int num_threads);
int pagedserve_argmax_rows(int64_t *out, const void *x, int64_t rows, int64_t n,
                           int64_t row_stride, int dtypes, int num_threads);
int pagedserve_sample_rows(int64_t *out, const void *x, const double *uniforms, const float *scales,
                           int64_t rows, int64_t n, int64_t row_stride, int dtypes, int num_threads);
int pagedserve_rms_norm(void *out, const void *x, const void *weight, int64_t rows, int64_t hidden,
                        float eps, int dtypes, int num_threads);
int pagedserve_fused_add_rms_norm(void *x, void *residual, const void *weight, int64_t rows,
                                  int64_t hidden, float eps, int dtypes, int num_threads);
int pagedserve_silu_and_mul(void *out, const void *x, int64_t rows, int64_t inter, int dtypes,
                            int num_threads);
int pagedserve_rotary_store_kv(void *qkv, int64_t qkv_stride, const void *cos, const void *sin,
                               int64_t cs_stride, const int64_t *slots, void *kv_cache,
                               int64_t num_slots, int64_t num_tokens, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t half, int dtypes,
                               int num_threads);
int pagedserve_linear(float *out, const float *x, int64_t x_stride, const float *packed,
                      const float *bias, int64_t rows, int64_t n, int64_t k, int num_threads);
int pagedserve_linear_panel(void);
int pagedserve_grouped_linear(float *out, const float *x, int64_t x_stride, const float *packed,
                              const int64_t *offsets, int64_t groups, int64_t n, int64_t k,
                              int num_threads);
int pagedserve_linear_bf16(void *out, const void *x, int64_t x_stride, const uint16_t *packed,
                           const void *bias, int dtypes, int64_t rows, int64_t n, int64_t k,
                           int num_threads);
int pagedserve_linear_bf16_panel(void);
int pagedserve_quant_linear(void *out, const void *x, int64_t x_stride, const int64_t *perm,
                            const uint8_t *q, const void *so, const void *bias, int dtypes,
                            int bits, int64_t group_size, int64_t rows, int64_t n, int64_t k,
                            int num_threads);
int pagedserve_quant_linear_panel(void);
int pagedserve_quant_linear_i8(float *out, const float *x, int64_t x_stride, const uint8_t *q,
                               const void *so, int so_f16, const float *bias, int bits,
                               int64_t group_size, int64_t rows, int64_t n, int64_t k,
                               int num_threads);
int pagedserve_quant_linear_i8_panel(void);
int pagedserve_decoder_layers(void *hidden, void *residual, void *scratch, const int64_t *layers,
                              const int64_t *kv_caches, const int64_t *step, const void *cos,
                              const void *sin, const int64_t *slots, const int32_t *block_tables,
                              const int32_t *seq_lens, const int32_t *query_start_loc,
                              const int64_t *lora, float eps, float scale, int num_threads);
int pagedserve_lora_delta(void *out, int64_t out_stride, const void *x, int64_t x_stride,
                          const int32_t *token_slots, const void *lora_a, const void *lora_b_t,
                          const int32_t *ranks, int64_t tokens, int64_t k, int64_t n, int64_t slots,
                          int64_t max_rank, int dtypes, int num_threads);

#endif
