// The one binding file of the opmux CPU kernels: schemas (with mutation annotations) and the
// CPU implementations, in the torch.ops.opmux_cpu namespace.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(opmux_cpu, m) {
  m.def("rms_norm_out(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def(
      "fused_add_rms_norm_out(Tensor(a!) out, Tensor(b!) residual_out, Tensor x, "
      "Tensor residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul_out(Tensor(a!) out, Tensor x) -> ()");
  m.def("gelu_and_mul_out(Tensor(a!) out, Tensor x, str approximate) -> ()");
  m.def(
      "rotary_embedding_out(Tensor(a!) query_out, Tensor(b!) key_out, Tensor positions, "
      "Tensor query, Tensor key, Tensor cos_sin_cache, int head_size, bool is_neox) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention_out(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
      "int sliding_window, float soft_cap) -> ()");
  m.def(
      "advance_step_flashattn(int num_seqs, int num_queries, int block_size, "
      "Tensor(a!) input_tokens, Tensor sampled_token_ids, Tensor(b!) input_positions, "
      "Tensor(c!) seq_lens, Tensor(d!) slot_mapping, Tensor block_tables) -> ()");
  m.def("fatrelu_and_mul_out(Tensor(a!) out, Tensor x, float threshold) -> ()");
  m.def("mul_and_silu_out(Tensor(a!) out, Tensor x) -> ()");
  m.def("swigluoai_and_mul_out(Tensor(a!) out, Tensor x, float alpha, float limit) -> ()");
  m.def(
      "gelu_and_mul_sparse_out(Tensor(a!) out, Tensor x, float std_multiplier, "
      "str approximate) -> ()");
  m.def("gelu_new_out(Tensor(a!) out, Tensor x) -> ()");
  m.def("gelu_fast_out(Tensor(a!) out, Tensor x) -> ()");
  m.def("quick_gelu_out(Tensor(a!) out, Tensor x) -> ()");
  m.def("relu2_out(Tensor(a!) out, Tensor x) -> ()");
  m.def(
      "xielu_out(Tensor(a!) out, Tensor x, Tensor alpha_p, Tensor alpha_n, float beta, "
      "float eps) -> ()");
  m.def(
      "apply_rotary_emb_out(Tensor(a!) out, Tensor x, Tensor cos, Tensor sin, "
      "bool is_neox) -> ()");
  m.def(
      "dual_chunk_rotary_embedding_out(Tensor(a!) query_out, Tensor(b!) key_out, "
      "Tensor positions, Tensor query, Tensor key, Tensor q_cache, Tensor qc_cache, "
      "Tensor k_cache, Tensor qc_no_clamp_cache, Tensor q_inter_cache, int head_size, "
      "bool is_neox, Tensor? offsets) -> ()");
  m.def("gemma_rms_norm_out(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def(
      "gemma_fused_add_rms_norm_out(Tensor(a!) out, Tensor(b!) residual_out, Tensor x, "
      "Tensor residual, Tensor weight, float eps) -> ()");
  m.def(
      "rms_norm_gated_out(Tensor(a!) out, Tensor x, Tensor weight, Tensor? z, float eps, "
      "int group_size, bool norm_before_gate, bool sigmoid) -> ()");
  m.def("quant_fp8_static_out(Tensor(a!) q, Tensor x, Tensor scale) -> ()");
  m.def(
      "quant_fp8_dynamic_out(Tensor(a!) q, Tensor(b!) scale_out, Tensor x, bool per_token, "
      "Tensor? scale_ub) -> ()");
  m.def(
      "quant_fp8_group_out(Tensor(a!) q, Tensor(b!) scale_out, Tensor x, int group_size, "
      "bool use_ue8m0) -> ()");
  m.def(
      "encoder_attention_out(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, "
      "float scale) -> ()");
  m.def(
      "concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "mla_latent_attention_out(Tensor(a!) out, Tensor q_lat, Tensor kv_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale) -> ()");
  m.def(
      "causal_conv1d_out(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, "
      "Tensor(b!) conv_states, Tensor? query_start_loc, Tensor? cache_indices, "
      "Tensor? has_initial_state, bool silu) -> ()");
  m.def(
      "selective_scan_out(Tensor(a!) out, Tensor u, Tensor(b!) ssm_states, Tensor delta, "
      "Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? delta_bias, "
      "bool delta_softplus, Tensor? query_start_loc, Tensor? cache_indices, "
      "Tensor? has_initial_state) -> ()");
  m.def(
      "ssd_scan_out(Tensor(a!) out, Tensor(b!) ssm_state, Tensor x, Tensor dt, Tensor A, "
      "Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? dt_bias, Tensor state_indices, "
      "Tensor? query_start_loc, Tensor? has_initial_state, bool dt_softplus, float dt_min, "
      "float dt_max) -> ()");
}

TORCH_LIBRARY_IMPL(opmux_cpu, CPU, m) {
  m.impl("rms_norm_out", &opmux_cpu::rms_norm_out);
  m.impl("fused_add_rms_norm_out", &opmux_cpu::fused_add_rms_norm_out);
  m.impl("silu_and_mul_out", &opmux_cpu::silu_and_mul_out);
  m.impl("gelu_and_mul_out", &opmux_cpu::gelu_and_mul_out);
  m.impl("rotary_embedding_out", &opmux_cpu::rotary_embedding_out);
  m.impl("reshape_and_cache", &opmux_cpu::reshape_and_cache);
  m.impl("paged_attention_out", &opmux_cpu::paged_attention_out);
  m.impl("advance_step_flashattn", &opmux_cpu::advance_step_flashattn);
  m.impl("fatrelu_and_mul_out", &opmux_cpu::fatrelu_and_mul_out);
  m.impl("mul_and_silu_out", &opmux_cpu::mul_and_silu_out);
  m.impl("swigluoai_and_mul_out", &opmux_cpu::swigluoai_and_mul_out);
  m.impl("gelu_and_mul_sparse_out", &opmux_cpu::gelu_and_mul_sparse_out);
  m.impl("gelu_new_out", &opmux_cpu::gelu_new_out);
  m.impl("gelu_fast_out", &opmux_cpu::gelu_fast_out);
  m.impl("quick_gelu_out", &opmux_cpu::quick_gelu_out);
  m.impl("relu2_out", &opmux_cpu::relu2_out);
  m.impl("xielu_out", &opmux_cpu::xielu_out);
  m.impl("apply_rotary_emb_out", &opmux_cpu::apply_rotary_emb_out);
  m.impl("dual_chunk_rotary_embedding_out", &opmux_cpu::dual_chunk_rotary_embedding_out);
  m.impl("gemma_rms_norm_out", &opmux_cpu::gemma_rms_norm_out);
  m.impl("gemma_fused_add_rms_norm_out", &opmux_cpu::gemma_fused_add_rms_norm_out);
  m.impl("rms_norm_gated_out", &opmux_cpu::rms_norm_gated_out);
  m.impl("quant_fp8_static_out", &opmux_cpu::quant_fp8_static_out);
  m.impl("quant_fp8_dynamic_out", &opmux_cpu::quant_fp8_dynamic_out);
  m.impl("quant_fp8_group_out", &opmux_cpu::quant_fp8_group_out);
  m.impl("encoder_attention_out", &opmux_cpu::encoder_attention_out);
  m.impl("concat_and_cache_mla", &opmux_cpu::concat_and_cache_mla);
  m.impl("mla_latent_attention_out", &opmux_cpu::mla_latent_attention_out);
  m.impl("causal_conv1d_out", &opmux_cpu::causal_conv1d_out);
  m.impl("selective_scan_out", &opmux_cpu::selective_scan_out);
  m.impl("ssd_scan_out", &opmux_cpu::ssd_scan_out);
}
