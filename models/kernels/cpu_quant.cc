// GGUF block-quantized matmul for the CPU, registered as the XLA FFI custom call "kiln_gguf_matmul".
//
// out (M, N) float32 = x (M, K) float32 @ W.T, W (N, K) stored as GGUF blocks along K (32 weights; 256 for the
// K-quants) in kiln's split layout (kiln.models.gguf_quant): scale holds each block's float16 fields (d, and m or dmin
// where the kind has one) and q the rest of the block's bytes in llama.cpp's order (Q8_0: int8 quants; Q4_0/Q4_1:
// byte j = element j in the low nibble and j + 16 in the high one; Q4_K: 12 bytes of packed 6-bit scales and mins,
// 128 of nibbles; Q5_K: those 12, 32 bytes of fifth bits, 128 of nibbles; Q6_K: 128 of low nibbles, 64 of 2-bit
// highs, 16 int8 scales).
//
// As llama.cpp does: every block of an activation row (32 weights, or 256 for the K-quants as in its Q8_K) is
// quantized on the fly to int8 with its own scale dx = max|x| / 127 (q = round-to-nearest-even(x / dx)). Legacy
// kinds: each block dot is an integer dot of 32 int8 x int8 (or uint4 x int8) products scaled by dw * dx (Q4_1 adds
// m * dx * sum(qx)). K-quants: the 256 unsigned quants times the int8 activations, weighted by the integer sub-block
// scales, summed in int32 over the block, then dx * (d * isum - dmin * sum_j(min_j * sum(qx over sub-block j)));
// Q6_K's quants are stored as v + 32, so its "min" is 32 * scale_j. AVX2 runs 32 products per _mm256_maddubs_epi16;
// with AVX-VNNI or AVX-512 VNNI (chosen at run time) dpbusd fuses it with the pairwise add (legacy kinds). From 2
// activation rows up, the legacy kinds repack 8 (AVX-512: 16) weight rows at a time into an L1 scratch interleaved
// per block (cpu_quant_simd.inc's rows_packed), so that the block dots of all those rows accumulate in int32 lanes
// without horizontal sums. Output rows are split over XLA's intra-op thread pool. The numpy oracle of the same
// arithmetic is kiln.models.kernels.cpu_quant.reference_matmul.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KILN_X86 1
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kBlock = 32, kSuper = 256;  // legacy blocks, K-quant blocks
enum Kind : int32_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4_K = 3, kQ5_K = 4, kQ6_K = 5 };
constexpr int kKinds = 6;

// Per kind (gguf_quant.LAYOUTS): weights per block, bytes per block in q, float16 fields per block in scale.
struct Layout {
  int elems, qbytes, halves;
};
constexpr Layout kLayouts[kKinds] = {{32, 32, 1}, {32, 16, 1}, {32, 16, 2}, {256, 140, 2}, {256, 172, 2}, {256, 208, 1}};
constexpr bool is_k(Kind kind) { return kind >= kQ4_K; }

float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) {
        man <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Activations of M rows quantized per block of E = 32 (legacy kinds) or 256 (K-quants): q (M, K) int8, d (M, K / E),
// ds = d * sum(q) (M, K / 32; legacy kinds); bsum (M, K / 16) int16, the sums of q over 16 (K-quants). dt and dst: d
// and ds transposed, (K / 32, M), so that consecutive rows' scales of one block load as one vector.
struct QuantizedRows {
  int64_t m = 0;
  std::vector<int8_t> q;
  std::vector<float> d, ds, dt, dst;
  std::vector<int32_t> xs;  // sum(q) per 32-block (legacy kinds)
  std::vector<int16_t> bsum;
};

void quantize_rows_k(const float* x, int64_t rows, int64_t k, QuantizedRows& out) {
  for (int64_t r = 0; r < rows * (k / kSuper); ++r) {
    const float* xb = x + r * kSuper;
    float amax = 0.f;
    for (int i = 0; i < kSuper; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    int8_t* q = out.q.data() + r * kSuper;
    for (int i = 0; i < kSuper; ++i) q[i] = static_cast<int8_t>(std::nearbyint(xb[i] * id));
    for (int g = 0; g < kSuper / 16; ++g) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += q[16 * g + i];
      out.bsum[r * (kSuper / 16) + g] = static_cast<int16_t>(sum);
    }
    out.d[r] = d;
  }
}

// The integer sub-block scales of a K-quant block, per 16 weights: sc[16] and mn[16] (Q4_K/Q5_K: the 6-bit scale
// and min of each 32-weight sub-block, twice; Q6_K: its int8 scales, and mn = sc since its stored quants are v + 32).
void k_scales(Kind kind, const uint8_t* wq, int16_t* sc, int16_t* mn) {
  if (kind == kQ6_K) {
    for (int j = 0; j < 16; ++j) sc[j] = mn[j] = static_cast<int8_t>(wq[192 + j]);
    return;
  }
  for (int j = 0; j < 8; ++j) {  // llama.cpp's get_scale_min_k4
    const int s = j < 4 ? wq[j] & 63 : (wq[j + 4] & 0x0f) | ((wq[j - 4] >> 6) << 4);
    const int m = j < 4 ? wq[j + 4] & 63 : (wq[j + 4] >> 4) | ((wq[j] >> 6) << 4);
    sc[2 * j] = sc[2 * j + 1] = static_cast<int16_t>(s);
    mn[2 * j] = mn[2 * j + 1] = static_cast<int16_t>(m);
  }
}

// The 256 unsigned quants of a K-quant block in element order (Q6_K: v + 32).
void k_quants(Kind kind, const uint8_t* wq, uint8_t* u) {
  if (kind == kQ6_K) {
    for (int h = 0; h < 2; ++h) {
      const uint8_t *ql = wq + 64 * h, *qh = wq + 128 + 32 * h;
      for (int l = 0; l < 32; ++l) {
        u[128 * h + l] = (ql[l] & 0x0f) | ((qh[l] & 3) << 4);
        u[128 * h + l + 32] = (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4);
        u[128 * h + l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        u[128 * h + l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
      }
    }
    return;
  }
  const uint8_t *qs = wq + (kind == kQ5_K ? 44 : 12), *qh = wq + 12;
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      const int hi0 = kind == kQ5_K ? ((qh[l] >> (2 * c)) & 1) << 4 : 0;
      const int hi1 = kind == kQ5_K ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0;
      u[64 * c + l] = (qs[32 * c + l] & 0x0f) | hi0;
      u[64 * c + l + 32] = (qs[32 * c + l] >> 4) | hi1;
    }
  }
}

void quantize_rows_scalar(const float* x, int64_t rows, int64_t k, QuantizedRows& out) {
  const int64_t nb = k / kBlock;
  for (int64_t r = 0; r < rows * nb; ++r) {
    const float* xb = x + r * kBlock;
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * id));
      out.q[r * kBlock + i] = static_cast<int8_t>(v);
      sum += v;
    }
    out.d[r] = d;
    out.xs[r] = sum;
    out.ds[r] = d * static_cast<float>(sum);
  }
}

// One weight row against one activation row, scalar (the reference for the SIMD paths and the non-x86 build).
float dot_row_scalar(Kind kind, const uint8_t* wq, const uint16_t* ws, const int8_t* xq, const float* xd,
                     const float* xds, const int16_t* xbsum, int64_t nb) {
  float acc = 0.f;
  if (is_k(kind)) {
    const Layout lay = kLayouts[kind];
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t u[kSuper];
      int16_t sc[16], mn[16];
      k_quants(kind, wq + b * lay.qbytes, u);
      k_scales(kind, wq + b * lay.qbytes, sc, mn);
      int isum = 0, msum = 0;
      for (int i = 0; i < kSuper; ++i) isum += sc[i / 16] * u[i] * xq[b * kSuper + i];
      for (int g = 0; g < 16; ++g) msum += mn[g] * xbsum[b * 16 + g];
      const float d = half_to_float(ws[lay.halves * b]);
      const float dm = kind == kQ6_K ? 32.f * d : half_to_float(ws[2 * b + 1]);
      acc += xd[b] * (d * static_cast<float>(isum) - dm * static_cast<float>(msum));
    }
    return acc;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* xb = xq + b * kBlock;
    int isum = 0;
    if (kind == kQ8_0) {
      const int8_t* w = reinterpret_cast<const int8_t*>(wq) + b * kBlock;
      for (int i = 0; i < kBlock; ++i) isum += w[i] * xb[i];
      acc += half_to_float(ws[b]) * xd[b] * static_cast<float>(isum);
    } else {
      const uint8_t* w = wq + b * (kBlock / 2);
      for (int i = 0; i < kBlock / 2; ++i) {
        isum += (w[i] & 0x0f) * xb[i] + (w[i] >> 4) * xb[i + kBlock / 2];
      }
      if (kind == kQ4_0) {
        int xsum = 0;
        for (int i = 0; i < kBlock; ++i) xsum += xb[i];
        acc += half_to_float(ws[b]) * xd[b] * static_cast<float>(isum - 8 * xsum);
      } else {
        acc += half_to_float(ws[2 * b]) * xd[b] * static_cast<float>(isum) + half_to_float(ws[2 * b + 1]) * xds[b];
      }
    }
  }
  return acc;
}

#ifdef KILN_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {
#define KILN_VNNI 0
#include "cpu_quant_simd.inc"
#undef KILN_VNNI
#undef KILN_DPBUSD256
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avxvnni"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#endif
namespace vnni {
#define KILN_VNNI 1
#include "cpu_quant_simd.inc"
#undef KILN_VNNI
#undef KILN_DPBUSD256
}  // namespace vnni
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"))), \
                             apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#pragma GCC diagnostic push  // GCC 12's AVX-512 headers: _mm512_undefined_ps "may be used uninitialized" under -Wall
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
namespace avx512 {
#define KILN_VNNI 1
#define KILN_AVX512 1
#include "cpu_quant_simd.inc"
#undef KILN_AVX512
#undef KILN_VNNI
#undef KILN_DPBUSD256
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
#endif  // KILN_X86

enum class Isa { kScalar, kAvx2, kVnni, kAvx512 };

// The best path this CPU runs (AVX-512 VNNI, AVX-VNNI, AVX2, scalar).
Isa best_isa() {
#ifdef KILN_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  if (avx512) return Isa::kAvx512;
  if (avx2 && __builtin_cpu_supports("avxvnni")) return Isa::kVnni;
  return avx2 ? Isa::kAvx2 : Isa::kScalar;
#else
  return Isa::kScalar;
#endif
}

// Whether this CPU runs a path (a CPU with AVX-512 VNNI may lack AVX-VNNI: Ice Lake, Cascade Lake).
bool runs(Isa want) {
  const Isa best = best_isa();
#ifdef KILN_X86
  if (want == Isa::kVnni) return best != Isa::kScalar && __builtin_cpu_supports("avxvnni");
#endif
  return static_cast<int>(want) <= static_cast<int>(best);
}

Isa detect_isa() {
  // KILN_CPU_QUANT_ISA = "scalar" / "avx2" / "avx-vnni" pins a slower path (tests, benchmarks) where the CPU runs it
  const char* force = std::getenv("KILN_CPU_QUANT_ISA");
  const char* names[] = {"scalar", "avx2", "avx-vnni", "avx512-vnni"};
  for (int i = 0; force && i < 4; ++i) {
    if (std::strcmp(force, names[i]) == 0 && runs(static_cast<Isa>(i))) return static_cast<Isa>(i);
  }
  return best_isa();
}

std::atomic<int>& chosen_isa() {
  static std::atomic<int> chosen{static_cast<int>(detect_isa())};
  return chosen;
}

Isa isa() { return static_cast<Isa>(chosen_isa().load(std::memory_order_relaxed)); }

void rows_scalar(Kind kind, const uint8_t* q, const uint16_t* s, const QuantizedRows& xr, int64_t m, int64_t k,
                 int64_t n, int64_t n0, int64_t n1, float* out) {
  const Layout lay = kLayouts[kind];
  const int64_t nb = k / lay.elems, row_bytes = nb * lay.qbytes, row_scales = nb * lay.halves;
  for (int64_t r = n0; r < n1; ++r) {
    for (int64_t t = 0; t < m; ++t) {
      out[t * n + r] = dot_row_scalar(kind, q + r * row_bytes, s + r * row_scales, xr.q.data() + t * k,
                                      xr.d.data() + t * nb, is_k(kind) ? nullptr : xr.ds.data() + t * nb,
                                      is_k(kind) ? xr.bsum.data() + t * (k / 16) : nullptr, nb);
    }
  }
}

void rows(Kind kind, const uint8_t* q, const uint16_t* s, const QuantizedRows& xr, int64_t m, int64_t k, int64_t n,
          int64_t n0, int64_t n1, float* out) {
#ifdef KILN_X86
  if (isa() == Isa::kAvx512) {
    // AVX-512 only where its packed paths run (its 16-row one: Q8_0 from 2 rows, the others from 16); elsewhere the AVX-VNNI build where the CPU has it (one row of
    // SmolLM2 decoding: 23.8 against 24.7 CPU ms a step, within the noise of that measurement, but no zmm for nothing)
    static const bool vnni256 = runs(Isa::kVnni);
    if ((!is_k(kind) && m >= (kind == kQ8_0 ? 2 : 4)) || !vnni256) return avx512::rows(kind, q, s, xr, m, k, n, n0, n1, out);
    return vnni::rows(kind, q, s, xr, m, k, n, n0, n1, out);
  }
  if (isa() == Isa::kVnni) return vnni::rows(kind, q, s, xr, m, k, n, n0, n1, out);
  if (isa() == Isa::kAvx2) return avx2::rows(kind, q, s, xr, m, k, n, n0, n1, out);
#endif
  rows_scalar(kind, q, s, xr, m, k, n, n0, n1, out);
}

// Runs fn(chunk) for chunk in [0, total) on the pool's threads and the calling one; returns when all are done. A task
// that starts after the work is gone finds nothing to do (the state is shared, so it outlives this call).
struct Work {
  std::atomic<int64_t> next{0}, done{0};
  int64_t total = 0;
  std::function<void(int64_t)> fn;
  void drain() {
    for (int64_t c; (c = next.fetch_add(1)) < total;) {
      fn(c);
      done.fetch_add(1);
    }
  }
};

int64_t max_threads() {  // KILN_CPU_QUANT_THREADS caps the pool threads a call uses (0 = the calling one only)
  static const int64_t cap = [] {
    const char* v = std::getenv("KILN_CPU_QUANT_THREADS");
    return v ? std::atoll(v) : int64_t{1} << 30;
  }();
  return cap;
}

void parallel_for(ffi::ThreadPool& pool, int64_t total, std::function<void(int64_t)> fn) {
  const int64_t threads = std::min(pool.num_threads(), max_threads());
  if (total <= 1 || threads <= 0) {
    for (int64_t c = 0; c < total; ++c) fn(c);
    return;
  }
  auto work = std::make_shared<Work>();
  work->total = total;
  work->fn = std::move(fn);
  for (int64_t i = 0; i < std::min<int64_t>(threads, total - 1); ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  while (work->done.load() < total) std::this_thread::yield();
}

// out (m, n) = x (m, k) @ the (n, k) weight (q, s); `for_chunks(total, fn)` runs fn(0..total-1), in any order.
template <class ForChunks>
void matmul(const float* x, const uint8_t* qp, const uint16_t* sp, float* op, int64_t m, int64_t k, int64_t n,
            Kind kd, ForChunks&& for_chunks) {
  QuantizedRows xr;
  const int64_t nb = k / kLayouts[kd].elems;
  xr.m = m;
  xr.q.resize(m * k);
  xr.d.resize(m * nb);
  if (is_k(kd)) {
    xr.bsum.resize(m * k / 16);
    quantize_rows_k(x, m, k, xr);
  } else {
    xr.ds.resize(m * nb);
    xr.xs.resize(m * nb);
#ifdef KILN_X86
    if (isa() != Isa::kScalar) {
      avx2::quantize_rows(x, m, k, xr);
    } else {
      quantize_rows_scalar(x, m, k, xr);
    }
#else
    quantize_rows_scalar(x, m, k, xr);
#endif
  }
  if (m >= 4 && !is_k(kd)) {
    xr.dt.resize(m * nb);
    xr.dst.resize(m * nb);
    for (int64_t t = 0; t < m; ++t) {
      for (int64_t b = 0; b < nb; ++b) {
        xr.dt[b * m + t] = xr.d[t * nb + b];
        xr.dst[b * m + t] = xr.ds[t * nb + b];
      }
    }
  }
  // Chunks of output rows for the threads: at least ~64k multiply-adds each (a task costs a few microseconds), at
  // most 64 of them, each a multiple of 16 rows.
  const int64_t macs = m * k * n;
  const int64_t chunks_wanted = std::max<int64_t>(1, std::min<int64_t>(64, macs >> 16));
  const int64_t rows_per_chunk = ((n + chunks_wanted - 1) / chunks_wanted + 15) / 16 * 16;
  const int64_t chunks = (n + rows_per_chunk - 1) / rows_per_chunk;
  for_chunks(chunks, [&](int64_t c) {
    const int64_t n0 = c * rows_per_chunk, n1 = std::min(n, n0 + rows_per_chunk);
    rows(kd, qp, sp, xr, m, k, n, n0, n1, op);
  });
}

ffi::Error matmul_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::AnyBuffer scale,
                       ffi::ResultBuffer<ffi::F32> out, int32_t kind) {
  const auto xd = x.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || od.size() != 2 || xd[0] != od[0]) return ffi::Error::InvalidArgument("bad x/out shapes");
  const int64_t m = xd[0], k = xd[1], n = od[1];
  if (kind < 0 || kind >= kKinds) return ffi::Error::InvalidArgument("unknown GGUF kind");
  const Kind kd = static_cast<Kind>(kind);
  const Layout lay = kLayouts[kd];
  if (k % lay.elems) return ffi::Error::InvalidArgument("K is not a multiple of the kind's block");
  const int64_t want_q = n * (k / lay.elems) * lay.qbytes, want_s = lay.halves * n * (k / lay.elems);
  if (static_cast<int64_t>(q.size_bytes()) != want_q || static_cast<int64_t>(scale.size_bytes()) != 2 * want_s) {
    return ffi::Error::InvalidArgument("q/scale sizes do not match x and out");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  matmul(x.typed_data(), static_cast<const uint8_t*>(q.untyped_data()),
         static_cast<const uint16_t*>(scale.untyped_data()), out->typed_data(), m, k, n, kd,
         [&](int64_t total, const std::function<void(int64_t)>& fn) { parallel_for(pool, total, fn); });
  return ffi::Error::Success();
}


// ---- paged decode attention -------------------------------------------------------------------------------------
//
// out (T, H, D) float32: query token t (H heads, H = KVH * G) attends keys [start_t, lens[t]) of its sequence, read
// straight from the pages (KVH, P, page, D) through its row tables[t] (the K/V of this step already written), start_t
// = max(0, lens[t] - window) with a sliding window; scores q . k * scale, soft-capped as cap * tanh(s / cap) where cap
// > 0, softmax in float32 (max subtracted, exp, sum), then the weighted sum of the values. lens[t] = 0 (padding):
// zeros. One work item is a (token, KV head): its G query heads share every key and value row it loads.

void attend(const float* q, const float* kp, const float* vp, const int32_t* table, int64_t start, int64_t len,
            int64_t num_pages, int64_t max_pages, int64_t ps, int64_t d, int64_t g, float scale, float cap, float* out,
            std::vector<float>& sc) {
  const int64_t l = len - start;
  sc.resize(static_cast<size_t>(g * l + g * d));
  float* s = sc.data();
  float* qs = s + g * l;  // the G query rows, scaled first (as the XLA path does)
  for (int64_t i = 0; i < g * d; ++i) qs[i] = q[i] * scale;
  auto row = [&](const float* pages, int64_t pos) {
    int64_t page = table[std::min<int64_t>(pos / ps, max_pages - 1)];
    page = std::min<int64_t>(std::max<int64_t>(page, 0), num_pages - 1);
    return pages + (page * ps + pos % ps) * d;
  };
  for (int64_t j = 0; j < l; ++j) {
    const float* k = row(kp, start + j);
    for (int64_t h = 0; h < g; ++h) {
      const float* qh = qs + h * d;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= d; i += 8) {
        for (int u = 0; u < 8; ++u) acc[u] += qh[i + u] * k[i + u];
      }
      float dot = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
      for (; i < d; ++i) dot += qh[i] * k[i];
      s[h * l + j] = cap > 0.f ? cap * std::tanh(dot / cap) : dot;
    }
  }
  for (int64_t h = 0; h < g; ++h) {
    float* sh = s + h * l;
    float m = -INFINITY;
    for (int64_t j = 0; j < l; ++j) m = std::fmax(m, sh[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < l; ++j) {
      sh[j] = std::exp(sh[j] - m);
      sum += sh[j];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int64_t j = 0; j < l; ++j) sh[j] *= inv;
  }
  std::fill(out, out + g * d, 0.f);
  for (int64_t j = 0; j < l; ++j) {
    const float* v = row(vp, start + j);
    for (int64_t h = 0; h < g; ++h) {
      const float p = s[h * l + j];
      float* o = out + h * d;
      for (int64_t i = 0; i < d; ++i) o[i] += p * v[i];
    }
  }
}

ffi::Error attention_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                          ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens,
                          ffi::ResultBuffer<ffi::F32> out, float scale, float soft_cap, int32_t window) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), td = tables.dimensions();
  auto same = [](auto a, auto b) { return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin()); };
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || !same(v_pages.dimensions(), kd) || td[0] != qd[0] ||
      lens.dimensions().size() != 1 || lens.dimensions()[0] != qd[0] || !same(out->dimensions(), qd) ||
      kd[3] != qd[2] || kd[0] == 0 || qd[1] % kd[0] || td[1] == 0 || kd[1] == 0) {
    return ffi::Error::InvalidArgument("bad paged attention shapes");
  }
  const int64_t t_n = qd[0], heads = qd[1], d = qd[2], kvh = kd[0], num_pages = kd[1], ps = kd[2], mp = td[1];
  const int64_t g = heads / kvh;
  const float *qp = q.typed_data(), *kp = k_pages.typed_data(), *vp = v_pages.typed_data();
  const int32_t *tp = tables.typed_data(), *lp = lens.typed_data();
  float* op = out->typed_data();
  int64_t keys = 0;
  for (int64_t t = 0; t < t_n; ++t) keys += std::min<int64_t>(std::max<int32_t>(lp[t], 0), mp * ps);
  auto item = [&](int64_t w) {
    thread_local std::vector<float> sc;
    const int64_t t = w / kvh, h = w % kvh;
    const int64_t len = std::min<int64_t>(std::max<int32_t>(lp[t], 0), mp * ps);
    float* o = op + (t * heads + h * g) * d;
    if (len == 0) {
      std::fill(o, o + g * d, 0.f);
      return;
    }
    const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const float *qt = qp + (t * heads + h * g) * d, *kh = kp + h * num_pages * ps * d, *vh = vp + h * num_pages * ps * d;
#ifdef KILN_X86
    if (isa() != Isa::kScalar && d % 8 == 0) {
      return avx2::attend(qt, kh, vh, tp + t * mp, start, len, num_pages, mp, ps, d, g, scale, soft_cap, o, sc);
    }
#endif
    attend(qt, kh, vh, tp + t * mp, start, len, num_pages, mp, ps, d, g, scale, soft_cap, o, sc);
  };
  // a task costs a few microseconds: split only when there are many keys to read (~1 MB of K and V in all)
  if (keys * kvh * d >= (int64_t{1} << 17) && t_n * kvh > 1) {
    parallel_for(pool, t_n * kvh, item);
  } else {
    for (int64_t w = 0; w < t_n * kvh; ++w) item(w);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KilnGgufMatmul, matmul_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x (M, K)
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // scale (float16)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out (M, N)
                                  .Attr<int32_t>("kind"));

// The same matmul on the calling thread, without XLA (tests run every M through it; benchmarks time the kernel
// alone). Returns 0, or 1 on bad arguments.
extern "C" int kiln_gguf_matmul_serial(const float* x, const void* q, const void* scale, float* out, int64_t m,
                                       int64_t k, int64_t n, int32_t kind) {
  if (kind < 0 || kind >= kKinds || k % kLayouts[kind].elems || m <= 0 || n <= 0) return 1;
  matmul(x, static_cast<const uint8_t*>(q), static_cast<const uint16_t*>(scale), out, m, k, n, static_cast<Kind>(kind),
         [](int64_t total, const std::function<void(int64_t)>& fn) {
           for (int64_t c = 0; c < total; ++c) fn(c);
         });
  return 0;
}

// Which SIMD path this CPU runs: 0 scalar, 1 AVX2, 2 AVX-VNNI, 3 AVX-512 VNNI (for logs and tests; ctypes calls it).
extern "C" int kiln_cpu_quant_isa() { return static_cast<int>(isa()); }

// Pins the path (tests run every path in one process); refused (returns -1) where this CPU cannot run it, else the
// path now taken. Not for use while a matmul runs.
extern "C" int kiln_cpu_quant_set_isa(int want) {
  if (want < 0 || want > static_cast<int>(Isa::kAvx512) || !runs(static_cast<Isa>(want))) return -1;
  chosen_isa().store(want);
  return want;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(KilnPagedAttention, attention_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q (T, H, D)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_pages (KVH, P, page, D)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables (T, max_pages): each token's sequence's
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lens (T,): keys visible to the token (0: padding)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out (T, H, D)
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("window"));
