// opmux CUDA kernels: declarations shared by the kernel files and the binding file.
// Inputs are `const &`; tensors written in place are `&` and marked `(a!)` in the schemas
// of bindings.cpp.
#pragma once

#include <ATen/ATen.h>

namespace opmux_cuda {

// silu(x[..., :d]) * x[..., d:] -> [..., d]; fp32 math, one rounding.
at::Tensor silu_and_mul(const at::Tensor& x);

// x * rsqrt(mean(x^2, -1) + eps) * weight in fp32, returned in x.dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// key/value [T, Hkv, D] -> caches [blocks, block_size, Hkv, D] at slot_mapping[t] (int64);
// slot -1 is skipped.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping);

// One decode step of bookkeeping, in place (DESIGN.md section 5).
void advance_step_flashattn(int64_t num_seqs, int64_t num_queries, int64_t block_size,
                            at::Tensor& input_tokens, const at::Tensor& sampled_token_ids,
                            at::Tensor& input_positions, at::Tensor& seq_lens,
                            at::Tensor& slot_mapping, const at::Tensor& block_tables);

}  // namespace opmux_cuda
