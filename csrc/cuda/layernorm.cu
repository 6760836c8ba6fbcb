// rms_norm: one block per row; fp32 sum of squares reduced with warp shuffles.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "ops.h"

namespace opmux_cuda {
namespace {

constexpr int kMaxThreads = 1024;

__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[kMaxThreads / 32];
  __shared__ float total;
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = (blockDim.x + 31) / 32;
    float s = lane < warps ? partial[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

template <typename scalar_t, typename weight_t>
__global__ void rms_norm_kernel(scalar_t* __restrict__ out, const scalar_t* __restrict__ x,
                                const weight_t* __restrict__ weight, int64_t d, float eps) {
  const int64_t row = blockIdx.x;
  const scalar_t* in = x + row * d;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    const float v = static_cast<float>(in[i]);
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss) / static_cast<float>(d) + eps);
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    const float v = static_cast<float>(in[i]);
    out[row * d + i] = static_cast<scalar_t>(v * inv * static_cast<float>(weight[i]));
  }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_cuda() && weight.device() == x.device(),
              "rms_norm (provider 'cuda_c'): arguments 'x' and 'weight' expected on one CUDA "
              "device, got ", x.device(), " and ", weight.device());
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm (provider 'cuda_c'): argument 'weight' expected shape (", x.size(-1),
              ",), got ", weight.sizes());
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  const int64_t d = x.size(-1);
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = weight.contiguous();
  const int64_t rows = xc.numel() / d;
  const c10::cuda::CUDAGuard guard(x.device());
  const int threads = static_cast<int>(std::min<int64_t>(((d + 31) / 32) * 32, kMaxThreads));
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    using x_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, wc.scalar_type(), "rms_norm_w", [&] {
      rms_norm_kernel<x_t, scalar_t><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
          out.data_ptr<x_t>(), xc.data_ptr<x_t>(), wc.data_ptr<scalar_t>(), d,
          static_cast<float>(eps));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace opmux_cuda
