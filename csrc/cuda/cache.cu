// reshape_and_cache and advance_step_flashattn: the KV-cache bookkeeping kernels.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "ops.h"

namespace opmux_cuda {
namespace {

template <typename src_t, typename dst_t>
__global__ void reshape_and_cache_kernel(const src_t* __restrict__ key,
                                         const src_t* __restrict__ value,
                                         dst_t* __restrict__ key_cache,
                                         dst_t* __restrict__ value_cache,
                                         const int64_t* __restrict__ slot_mapping,
                                         int64_t key_stride, int64_t value_stride,
                                         int64_t block_stride, int64_t block_size,
                                         int64_t width) {
  const int64_t tok = blockIdx.x;
  const int64_t slot = slot_mapping[tok];
  if (slot < 0) return;
  const int64_t base = (slot / block_size) * block_stride + (slot % block_size) * width;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    key_cache[base + i] = static_cast<dst_t>(static_cast<float>(key[tok * key_stride + i]));
    value_cache[base + i] = static_cast<dst_t>(static_cast<float>(value[tok * value_stride + i]));
  }
}

__global__ void advance_step_kernel(int64_t num_seqs, int64_t num_queries, int64_t block_size,
                                    int64_t* __restrict__ input_tokens,
                                    const int64_t* __restrict__ sampled, int64_t sampled_stride,
                                    int64_t* __restrict__ input_positions,
                                    int32_t* __restrict__ seq_lens,
                                    int64_t* __restrict__ slot_mapping,
                                    const int32_t* __restrict__ block_tables,
                                    int64_t block_tables_stride) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_seqs) return;
  if (i < num_queries) {
    const int64_t pos = seq_lens[i];
    input_tokens[i] = sampled[i * sampled_stride];
    input_positions[i] = pos;
    seq_lens[i] = static_cast<int32_t>(pos + 1);
    const int64_t block = block_tables[i * block_tables_stride + pos / block_size];
    slot_mapping[i] = block * block_size + pos % block_size;
  } else {
    input_tokens[i] = 0;
    input_positions[i] = 0;
    slot_mapping[i] = -1;
  }
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key_cache.dim() == 4 &&
                  value_cache.sizes() == key_cache.sizes() &&
                  key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2),
              "reshape_and_cache (provider 'cuda_c'): expected key/value [T, Hkv, D] and caches "
              "[blocks, block_size, Hkv, D], got ", key.sizes(), " and ", key_cache.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0),
              "reshape_and_cache (provider 'cuda_c'): argument 'slot_mapping' expected int64 of "
              "shape (", key.size(0), ",), got ", slot_mapping.scalar_type(), " ",
              slot_mapping.sizes());
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type() &&
                  key.scalar_type() == value.scalar_type(),
              "reshape_and_cache (provider 'cuda_c'): key/value and the two caches must share "
              "their dtypes");
  TORCH_CHECK(key_cache.stride(3) == 1 && key_cache.stride(2) == key_cache.size(3) &&
                  key_cache.stride(1) == key_cache.size(2) * key_cache.size(3) &&
                  value_cache.strides() == key_cache.strides(),
              "reshape_and_cache (provider 'cuda_c'): caches expected contiguous within a block, "
              "got strides ", key_cache.strides());
  const int64_t tokens = key.size(0);
  const int64_t width = key.size(1) * key.size(2);
  if (tokens == 0 || width == 0) return;
  const at::Tensor k = key.reshape({tokens, width}).contiguous();
  const at::Tensor v = value.reshape({tokens, width}).contiguous();
  const at::Tensor slots = slot_mapping.contiguous();
  const c10::cuda::CUDAGuard guard(key.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int threads = static_cast<int>(std::min<int64_t>(width, 512));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.scalar_type(), "rac_src", [&] {
    using src_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key_cache.scalar_type(), "rac_dst",
                                    [&] {
      reshape_and_cache_kernel<src_t, scalar_t><<<static_cast<unsigned>(tokens), threads, 0,
                                                  stream>>>(
          k.data_ptr<src_t>(), v.data_ptr<src_t>(), key_cache.data_ptr<scalar_t>(),
          value_cache.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), width, width,
          key_cache.stride(0), key_cache.size(1), width);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void advance_step_flashattn(int64_t num_seqs, int64_t num_queries, int64_t block_size,
                            at::Tensor& input_tokens, const at::Tensor& sampled_token_ids,
                            at::Tensor& input_positions, at::Tensor& seq_lens,
                            at::Tensor& slot_mapping, const at::Tensor& block_tables) {
  TORCH_CHECK(0 <= num_queries && num_queries <= num_seqs && block_size > 0,
              "advance_step_flashattn (provider 'cuda_c'): expected 0 <= num_queries <= "
              "num_seqs and block_size > 0, got ", num_queries, ", ", num_seqs, ", ", block_size);
  TORCH_CHECK(input_tokens.scalar_type() == at::kLong && input_positions.scalar_type() == at::kLong &&
                  slot_mapping.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kInt &&
                  sampled_token_ids.scalar_type() == at::kLong &&
                  block_tables.scalar_type() == at::kInt,
              "advance_step_flashattn (provider 'cuda_c'): expected int64 tokens/positions/slots/"
              "sampled ids and int32 seq_lens/block_tables");
  TORCH_CHECK(input_tokens.is_contiguous() && input_positions.is_contiguous() &&
                  seq_lens.is_contiguous() && slot_mapping.is_contiguous() &&
                  block_tables.stride(1) == 1,
              "advance_step_flashattn (provider 'cuda_c'): expected contiguous state tensors");
  if (num_seqs == 0) return;
  const c10::cuda::CUDAGuard guard(input_tokens.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  constexpr int threads = 256;
  const unsigned blocks = static_cast<unsigned>((num_seqs + threads - 1) / threads);
  advance_step_kernel<<<blocks, threads, 0, stream>>>(
      num_seqs, num_queries, block_size, input_tokens.data_ptr<int64_t>(),
      sampled_token_ids.data_ptr<int64_t>(), sampled_token_ids.stride(0),
      input_positions.data_ptr<int64_t>(), seq_lens.data_ptr<int32_t>(),
      slot_mapping.data_ptr<int64_t>(), block_tables.data_ptr<int32_t>(), block_tables.stride(0));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace opmux_cuda
