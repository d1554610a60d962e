// Statistics of one float32 value in one read, as an XLA FFI custom call (CPU).
//
// Computes exactly what `kernel.finalize` publishes from raw rows (see DESIGN.md, "The
// probe"): sums of x and x^2, the squared deviations from the mean (each chunk's about
// its own mean, pooled by Chan's formula), the squared rounding error against each
// audited format, zero / non-finite / underflow / subnormal / overflow counts, the
// abs-max and the exponent histogram. Rounding to a format is integer work on the float32 bit pattern
// (round to nearest even on the dropped mantissa bits; a fixed step in the format's
// subnormal range), so no float8 conversion is needed and every format costs the same.
//
// The value is read in chunks of kChunk elements that stay in L1: pass one finds the
// chunk's abs-max, pass two accumulates every feature in float32 lanes in units of the
// chunk's power of two (squares of any float32 neither overflow nor underflow), pass
// three counts exponents. Chunk sums go into double totals; the result is expressed in
// units of the value's abs-max power of two, as the pure-XLA kernel does.
//
// Inputs are float32, float16, bfloat16 or any 8-bit float type (widened through a
// 256-entry table). Like XLA on CPU, float32 subnormal inputs count as zero.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using scalescope::Loader;

// Wall time spent in the kernel and calls made, for benchmarks (scalescope_stats_clock).
std::atomic<uint64_t> g_nanos{0}, g_calls{0};

// Lanes per vector: as wide as the CPU's vectors (16 with AVX-512, 8 with AVX, else 4;
// generic vectors wider than the CPU's compile to scalar code, 10x slower).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
constexpr int kVecBytes = 4 * kLanes;
typedef float v8f __attribute__((vector_size(kVecBytes)));
typedef int32_t v8i __attribute__((vector_size(kVecBytes)));
typedef uint32_t v8u __attribute__((vector_size(kVecBytes)));

constexpr int kMaxFormats = 8;
constexpr int64_t kChunk = 256;               // elements per chunk (a multiple of 8)
// Values this big use several threads. XLA already runs independent custom calls side by
// side on its own threads, so only values large enough to leave those idle are split.
constexpr int64_t kParallelMin = int64_t{1} << 22;
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kMinNormalBits = 0x00800000u;  // FLT_MIN
constexpr uint32_t kInfBits = 0x7f800000u;

struct Fmt {
  bool round;        // false: the format is float32 itself (nothing to round)
  int shift;         // mantissa bits dropped: 23 - mantissa bits
  uint32_t half_m1;  // (1 << (shift - 1)) - 1
  uint32_t keep;     // ~((1 << shift) - 1)
  float max, min_normal, magic;  // magic: min_subnormal * 2^23 (subnormal-range rounding)
  uint32_t max_bits;
  // |x| above `nonzero` rounds to a non-zero value (min_subnormal / 2 ties to 0); |x| at
  // or above `normal` rounds to a normal one (min_normal - min_subnormal / 2 ties up).
  float nonzero, normal;
};

struct Totals {
  double sum = 0, sumsq = 0;
  // Squared deviations from the mean, over `finite` elements, pooled chunk by chunk by
  // Chan's formula: sumsq / n - mean^2 cancels where the mean dwarfs the spread.
  double m2 = 0;
  int64_t finite = 0;
  double err2[kMaxFormats] = {};
  int64_t nonzero_q[kMaxFormats] = {}, normal_q[kMaxFormats] = {}, over[kMaxFormats] = {};
  int64_t nan = 0;
  int64_t hist[256] = {};  // by float32 exponent field: 0 zero (or flushed), 255 non-finite
  uint32_t lanes[8][256] = {};  // hist being counted: 8 interleaved copies (no store stalls)
  float amax = 0;
  // Over finite elements (subnormals read as 0): the largest, the negated smallest, and
  // the negated smallest non-zero magnitude; -inf while none was seen.
  float top = -INFINITY, negmin = -INFINITY, negabsmin = -INFINITY;
};

inline v8u as_u(v8f v) { return (v8u)v; }
inline v8f as_f(v8u v) { return (v8f)v; }

inline float hmax(v8f v) {
  float m = v[0];
  for (int j = 1; j < kLanes; ++j) m = std::max(m, v[j]);
  return m;
}

inline double hsum(v8f v) {
  double s = 0;
  for (int j = 0; j < kLanes; ++j) s += v[j];
  return s;
}

inline int64_t hcount(v8i v) {  // lanes hold negated counts (masks are -1)
  int64_t s = 0;
  for (int j = 0; j < kLanes; ++j) s -= v[j];
  return s;
}

// Exponent of a positive normal float (floor(log2)), from its bits; 0 for 0.
inline int exponent_of(float a) {
  if (!(a >= 1.1754944e-38f)) return 0;
  uint32_t b;
  std::memcpy(&b, &a, 4);
  return std::clamp(int(b >> 23) - 127, -126, 126);
}

// kLanes elements at p: x with non-finite and subnormal elements set to 0; `ab` gets the
// bits of |x| (inf and NaN included), `keep` the mask of the elements kept.
inline v8f finite_lanes(const float* p, v8u& ab, v8u& keep) {
  v8f v;
  std::memcpy(&v, p, kVecBytes);
  v8u xb = as_u(v);
  ab = xb & kAbsMask;
  keep = (ab < kMinNormalBits || ab >= kInfBits) ? 0u : 0xffffffffu;
  return as_f(xb & keep);
}

// Chan's formula: `n` more finite elements, of sum `sum` and squared deviations `m2`
// from their own mean, pooled into t's m2 (before t.sum takes `sum` in).
inline void pool_moments(Totals& t, int64_t n, double sum, double m2) {
  if (n == 0) return;
  if (t.finite > 0) {
    double d = sum / double(n) - t.sum / double(t.finite);
    m2 += d * d * (double(t.finite) * double(n) / double(t.finite + n));
  }
  t.m2 += m2;
  t.finite += n;
}

// One chunk of n8 elements (a multiple of kLanes and of 8, n8 <= kChunk) into totals.
void chunk_stats(const float* x, int64_t n8, const Fmt* fmts, int nf, Totals& t) {
  // Pass one: sums, abs-max, NaN count; |x| (finite, normal, else 0) and its bits (all)
  // kept for the format passes. While the chunk's abs-max lies in [1, 2^60) (unit-scaled
  // data) squares need no scaling: neither overflows, and what flushes to zero is below
  // 2^-126 of the abs-max squared, as in units of its power of two. Otherwise the sums are
  // taken again in units of the chunk's power of two.
  v8f s1 = {}, s2 = {}, vmax = {};
  const v8f ninf = -INFINITY - v8f{};
  v8f vtop = ninf, vnegmin = ninf, vnegabs = ninf;
  v8i c_nan = {}, c_nonfinite = {};
  alignas(64) float abs_buf[kChunk];
  alignas(64) uint32_t bits_buf[kChunk];
  for (int64_t i = 0; i < n8; i += kLanes) {
    v8u ab, keep;
    v8f xf = finite_lanes(x + i, ab, keep);
    s1 += xf;
    s2 += xf * xf;
    c_nan += (v8i)(ab > kInfBits);
    c_nonfinite += (v8i)(ab >= kInfBits);
    v8f af = as_f(ab & keep);
    vmax = af > vmax ? af : vmax;
    v8f hi = ab < kInfBits ? xf : ninf, lo = ab < kInfBits ? -xf : ninf;
    v8f nz = af > 0 ? -af : ninf;
    vtop = hi > vtop ? hi : vtop;
    vnegmin = lo > vnegmin ? lo : vnegmin;
    vnegabs = nz > vnegabs ? nz : vnegabs;
    std::memcpy(abs_buf + i, &af, kVecBytes);
    std::memcpy(bits_buf + i, &ab, kVecBytes);
  }
  float amax = hmax(vmax);
  t.amax = std::max(t.amax, amax);
  t.top = std::max(t.top, hmax(vtop));
  t.negmin = std::max(t.negmin, hmax(vnegmin));
  t.negabsmin = std::max(t.negabsmin, hmax(vnegabs));
  int k = 0;
  if (amax > 0 && (amax >= 0x1p60f || amax < 1.0f)) {
    k = exponent_of(amax);
    const v8f u = std::ldexp(1.0f, -k) - v8f{};
    s1 = v8f{};
    s2 = v8f{};
    for (int64_t i = 0; i < n8; i += kLanes) {
      v8u ab, keep;
      v8f xs = finite_lanes(x + i, ab, keep) * u;
      s1 += xs;
      s2 += xs * xs;
    }
  }
  const v8f u = std::ldexp(1.0f, -k) - v8f{};

  // The chunk's squared deviations from its own mean (in units of 2^k; the chunk is in
  // L1), minus the square of their sum, which the rounding of the mean leaves.
  const int64_t n_fin = n8 - hcount(c_nonfinite);
  double chunk_m2 = 0, chunk_mean = 0, chunk_sum = hsum(s1);
  if (n_fin > 0) {
    chunk_mean = hsum(s1) / double(n_fin);
    const v8f mean = float(chunk_mean) - v8f{};
    v8f d1 = {}, d2 = {};
    for (int64_t i = 0; i < n8; i += kLanes) {
      v8u ab, keep;
      v8f xs = finite_lanes(x + i, ab, keep) * u;
      v8f d = ab < kInfBits ? xs - mean : v8f{};  // subnormals are zeros, and counted
      d1 += d;
      d2 += d * d;
    }
    double sd = hsum(d1);
    chunk_m2 = std::max(hsum(d2) - sd * sd / double(n_fin), 0.0);
    // The chunk's sum from its small deviations: float32 lanes summing large values
    // round by an ulp of the sum, which the pooling would read as a spread of the means.
    chunk_sum = double(n_fin) * double(float(chunk_mean)) + sd;
  }

  // Then one pass per format over the (L1-resident) chunk, so each format's constants and
  // accumulators stay in registers: rounding error (in units of 2^k) and range flags.
  v8f e2[kMaxFormats] = {};
  v8i c_nz[kMaxFormats] = {}, c_norm[kMaxFormats] = {}, c_over[kMaxFormats] = {};
  for (int f = 0; f < nf; ++f) {
    const Fmt& F = fmts[f];
    const v8f fmax = F.max - v8f{}, magic = F.magic - v8f{}, mn = F.min_normal - v8f{};
    const v8f nonzero = F.nonzero - v8f{}, normal = F.normal - v8f{};
    v8f acc = {};
    v8i nz = {}, norm = {}, over = {};
    for (int64_t i = 0; i < n8; i += kLanes) {
      v8f a;
      v8u ab;
      std::memcpy(&a, abs_buf + i, kVecBytes);
      std::memcpy(&ab, bits_buf + i, kVecBytes);
      v8f ac = a < fmax ? a : fmax;
      v8f q = ac;
      if (F.round) {
        v8u b = as_u(ac);
        v8u r = (b + F.half_m1 + ((b >> F.shift) & 1u)) & F.keep;
        v8f qs = (ac + magic) - magic;
        q = ac >= mn ? as_f(r) : qs;
      }
      v8f err = (a - q) * u;
      acc += err * err;
      nz += (v8i)(a > nonzero);
      norm += (v8i)(a >= normal);
      over += (v8i)(ab > F.max_bits);  // inf too; NaN is taken back out at the end
    }
    e2[f] = acc;
    c_nz[f] = nz;
    c_norm[f] = norm;
    c_over[f] = over;
  }
  double unit_back = std::ldexp(1.0, k);
  pool_moments(t, n_fin, chunk_sum * unit_back, chunk_m2 * unit_back * unit_back);
  t.sum += chunk_sum * unit_back;
  t.sumsq += hsum(s2) * unit_back * unit_back;
  t.nan += hcount(c_nan);
  for (int f = 0; f < nf; ++f) {
    t.err2[f] += hsum(e2[f]) * unit_back * unit_back;
    t.nonzero_q[f] += hcount(c_nz[f]);
    t.normal_q[f] += hcount(c_norm[f]);
    t.over[f] += hcount(c_over[f]);
  }

  // Pass three: exponent field counts (zero and flushed subnormals in 0, non-finite 255).
  for (int64_t i = 0; i < n8; i += 8) {  // n8 is a multiple of 8
    for (int j = 0; j < 8; ++j) ++t.lanes[j][bits_buf[i + j] >> 23];
  }
}

// Fold the interleaved counts into the histogram (before their 32 bits could wrap).
void fold_lanes(Totals& t) {
  for (int e = 0; e < 256; ++e) {
    for (int j = 0; j < 8; ++j) {
      t.hist[e] += t.lanes[j][e];
      t.lanes[j][e] = 0;
    }
  }
}

void range_stats(const Loader& in, int64_t lo, int64_t hi, const Fmt* fmts, int nf,
                 Totals& t) {
  alignas(64) float buf[kChunk];
  int64_t since_fold = 0;
  for (int64_t i = lo; i < hi; i += kChunk) {
    if ((since_fold += kChunk) >= (int64_t{1} << 30)) {
      fold_lanes(t);
      since_fold = 0;
    }
    int64_t count = std::min(kChunk, hi - i);
    constexpr int64_t kPad = kLanes > 8 ? kLanes : 8;  // whole vectors, whole histogram rows
    int64_t n8 = (count + kPad - 1) / kPad * kPad;
    in.load(i, count, buf);
    // A partial chunk is padded with NaNs, taken back out of the non-finite count (they
    // stay in `nan`, which only corrects the overflow counts, where they also are).
    std::fill(buf + count, buf + n8, NAN);
    chunk_stats(buf, n8, fmts, nf, t);
    t.hist[255] -= n8 - count;
  }
  fold_lanes(t);
}

void merge(Totals& into, const Totals& t, int nf) {
  pool_moments(into, t.finite, t.sum, t.m2);
  into.sum += t.sum;
  into.sumsq += t.sumsq;
  into.nan += t.nan;
  for (int f = 0; f < nf; ++f) {
    into.err2[f] += t.err2[f];
    into.nonzero_q[f] += t.nonzero_q[f];
    into.normal_q[f] += t.normal_q[f];
    into.over[f] += t.over[f];
  }
  for (int e = 0; e < 256; ++e) into.hist[e] += t.hist[e];
  into.amax = std::max(into.amax, t.amax);
  into.top = std::max(into.top, t.top);
  into.negmin = std::max(into.negmin, t.negmin);
  into.negabsmin = std::max(into.negabsmin, t.negabsmin);
}

// One call's work, with everything it needs copied out of the call's attributes (an
// asynchronous call runs it after the handler has returned).
struct Job {
  Loader in;
  int64_t n = 0;
  Fmt fmts[kMaxFormats];
  int nf = 0;
  int64_t n_hist = 0, hist_lo = 0;
  int64_t threads = 1;
  float* of = nullptr;
  int32_t* oi = nullptr;
};

ffi::Error prepare(Job& job, ffi::AnyBuffer x, ffi::Span<const float> lut,
                          ffi::Span<const int64_t> mantissa, ffi::Span<const float> fmax,
                          ffi::Span<const float> min_normal,
                          ffi::Span<const float> min_subnormal, int64_t hist_lo,
                          int64_t hist_hi, int64_t threads, ffi::Result<ffi::Buffer<ffi::F32>> out_f,
                          ffi::Result<ffi::Buffer<ffi::S32>> out_i) {
  const int nf = static_cast<int>(mantissa.size());
  if (nf > kMaxFormats || fmax.size() != mantissa.size() ||
      min_normal.size() != mantissa.size() || min_subnormal.size() != mantissa.size()) {
    return ffi::Error::InvalidArgument("scalescope_stats: bad format attributes");
  }
  job.nf = nf;
  job.n_hist = hist_hi >= hist_lo ? hist_hi - hist_lo + 5 : 0;
  job.hist_lo = hist_lo;
  if (out_f->element_count() != static_cast<size_t>(7 + nf) ||
      out_i->element_count() != static_cast<size_t>(3 + 3 * nf + job.n_hist)) {
    return ffi::Error::InvalidArgument("scalescope_stats: bad output sizes");
  }
  for (int f = 0; f < nf; ++f) {
    Fmt& F = job.fmts[f];
    F.shift = 23 - static_cast<int>(mantissa[f]);
    F.round = F.shift > 0;
    F.half_m1 = F.round ? (1u << (F.shift - 1)) - 1u : 0u;
    F.keep = F.round ? ~((1u << F.shift) - 1u) : 0xffffffffu;
    F.max = fmax[f];
    F.min_normal = min_normal[f];
    F.magic = std::ldexp(min_subnormal[f], 23);
    std::memcpy(&F.max_bits, &F.max, 4);
    // Thresholds in float32: sub/2 is a power of two; normal - sub/2 is exact when the
    // format is narrower than float32, and float32 itself has nothing to round.
    F.nonzero = F.round ? 0.5f * min_subnormal[f] : 0.0f;
    F.normal = F.round ? min_normal[f] - 0.5f * min_subnormal[f] : min_normal[f];
  }
  const ffi::DataType dtype = x.element_type();
  const bool byte = ffi::ByteWidth(dtype) == 1;
  if (!(dtype == ffi::DataType::F32 || dtype == ffi::DataType::F16 ||
        dtype == ffi::DataType::BF16 || byte) ||
      (byte && lut.size() != 256)) {
    return ffi::Error::InvalidArgument("scalescope_stats: unsupported input type");
  }
  // The 8-bit table lives in the call's attributes, which outlive an asynchronous run
  // (they belong to the compiled program).
  job.in = Loader{dtype, x.untyped_data(), lut.begin()};
  job.n = static_cast<int64_t>(x.element_count());
  job.threads = threads;
  job.of = out_f->typed_data();
  job.oi = out_i->typed_data();
  return ffi::Error::Success();
}

void run_job(const Job& job) {
  const auto started = std::chrono::steady_clock::now();
  const int nf = job.nf;
  const int64_t n = job.n, n_hist = job.n_hist, hist_lo = job.hist_lo;
  const Loader& in = job.in;
  const Fmt* fmts = job.fmts;
  Totals total;
  int64_t n_threads = std::max<int64_t>(1, std::min<int64_t>(job.threads, n / kParallelMin));
  if (n_threads <= 1) {
    range_stats(in, 0, n, fmts, nf, total);
  } else {
    std::vector<Totals> parts(n_threads);
    std::vector<std::thread> pool;
    int64_t per = (n / n_threads) / kChunk * kChunk;
    for (int64_t p = 0; p < n_threads; ++p) {
      int64_t lo = p * per, hi = p + 1 == n_threads ? n : lo + per;
      pool.emplace_back([=, &in, &parts] { range_stats(in, lo, hi, fmts, nf, parts[p]); });
    }
    for (auto& th : pool) th.join();
    for (const auto& t : parts) merge(total, t, nf);
  }

  // Sums in units of the value's abs-max power of two (kernel._row_exponent).
  int k = exponent_of(total.amax);
  double lin = std::ldexp(1.0, -k), sq = lin * lin;
  float* of = job.of;
  // The sum about the mid-range of the finite elements (kernel._reference), so that the
  // mean keeps the digits of the spread however far it is from 0.
  const float mid = total.top > -INFINITY ? total.top * 0.5f - total.negmin * 0.5f : 0.0f;
  of[0] = static_cast<float>((total.sum - double(total.finite) * double(mid)) * lin);
  of[1] = static_cast<float>(total.sumsq * sq);
  of[2] = static_cast<float>(total.m2 * sq);
  for (int f = 0; f < nf; ++f) of[3 + f] = static_cast<float>(total.err2[f] * sq);
  of[3 + nf] = total.amax;
  of[4 + nf] = total.top;
  of[5 + nf] = total.negmin;
  of[6 + nf] = total.negabsmin;

  int32_t* oi = job.oi;
  oi[0] = static_cast<int32_t>(n);
  oi[1] = static_cast<int32_t>(total.hist[0]);
  oi[2] = static_cast<int32_t>(total.hist[255]);
  // Non-zero finite elements (flushed subnormals are zeros).
  const int64_t nonzero = n - total.hist[0] - total.hist[255];
  for (int f = 0; f < nf; ++f) {
    oi[3 + 3 * f] = static_cast<int32_t>(nonzero - total.nonzero_q[f]);
    oi[4 + 3 * f] = static_cast<int32_t>(total.nonzero_q[f] - total.normal_q[f]);
    oi[5 + 3 * f] = static_cast<int32_t>(total.over[f] - total.nan);
  }
  if (n_hist) {
    int32_t* h = oi + 3 + 3 * nf;
    std::fill(h, h + n_hist, 0);
    h[0] = static_cast<int32_t>(total.hist[0]);
    h[n_hist - 1] = static_cast<int32_t>(total.hist[255]);
    for (int e = 1; e < 255; ++e) {
      int64_t col = std::clamp<int64_t>(e - 127 - (hist_lo - 2), 1, n_hist - 2);
      h[col] += static_cast<int32_t>(total.hist[e]);
    }
  }
  g_nanos += std::chrono::duration_cast<std::chrono::nanoseconds>(
                 std::chrono::steady_clock::now() - started)
                 .count();
  g_calls += 1;
}

ffi::Error StatsImpl(ffi::AnyBuffer x, ffi::Span<const float> lut, ffi::Span<const int64_t> mantissa,
                     ffi::Span<const float> fmax, ffi::Span<const float> min_normal,
                     ffi::Span<const float> min_subnormal, int64_t hist_lo, int64_t hist_hi,
                     int64_t threads, ffi::ResultBuffer<ffi::F32> out_f,
                     ffi::ResultBuffer<ffi::S32> out_i) {
  Job job;
  ffi::Error error = prepare(job, x, lut, mantissa, fmax, min_normal, min_subnormal, hist_lo,
                             hist_hi, threads, out_f, out_i);
  if (error.failure()) return error;
  run_job(job);
  return ffi::Error::Success();
}

// The same statistics, computed asynchronously on XLA's own thread pool: the call returns
// at once and only what reads the statistics waits for them, so the kernel runs beside
// the rest of the program instead of on its critical path.
ffi::Future StatsAsyncImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Span<const float> lut,
                           ffi::Span<const int64_t> mantissa, ffi::Span<const float> fmax,
                           ffi::Span<const float> min_normal,
                           ffi::Span<const float> min_subnormal, int64_t hist_lo,
                           int64_t hist_hi, int64_t threads, ffi::ResultBuffer<ffi::F32> out_f,
                           ffi::ResultBuffer<ffi::S32> out_i) {
  Job job;
  ffi::Error error = prepare(job, x, lut, mantissa, fmax, min_normal, min_subnormal, hist_lo,
                             hist_hi, threads, out_f, out_i);
  return scalescope::run_async(pool, std::move(error), job, run_job);
}

// Hands its operand back in the same buffer (an aliased output; copied only where XLA
// could not alias it). The probe passes each recorded value through it: XLA cannot look
// through a custom call, so the value is computed once, into memory, and shared by its
// consumers and the statistics call, instead of XLA recomputing it inside each
// consumer's fusion.
ffi::Error SameImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  if (out->untyped_data() != x.untyped_data()) {
    if (out->size_bytes() != x.size_bytes()) {
      return ffi::Error::InvalidArgument("scalescope_same: output size differs");
    }
    std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
  }
  return ffi::Error::Success();
}

}  // namespace

// Total wall nanoseconds spent in the kernel, and the number of calls, since loading.
extern "C" uint64_t scalescope_stats_nanos() { return g_nanos.load(); }
extern "C" uint64_t scalescope_stats_calls() { return g_calls.load(); }

// The statistics calls' operand, attributes and results (after any context argument).
template <typename Binding>
auto stats_signature(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Attr<ffi::Span<const float>>("lut")
      .template Attr<ffi::Span<const int64_t>>("mantissa")
      .template Attr<ffi::Span<const float>>("fmax")
      .template Attr<ffi::Span<const float>>("min_normal")
      .template Attr<ffi::Span<const float>>("min_subnormal")
      .template Attr<int64_t>("hist_lo")
      .template Attr<int64_t>("hist_hi")
      .template Attr<int64_t>("threads")
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::S32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScalescopeStats, StatsImpl, stats_signature(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScalescopeStatsAsync, StatsAsyncImpl,
                              stats_signature(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScalescopeSame, SameImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
