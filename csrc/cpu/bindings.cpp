// The torch.ops.opmux_cpu namespace of the opmux CPU kernels. Each kernel file defines its own
// ops (schema and CPU kernel) in a TORCH_LIBRARY_FRAGMENT next to their definitions; see
// op_library.h.
#include <torch/library.h>

TORCH_LIBRARY(opmux_cpu, m) {}
