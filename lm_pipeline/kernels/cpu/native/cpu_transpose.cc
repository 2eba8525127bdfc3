// A 2-D transpose for the CPU backend as an XLA FFI custom call: x [M, K] -> [K, M], any
// element type of 2 or 4 bytes (bits are copied, never converted).
//
// XLA:CPU folds a transpose that feeds a dot into the dot's dimension numbers. For a weight
// gradient x^T g that form goes to Eigen (f32), and with bf16 operands XLA computes the product
// in f32. Behind this opaque call the product is a plain [K, M] @ [M, N] that YNNPACK takes at
// the operands' own precision (bf16 x bf16 -> f32 on AVX512-BF16 / AMX). Tiles of 16 x 16
// elements go through a register-sized block; tile rows are split over XLA's intra-op pool.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using lm_pipeline_native::parallel_for;

namespace {

constexpr int64_t kTile = 16;

// out[k, m] = in[m, k] for m in [m0, m1), all k.
template <typename T>
void transpose_rows(const T* in, T* out, int64_t M, int64_t K, int64_t m0, int64_t m1) {
  for (int64_t k0 = 0; k0 < K; k0 += kTile) {
    const int64_t k1 = std::min(K, k0 + kTile);
    if (m1 - m0 == kTile && k1 - k0 == kTile) {
      T tile[kTile][kTile];
      for (int64_t i = 0; i < kTile; ++i) std::memcpy(tile[i], in + (m0 + i) * K + k0, sizeof(T) * kTile);
      for (int64_t j = 0; j < kTile; ++j) {
        T row[kTile];
        for (int64_t i = 0; i < kTile; ++i) row[i] = tile[i][j];
        std::memcpy(out + (k0 + j) * M + m0, row, sizeof(T) * kTile);
      }
    } else {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t k = k0; k < k1; ++k) out[k * M + m] = in[m * K + k];
    }
  }
}

ffi::Error Transpose(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  auto d = x.dimensions();
  if (d.size() != 2) return ffi::Error::InvalidArgument("transpose: the operand must be 2-D");
  const int64_t M = d[0], K = d[1];
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != K || yd[1] != M || y->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("transpose: the result must be [K, M] of the operand's type");
  const size_t bytes = ffi::ByteWidth(x.element_type());
  if (bytes != 2 && bytes != 4) return ffi::Error::InvalidArgument("transpose: elements must be 2 or 4 bytes");
  if (M * K == 0) return ffi::Error::Success();
  const int64_t blocks = (M + kTile - 1) / kTile;
  // Few large tasks: each pool hand-off costs more than a small tile's copy.
  const int64_t tasks = std::min<int64_t>(blocks, std::max<int64_t>(pool.num_threads(), 1) * 4);
  auto item = [&](int64_t t) {
    const int64_t b0 = blocks * t / tasks, b1 = blocks * (t + 1) / tasks;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t m0 = b * kTile, m1 = std::min(M, m0 + kTile);
      if (bytes == 4)
        transpose_rows(static_cast<const uint32_t*>(x.untyped_data()), static_cast<uint32_t*>(y->untyped_data()), M,
                       K, m0, m1);
      else
        transpose_rows(static_cast<const uint16_t*>(x.untyped_data()), static_cast<uint16_t*>(y->untyped_data()), M,
                       K, m0, m1);
    }
  };
  parallel_for(pool, tasks, item);
  return ffi::Error::Success();
}

}  // namespace

// x [M, K] -> x^T [K, M]
XLA_FFI_DEFINE_HANDLER_SYMBOL(LmpTranspose, Transpose,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
