// The kernels one C++ file calls from another (each defined, checked and registered as an op in
// its own file, which includes this header so that the compiler holds the two to one
// signature; these are the plain functions behind those ops).
#pragma once

#include <ATen/ATen.h>

namespace opmux_cpu {

void rms_norm_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm_out(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& x,
                            const at::Tensor& residual, const at::Tensor& weight, double eps);
void rotary_embedding_out(at::Tensor& query_out, at::Tensor& key_out,
                          const at::Tensor& positions, const at::Tensor& query,
                          const at::Tensor& key, const at::Tensor& cos_sin_cache,
                          int64_t head_size, bool is_neox);
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping);
void paged_attention_out(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                         double scale, int64_t sliding_window, double soft_cap);
void silu_and_mul_out(at::Tensor& out, const at::Tensor& x);
void linear_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                const c10::optional<at::Tensor>& bias, bool huge_pages);

}  // namespace opmux_cpu
