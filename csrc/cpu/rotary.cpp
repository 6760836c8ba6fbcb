// rotary_embedding: functional (writes new query/key tensors), neox (halves) or gptj (pairs)
// rotation of the first `rot` dims of every head; dims rot..head_size are copied through.
#include "op_library.h"
#include "rope_head.h"

namespace opmux_cpu {
namespace {

// Token stride of a [T, H*D] or [T, H, D] tensor whose per-token part is contiguous, or -1.
int64_t token_stride(const at::Tensor& t) {
  if (t.dim() == 2 && t.stride(1) == 1) return t.stride(0);
  if (t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2)) return t.stride(0);
  return -1;
}

}  // namespace

void rotary_embedding_out(at::Tensor& query_out, at::Tensor& key_out,
                          const at::Tensor& positions, const at::Tensor& query,
                          const at::Tensor& key, const at::Tensor& cos_sin_cache,
                          int64_t head_size, bool is_neox) {
#define ROPE_CHECK(cond, ...) OPMUX_CHECK("rotary_embedding", cond, __VA_ARGS__)
  ROPE_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong,
             "positions must be a 1-d int64 tensor, got ", positions.sizes(), " ",
             positions.scalar_type());
  const int64_t T = positions.size(0);
  ROPE_CHECK(query.scalar_type() == key.scalar_type() &&
                 cos_sin_cache.scalar_type() == query.scalar_type(),
             "query, key and cos_sin_cache must share a dtype, got ", query.scalar_type(), ", ",
             key.scalar_type(), ", ", cos_sin_cache.scalar_type());
  ROPE_CHECK(query.size(0) == T && key.size(0) == T, "query and key must have ", T,
             " tokens (positions.size(0)), got ", query.sizes(), " and ", key.sizes());
  const int64_t qs = token_stride(query);
  const int64_t ks = token_stride(key);
  ROPE_CHECK(qs >= 0 && ks >= 0,
             "query/key must be [T, H*D] or [T, H, D] with contiguous tokens, got strides ",
             query.strides(), " and ", key.strides());
  ROPE_CHECK(head_size > 0, "head_size must be positive, got ", head_size);
  const int64_t q_width = T == 0 ? 0 : query.numel() / T;
  const int64_t k_width = T == 0 ? 0 : key.numel() / T;
  ROPE_CHECK(q_width % head_size == 0 && k_width % head_size == 0,
             "query/key width must be a multiple of head_size ", head_size, ", got ", q_width,
             " and ", k_width);
  ROPE_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous(),
             "cos_sin_cache must be a contiguous [max_pos, rot] tensor, got ",
             cos_sin_cache.sizes());
  const int64_t rot = cos_sin_cache.size(1);
  const int64_t max_pos = cos_sin_cache.size(0);
  ROPE_CHECK(rot % 2 == 0 && rot > 0 && rot <= head_size,
             "rot (cos_sin_cache.size(1)) must be even, positive and <= ", head_size, ", got ",
             rot);
  ROPE_CHECK((query.dim() == 2 || query.size(2) == head_size) &&
                 (key.dim() == 2 || key.size(2) == head_size),
             "per-head query/key [T, H, D] must have D == head_size ", head_size, ", got ",
             query.sizes(), " and ", key.sizes());
  ROPE_CHECK(query_out.is_contiguous() && key_out.is_contiguous() &&
                 query_out.numel() == query.numel() && key_out.numel() == key.numel() &&
                 query_out.scalar_type() == query.scalar_type() &&
                 key_out.scalar_type() == key.scalar_type(),
             "query_out/key_out must be contiguous like query/key");
  // positions may be any 1-d view (strided, stride 0): read through its stride (#11)
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t ps = positions.stride(0);
  for (int64_t t = 0; t < T; ++t) {
    ROPE_CHECK(pos[t * ps] >= 0 && pos[t * ps] < max_pos, "positions[", t, "] = ", pos[t * ps],
               " is outside [0, ", max_pos, ")");
  }
#undef ROPE_CHECK
  advise_huge_pages(query_out);
  advise_huge_pages(key_out);
  const int64_t hq = q_width / head_size;
  const int64_t hk = k_width / head_size;
  OPMUX_DISPATCH_FLOATS(query.scalar_type(), "rotary_embedding", [&] {
    const scalar_t* q = query.const_data_ptr<scalar_t>();
    const scalar_t* k = key.const_data_ptr<scalar_t>();
    const scalar_t* cache = cos_sin_cache.const_data_ptr<scalar_t>();
    scalar_t* qo = query_out.data_ptr<scalar_t>();
    scalar_t* ko = key_out.data_ptr<scalar_t>();
    // at least 16384 elements a task: a decode batch rotates on the calling thread
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(q_width + k_width, 1));
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* cos = cache + pos[t * ps] * rot;
        const scalar_t* sin = cos + rot / 2;
        rope_heads(qo + t * q_width, q + t * qs, hq, cos, sin, rot, head_size, is_neox);
        rope_heads(ko + t * k_width, k + t * ks, hk, cos, sin, rot, head_size, is_neox);
      }
      stream_fence();
    });
  });
}

// This file's ops in torch.ops.opmux_cpu (op_library.h).
TORCH_LIBRARY_FRAGMENT(opmux_cpu, m) {
  m.def(
      "rotary_embedding_out(Tensor(a!) query_out, Tensor(b!) key_out, Tensor positions, "
      "Tensor query, Tensor key, Tensor cos_sin_cache, int head_size, bool is_neox) -> ()",
      cpu_kernel(&rotary_embedding_out));
}

}  // namespace opmux_cpu
