// Host-side interface of the AscendC advance_step_flashattn kernel.
//
// Semantics (DESIGN.md section 5), all tensors contiguous, in device memory:
//   for i < num_queries:
//     input_tokens[i]    = sampled_token_ids[i]                       (int64)
//     pos                = seq_lens[i]                                (int32)
//     seq_lens[i]        = pos + 1
//     input_positions[i] = pos                                        (int64)
//     slot_mapping[i]    = block_tables[i * bt_stride + pos / block_size] * block_size
//                          + pos % block_size                         (int64)
//   for num_queries <= i < num_seqs (graph padding rows):
//     input_tokens[i] = 0, input_positions[i] = 0, slot_mapping[i] = -1, seq_lens untouched.
//
// The rows are tiled across AI cores: core b handles rows
// [b * rows_per_core, min((b + 1) * rows_per_core, num_seqs)). Use
// AdvStepFlashTiling() to pick block_dim and rows_per_core.
#ifndef OPMUX_CSRC_ASCENDC_ADV_STEP_FLASH_H_
#define OPMUX_CSRC_ASCENDC_ADV_STEP_FLASH_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Rows per core are a multiple of this, so every core's first row starts on a
// 32-byte boundary for the int32 arrays and a 64-byte boundary for int64 ones.
#define OPMUX_ADV_STEP_ROW_ALIGN 8
// Below this many rows per core, extra cores cost more in launch than they save.
#define OPMUX_ADV_STEP_MIN_ROWS_PER_CORE 64

// Launches the kernel on `stream` (an aclrtStream) with `block_dim` cores.
// Pointers are device addresses. Returns immediately (asynchronous launch).
void AdvStepFlashKernelEntry(uint32_t block_dim, void *stream, uint8_t *sampled_token_ids,
                             uint8_t *seq_lens, uint8_t *block_tables, uint8_t *input_tokens,
                             uint8_t *input_positions, uint8_t *slot_mapping, int32_t num_seqs,
                             int32_t num_queries, int32_t block_size, int64_t block_tables_stride,
                             int32_t rows_per_core);

// Splits num_seqs rows over at most max_cores cores (max_cores >= 1).
static inline void AdvStepFlashTiling(int32_t num_seqs, uint32_t max_cores, uint32_t *block_dim,
                                      int32_t *rows_per_core) {
  int64_t per_core = OPMUX_ADV_STEP_MIN_ROWS_PER_CORE;
  int64_t cores = (num_seqs + per_core - 1) / per_core;
  if (cores > (int64_t)max_cores) {
    cores = (int64_t)max_cores;
    per_core = (num_seqs + cores - 1) / cores;
    per_core = (per_core + OPMUX_ADV_STEP_ROW_ALIGN - 1) / OPMUX_ADV_STEP_ROW_ALIGN *
               OPMUX_ADV_STEP_ROW_ALIGN;
  }
  if (cores < 1) {
    cores = 1;
  }
  *block_dim = (uint32_t)cores;
  *rows_per_core = (int32_t)per_core;
}

#ifdef __cplusplus
}
#endif

#endif  // OPMUX_CSRC_ASCENDC_ADV_STEP_FLASH_H_
