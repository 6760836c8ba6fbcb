// The one binding file of the opmux CUDA kernels: schemas (with `Tensor(a!)` for the tensors
// written in place) and their CUDA implementations, as torch.ops.opmux_cuda.*.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(opmux_cuda, m) {
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "advance_step_flashattn(int num_seqs, int num_queries, int block_size, "
      "Tensor(a!) input_tokens, Tensor sampled_token_ids, Tensor(b!) input_positions, "
      "Tensor(c!) seq_lens, Tensor(d!) slot_mapping, Tensor block_tables) -> ()");
}

TORCH_LIBRARY_IMPL(opmux_cuda, CUDA, m) {
  m.impl("silu_and_mul", &opmux_cuda::silu_and_mul);
  m.impl("rms_norm", &opmux_cuda::rms_norm);
  m.impl("reshape_and_cache", &opmux_cuda::reshape_and_cache);
  m.impl("advance_step_flashattn", &opmux_cuda::advance_step_flashattn);
}
