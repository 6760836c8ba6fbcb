// How a kernel file adds its ops to torch.ops.opmux_cpu (the namespace bindings.cpp declares):
// next to their definitions, one TORCH_LIBRARY_FRAGMENT whose m.def calls give each op's schema
// (Tensor(a!) marks a tensor written in place) together with its CPU kernel:
//
//   TORCH_LIBRARY_FRAGMENT(opmux_cpu, m) {
//     m.def("relu2_out(Tensor(a!) out, Tensor x) -> ()", cpu_kernel(&relu2_out));
//   }
#pragma once

#include <torch/library.h>

namespace opmux_cpu {

// `fn` as the op's kernel for CPU tensors (the dispatch key TORCH_LIBRARY_IMPL(..., CPU, m)
// would give it).
template <typename Fn>
torch::CppFunction cpu_kernel(Fn* fn) {
  return torch::dispatch(c10::DispatchKey::CPU, fn);
}

}  // namespace opmux_cpu
