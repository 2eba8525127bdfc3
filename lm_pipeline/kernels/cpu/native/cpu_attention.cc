// Causal self-attention for the CPU backend as XLA FFI custom calls (forward and backward).
//
// Built at first use by lm_pipeline/kernels/cpu/native_attention.py (g++ -O3 -march=<x86-64 level>) and
// registered with jax.ffi; without a compiler the Python side keeps the XLA path. Layouts are
// the model's own: q [B, T, N, H], k/v [B, T, K, H] (N = K * G query heads share k/v head
// n / G), o [B, T, N, H], lse [B, N, T], all float32 and row-major. Work is split over
// (batch, head) pairs on XLA's intra-op thread pool; each pair's products are small
// row-major GEMMs with a register-blocked 6 x 16 kernel (6 x 32 where AVX-512 is built in),
// softmax and its gradient fused between them, so no [T, T] score map is written to memory.
// Each product computes only the blocks the causal mask leaves (about half), and reads a
// transposed operand (P^T, dS^T) in place; only k and v are copied transposed, once per head.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX__
#include <immintrin.h>
#endif

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using lm_pipeline_native::parallel_for;

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8v __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));

constexpr int kBlockQ = 64;  // query rows per block

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void store8(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }
inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

template <typename VT>
constexpr int kLanes = sizeof(VT) / sizeof(float);
template <typename VT>
inline VT loadv(const float* p) {
  VT r;
  std::memcpy(&r, p, sizeof(VT));
  return r;
}
template <typename VT>
inline void storev(float* p, VT x) { std::memcpy(p, &x, sizeof(VT)); }
template <typename VT>
inline VT splatv(float x) { return VT{} + x; }

// C[R, L * V] (+)= op(A)[R, k0:k1] B[k0:k1, L * V] for R <= 6 rows and V <= 2 vectors of
// L = kLanes<VT> columns; op(A) is A (row r at A + r * lda) or, with TA, A^T (A stored [K, M]:
// element (r, k) at A[k * lda + r]), so a transposed operand needs no copy. Each element of C
// sums over k in the same order whatever the vector width, so the 16-lane (AVX-512) and 8-lane
// builds give the same values.
template <typename VT, int R, int V, bool TA>
inline void kernel(int k0, int k1, const float* A, int lda, const float* B, int ldb, float* C, int ldc, bool acc) {
  constexpr int L = kLanes<VT>;
  VT c[R][V];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < V; ++u) c[r][u] = acc ? loadv<VT>(C + r * ldc + L * u) : splatv<VT>(0.f);
  for (int k = k0; k < k1; ++k) {
    VT b[V];
    for (int u = 0; u < V; ++u) b[u] = loadv<VT>(B + k * ldb + L * u);
    for (int r = 0; r < R; ++r) {
      const VT a = splatv<VT>(TA ? A[k * lda + r] : A[r * lda + k]);
      for (int u = 0; u < V; ++u) c[r][u] += a * b[u];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < V; ++u) storev<VT>(C + r * ldc + L * u, c[r][u]);
}

template <int R, bool TA>
void rows_block(int N, int k0, int k1, const float* A, int lda, const float* B, int ldb, float* C, int ldc, bool acc) {
  int j = 0;
#ifdef __AVX512F__
  for (; j + 32 <= N; j += 32) kernel<v16, R, 2, TA>(k0, k1, A, lda, B + j, ldb, C + j, ldc, acc);
  for (; j + 16 <= N; j += 16) kernel<v16, R, 1, TA>(k0, k1, A, lda, B + j, ldb, C + j, ldc, acc);
#else
  for (; j + 16 <= N; j += 16) kernel<v8, R, 2, TA>(k0, k1, A, lda, B + j, ldb, C + j, ldc, acc);
#endif
  for (; j + 8 <= N; j += 8) kernel<v8, R, 1, TA>(k0, k1, A, lda, B + j, ldb, C + j, ldc, acc);
  for (; j < N; ++j) {
    for (int r = 0; r < R; ++r) {
      float s = acc ? C[r * ldc + j] : 0.f;
      for (int k = k0; k < k1; ++k) s += (TA ? A[k * lda + r] : A[r * lda + k]) * B[k * ldb + j];
      C[r * ldc + j] = s;
    }
  }
}

// Which part of a causal product a block of rows [i, i + R) of C needs; the rest is masked
// (zeros in op(A), or columns of C that are zeroed after). `off` is the rows' offset in the
// sequence relative to the columns (kColsTo, kKTo) or to k (kKFrom).
enum class Causal {
  kNone,
  kColsTo,  // C's columns j < off + i + R (scores: query rows see keys up to themselves)
  kKTo,     // terms k < off + i + R (probabilities or their gradient times k/v rows)
  kKFrom,   // terms k >= i - off (transposed probabilities: key rows are seen by later queries)
};

template <int R, bool TA>
void causal_block(int i, int N, int K, const float* A, int lda, const float* B, int ldb, float* C, int ldc, bool acc,
                  Causal mode, int off) {
  int n = N, k0 = 0, k1 = K;
  if (mode == Causal::kColsTo) n = std::min(N, (off + i + R + 7) / 8 * 8);  // whole 8-lane blocks: the same code per column
  if (mode == Causal::kKTo) k1 = std::min(K, off + i + R);
  if (mode == Causal::kKFrom) k0 = std::min(K, std::max(0, i - off));
  rows_block<R, TA>(n, k0, k1, TA ? A + i : A + static_cast<size_t>(i) * lda, lda, B, ldb, C + static_cast<size_t>(i) * ldc,
                    ldc, acc);
}

// C[M, N] (+)= op(A)[M, K] B[K, N], row-major with leading dimensions (op: see kernel), computing
// only what `mode` says the causal mask leaves (the skipped terms are exact zeros).
template <bool TA>
void gemm(int M, int N, int K, const float* A, int lda, const float* B, int ldb, float* C, int ldc, bool acc,
          Causal mode = Causal::kNone, int off = 0) {
  int i = 0;
  for (; i + 6 <= M; i += 6) causal_block<6, TA>(i, N, K, A, lda, B, ldb, C, ldc, acc, mode, off);
  switch (M - i) {
    case 5: causal_block<5, TA>(i, N, K, A, lda, B, ldb, C, ldc, acc, mode, off); break;
    case 4: causal_block<4, TA>(i, N, K, A, lda, B, ldb, C, ldc, acc, mode, off); break;
    case 3: causal_block<3, TA>(i, N, K, A, lda, B, ldb, C, ldc, acc, mode, off); break;
    case 2: causal_block<2, TA>(i, N, K, A, lda, B, ldb, C, ldc, acc, mode, off); break;
    case 1: causal_block<1, TA>(i, N, K, A, lda, B, ldb, C, ldc, acc, mode, off); break;
    default: break;
  }
}

#ifdef __AVX__
// dst[8, 8] = src[8, 8]^T with AVX shuffles.
inline void transpose8(const float* src, int lds, float* dst, int ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#endif

// dst[cols, rows] = src[rows, cols]^T (src leading dimension lds, dst leading dimension ldd).
void transpose(int rows, int cols, const float* src, int lds, float* dst, int ldd) {
  constexpr int kT = 8;
  for (int i0 = 0; i0 < rows; i0 += kT)
    for (int j0 = 0; j0 < cols; j0 += kT) {
#ifdef __AVX__
      if (i0 + kT <= rows && j0 + kT <= cols) {
        transpose8(src + i0 * lds + j0, lds, dst + j0 * ldd + i0, ldd);
        continue;
      }
#endif
      for (int i = i0; i < std::min(rows, i0 + kT); ++i)
        for (int j = j0; j < std::min(cols, j0 + kT); ++j) dst[j * ldd + i] = src[i * lds + j];
    }
}

// exp(x) per lane (Cephes-style: 2^n * poly(r), |rel. error| < 2e-7 on [-87, 88]); the same
// operations on every lane, so 8- and 16-lane vectors give the same values. IT: int32 lanes.
template <typename VT, typename IT>
inline VT expv(VT x) {
  const VT hi = splatv<VT>(88.3762626647949f), lo = splatv<VT>(-87.3365447504f);
  x = x < hi ? x : hi;
  x = x > lo ? x : lo;
  VT fx = x * splatv<VT>(1.44269504088896341f) + splatv<VT>(0.5f);
  VT fl = __builtin_convertvector(__builtin_convertvector(fx, IT), VT);
  fl = fl > fx ? fl - splatv<VT>(1.f) : fl;  // floor
  x = x - fl * splatv<VT>(0.693359375f) - fl * splatv<VT>(-2.12194440e-4f);
  VT y = splatv<VT>(1.9875691500E-4f);
  y = y * x + splatv<VT>(1.3981999507E-3f);
  y = y * x + splatv<VT>(8.3334519073E-3f);
  y = y * x + splatv<VT>(4.1665795894E-2f);
  y = y * x + splatv<VT>(1.6666665459E-1f);
  y = y * x + splatv<VT>(5.0000001201E-1f);
  y = y * x * x + x + splatv<VT>(1.f);
  IT n = __builtin_convertvector(fl, IT);
  n = (n + 127) << 23;
  VT pow2;
  std::memcpy(&pow2, &n, sizeof(pow2));
  return y * pow2;
}

inline v8 exp8(v8 x) { return expv<v8, i8v>(x); }

// p[0:n] *= scale, rounded to float and stored; returns their maximum. Forward and backward
// take the exponent from these stored scores, so both see the same rounded values, and the
// maximum's own exponent is exactly 0 (no fused multiply-add can round `x * scale - max`
// differently from the `max` it subtracts).
inline float scale_row(float* p, int n, float scale) {
  v8 vmx = splat(-INFINITY);
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8 x = load8(p + j) * splat(scale);
    store8(p + j, x);
    vmx = vmx < x ? x : vmx;  // a maximum is exact in any order
  }
  float mx = -INFINITY;
  for (int u = 0; u < 8; ++u) mx = std::max(mx, vmx[u]);
  for (; j < n; ++j) {
    p[j] *= scale;
    mx = std::max(mx, p[j]);
  }
  return mx;
}

// p[0:n] = exp(p[0:n] - sub); returns their sum.
inline float exp_row(float* p, int n, float sub) {
  v8 acc = splat(0.f);
  int j = 0;
#ifdef __AVX512F__
  for (; j + 16 <= n; j += 16) {  // 16 lanes at a time, summed in the 8-lane order
    const v16 e = expv<v16, i16v>(loadv<v16>(p + j) - splatv<v16>(sub));
    storev<v16>(p + j, e);
    acc += loadv<v8>(p + j);
    acc += loadv<v8>(p + j + 8);
  }
#endif
  for (; j + 8 <= n; j += 8) {
    v8 e = exp8(load8(p + j) - splat(sub));
    store8(p + j, e);
    acc += e;
  }
  float s = acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
  if (j < n) {
    float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int t = j; t < n; ++t) tmp[t - j] = p[t];
    v8 e = exp8(load8(tmp) - splat(sub));
    for (int t = j; t < n; ++t) {
      p[t] = e[t - j];
      s += e[t - j];
    }
  }
  return s;
}

// out[i] = sum_h a[i * ld + h] * b[i * ld + h], each product rounded and added in the order of h
// (no fused multiply-add, on every ISA level); with AVX eight rows at a time, one per lane, from
// 8 x 8 blocks transposed in registers.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
void row_dots(int T, int H, const float* a, const float* b, int ld, float* out) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  int i = 0;
#ifdef __AVX__
  const int H8 = H / 8 * 8;
  alignas(32) float ta[8][8], tb[8][8], acc8[8];
  for (; i + 8 <= T; i += 8) {
    v8 acc = splat(0.f);
    for (int h0 = 0; h0 < H8; h0 += 8) {
      transpose8(a + i * ld + h0, ld, &ta[0][0], 8);
      transpose8(b + i * ld + h0, ld, &tb[0][0], 8);
      for (int hh = 0; hh < 8; ++hh) {
        const v8 prod = load8(ta[hh]) * load8(tb[hh]);
        acc = acc + prod;
      }
    }
    store8(acc8, acc);
    for (int l = 0; l < 8; ++l) {
      float s = acc8[l];
      for (int h = H8; h < H; ++h) {
        const float prod = a[(i + l) * ld + h] * b[(i + l) * ld + h];
        s = s + prod;
      }
      out[i + l] = s;
    }
  }
#endif
  for (; i < T; ++i) {
    float s = 0.f;
    for (int h = 0; h < H; ++h) {
      const float prod = a[i * ld + h] * b[i * ld + h];
      s = s + prod;
    }
    out[i] = s;
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

// Per-thread buffers are kept between items and calls; one over 1 MB (a long sequence's) is freed
// after each item, so a pool thread does not hold it for the rest of the process.
constexpr size_t kKeepFloats = size_t{1} << 18;
template <typename... Bufs>
void release_large(Bufs&... bufs) {
  ((bufs.capacity() > kKeepFloats ? std::vector<float>().swap(bufs) : void()), ...);
}

struct Dims {
  int64_t B, T, N, K, H, G;
};

ffi::Error dims_of(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k, Dims* d) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4) return ffi::Error::InvalidArgument("attention: q and k must be [B, T, heads, H]");
  *d = Dims{qd[0], qd[1], qd[2], kd[2], qd[3], 0};
  if (kd[0] != d->B || kd[1] != d->T || kd[3] != d->H || d->K == 0 || d->N % d->K != 0)
    return ffi::Error::InvalidArgument("attention: k/v shape does not match q");
  d->G = d->N / d->K;
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::F32> scale_buf, ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> lse) {
  Dims d;
  if (auto err = dims_of(q, k, &d); err.failure()) return err;
  const float scale = scale_buf.typed_data()[0];
  const float* Q = q.typed_data();
  const float* Kp = k.typed_data();
  const float* V = v.typed_data();
  float* O = o->typed_data();
  float* LSE = lse->typed_data();
  const int T = d.T, H = d.H;
  const int ldq = d.N * H, ldk = d.K * H;
  auto item = [&](int64_t idx) {
    const int64_t b = idx / d.N, n = idx % d.N, kh = n / d.G;
    thread_local std::vector<float> kt, s;  // per thread, reused: no allocation per item
    kt.resize(static_cast<size_t>(H) * T);
    s.resize(static_cast<size_t>(kBlockQ) * T);
    const float* kb = Kp + (b * T * d.K + kh) * H;
    transpose(T, H, kb, ldk, kt.data(), T);  // kt [H, T]
    const float* qb = Q + (b * T * d.N + n) * H;
    const float* vb = V + (b * T * d.K + kh) * H;
    float* ob = O + (b * T * d.N + n) * H;
    float* lb = LSE + (b * d.N + n) * T;
    for (int r0 = 0; r0 < T; r0 += kBlockQ) {
      const int rows = std::min(kBlockQ, T - r0), L = r0 + rows;
      gemm<false>(rows, L, H, qb + r0 * ldq, ldq, kt.data(), T, s.data(), L, false, Causal::kColsTo, r0);
      for (int r = 0; r < rows; ++r) {
        float* sr = s.data() + r * L;
        const int n_valid = r0 + r + 1;
        const float mx = scale_row(sr, n_valid, scale);
        const float sum = exp_row(sr, n_valid, mx);
        const float inv = 1.f / sum;
        for (int j = 0; j < n_valid; ++j) sr[j] *= inv;
        std::fill(sr + n_valid, sr + L, 0.f);
        lb[r0 + r] = mx + std::log(sum);
      }
      gemm<false>(rows, H, L, s.data(), L, vb, ldk, ob + r0 * ldq, ldq, false, Causal::kKTo, r0);
    }
    release_large(kt, s);
  };
  parallel_for(pool, d.B * d.N, item);
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                    ffi::Buffer<ffi::F32> scale_buf, ffi::Buffer<ffi::F32> o, ffi::Buffer<ffi::F32> lse,
                    ffi::Buffer<ffi::F32> dout, ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                    ffi::ResultBuffer<ffi::F32> dv) {
  Dims d;
  if (auto err = dims_of(q, k, &d); err.failure()) return err;
  const float scale = scale_buf.typed_data()[0];
  const float *Q = q.typed_data(), *Kp = k.typed_data(), *V = v.typed_data();
  const float *O = o.typed_data(), *LSE = lse.typed_data(), *DO = dout.typed_data();
  float *DQ = dq->typed_data(), *DK = dk->typed_data(), *DV = dv->typed_data();
  const int T = d.T, H = d.H;
  const int ldq = d.N * H, ldk = d.K * H;
  auto item = [&](int64_t idx) {
    const int64_t b = idx / d.K, kh = idx % d.K;
    const size_t TH = static_cast<size_t>(T) * H;
    thread_local std::vector<float> kt, vt, p, dp, delta, dkb, dvb;  // per thread, reused
    for (auto* buf : {&kt, &vt}) buf->resize(TH);
    for (auto* buf : {&p, &dp}) buf->resize(static_cast<size_t>(kBlockQ) * T);
    delta.resize(T);
    dkb.assign(TH, 0.f);
    dvb.assign(TH, 0.f);
    const float* kb = Kp + (b * T * d.K + kh) * H;
    const float* vb = V + (b * T * d.K + kh) * H;
    transpose(T, H, kb, ldk, kt.data(), T);
    transpose(T, H, vb, ldk, vt.data(), T);
    for (int64_t g = 0; g < d.G; ++g) {
      const int64_t n = kh * d.G + g;
      const size_t off = (b * T * d.N + n) * H;
      const float *qb = Q + off, *ob = O + off, *dob = DO + off, *lb = LSE + (b * d.N + n) * T;
      float* dqb = DQ + off;
      row_dots(T, H, dob, ob, ldq, delta.data());  // delta_i = dO_i . O_i
      for (int r0 = 0; r0 < T; r0 += kBlockQ) {
        const int rows = std::min(kBlockQ, T - r0), L = r0 + rows;
        gemm<false>(rows, L, H, qb + r0 * ldq, ldq, kt.data(), T, p.data(), L, false, Causal::kColsTo, r0);  // scores
        for (int r = 0; r < rows; ++r) {
          float* pr = p.data() + r * L;
          const int n_valid = r0 + r + 1;
          scale_row(pr, n_valid, scale);
          exp_row(pr, n_valid, lb[r0 + r]);
          std::fill(pr + n_valid, pr + L, 0.f);
        }
        // dV += P^T dO
        gemm<true>(L, H, rows, p.data(), L, dob + r0 * ldq, ldq, dvb.data(), H, true, Causal::kKFrom, r0);
        // dP = dO V^T
        gemm<false>(rows, L, H, dob + r0 * ldq, ldq, vt.data(), T, dp.data(), L, false, Causal::kColsTo, r0);
        for (int r = 0; r < rows; ++r) {
          float *pr = p.data() + r * L, *dpr = dp.data() + r * L;
          const float dl = delta[r0 + r];
          const int n_valid = r0 + r + 1;
          for (int j = 0; j < n_valid; ++j) dpr[j] = pr[j] * (dpr[j] - dl) * scale;  // dS (scaled)
          std::fill(dpr + n_valid, dpr + L, 0.f);  // masked (dP was not computed there)
        }
        gemm<false>(rows, H, L, dp.data(), L, kb, ldk, dqb + r0 * ldq, ldq, false, Causal::kKTo, r0);  // dQ = dS K
        gemm<true>(L, H, rows, dp.data(), L, qb + r0 * ldq, ldq, dkb.data(), H, true, Causal::kKFrom, r0);  // dK += dS^T Q
      }
    }
    float* dkout = DK + (b * T * d.K + kh) * H;
    float* dvout = DV + (b * T * d.K + kh) * H;
    for (int i = 0; i < T; ++i) {
      std::memcpy(dkout + i * ldk, dkb.data() + i * H, H * sizeof(float));
      std::memcpy(dvout + i * ldk, dvb.data() + i * H, H * sizeof(float));
    }
    release_large(kt, vt, p, dp, delta, dkb, dvb);
  };
  parallel_for(pool, d.B * d.K, item);
  return ffi::Error::Success();
}

}  // namespace

using F32Buffer = ffi::Buffer<ffi::F32>;

// q, k, v, scale [1] -> o, lse
XLA_FFI_DEFINE_HANDLER_SYMBOL(LmpCausalAttentionFwd, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Buffer>()
                                  .Arg<F32Buffer>()
                                  .Arg<F32Buffer>()
                                  .Arg<F32Buffer>()
                                  .Ret<F32Buffer>()
                                  .Ret<F32Buffer>());

// q, k, v, scale [1], o, lse, dO -> dq, dk, dv
XLA_FFI_DEFINE_HANDLER_SYMBOL(LmpCausalAttentionBwd, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Buffer>()
                                  .Arg<F32Buffer>()
                                  .Arg<F32Buffer>()
                                  .Arg<F32Buffer>()
                                  .Arg<F32Buffer>()
                                  .Arg<F32Buffer>()
                                  .Arg<F32Buffer>()
                                  .Ret<F32Buffer>()
                                  .Ret<F32Buffer>()
                                  .Ret<F32Buffer>());
