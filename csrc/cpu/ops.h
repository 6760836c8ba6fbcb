// Declarations of the opmux CPU kernels. Inputs are const references; outputs and in-place
// arguments are mutable references (the schema in bindings.cpp marks them Tensor(a!)).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace opmux_cpu {

void rms_norm_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);

void fused_add_rms_norm_out(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& x,
                            const at::Tensor& residual, const at::Tensor& weight, double eps);

void silu_and_mul_out(at::Tensor& out, const at::Tensor& x);

void gelu_and_mul_out(at::Tensor& out, const at::Tensor& x, const std::string& approximate);

void rotary_embedding_out(at::Tensor& query_out, at::Tensor& key_out,
                          const at::Tensor& positions, const at::Tensor& query,
                          const at::Tensor& key, const at::Tensor& cos_sin_cache,
                          int64_t head_size, bool is_neox);

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping);

// sliding_window <= 0 and soft_cap <= 0 mean "none".
void paged_attention_out(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                         double scale, int64_t sliding_window, double soft_cap);

void advance_step_flashattn(int64_t num_seqs, int64_t num_queries, int64_t block_size,
                            at::Tensor& input_tokens, const at::Tensor& sampled_token_ids,
                            at::Tensor& input_positions, at::Tensor& seq_lens,
                            at::Tensor& slot_mapping, const at::Tensor& block_tables);

// vLLM's other activation rows (activation_more.cpp).
void fatrelu_and_mul_out(at::Tensor& out, const at::Tensor& x, double threshold);
void mul_and_silu_out(at::Tensor& out, const at::Tensor& x);
void swigluoai_and_mul_out(at::Tensor& out, const at::Tensor& x, double alpha, double limit);
void gelu_and_mul_sparse_out(at::Tensor& out, const at::Tensor& x, double std_multiplier,
                             const std::string& approximate);
void gelu_new_out(at::Tensor& out, const at::Tensor& x);
void gelu_fast_out(at::Tensor& out, const at::Tensor& x);
void quick_gelu_out(at::Tensor& out, const at::Tensor& x);
void relu2_out(at::Tensor& out, const at::Tensor& x);
void xielu_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& alpha_p,
               const at::Tensor& alpha_n, double beta, double eps);
void apply_rotary_emb_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& cos,
                          const at::Tensor& sin, bool is_neox);

void dual_chunk_rotary_embedding_out(
    at::Tensor& query_out, at::Tensor& key_out, const at::Tensor& positions,
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& q_cache,
    const at::Tensor& qc_cache, const at::Tensor& k_cache, const at::Tensor& qc_no_clamp_cache,
    const at::Tensor& q_inter_cache, int64_t head_size, bool is_neox,
    const std::optional<at::Tensor>& offsets);
// Gemma norms (weight + 1) and the gated norm; weight is x's dtype or float32. group_size <= 0
// means one group per row; sigmoid selects the gate activation (else SiLU).
void gemma_rms_norm_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                        double eps);

void gemma_fused_add_rms_norm_out(at::Tensor& out, at::Tensor& residual_out,
                                  const at::Tensor& x, const at::Tensor& residual,
                                  const at::Tensor& weight, double eps);

void rms_norm_gated_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& z, double eps, int64_t group_size,
                        bool norm_before_gate, bool sigmoid);

// FP8 (e4m3fn) quantisation. Static: scale is float32 [a, b] tiling x's last two dims.
void quant_fp8_static_out(at::Tensor& q, const at::Tensor& x, const at::Tensor& scale);

void quant_fp8_dynamic_out(at::Tensor& q, at::Tensor& scale_out, const at::Tensor& x,
                           bool per_token, const std::optional<at::Tensor>& scale_ub);

void quant_fp8_group_out(at::Tensor& q, at::Tensor& scale_out, const at::Tensor& x,
                         int64_t group_size, bool use_ue8m0);

// Encoder attention and MLA (attention_extra.cpp, issue 14).
void encoder_attention_out(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& cu_seqlens, double scale);
void concat_and_cache_mla(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& kv_cache,
                          const at::Tensor& slot_mapping);
void mla_latent_attention_out(at::Tensor& out, const at::Tensor& q_lat,
                              const at::Tensor& kv_cache, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                              double scale);
// State-space kernels (ssm.cpp). Without query_start_loc every row is its own sequence
// (decode) and starts from its slot's state; slot -1 is padding.
void causal_conv1d_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, at::Tensor& conv_states,
                       const std::optional<at::Tensor>& query_start_loc,
                       const std::optional<at::Tensor>& cache_indices,
                       const std::optional<at::Tensor>& has_initial_state, bool silu);
void selective_scan_out(at::Tensor& out, const at::Tensor& u, at::Tensor& ssm_states,
                        const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                        const at::Tensor& C, const std::optional<at::Tensor>& D,
                        const std::optional<at::Tensor>& z,
                        const std::optional<at::Tensor>& delta_bias, bool delta_softplus,
                        const std::optional<at::Tensor>& query_start_loc,
                        const std::optional<at::Tensor>& cache_indices,
                        const std::optional<at::Tensor>& has_initial_state);

// Mamba-2 SSD scan (ssd.cpp): prefill over query_start_loc, or decode (one token per slot)
// when query_start_loc is None. dt_max < 0 means no upper clamp.
void ssd_scan_out(at::Tensor& out, at::Tensor& ssm_state, const at::Tensor& x,
                  const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                  const at::Tensor& C, const std::optional<at::Tensor>& D,
                  const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& dt_bias,
                  const at::Tensor& state_indices,
                  const std::optional<at::Tensor>& query_start_loc,
                  const std::optional<at::Tensor>& has_initial_state, bool dt_softplus,
                  double dt_min, double dt_max);

}  // namespace opmux_cpu
