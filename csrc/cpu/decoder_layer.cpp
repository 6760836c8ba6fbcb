// decoder_layer: one Llama/Qwen2 decoder layer of a few token rows in one call, the kernels of
// the catalog ops its layers run (rms_norm or fused_add_rms_norm, rotary_embedding,
// reshape_and_cache, paged_attention, fused_add_rms_norm, silu_and_mul) and the row kernel
// linear_out for its four projections, called in the order the layers call them, so the
// result is theirs to the bit. Each kernel checks its own arguments before it writes; the
// distinct slots native's reshape_and_cache requires are checked here, before anything is
// written, and so are caches without overlapping elements (reshape_and_cache's kernel does
// not read that condition of native's).
#include "kernels.h"
#include "op_library.h"
#include "vec_common.h"

#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <tuple>
#include <vector>

namespace opmux_cpu {
namespace {

void check_distinct_slots(const at::Tensor& slot_mapping) {
  OPMUX_CHECK("reshape_and_cache",
              slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong,
              "slot_mapping must be a 1-d int64 tensor, got ", slot_mapping.sizes(), " ",
              slot_mapping.scalar_type());
  const auto slots = slot_mapping.accessor<int64_t, 1>();
  std::vector<int64_t> used;
  used.reserve(slots.size(0));
  for (int64_t i = 0; i < slots.size(0); ++i) {
    if (slots[i] >= 0) used.push_back(slots[i]);
  }
  std::sort(used.begin(), used.end());
  OPMUX_CHECK("reshape_and_cache", std::adjacent_find(used.begin(), used.end()) == used.end(),
              "slot_mapping must hold distinct slots (each slot written at most once per "
              "call; -1 may repeat)");
}

at::Tensor rows_of(const at::Tensor& like, int64_t width) {
  return at::empty({like.size(0), width}, like.options());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& hidden, const c10::optional<at::Tensor>& residual,
    const at::Tensor& norm1, double eps1, const at::Tensor& norm2, double eps2,
    const at::Tensor& qkv, const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o,
    const at::Tensor& gate_up, const at::Tensor& down, bool huge_pages,
    const at::Tensor& positions, const at::Tensor& cos_sin_cache, int64_t heads,
    int64_t kv_heads, int64_t head_size, bool is_neox, at::Tensor& key_cache,
    at::Tensor& value_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
    int64_t sliding_window, double soft_cap) {
  OPMUX_CHECK("decoder_layer", hidden.dim() == 2 && heads > 0 && kv_heads > 0 && head_size > 0,
              "expected hidden [T, hidden_size] and positive head counts, got ", hidden.sizes());
  check_distinct_slots(slot_mapping);
  OPMUX_CHECK("reshape_and_cache",
              at::has_internal_overlap(key_cache) != at::MemOverlap::Yes &&
                  at::has_internal_overlap(value_cache) != at::MemOverlap::Yes,
              "key_cache and value_cache must not have elements that overlap");
  const int64_t T = hidden.size(0);
  const int64_t q_width = heads * head_size;
  const int64_t kv_width = kv_heads * head_size;
  OPMUX_CHECK("decoder_layer", qkv.dim() == 2 && qkv.size(0) == q_width + 2 * kv_width,
              "expected a QKV weight of ", q_width + 2 * kv_width, " rows, got ", qkv.size(0));

  at::Tensor x = at::empty_like(hidden);
  at::Tensor res;
  if (residual.has_value()) {
    res = at::empty_like(hidden);
    fused_add_rms_norm_out(x, res, hidden, *residual, norm1, eps1);
  } else {
    rms_norm_out(x, hidden, norm1, eps1);
    res = hidden;
  }
  at::Tensor qkv_out = rows_of(hidden, qkv.size(0));
  linear_out(qkv_out, x, qkv, qkv_bias, huge_pages);
  const at::Tensor v = qkv_out.narrow(1, q_width + kv_width, kv_width);
  at::Tensor q = rows_of(hidden, q_width);
  at::Tensor k = rows_of(hidden, kv_width);
  rotary_embedding_out(q, k, positions, qkv_out.narrow(1, 0, q_width),
                       qkv_out.narrow(1, q_width, kv_width), cos_sin_cache, head_size, is_neox);
  reshape_and_cache(k.view({T, kv_heads, head_size}), v.view({T, kv_heads, head_size}),
                    key_cache, value_cache, slot_mapping);
  at::Tensor attn = rows_of(hidden, q_width);
  at::Tensor attn_heads = attn.view({T, heads, head_size});
  paged_attention_out(attn_heads, q.view({T, heads, head_size}), key_cache, value_cache,
                      block_tables, seq_lens, query_start_loc, scale, sliding_window, soft_cap);
  at::Tensor o_out = rows_of(hidden, o.size(0));
  linear_out(o_out, attn, o, c10::nullopt, huge_pages);
  at::Tensor x2 = at::empty_like(o_out);
  at::Tensor res2 = at::empty_like(o_out);
  fused_add_rms_norm_out(x2, res2, o_out, res, norm2, eps2);
  at::Tensor gate_up_out = rows_of(hidden, gate_up.size(0));
  linear_out(gate_up_out, x2, gate_up, c10::nullopt, huge_pages);
  at::Tensor act = rows_of(hidden, gate_up.size(0) / 2);
  silu_and_mul_out(act, gate_up_out);
  at::Tensor out = rows_of(hidden, down.size(0));
  linear_out(out, act, down, c10::nullopt, huge_pages);
  return {out, res2};
}

TORCH_LIBRARY_FRAGMENT(opmux_cpu, m) {
  m.def("decoder_layer(Tensor hidden, Tensor? residual, Tensor norm1, float eps1, "
        "Tensor norm2, float eps2, Tensor qkv, Tensor? qkv_bias, Tensor o, Tensor gate_up, "
        "Tensor down, bool huge_pages, Tensor positions, Tensor cos_sin_cache, int heads, "
        "int kv_heads, int head_size, bool is_neox, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, int sliding_window, float soft_cap) "
        "-> (Tensor, Tensor)",
        cpu_kernel(&decoder_layer));
}

}  // namespace opmux_cpu
