// A float32 matrix product for the CPU backend as an XLA FFI custom call, computed by an
// external BLAS's row-major sgemm (Intel oneMKL's cblas_sgemm, loaded by the Python side and
// handed over with LmpSetSgemm; sequential, one call per task), with the output's rows split
// over XLA's intra-op pool as static, equal blocks.
//
// c [M, N] = op(a) @ op(b): op(a) is a [M, K] or, with trans_a, the transpose of a [K, M];
// op(b) is b [K, N] or, with trans_b, the transpose of b [N, K]. A BLAS reads either layout at
// full speed, so a weight gradient x^T g needs no transposed copy and runs at the GEMM's rate.

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using lm_pipeline_native::parallel_for;

namespace {

// cblas_sgemm(layout, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) with the
// LP64 interface: 32-bit ints, CblasRowMajor = 101, CblasNoTrans = 111, CblasTrans = 112.
using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                         int);
std::atomic<SgemmFn> g_sgemm{nullptr};

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
constexpr int64_t kMaxDim = 2147483647;
constexpr int64_t kRowAlign = 16;  // block starts on a multiple of 16 rows (whole cache lines of c)

ffi::Error Gemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                ffi::ResultBuffer<ffi::F32> c, bool trans_a, bool trans_b) {
  const SgemmFn sgemm = g_sgemm.load();
  if (sgemm == nullptr) return ffi::Error::Internal("gemm: no sgemm was set (LmpSetSgemm)");
  auto ad = a.dimensions(), bd = b.dimensions(), cd = c->dimensions();
  if (ad.size() != 2 || bd.size() != 2 || cd.size() != 2)
    return ffi::Error::InvalidArgument("gemm: operands and result must be 2-D");
  const int64_t M = trans_a ? ad[1] : ad[0], K = trans_a ? ad[0] : ad[1];
  const int64_t KB = trans_b ? bd[1] : bd[0], N = trans_b ? bd[0] : bd[1];
  if (KB != K || cd[0] != M || cd[1] != N)
    return ffi::Error::InvalidArgument("gemm: shapes do not agree ([M, K] @ [K, N] -> [M, N])");
  if (M > kMaxDim || N > kMaxDim || K > kMaxDim) return ffi::Error::InvalidArgument("gemm: a dimension over 2^31 - 1");
  float* out = c->typed_data();
  if (M * N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(out, out + M * N, 0.0f);
    return ffi::Error::Success();
  }
  const float* pa = a.typed_data();
  const float* pb = b.typed_data();
  const int lda = static_cast<int>(ad[1]), ldb = static_cast<int>(bd[1]);
  // Static blocks of rows, one per pool thread (the split a BLAS's own threading makes); tiny
  // products run on the calling thread alone.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t flops = 2 * M * N * K;
  const int64_t tasks = flops < (int64_t{1} << 22) ? 1 : std::min<int64_t>(threads, (M + kRowAlign - 1) / kRowAlign);
  auto item = [&](int64_t t) {
    const int64_t m0 = (M * t / tasks) / kRowAlign * kRowAlign;
    const int64_t m1 = t + 1 == tasks ? M : (M * (t + 1) / tasks) / kRowAlign * kRowAlign;
    if (m1 <= m0) return;
    const float* pa0 = trans_a ? pa + m0 : pa + m0 * lda;
    sgemm(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans, static_cast<int>(m1 - m0),
          static_cast<int>(N), static_cast<int>(K), 1.0f, pa0, lda, pb, ldb, 0.0f, out + m0 * N, static_cast<int>(N));
  };
  if (tasks == 1)
    item(0);
  else
    parallel_for(pool, tasks, item);
  return ffi::Error::Success();
}

}  // namespace

extern "C" void LmpSetSgemm(void* fn) { g_sgemm.store(reinterpret_cast<SgemmFn>(fn)); }

// c [M, N] = op(a) @ op(b) in float32
XLA_FFI_DEFINE_HANDLER_SYMBOL(LmpGemmF32, Gemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"));
