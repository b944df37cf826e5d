/* The batched multi-LoRA delta (csrc/lora.c) as other kernels' files call it: the fused decoder
 * loop (csrc/decoder_layers.c) adds each projection's adapters with it, passing no scratch: the
 * kernel keeps a decode step's on its stack, so a step allocates nothing. */
#ifndef PAGEDSERVE_LORA_H
#define PAGEDSERVE_LORA_H

#include <stddef.h>
#include <stdint.h>

/* Bytes of scratch ps_lora_delta needs for `tokens` rows, `slots` adapters of rank <= max_rank. */
size_t ps_lora_scratch_bytes(int64_t tokens, int64_t slots, int64_t max_rank);

/* out[t, :n] += (lora_a[s, :r] . x[t, :k]) . lora_b_t[s, :r] for each row t with s =
 * token_slots[t] >= 0 (-1: no adapter, row untouched) and r = ranks[s]. x, out: rows `x_stride` /
 * `out_stride` elements apart, bf16 where dtypes has PS_BF16_DATA, else fp32; lora_a [slots,
 * max_rank, k] and lora_b_t [slots, max_rank, n], contiguous, bf16 where PS_BF16_WEIGHT. fp32
 * arithmetic; out rounded once per element. scratch: ps_lora_scratch_bytes() bytes, or NULL to
 * allocate them. Returns PS_BAD_LORA (nothing written) for a slot outside [-1, slots) or a rank
 * outside [0, max_rank], PS_OUT_OF_MEMORY where it cannot allocate. */
int ps_lora_delta(void *out, int64_t out_stride, const void *x, int64_t x_stride,
                  const int32_t *token_slots, const void *lora_a, const void *lora_b_t,
                  const int32_t *ranks, int64_t tokens, int64_t k, int64_t n, int64_t slots,
                  int64_t max_rank, int dtypes, void *scratch, int num_threads);

#endif
