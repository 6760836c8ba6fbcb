// reshape_and_cache (scatter new keys/values into the paged cache) and advance_step_flashattn
// (in-place metadata update between decode steps). Both validate every argument, and every
// index they will use, before writing anything.
#include "kernels.h"
#include "op_library.h"
#include "vec_common.h"

#include <cstring>

namespace opmux_cpu {

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping) {
#define RC_CHECK(cond, ...) OPMUX_CHECK("reshape_and_cache", cond, __VA_ARGS__)
  RC_CHECK(key.dim() == 3 && value.sizes() == key.sizes(),
           "key and value must both be [T, Hkv, D], got ", key.sizes(), " and ", value.sizes());
  RC_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
           "key_cache and value_cache must both be [B, bs, Hkv, D], got ", key_cache.sizes(),
           " and ", value_cache.sizes());
  RC_CHECK(key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2),
           "cache heads/head size ", key_cache.sizes(), " do not match key ", key.sizes());
  const auto dtype = key_cache.scalar_type();
  RC_CHECK(key.scalar_type() == dtype && value.scalar_type() == dtype &&
               value_cache.scalar_type() == dtype,
           "key, value, key_cache and value_cache must share a dtype, got ", key.scalar_type(),
           ", ", value.scalar_type(), ", ", dtype, ", ", value_cache.scalar_type());
  // any cache strides (NHD/HND views, K and V as two views of one buffer) as long as a head's
  // D elements are contiguous
  RC_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
           "key_cache and value_cache must be contiguous in the head dim, got strides ",
           key_cache.strides(), " and ", value_cache.strides());
  RC_CHECK(key.stride(2) == 1 && value.stride(2) == 1,
           "key and value must be contiguous in the head dim, got strides ", key.strides(),
           " and ", value.strides());
  RC_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong &&
               slot_mapping.size(0) == key.size(0),
           "slot_mapping must be int64 [", key.size(0), "], got ", slot_mapping.scalar_type(),
           " ", slot_mapping.sizes());
  const int64_t T = key.size(0);
  const int64_t hkv = key.size(1);
  const int64_t d = key.size(2);
  const int64_t bs = key_cache.size(1);
  RC_CHECK(bs > 0, "block_size (key_cache dim 1) must be positive, got ", key_cache.sizes());
  const int64_t n_slots = key_cache.size(0) * bs;
  // slot_mapping may be any 1-d view (a column of a [T, 2] tensor, an expanded scalar)
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t ss = slot_mapping.stride(0);
  for (int64_t t = 0; t < T; ++t) {
    RC_CHECK(slots[t * ss] >= -1 && slots[t * ss] < n_slots, "slot_mapping[", t, "] = ",
             slots[t * ss], " is outside [-1, ", n_slots, ")");
  }
#undef RC_CHECK
  const int64_t elt = key.element_size();
  const auto* k = static_cast<const char*>(key.const_data_ptr());
  const auto* v = static_cast<const char*>(value.const_data_ptr());
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t ks0 = key.stride(0) * elt, ks1 = key.stride(1) * elt;
  const int64_t vs0 = value.stride(0) * elt, vs1 = value.stride(1) * elt;
  const int64_t row = d * elt;
  const int64_t kcb = key_cache.stride(0) * elt, kco = key_cache.stride(1) * elt,
                kch = key_cache.stride(2) * elt;
  const int64_t vcb = value_cache.stride(0) * elt, vco = value_cache.stride(1) * elt,
                vch = value_cache.stride(2) * elt;
  // one memcpy per token when both sides hold the token's Hkv rows back to back
  const bool k_packed = (hkv == 1 || (key.stride(1) == d && key_cache.stride(2) == d));
  const bool v_packed = (hkv == 1 || (value.stride(1) == d && value_cache.stride(2) == d));
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = slots[t * ss];
      if (s < 0) continue;
      char* kdst = kc + (s / bs) * kcb + (s % bs) * kco;
      char* vdst = vc + (s / bs) * vcb + (s % bs) * vco;
      if (k_packed) {
        std::memcpy(kdst, k + t * ks0, hkv * row);
      } else {
        for (int64_t h = 0; h < hkv; ++h) std::memcpy(kdst + h * kch, k + t * ks0 + h * ks1, row);
      }
      if (v_packed) {
        std::memcpy(vdst, v + t * vs0, hkv * row);
      } else {
        for (int64_t h = 0; h < hkv; ++h) std::memcpy(vdst + h * vch, v + t * vs0 + h * vs1, row);
      }
    }
  });
}

void advance_step_flashattn(int64_t num_seqs, int64_t num_queries, int64_t block_size,
                            at::Tensor& input_tokens, const at::Tensor& sampled_token_ids,
                            at::Tensor& input_positions, at::Tensor& seq_lens,
                            at::Tensor& slot_mapping, const at::Tensor& block_tables) {
#define AS_CHECK(cond, ...) OPMUX_CHECK("advance_step_flashattn", cond, __VA_ARGS__)
  AS_CHECK(num_seqs >= 0 && num_queries >= 0 && num_queries <= num_seqs,
           "need 0 <= num_queries <= num_seqs, got num_queries=", num_queries,
           ", num_seqs=", num_seqs);
  AS_CHECK(block_size > 0, "block_size must be positive, got ", block_size);
  auto check_1d = [&](const at::Tensor& t, const char* name, at::ScalarType dtype) {
    AS_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
    AS_CHECK(t.is_contiguous(), name, " must be contiguous");
    AS_CHECK(t.dim() >= 1 && t.size(0) == num_seqs, name, " must have first dim num_seqs=",
             num_seqs, ", got ", t.sizes());
  };
  check_1d(input_tokens, "input_tokens", at::kLong);
  check_1d(input_positions, "input_positions", at::kLong);
  check_1d(seq_lens, "seq_lens", at::kInt);
  check_1d(slot_mapping, "slot_mapping", at::kLong);
  // block_tables and sampled_token_ids are read through their strides (any view)
  AS_CHECK(block_tables.scalar_type() == at::kInt, "block_tables must be ", at::kInt, ", got ",
           block_tables.scalar_type());
  AS_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
           "block_tables must be [num_seqs=", num_seqs, ", max_blocks], got ",
           block_tables.sizes());
  AS_CHECK(sampled_token_ids.scalar_type() == at::kLong, "sampled_token_ids must be ",
           at::kLong, ", got ", sampled_token_ids.scalar_type());
  AS_CHECK((sampled_token_ids.dim() == 1 && sampled_token_ids.size(0) == num_queries) ||
               (sampled_token_ids.dim() == 2 && sampled_token_ids.size(0) >= num_queries &&
                sampled_token_ids.size(1) == 1),
           "sampled_token_ids must be [num_queries=", num_queries, ", 1], got ",
           sampled_token_ids.sizes());
  const int64_t m = block_tables.size(1);
  const int64_t bt0 = block_tables.stride(0), bt1 = block_tables.stride(1);
  int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.const_data_ptr<int32_t>();
  for (int64_t i = 0; i < num_queries; ++i) {
    AS_CHECK(lens[i] >= 0 && lens[i] / block_size < m, "seq_lens[", i, "] = ", lens[i],
             " needs block ", lens[i] / block_size, " but block_tables has ", m, " columns");
    const int32_t blk = bt[i * bt0 + (lens[i] / block_size) * bt1];
    AS_CHECK(blk >= 0, "block_tables[", i, ", ", lens[i] / block_size, "] = ", blk,
             " (the block of the next position) must be a non-negative block id");
  }
#undef AS_CHECK
  int64_t* tokens = input_tokens.data_ptr<int64_t>();
  int64_t* positions = input_positions.data_ptr<int64_t>();
  int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t* sampled = sampled_token_ids.const_data_ptr<int64_t>();
  const int64_t sampled_stride = sampled_token_ids.stride(0);
  for (int64_t i = 0; i < num_queries; ++i) {
    const int64_t pos = lens[i];
    tokens[i] = sampled[i * sampled_stride];
    lens[i] = static_cast<int32_t>(pos + 1);
    positions[i] = pos;
    slots[i] = static_cast<int64_t>(bt[i * bt0 + (pos / block_size) * bt1]) * block_size +
               pos % block_size;
  }
  for (int64_t i = num_queries; i < num_seqs; ++i) {
    tokens[i] = 0;
    positions[i] = 0;
    slots[i] = -1;
  }
}

// This file's ops in torch.ops.opmux_cpu (op_library.h).
TORCH_LIBRARY_FRAGMENT(opmux_cpu, m) {
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor slot_mapping) -> ()",
      cpu_kernel(&reshape_and_cache));
  m.def(
      "advance_step_flashattn(int num_seqs, int num_queries, int block_size, "
      "Tensor(a!) input_tokens, Tensor sampled_token_ids, Tensor(b!) input_positions, "
      "Tensor(c!) seq_lens, Tensor(d!) slot_mapping, Tensor block_tables) -> ()",
      cpu_kernel(&advance_step_flashattn));
}

}  // namespace opmux_cpu
