// Encoder attention (packed, non-causal, no cache) and the MLA latent cache + latent attention.
// The Python side (plugins/cpu/cpp_attention_extra.py) validates index values
// with the catalog's checks before calling; the checks here guard the layouts the loops read.
#include "op_library.h"
#include "vec_common.h"

#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace opmux_cpu {
namespace {

constexpr int64_t kQueryTile = 64;  // encoder query rows per task (scores tile: 64 x n fp32)
constexpr int64_t kHeadGroup = 16;  // MLA heads per task (they share every cache row read)

template <typename T>
inline void row_to_float(float* dst, const T* src, int64_t n) {
  for_each_vec(n, [&](int64_t j, int64_t c) { load_n(src + j, c).store(dst + j, c); });
}

// In place: row <- exp(row - max(row)); returns the sum of the row.
inline float exp_row(float* row, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, row[j]);
  float sum = 0.0f;
  for_each_vec(n, [&](int64_t j, int64_t c) {
    fVec e = (fVec::loadu(row + j, c) - fVec(mx)).exp_u20();
    e.store(row + j, c);
    float tmp[kF];
    e.store(tmp);
    for (int64_t i = 0; i < c; ++i) sum += tmp[i];
  });
  return sum;
}

template <typename T>
void encoder_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const std::vector<int64_t>& cu, double scale) {
  const int64_t heads = q.size(1), kv_heads = k.size(1), d = q.size(2);
  const int64_t group = heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1);
  struct Task { int64_t seq, head, row0, rows; };
  std::vector<Task> tasks;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    const int64_t n = cu[s + 1] - cu[s];
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t r = 0; r < n; r += kQueryTile)
        tasks.push_back({static_cast<int64_t>(s), h, r, std::min(kQueryTile, n - r)});
  }
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qbuf, kbuf, vbuf, sbuf, obuf;
    int64_t cached_seq = -1, cached_kvh = -1;
    auto opts = at::TensorOptions().dtype(at::kFloat);
    for (int64_t i = begin; i < end; ++i) {
      const Task& t = tasks[i];
      const int64_t s0 = cu[t.seq], n = cu[t.seq + 1] - s0, kvh = t.head / group;
      if (t.seq != cached_seq || kvh != cached_kvh) {  // keys/values of this kv head, fp32
        kbuf.resize(n * d);
        vbuf.resize(n * d);
        for (int64_t j = 0; j < n; ++j) {
          row_to_float(kbuf.data() + j * d, kp + (s0 + j) * ks0 + kvh * ks1, d);
          row_to_float(vbuf.data() + j * d, vp + (s0 + j) * vs0 + kvh * vs1, d);
        }
        cached_seq = t.seq;
        cached_kvh = kvh;
      }
      const int64_t m = t.rows;
      qbuf.resize(m * d);
      sbuf.resize(m * n);
      obuf.resize(m * d);
      for (int64_t r = 0; r < m; ++r) {
        row_to_float(qbuf.data() + r * d, qp + (s0 + t.row0 + r) * qs0 + t.head * qs1, d);
      }
      at::Tensor qt = at::from_blob(qbuf.data(), {m, d}, opts);
      at::Tensor kt = at::from_blob(kbuf.data(), {n, d}, opts);
      at::Tensor vt = at::from_blob(vbuf.data(), {n, d}, opts);
      at::Tensor st = at::from_blob(sbuf.data(), {m, n}, opts);
      at::Tensor ot = at::from_blob(obuf.data(), {m, d}, opts);
      at::mm_out(st, qt, kt.t());
      std::vector<float> inv(m);
      for (int64_t r = 0; r < m; ++r) {
        float* row = sbuf.data() + r * n;
        for_each_vec(n, [&](int64_t j, int64_t c) {
          (fVec::loadu(row + j, c) * fVec(fscale)).store(row + j, c);
        });
        inv[r] = 1.0f / exp_row(row, n);
      }
      at::mm_out(ot, st, vt);
      for (int64_t r = 0; r < m; ++r) {
        T* dst = op + ((s0 + t.row0 + r) * heads + t.head) * d;
        const float* src = obuf.data() + r * d;
        const fVec w(inv[r]);
        for_each_vec(d, [&](int64_t j, int64_t c) { store_n(dst + j, fVec::loadu(src + j, c) * w, c); });
      }
    }
  });
}

// One task = one query row x a group of up to kHeadGroup heads. Per block of the sequence (its
// visible rows are contiguous inside the block): S^T[rows, heads] = Block[rows, L + R] x
// Q[heads, L + R]^T, then a softmax per head over all visible rows, then
// O[heads, L] += P[rows, heads]^T x Block[rows, :L]; both products are ATen CPU GEMMs (run
// single-threaded inside the task), bf16/fp16 blocks are converted to fp32 first.
template <typename T>
void mla_latent_impl(at::Tensor& out, const at::Tensor& q_lat, const at::Tensor& kv_cache,
                     const int32_t* tables, int64_t table_stride, const int32_t* lens,
                     const int32_t* qsl, int64_t num_seqs, double scale) {
  const int64_t heads = q_lat.size(1), width = q_lat.size(2), lora = out.size(2);
  const int64_t block_size = kv_cache.size(1);
  float* qp = q_lat.data_ptr<float>();
  float* op = out.data_ptr<float>();
  T* cache = kv_cache.data_ptr<T>();
  const int64_t groups = (heads + kHeadGroup - 1) / kHeadGroup;
  const int64_t rows = qsl[num_seqs];
  std::vector<int64_t> seq_of(rows);
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t r = qsl[s]; r < qsl[s + 1]; ++r) seq_of[r] = s;
  const fVec vscale(static_cast<float>(scale));
  auto opts = at::TensorOptions().dtype(at::kFloat);
  at::parallel_for(0, rows * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> st, blkf, inv(kHeadGroup);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / groups, h0 = (task % groups) * kHeadGroup;
      const int64_t hg = std::min(kHeadGroup, heads - h0);
      const int64_t s = seq_of[r];
      const int64_t visible = lens[s] - (qsl[s + 1] - qsl[s]) + (r - qsl[s]) + 1;
      const int32_t* table = tables + s * table_stride;
      st.resize(visible * hg);
      at::Tensor q = at::from_blob(qp + (r * heads + h0) * width, {hg, width}, opts);
      at::Tensor o = at::from_blob(op + (r * heads + h0) * lora, {hg, lora}, opts);
      auto block = [&](int64_t b0, int64_t n) {
        T* src = cache + static_cast<int64_t>(table[b0 / block_size]) * block_size * width;
        if constexpr (std::is_same_v<T, float>) {
          return at::from_blob(src, {n, width}, opts);
        } else {
          blkf.resize(n * width);
          row_to_float(blkf.data(), src, n * width);
          return at::from_blob(blkf.data(), {n, width}, opts);
        }
      };
      for (int64_t b0 = 0; b0 < visible; b0 += block_size) {
        const int64_t n = std::min(block_size, visible - b0);
        at::Tensor sblk = at::from_blob(st.data() + b0 * hg, {n, hg}, opts);
        at::mm_out(sblk, block(b0, n), q.t());
      }
      for_each_vec(hg, [&](int64_t j, int64_t c) {  // softmax over rows, kF heads at a time
        fVec mx(-std::numeric_limits<float>::infinity());
        for (int64_t t = 0; t < visible; ++t)
          mx = at::vec::maximum(mx, fVec::loadu(st.data() + t * hg + j, c) * vscale);
        fVec sum(0.0f);
        for (int64_t t = 0; t < visible; ++t) {
          fVec e = (fVec::loadu(st.data() + t * hg + j, c) * vscale - mx).exp_u20();
          e.store(st.data() + t * hg + j, c);
          sum = sum + e;
        }
        float tmp[kF];
        sum.store(tmp);
        for (int64_t i = 0; i < c; ++i) inv[j + i] = 1.0f / tmp[i];
      });
      o.zero_();
      for (int64_t b0 = 0; b0 < visible; b0 += block_size) {
        const int64_t n = std::min(block_size, visible - b0);
        at::Tensor p = at::from_blob(st.data() + b0 * hg, {n, hg}, opts);
        o.addmm_(p.t(), block(b0, n).narrow(1, 0, lora));
      }
      for (int64_t h = 0; h < hg; ++h) {
        float* dst = op + (r * heads + h0 + h) * lora;
        const fVec w(inv[h]);
        for_each_vec(lora, [&](int64_t j, int64_t c) {
          (fVec::loadu(dst + j, c) * w).store(dst + j, c);
        });
      }
    }
  });
}

}  // namespace

void encoder_attention_out(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& cu_seqlens, double scale) {
#define ENC_CHECK(cond, ...) OPMUX_CHECK("encoder_attention", cond, __VA_ARGS__)
  ENC_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-d, got ",
            q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  ENC_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                out.scalar_type() == q.scalar_type(),
            "q, k, v and out must share a dtype, got ", q.scalar_type(), ", ", k.scalar_type(),
            ", ", v.scalar_type(), ", ", out.scalar_type());
  ENC_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2) &&
                k.size(1) > 0 && q.size(1) % k.size(1) == 0,
            "k and v must be [T, Hkv, D] with Hkv dividing H, got ", k.sizes(), " and ",
            v.sizes(), " for q ", q.sizes());
  ENC_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
            "q, k, v must have a contiguous last dimension");
  ENC_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be a contiguous ",
            q.sizes(), " tensor, got ", out.sizes());
  ENC_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1 && cu_seqlens.is_contiguous() &&
                cu_seqlens.scalar_type() == at::kInt,
            "cu_seqlens must be a contiguous 1-d int32 tensor, got ", cu_seqlens.sizes(), " ",
            cu_seqlens.scalar_type());
  const int32_t* cp = cu_seqlens.data_ptr<int32_t>();
  std::vector<int64_t> cu(cp, cp + cu_seqlens.size(0));
  const int64_t tokens = q.size(0);
  ENC_CHECK(cu[0] == 0 && cu.back() <= tokens, "cu_seqlens must run from 0 to at most T=",
            tokens);
  for (size_t i = 1; i < cu.size(); ++i)
    ENC_CHECK(cu[i] >= cu[i - 1], "cu_seqlens must not decrease");
  const int64_t width = q.size(1) * q.size(2);
  if (cu.back() < tokens) {  // padding rows
    OPMUX_DISPATCH_FLOATS(q.scalar_type(), "encoder_attention", [&] {
      std::fill(out.data_ptr<scalar_t>() + cu.back() * width,
                out.data_ptr<scalar_t>() + tokens * width, scalar_t(0));
    });
  }
  if (width == 0) return;
  OPMUX_DISPATCH_FLOATS(q.scalar_type(), "encoder_attention", [&] {
    encoder_attention_impl<scalar_t>(out, q, k, v, cu, scale);
  });
#undef ENC_CHECK
}

void concat_and_cache_mla(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& kv_cache,
                          const at::Tensor& slot_mapping) {
#define MLA_CACHE_CHECK(cond, ...) OPMUX_CHECK("concat_and_cache_mla", cond, __VA_ARGS__)
  MLA_CACHE_CHECK(kv_cache.dim() == 3 && kv_cache.is_contiguous(),
                  "kv_cache must be a contiguous [num_blocks, block_size, L + R] tensor, got ",
                  kv_cache.sizes());
  MLA_CACHE_CHECK(kv_c.dim() == 2 && k_pe.dim() == 2 && kv_c.stride(1) == 1 &&
                      k_pe.stride(1) == 1 && k_pe.size(0) == kv_c.size(0) &&
                      kv_c.size(1) + k_pe.size(1) == kv_cache.size(2),
                  "kv_c [T, L] and k_pe [T, R] with contiguous rows and L + R = ",
                  kv_cache.size(2), " expected, got ", kv_c.sizes(), " and ", k_pe.sizes());
  MLA_CACHE_CHECK(kv_c.scalar_type() == kv_cache.scalar_type() &&
                      k_pe.scalar_type() == kv_cache.scalar_type(),
                  "kv_c and k_pe must have the cache's dtype ", kv_cache.scalar_type());
  MLA_CACHE_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == kv_c.size(0) &&
                      slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
                  "slot_mapping must be a contiguous [T] int64 tensor, got ",
                  slot_mapping.sizes(), " ", slot_mapping.scalar_type());
  const int64_t tokens = kv_c.size(0), lora = kv_c.size(1), rope = k_pe.size(1);
  const int64_t width = kv_cache.size(2);
  const int64_t slots = kv_cache.size(0) * kv_cache.size(1);
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    MLA_CACHE_CHECK(sp[t] >= -1 && sp[t] < slots, "slot_mapping values must be -1 or in [0, ",
                    slots, "), got ", sp[t], " at token ", t);
  const size_t elem = kv_cache.element_size();
  auto* dst = static_cast<char*>(kv_cache.data_ptr());
  const auto* cp = static_cast<const char*>(kv_c.data_ptr());
  const auto* pp = static_cast<const char*>(k_pe.data_ptr());
  const int64_t cs = kv_c.stride(0), ps = k_pe.stride(0);
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (sp[t] < 0) continue;
      char* row = dst + sp[t] * width * elem;
      std::memcpy(row, cp + t * cs * elem, lora * elem);
      std::memcpy(row + lora * elem, pp + t * ps * elem, rope * elem);
    }
  });
#undef MLA_CACHE_CHECK
}

void mla_latent_attention_out(at::Tensor& out, const at::Tensor& q_lat,
                              const at::Tensor& kv_cache, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                              double scale) {
#define MLA_CHECK(cond, ...) OPMUX_CHECK("mla_attention", cond, __VA_ARGS__)
  MLA_CHECK(q_lat.dim() == 3 && q_lat.is_contiguous() && q_lat.scalar_type() == at::kFloat,
            "q_lat must be a contiguous float32 [T, H, L + R] tensor, got ", q_lat.sizes(),
            " ", q_lat.scalar_type());
  MLA_CHECK(kv_cache.dim() == 3 && kv_cache.is_contiguous() && kv_cache.size(2) == q_lat.size(2),
            "kv_cache must be a contiguous [num_blocks, block_size, ", q_lat.size(2),
            "] tensor, got ", kv_cache.sizes());
  MLA_CHECK(out.dim() == 3 && out.is_contiguous() && out.scalar_type() == at::kFloat &&
                out.size(0) == q_lat.size(0) && out.size(1) == q_lat.size(1) &&
                out.size(2) < q_lat.size(2),
            "out must be a contiguous float32 [T, H, L] tensor, got ", out.sizes());
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc})
    MLA_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
              "block_tables, seq_lens and query_start_loc must be contiguous int32 tensors");
  const int64_t num_seqs = seq_lens.size(0);
  MLA_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                query_start_loc.size(0) == num_seqs + 1,
            "block_tables [S, M], seq_lens [S] and query_start_loc [S + 1] expected, got ",
            block_tables.sizes(), ", ", seq_lens.sizes(), ", ", query_start_loc.sizes());
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t tokens = q_lat.size(0);
  MLA_CHECK(qsl[0] == 0 && qsl[num_seqs] <= tokens, "query_start_loc must run from 0 to at most T");
  for (int64_t s = 0; s < num_seqs; ++s)
    MLA_CHECK(qsl[s + 1] >= qsl[s] && lens[s] >= qsl[s + 1] - qsl[s] &&
                  lens[s] <= block_tables.size(1) * kv_cache.size(1),
              "sequence ", s, ": offsets must not decrease and q_len <= kv_len <= table span");
  out.zero_();
  if (out.numel() == 0) return;
  OPMUX_DISPATCH_FLOATS(kv_cache.scalar_type(), "mla_attention", [&] {
    mla_latent_impl<scalar_t>(out, q_lat, kv_cache, block_tables.data_ptr<int32_t>(),
                              block_tables.size(1), lens, qsl, num_seqs, scale);
  });
#undef MLA_CHECK
}

// This file's ops in torch.ops.opmux_cpu (op_library.h).
TORCH_LIBRARY_FRAGMENT(opmux_cpu, m) {
  m.def(
      "encoder_attention_out(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, "
      "float scale) -> ()",
      cpu_kernel(&encoder_attention_out));
  m.def(
      "concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, "
      "Tensor slot_mapping) -> ()",
      cpu_kernel(&concat_and_cache_mla));
  m.def(
      "mla_latent_attention_out(Tensor(a!) out, Tensor q_lat, Tensor kv_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale) -> ()",
      cpu_kernel(&mla_latent_attention_out));
}

}  // namespace opmux_cpu
