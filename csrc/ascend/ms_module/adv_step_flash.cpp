// advance_step_flashattn for MindSpore (PyNative): a PyboostRunner that updates
// the caller's tensors in place.
//
// Backends:
//   Ascend  the AscendC kernel (csrc/ascend/ascendc), compiled in only when the CANN
//           toolkit is present (OPMUX_WITH_ASCENDC) and MindSpore runs on Ascend;
//   CPU     a C++ loop with the same semantics.
// Semantics: DESIGN.md section 5 and csrc/ascend/ascendc/adv_step_flash.h.
//
// Every argument is checked synchronously, on the caller's thread, before the
// op is dispatched, so a bad call raises ValueError and writes nothing.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ms_extension/api.h"
#include "ms_module/module.h"
#include "utils/ms_context.h"

#ifdef OPMUX_WITH_ASCENDC
#include "ascendc/adv_step_flash.h"
#endif

namespace opmux {
namespace {

constexpr const char kOpName[] = "advance_step_flashattn";
#ifdef OPMUX_WITH_ASCENDC
// At most this many AI cores take part; rows are split evenly (host tiling).
constexpr uint32_t kMaxAscendCores = 40;
#endif

// Raised (as Python's _C_ops.GraphModeError, a RuntimeError) when called outside
// PyNative mode: the op runs eagerly through PyboostRunner and has no graph kernel.
class GraphModeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] void Fail(const std::string &arg, const std::string &expected, const std::string &got) {
  throw std::invalid_argument(std::string(kOpName) + ": argument '" + arg + "' expected " + expected +
                              ", got " + got);
}

std::string ShapeStr(const ms::Tensor &t) {
  std::string s = "[";
  const auto &shape = t.shape();
  for (size_t i = 0; i < shape.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(shape[i]);
  }
  return s + "]";
}

std::string StridesStr(const ms::Tensor &t) {
  std::string s = "[";
  const auto strides = t.stride();
  for (size_t i = 0; i < strides.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(strides[i]);
  }
  return s + "]";
}

std::string DtypeStr(ms::TypeId t) { return mindspore::TypeIdToString(t); }

// Checks definedness and dtype of one tensor argument.
void CheckDtype(const ms::Tensor &t, const char *name, ms::TypeId dtype) {
  if (!t.is_defined()) {
    Fail(name, "a tensor", "an undefined tensor");
  }
  // Outputs of earlier asynchronous ops arrive as stub nodes; resolve them so
  // dtype and shape are known (waits for the frontend, not for the device).
  t.ConvertStubNodeToTensor();
  if (t.data_type() != dtype) {
    Fail(name, "dtype " + DtypeStr(dtype), "dtype " + DtypeStr(t.data_type()));
  }
}

// Checks a per-sequence state vector: dtype, shape [num_seqs], contiguity.
void CheckVector(const ms::Tensor &t, const char *name, ms::TypeId dtype, int64_t num_seqs) {
  CheckDtype(t, name, dtype);
  const auto &shape = t.shape();
  if (shape.size() != 1 || shape[0] != num_seqs) {
    Fail(name, "shape [" + std::to_string(num_seqs) + "] (num_seqs)", "shape " + ShapeStr(t));
  }
  if (!t.is_contiguous()) {
    Fail(name, "a contiguous tensor", "a non-contiguous tensor (strides " + StridesStr(t) + ")");
  }
}

// The C++ loop used on the CPU backend. Validates every block lookup first so
// that a bad seq_lens / block_tables pair raises before any element is written.
void AdvStepFlashCpu(int32_t num_seqs, int32_t num_queries, int32_t block_size,
                     const int64_t *sampled, int32_t *seq_lens, const int32_t *block_tables,
                     int64_t max_blocks, int64_t bt_stride, int64_t *tokens, int64_t *positions,
                     int64_t *slots) {
  for (int32_t i = 0; i < num_queries; ++i) {
    const int32_t pos = seq_lens[i];
    // Runs on MindSpore's launch thread: MS_LOG(EXCEPTION) carries the message
    // to the caller at its next synchronisation point.
    if (pos < 0 || pos / block_size >= max_blocks) {
      MS_LOG(EXCEPTION) << kOpName << ": argument 'seq_lens' expected values in [0, "
                        << max_blocks * block_size << ") (the next position must fit max_blocks*block_size), got "
                        << "seq_lens[" << i << "] = " << pos;
    }
    if (block_tables[i * bt_stride + pos / block_size] < 0) {
      MS_LOG(EXCEPTION) << kOpName << ": argument 'block_tables' expected non-negative block ids at the next "
                        << "position of each sequence, got block_tables[" << i << ", " << pos / block_size
                        << "] = " << block_tables[i * bt_stride + pos / block_size];
    }
  }
  for (int32_t i = 0; i < num_queries; ++i) {
    const int32_t pos = seq_lens[i];
    const int64_t block = block_tables[i * bt_stride + pos / block_size];
    tokens[i] = sampled[i];
    positions[i] = pos;
    seq_lens[i] = pos + 1;
    slots[i] = block * block_size + pos % block_size;
  }
  for (int32_t i = num_queries; i < num_seqs; ++i) {
    tokens[i] = 0;
    positions[i] = 0;
    slots[i] = -1;
  }
}

// inputs:  sampled_token_ids, seq_lens, block_tables
// outputs: input_tokens, input_positions, seq_lens, slot_mapping (the caller's tensors)
class AdvStepFlashRunner : public ms::pynative::PyboostRunner {
 public:
  AdvStepFlashRunner(int32_t num_seqs, int32_t num_queries, int32_t block_size)
      : PyboostRunner(kOpName), num_seqs_(num_seqs), num_queries_(num_queries), block_size_(block_size) {}

  void LaunchKernel() override {
    const ms::Tensor &sampled = inputs()[0];
    const ms::Tensor &block_tables = inputs()[2];
    const ms::Tensor &tokens = outputs()[0];
    const ms::Tensor &positions = outputs()[1];
    const ms::Tensor &seq_lens = outputs()[2];
    const ms::Tensor &slots = outputs()[3];
    const int64_t max_blocks = block_tables.shape()[1];
    const int64_t bt_stride = block_tables.stride()[0];
#ifdef OPMUX_WITH_ASCENDC
    const auto &target = mindspore::MsContext::GetInstance()->get_param<std::string>(mindspore::MS_CTX_DEVICE_TARGET);
    if (target == mindspore::kAscendDevice) {
      uint32_t block_dim = 1;
      int32_t rows_per_core = 0;
      AdvStepFlashTiling(num_seqs_, kMaxAscendCores, &block_dim, &rows_per_core);
      AdvStepFlashKernelEntry(block_dim, stream(), static_cast<uint8_t *>(sampled.GetDataPtr()),
                              static_cast<uint8_t *>(seq_lens.GetDataPtr()),
                              static_cast<uint8_t *>(block_tables.GetDataPtr()),
                              static_cast<uint8_t *>(tokens.GetDataPtr()),
                              static_cast<uint8_t *>(positions.GetDataPtr()),
                              static_cast<uint8_t *>(slots.GetDataPtr()), num_seqs_, num_queries_,
                              block_size_, bt_stride, rows_per_core);
      return;
    }
#endif
    AdvStepFlashCpu(num_seqs_, num_queries_, block_size_, sampled.data_ptr<int64_t>(),
                    seq_lens.data_ptr<int32_t>(), block_tables.data_ptr<int32_t>(), max_blocks,
                    bt_stride, tokens.data_ptr<int64_t>(), positions.data_ptr<int64_t>(), slots.data_ptr<int64_t>());
  }

  static void Eval(int32_t num_seqs, int32_t num_queries, int32_t block_size, const ms::Tensor &input_tokens,
                   const ms::Tensor &sampled_token_ids, const ms::Tensor &input_positions,
                   const ms::Tensor &seq_lens, const ms::Tensor &slot_mapping, const ms::Tensor &block_tables) {
    auto runner = std::make_shared<AdvStepFlashRunner>(num_seqs, num_queries, block_size);
    runner->Run({sampled_token_ids, seq_lens, block_tables}, {input_tokens, input_positions, seq_lens, slot_mapping});
  }

 private:
  int32_t num_seqs_;
  int32_t num_queries_;
  int32_t block_size_;
};

void CheckArgs(int64_t num_seqs, int64_t num_queries, int64_t block_size, const ms::Tensor &input_tokens,
               const ms::Tensor &sampled_token_ids, const ms::Tensor &input_positions, const ms::Tensor &seq_lens,
               const ms::Tensor &slot_mapping, const ms::Tensor &block_tables) {
  if (num_seqs < 0 || num_seqs > INT32_MAX) {
    Fail("num_seqs", "0 <= num_seqs <= 2**31 - 1", std::to_string(num_seqs));
  }
  if (num_queries < 0 || num_queries > num_seqs) {
    Fail("num_queries", "0 <= num_queries <= num_seqs (" + std::to_string(num_seqs) + ")",
         std::to_string(num_queries));
  }
  if (block_size <= 0 || block_size > INT32_MAX) {
    Fail("block_size", "a positive int32", std::to_string(block_size));
  }
  using mindspore::kNumberTypeInt32;
  using mindspore::kNumberTypeInt64;
  CheckVector(input_tokens, "input_tokens", kNumberTypeInt64, num_seqs);
  CheckVector(input_positions, "input_positions", kNumberTypeInt64, num_seqs);
  CheckVector(seq_lens, "seq_lens", kNumberTypeInt32, num_seqs);
  CheckVector(slot_mapping, "slot_mapping", kNumberTypeInt64, num_seqs);

  // [num_queries, 1] (or [num_queries], or more rows than needed), read row by row.
  CheckDtype(sampled_token_ids, "sampled_token_ids", kNumberTypeInt64);
  const auto &sampled_shape = sampled_token_ids.shape();
  const bool sampled_ok = (sampled_shape.size() == 1 && sampled_shape[0] == num_queries) ||
                          (sampled_shape.size() == 2 && sampled_shape[0] >= num_queries && sampled_shape[1] == 1);
  if (!sampled_ok) {
    Fail("sampled_token_ids", "shape [" + std::to_string(num_queries) + ", 1] (num_queries)",
         "shape " + ShapeStr(sampled_token_ids));
  }
  if (sampled_token_ids.stride()[0] != 1) {
    Fail("sampled_token_ids", "consecutive rows (stride 1 along dim 0)",
         "strides " + StridesStr(sampled_token_ids));
  }

  // [num_seqs, max_blocks]; rows may be padded (any row stride), columns must be dense.
  CheckDtype(block_tables, "block_tables", kNumberTypeInt32);
  const auto &bt_shape = block_tables.shape();
  if (bt_shape.size() != 2 || bt_shape[0] != num_seqs) {
    Fail("block_tables", "shape [" + std::to_string(num_seqs) + ", max_blocks] (num_seqs rows)",
         "shape " + ShapeStr(block_tables));
  }
  const auto bt_strides = block_tables.stride();
  if (bt_shape[1] > 1 && bt_strides[1] != 1) {
    Fail("block_tables", "dense rows (stride 1 along dim 1)", "strides " + StridesStr(block_tables));
  }
}

py::object AdvanceStepFlashattn(int64_t num_seqs, int64_t num_queries, int64_t block_size,
                                const ms::Tensor &input_tokens, const ms::Tensor &sampled_token_ids,
                                const ms::Tensor &input_positions, const ms::Tensor &seq_lens,
                                const ms::Tensor &slot_mapping, const ms::Tensor &block_tables) {
  if (mindspore::MsContext::GetInstance()->get_param<int>(mindspore::MS_CTX_EXECUTION_MODE) !=
      mindspore::kPynativeMode) {
    throw GraphModeError(std::string(kOpName) +
                         ": runs in PyNative mode only (mindspore.set_context(mode=mindspore.PYNATIVE_MODE)); "
                         "the current mode is GRAPH_MODE");
  }
  CheckArgs(num_seqs, num_queries, block_size, input_tokens, sampled_token_ids, input_positions, seq_lens,
            slot_mapping, block_tables);
  if (num_seqs == 0) {
    return py::none();  // nothing to update; MindSpore cannot launch on empty tensors
  }
  return ms::pynative::PyboostRunner::Call<0>(
      std::string(kOpName), AdvStepFlashRunner::Eval, static_cast<int32_t>(num_seqs), static_cast<int32_t>(num_queries),
      static_cast<int32_t>(block_size), input_tokens, sampled_token_ids, input_positions, seq_lens, slot_mapping,
      block_tables);
}

}  // namespace
}  // namespace opmux

OPMUX_MS_EXTENSION_MODULE(m) {
  namespace py = pybind11;
  py::register_exception<opmux::GraphModeError>(m, "GraphModeError", PyExc_RuntimeError);
  m.def("advance_step_flashattn", &opmux::AdvanceStepFlashattn,
        "In place: advance one decode step (tokens, positions, seq_lens, slot_mapping).", py::arg("num_seqs"),
        py::arg("num_queries"), py::arg("block_size"), py::arg("input_tokens"), py::arg("sampled_token_ids"),
        py::arg("input_positions"), py::arg("seq_lens"), py::arg("slot_mapping"), py::arg("block_tables"));
  m.attr("HAS_ASCENDC") =
#ifdef OPMUX_WITH_ASCENDC
      true;
#else
      false;
#endif
}
