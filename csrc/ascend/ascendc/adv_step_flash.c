// AscendC kernel for advance_step_flashattn (semantics: adv_step_flash.h).
//
// Compiled only with the CANN toolkit (ascendc_library in CMakeLists.txt); the
// MindSpore module calls AdvStepFlashKernelEntry when it is built with
// OPMUX_WITH_ASCENDC.
//
// Work split: every AI core owns a contiguous range of rows (host tiling,
// rows_per_core is a multiple of 8 so each range starts 32-byte aligned). A
// core walks its range in tiles of kTileRows rows:
//   MTE2  GM -> UB   seq_lens (int32) and sampled_token_ids (int64) of the tile
//   S     scalar     int32/int64 arithmetic per row, block-table gather from GM
//   MTE3  UB -> GM   input_tokens, input_positions, slot_mapping (int64),
//                    seq_lens (int32, query rows only)
// Hardware events order the pipes; UB buffers are reused across tiles only
// after the previous tile's copy-out has drained.
#include "kernel_operator.h"

#include "adv_step_flash.h"

namespace {

using AscendC::GlobalTensor;
using AscendC::HardEvent;
using AscendC::LocalTensor;

// Rows per tile; a multiple of 8. UB use: 4 + 8 * 4 bytes per row = 36 KiB.
constexpr int32_t kTileRows = 1024;
// DataCopy moves whole 32-byte blocks; other lengths go through DataCopyPad.
constexpr uint32_t kDataBlockBytes = 32;

// Copies `count` elements of T between global and local memory, either way: DataCopy for
// whole 32-byte blocks, DataCopyPad otherwise (`pad...`: the padding spec a copy in takes).
template <typename T, typename Dst, typename Src, typename... Pad>
__aicore__ inline void CopyElems(const Dst &dst, const Src &src, uint32_t count,
                                 const Pad &...pad) {
  const uint32_t bytes = count * sizeof(T);
  if (bytes % kDataBlockBytes == 0) {
    AscendC::DataCopy(dst, src, count);
  } else {
    AscendC::DataCopyExtParams params{1, bytes, 0, 0, 0};
    AscendC::DataCopyPad(dst, src, params, pad...);
  }
}

template <typename T>
__aicore__ inline void CopyIn(const LocalTensor<T> &dst, const GlobalTensor<T> &src,
                              uint32_t count) {
  CopyElems<T>(dst, src, count, AscendC::DataCopyPadExtParams<T>{false, 0, 0, 0});
}

template <typename T>
__aicore__ inline void CopyOut(const GlobalTensor<T> &dst, const LocalTensor<T> &src,
                               uint32_t count) {
  CopyElems<T>(dst, src, count);
}

template <HardEvent EVENT>
__aicore__ inline void WaitPipe(AscendC::TPipe &pipe) {
  const event_t ev = static_cast<event_t>(pipe.FetchEventID(EVENT));
  AscendC::SetFlag<EVENT>(ev);
  AscendC::WaitFlag<EVENT>(ev);
}

class AdvStepFlashKernel {
 public:
  __aicore__ inline AdvStepFlashKernel() = default;

  __aicore__ inline void Init(GM_ADDR sampled_token_ids, GM_ADDR seq_lens, GM_ADDR block_tables,
                              GM_ADDR input_tokens, GM_ADDR input_positions,
                              GM_ADDR slot_mapping, int32_t num_seqs, int32_t num_queries,
                              int32_t block_size, int64_t block_tables_stride,
                              int32_t rows_per_core) {
    numQueries_ = num_queries;
    blockSize_ = block_size;
    blockTablesStride_ = block_tables_stride;

    const int64_t begin = static_cast<int64_t>(AscendC::GetBlockIdx()) * rows_per_core;
    int64_t end = begin + rows_per_core;
    if (end > num_seqs) {
      end = num_seqs;
    }
    rowBegin_ = begin;
    rowCount_ = end > begin ? static_cast<int32_t>(end - begin) : 0;

    // Views start at this core's first row; block_tables stays whole (gathered by row).
    sampledGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t *>(sampled_token_ids) + begin);
    seqLensGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t *>(seq_lens) + begin);
    blockTablesGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t *>(block_tables));
    tokensGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t *>(input_tokens) + begin);
    positionsGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t *>(input_positions) + begin);
    slotsGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t *>(slot_mapping) + begin);

    pipe_.InitBuffer(seqLensBuf_, kTileRows * sizeof(int32_t));
    pipe_.InitBuffer(sampledBuf_, kTileRows * sizeof(int64_t));
    pipe_.InitBuffer(tokensBuf_, kTileRows * sizeof(int64_t));
    pipe_.InitBuffer(positionsBuf_, kTileRows * sizeof(int64_t));
    pipe_.InitBuffer(slotsBuf_, kTileRows * sizeof(int64_t));
  }

  __aicore__ inline void Process() {
    if (rowCount_ == 0) {
      return;
    }
    // block_tables was written by earlier kernels or host copies; drop any stale
    // scalar-cache lines before the gather reads it through the scalar unit.
    AscendC::DataCacheCleanAndInvalid<int32_t, AscendC::CacheLine::ENTIRE_DATA_CACHE>(
        blockTablesGm_);
    for (int32_t offset = 0; offset < rowCount_; offset += kTileRows) {
      const int32_t rows = rowCount_ - offset < kTileRows ? rowCount_ - offset : kTileRows;
      ProcessTile(offset, rows);
      // The next tile reuses every UB buffer: wait for this tile's copy-out.
      WaitPipe<HardEvent::MTE3_MTE2>(pipe_);
      WaitPipe<HardEvent::MTE3_S>(pipe_);
    }
  }

 private:
  __aicore__ inline void ProcessTile(int32_t offset, int32_t rows) {
    const int64_t first = rowBegin_ + offset;  // absolute index of the tile's first row
    // Rows [first, first + active) are query rows; the rest are padding.
    int64_t active = static_cast<int64_t>(numQueries_) - first;
    if (active < 0) {
      active = 0;
    } else if (active > rows) {
      active = rows;
    }

    LocalTensor<int32_t> seqLens = seqLensBuf_.Get<int32_t>();
    LocalTensor<int64_t> sampled = sampledBuf_.Get<int64_t>();
    LocalTensor<int64_t> tokens = tokensBuf_.Get<int64_t>();
    LocalTensor<int64_t> positions = positionsBuf_.Get<int64_t>();
    LocalTensor<int64_t> slots = slotsBuf_.Get<int64_t>();

    if (active > 0) {
      CopyIn(seqLens, seqLensGm_[offset], static_cast<uint32_t>(active));
      CopyIn(sampled, sampledGm_[offset], static_cast<uint32_t>(active));
      WaitPipe<HardEvent::MTE2_S>(pipe_);
    }

    for (int32_t j = 0; j < static_cast<int32_t>(active); ++j) {
      const int32_t pos = seqLens.GetValue(j);
      const int64_t row = first + j;
      const int64_t col = static_cast<int64_t>(pos / blockSize_);
      const int32_t block = blockTablesGm_.GetValue(row * blockTablesStride_ + col);
      tokens.SetValue(j, sampled.GetValue(j));
      positions.SetValue(j, static_cast<int64_t>(pos));
      slots.SetValue(j, static_cast<int64_t>(block) * blockSize_ + pos % blockSize_);
      seqLens.SetValue(j, pos + 1);
    }
    for (int32_t j = static_cast<int32_t>(active); j < rows; ++j) {
      tokens.SetValue(j, 0);
      positions.SetValue(j, 0);
      slots.SetValue(j, -1);
    }

    WaitPipe<HardEvent::S_MTE3>(pipe_);
    CopyOut(tokensGm_[offset], tokens, static_cast<uint32_t>(rows));
    CopyOut(positionsGm_[offset], positions, static_cast<uint32_t>(rows));
    CopyOut(slotsGm_[offset], slots, static_cast<uint32_t>(rows));
    if (active > 0) {
      CopyOut(seqLensGm_[offset], seqLens, static_cast<uint32_t>(active));
    }
  }

  AscendC::TPipe pipe_;
  AscendC::TBuf<AscendC::TPosition::VECCALC> seqLensBuf_;
  AscendC::TBuf<AscendC::TPosition::VECCALC> sampledBuf_;
  AscendC::TBuf<AscendC::TPosition::VECCALC> tokensBuf_;
  AscendC::TBuf<AscendC::TPosition::VECCALC> positionsBuf_;
  AscendC::TBuf<AscendC::TPosition::VECCALC> slotsBuf_;

  GlobalTensor<int64_t> sampledGm_;
  GlobalTensor<int32_t> seqLensGm_;
  GlobalTensor<int32_t> blockTablesGm_;
  GlobalTensor<int64_t> tokensGm_;
  GlobalTensor<int64_t> positionsGm_;
  GlobalTensor<int64_t> slotsGm_;

  int64_t rowBegin_ = 0;
  int64_t blockTablesStride_ = 0;
  int32_t rowCount_ = 0;
  int32_t numQueries_ = 0;
  int32_t blockSize_ = 1;
};

}  // namespace

extern "C" __global__ __aicore__ void adv_step_flash_kernel(
    GM_ADDR sampled_token_ids, GM_ADDR seq_lens, GM_ADDR block_tables, GM_ADDR input_tokens,
    GM_ADDR input_positions, GM_ADDR slot_mapping, int32_t num_seqs, int32_t num_queries,
    int32_t block_size, int64_t block_tables_stride, int32_t rows_per_core) {
  AdvStepFlashKernel kernel;
  kernel.Init(sampled_token_ids, seq_lens, block_tables, input_tokens, input_positions,
              slot_mapping, num_seqs, num_queries, block_size, block_tables_stride,
              rows_per_core);
  kernel.Process();
}

#ifndef __CCE_KT_TEST__
extern "C" void AdvStepFlashKernelEntry(uint32_t block_dim, void *stream,
                                        uint8_t *sampled_token_ids, uint8_t *seq_lens,
                                        uint8_t *block_tables, uint8_t *input_tokens,
                                        uint8_t *input_positions, uint8_t *slot_mapping,
                                        int32_t num_seqs, int32_t num_queries,
                                        int32_t block_size, int64_t block_tables_stride,
                                        int32_t rows_per_core) {
  adv_step_flash_kernel<<<block_dim, nullptr, stream>>>(
      sampled_token_ids, seq_lens, block_tables, input_tokens, input_positions, slot_mapping,
      num_seqs, num_queries, block_size, block_tables_stride, rows_per_core);
}
#endif
