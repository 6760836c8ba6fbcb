// rotary_embedding: functional (writes new query/key tensors), neox (halves) or gptj (pairs)
// rotation of the first `rot` dims of every head; dims rot..head_size are copied through.
// apply_rotary_emb (vLLM's ApplyRotaryEmb: whole heads, per-sequence-position cos/sin) and
// dual_chunk_rotary_embedding (vLLM's DualChunkRotaryEmbedding: one key rotation, five query
// rotations written side by side). Both are functional: they write into given outputs, math
// in fp32, one rounding to the output dtype.
#include "kernels.h"
#include "op_library.h"
#include "rope_head.h"

#include <optional>

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
  // positions may be any 1-d view (strided, stride 0): read through its stride
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

namespace {

template <typename T, typename C>
void apply_rotary_emb_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& cos,
                           const at::Tensor& sin, bool is_neox) {
  const int64_t D = x.size(-1);
  const int64_t H = x.size(-2);
  const int64_t S = x.size(-3);
  const int64_t rows = S == 0 || H == 0 ? 0 : x.numel() / (H * D);  // (batch, position) pairs
  const T* xp = x.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const C* cp = cos.const_data_ptr<C>();
  const C* sp = sin.const_data_ptr<C>();
  const int64_t cs = cos.stride(0);
  const int64_t ss = sin.stride(0);
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(H * D, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t s = r % S;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t off = (r * H + h) * D;
        rope_head(op + off, xp + off, cp + s * cs, sp + s * ss, D, D, is_neox);
      }
    }
    stream_fence();
  });
}

}  // namespace

void apply_rotary_emb_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& cos,
                          const at::Tensor& sin, bool is_neox) {
#define ARE_CHECK(cond, ...) OPMUX_CHECK("apply_rotary_emb", cond, __VA_ARGS__)
  ARE_CHECK(x.dim() >= 3 && x.is_contiguous() && x.size(-1) % 2 == 0,
            "x must be a contiguous [..., seq_len, num_heads, head_size] tensor with an even "
            "head_size, got ", x.sizes(), " strides ", x.strides());
  const int64_t S = x.size(-3);
  const int64_t half = x.size(-1) / 2;
  ARE_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.size(0) == S && sin.size(0) == S &&
                cos.size(1) == half && sin.size(1) == half,
            "cos and sin must be [", S, ", ", half, "] (seq_len, head_size/2), got ",
            cos.sizes(), " and ", sin.sizes());
  ARE_CHECK(cos.stride(1) == 1 && sin.stride(1) == 1,
            "cos and sin need unit-stride rows, got strides ", cos.strides(), " and ",
            sin.strides());
  ARE_CHECK(cos.scalar_type() == sin.scalar_type() &&
                (cos.scalar_type() == x.scalar_type() || cos.scalar_type() == at::kFloat),
            "cos and sin must share x's dtype or be float32, got ", cos.scalar_type(), " and ",
            sin.scalar_type(), " for x ", x.scalar_type());
  ARE_CHECK(out.is_contiguous() && out.sizes() == x.sizes() &&
                out.scalar_type() == x.scalar_type(),
            "out must be contiguous like x");
#undef ARE_CHECK
  advise_huge_pages(out);
  const bool f32_tables = cos.scalar_type() == at::kFloat;
  OPMUX_DISPATCH_FLOATS(x.scalar_type(), "apply_rotary_emb", [&] {
    if (f32_tables) {
      apply_rotary_emb_impl<scalar_t, float>(out, x, cos, sin, is_neox);
    } else {
      apply_rotary_emb_impl<scalar_t, scalar_t>(out, x, cos, sin, is_neox);
    }
  });
}

void dual_chunk_rotary_embedding_out(
    at::Tensor& query_out, at::Tensor& key_out, const at::Tensor& positions,
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& q_cache,
    const at::Tensor& qc_cache, const at::Tensor& k_cache, const at::Tensor& qc_no_clamp_cache,
    const at::Tensor& q_inter_cache, int64_t head_size, bool is_neox,
    const std::optional<at::Tensor>& offsets) {
#define DCR_CHECK(cond, ...) OPMUX_CHECK("dual_chunk_rotary_embedding", cond, __VA_ARGS__)
  DCR_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong &&
                positions.is_contiguous(),
            "positions must be a contiguous 1-d int64 tensor, got ", positions.sizes(), " ",
            positions.scalar_type());
  const int64_t T = positions.size(0);
  const bool has_offsets = offsets.has_value();
  if (has_offsets) {
    DCR_CHECK(offsets->dim() == 1 && offsets->size(0) == T &&
                  offsets->scalar_type() == at::kLong && offsets->is_contiguous(),
              "offsets must be None or a contiguous int64 [", T, "] tensor, got ",
              offsets->sizes(), " ", offsets->scalar_type());
  }
  DCR_CHECK(head_size > 0, "head_size must be positive, got ", head_size);
  DCR_CHECK(query.dim() == 2 && key.dim() == 2 && query.size(0) == T && key.size(0) == T &&
                query.stride(1) == 1 && key.stride(1) == 1,
            "query and key must be [", T, ", heads*head_size] with unit-stride rows, got ",
            query.sizes(), " and ", key.sizes());
  const int64_t qw = query.size(1);
  const int64_t kw = key.size(1);
  DCR_CHECK(qw % head_size == 0 && kw % head_size == 0,
            "query/key widths must be multiples of head_size ", head_size, ", got ", qw,
            " and ", kw);
  const at::Tensor* caches[] = {&q_cache, &qc_cache, &qc_no_clamp_cache, &q_inter_cache,
                                &k_cache};
  const int64_t chunk_len = q_cache.size(0);
  const int64_t rot = q_cache.dim() == 2 ? q_cache.size(1) : -1;
  for (const at::Tensor* c : caches) {
    DCR_CHECK(c->dim() == 2 && c->size(1) == rot && c->is_contiguous() &&
                  c->scalar_type() == query.scalar_type() &&
                  (c == &k_cache || c->size(0) == chunk_len),
              "the caches must be contiguous [rows, rot] tensors of query's dtype (", rot,
              " columns, ", chunk_len, " rows but cos_sin_k_cache), got ", c->sizes(), " ",
              c->scalar_type());
  }
  DCR_CHECK(chunk_len >= 1 && rot > 0 && rot % 2 == 0 && rot <= head_size,
            "cos_sin_q_cache must be [chunk_len >= 1, even rot <= head_size ", head_size,
            "], got ", q_cache.sizes());
  DCR_CHECK(key.scalar_type() == query.scalar_type() &&
                query_out.scalar_type() == query.scalar_type() &&
                key_out.scalar_type() == query.scalar_type() && query_out.is_contiguous() &&
                key_out.is_contiguous() && query_out.numel() == 5 * T * qw &&
                key_out.numel() == T * kw,
            "key and the outputs must have query's dtype; outputs contiguous [T, 5*", qw,
            "] and [T, ", kw, "]");
  const int64_t max_pos = k_cache.size(0);
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t* off = has_offsets ? offsets->const_data_ptr<int64_t>() : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = pos[t] + (off ? off[t] : 0);
    DCR_CHECK(p >= 0 && p < max_pos, "position ", p, " of token ", t,
              " (positions + offsets) is outside [0, ", max_pos, ") (cos_sin_k_cache rows)");
  }
#undef DCR_CHECK
  advise_huge_pages(query_out);
  const int64_t hq = qw / head_size;
  const int64_t hk = kw / head_size;
  OPMUX_DISPATCH_FLOATS(query.scalar_type(), "dual_chunk_rotary_embedding", [&] {
    const scalar_t* q = query.const_data_ptr<scalar_t>();
    const scalar_t* k = key.const_data_ptr<scalar_t>();
    const int64_t qs = query.stride(0);
    const int64_t ks = key.stride(0);
    const scalar_t* tables[4] = {
        q_cache.const_data_ptr<scalar_t>(), qc_cache.const_data_ptr<scalar_t>(),
        qc_cache.const_data_ptr<scalar_t>() + (chunk_len - 1) * rot,  // one row for all
        qc_no_clamp_cache.const_data_ptr<scalar_t>()};
    const scalar_t* inter_crit = q_inter_cache.const_data_ptr<scalar_t>();
    const scalar_t* kc = k_cache.const_data_ptr<scalar_t>();
    scalar_t* qo = query_out.data_ptr<scalar_t>();
    scalar_t* ko = key_out.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 2048 / std::max<int64_t>(5 * qw + kw, 1));
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t p = pos[t] + (off ? off[t] : 0);
        const int64_t c = p % chunk_len;
        const scalar_t* rows[5] = {tables[0] + c * rot, tables[1] + c * rot, tables[2],
                                   tables[3] + c * rot, inter_crit + c * rot};
        const scalar_t* kr = kc + p * rot;
        rope_heads(ko + t * kw, k + t * ks, hk, kr, kr + rot / 2, rot, head_size, is_neox);
        scalar_t* qrow = qo + t * 5 * qw;
        for (int64_t v = 0; v < 5; ++v) {
          rope_heads(qrow + v * qw, q + t * qs, hq, rows[v], rows[v] + rot / 2, rot, head_size,
                     is_neox);
        }
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
  m.def(
      "apply_rotary_emb_out(Tensor(a!) out, Tensor x, Tensor cos, Tensor sin, "
      "bool is_neox) -> ()",
      cpu_kernel(&apply_rotary_emb_out));
  m.def(
      "dual_chunk_rotary_embedding_out(Tensor(a!) query_out, Tensor(b!) key_out, "
      "Tensor positions, Tensor query, Tensor key, Tensor q_cache, Tensor qc_cache, "
      "Tensor k_cache, Tensor qc_no_clamp_cache, Tensor q_inter_cache, int head_size, "
      "bool is_neox, Tensor? offsets) -> ()",
      cpu_kernel(&dual_chunk_rotary_embedding_out));
}

}  // namespace opmux_cpu
