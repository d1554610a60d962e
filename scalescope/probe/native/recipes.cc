// Block-scaled recipe statistics of one value, as an XLA FFI custom call (CPU).
//
// The value arrives as [outer, rows, length] with its block axis last (the caller
// transposes). For each recipe it is cut into blocks (`block` elements of a row, or
// `rows` x `block` tiles, or the whole tensor), each block gets its dequantisation scale
// X from its abs-max by the recipe's rule, and every element is rounded to the element
// format as d / X. The arithmetic is in double, where d * s (float32 times float32) and
// d * S / s_b are exact or rounded once far from any of the element grid's ties, so the
// one rounding to the element format is the exact one (see scalescope/core/recipes.py).
//
// Results per recipe: floats [squared error in units of 2^k (k the exponent of the
// value's finite abs-max), largest log2 X, -smallest log2 X] (-inf without a scaled
// block); ints [underflowed, clipped (inf included), flushed blocks, non-empty blocks].

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using scalescope::Loader;

constexpr int kMaxRecipes = 16;
constexpr int64_t kChunk = 4096;
constexpr float kFltMin = 1.17549435e-38f;
enum Rule { kTensor = 0, kMxFloor = 1, kMxRceil = 2, kNvfp4 = 3, kPow2Floor = 4 };

struct Elem {  // an element format
  int mant;
  double max, min_normal, min_sub;
  int emax;
};

const Elem kE4m3{3, 448.0, 0x1p-6, 0x1p-9, 8};

struct Recipe {
  int rule;
  int64_t block, rows;
  Elem el;
};

// Round a >= 0 to the format: nearest even, saturating at its max.
inline double round_to(double a, const Elem& el) {
  double q;
  if (a >= el.min_normal) {
    uint64_t b;
    std::memcpy(&b, &a, 8);
    const int shift = 52 - el.mant;
    const uint64_t one = 1;
    b = (b + ((one << (shift - 1)) - 1) + ((b >> shift) & 1)) & ~((one << shift) - 1);
    std::memcpy(&q, &b, 8);
  } else {
    const double magic = el.min_sub * 0x1p52;  // its ulp is the format's subnormal step
    volatile double t = a + magic;
    q = t - magic;
  }
  return q < el.max ? q : el.max;
}

// |x| of a finite, normal float32 element; 0 for zeros and float32 subnormals (as XLA on
// CPU flushes them); -1 for inf; -2 for NaN.
inline float magnitude(float x) {
  float a = std::fabs(x);
  if (std::isnan(a)) return -2.0f;
  if (std::isinf(a)) return -1.0f;
  return a < kFltMin ? 0.0f : a;
}

struct Acc {
  double err2 = 0;
  double smax = -std::numeric_limits<double>::infinity();
  double smin = std::numeric_limits<double>::infinity();
  int64_t under = 0, over = 0, flush = 0, blocks = 0;
};

// How to quantise one block: d -> round(d * num / den) * den / num (d * num is exact,
// the division the one rounding), with `zero` forcing 0.
struct BlockScale {
  double num = 1, den = 1, log2x = 0;
  bool zero = false;
};

BlockScale scale_of(const Recipe& r, float amax_b, float enc) {
  BlockScale s;
  const Elem& el = r.el;
  const int e = std::ilogb(amax_b);
  switch (r.rule) {
    case kTensor: {
      s.num = enc;  // f32(448 / amax)
      s.log2x = -std::log2(s.num);
      break;
    }
    case kMxFloor:
    case kMxRceil: {
      int ex = e - el.emax;
      if (r.rule == kMxRceil && std::ldexp(double(amax_b), -ex) > el.max) ++ex;
      ex = std::clamp(ex, -127, 127);
      s.num = std::ldexp(1.0, -ex);
      s.log2x = ex;
      break;
    }
    case kPow2Floor: {
      int ex = el.emax - e;
      if (std::ldexp(double(amax_b), ex) > el.max) --ex;
      ex = std::min(ex, 127);
      s.num = std::ldexp(1.0, ex);
      s.log2x = -ex;
      break;
    }
    default: {  // kNvfp4: an E4M3 block scale under the float32 tensor factor enc
      const double sb = round_to(double(amax_b) * double(enc) / 6.0, kE4m3);
      s.zero = sb == 0;
      s.num = enc;
      s.den = s.zero ? 1 : sb;
      s.log2x = s.zero ? 0 : std::log2(sb) - std::log2(double(enc));
    }
  }
  return s;
}

// Element statistics of magnitudes a[0..n) (see `magnitude`) under one block scale;
// returns whether every non-zero finite element quantised to zero.
// Branch-free per element, so the compiler vectorises it: the zero-scale case and the
// division (NVFP4 only) are decided once per block.
template <bool kDivide>
bool quantise_as(const float* a, int64_t n, const Elem& el, double num, double den,
                 Acc& acc) {
  const int shift = 52 - el.mant;
  const uint64_t one = 1, half_m1 = (one << (shift - 1)) - 1, keep = ~((one << shift) - 1);
  const double magic = el.min_sub * 0x1p52;  // its ulp is the format's subnormal step
  const double back = den / num;             // exact for power-of-two scales
  double err2 = 0;
  int64_t over = 0, under = 0, nonzero = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = a[i];
    const bool valid = v > 0;
    const double d = valid ? double(v) : 0.0;
    const double y = kDivide ? d * num / den : d * num;
    uint64_t b;
    std::memcpy(&b, &y, 8);
    b = (b + half_m1 + ((b >> shift) & 1)) & keep;
    double qn;
    std::memcpy(&qn, &b, 8);
    const double qs = (y + magic) - magic;
    double q = y >= el.min_normal ? qn : qs;
    q = q < el.max ? q : el.max;
    over += (y > el.max) | (v == -1.0f);
    under += valid & (q == 0);
    nonzero += q != 0;
    const double err = d - q * back;
    err2 += err * err;
  }
  acc.err2 += err2;
  acc.over += over;
  acc.under += under;
  return nonzero == 0;
}

bool quantise(const float* a, int64_t n, const Recipe& r, const BlockScale& s, Acc& acc) {
  if (s.zero) {  // everything rounds to 0
    for (int64_t i = 0; i < n; ++i) {
      const float v = a[i];
      acc.over += v == -1.0f;
      acc.under += v > 0;
      acc.err2 += v > 0 ? double(v) * double(v) : 0.0;
    }
    return true;
  }
  if (s.den != 1) return quantise_as<true>(a, n, r.el, s.num, s.den, acc);
  return quantise_as<false>(a, n, r.el, s.num, s.den, acc);
}

void close_block(const Recipe& r, float amax_b, float enc, const float* a, int64_t n,
                 Acc& acc) {
  if (!(amax_b > 0)) {  // no non-zero finite element: only inf can count (as clipped)
    for (int64_t i = 0; i < n; ++i) acc.over += a[i] == -1.0f;
    return;
  }
  const BlockScale s = scale_of(r, amax_b, enc);
  const bool flushed = quantise(a, n, r, s, acc);
  ++acc.blocks;
  acc.flush += flushed;
  if (!s.zero) {
    acc.smax = std::max(acc.smax, s.log2x);
    acc.smin = std::min(acc.smin, s.log2x);
  }
}

struct Value {
  Loader in;
  int64_t outer, rows, length;

  // Magnitudes of row `r` (of outer * rows), columns [c0, c0 + n), into out.
  void load(int64_t r, int64_t c0, int64_t n, float* out) const {
    in.load(r * length + c0, n, out);
    for (int64_t i = 0; i < n; ++i) out[i] = magnitude(out[i]);
  }
};

void run_recipe(const Value& v, const Recipe& r, float amax, Acc& acc) {
  const float enc_tensor = amax > 0 ? 448.0f / amax : 1.0f;
  const float enc_nv = amax > 0 ? 2688.0f / amax : 1.0f;
  const float enc = r.rule == kTensor ? enc_tensor : enc_nv;
  const int64_t n_rows = v.outer * v.rows;
  if (r.block == 0) {  // the whole tensor, streamed
    if (!(amax > 0)) {
      std::vector<float> buf(kChunk);
      for (int64_t row = 0; row < n_rows; ++row) {
        for (int64_t c = 0; c < v.length; c += kChunk) {
          int64_t n = std::min(kChunk, v.length - c);
          v.load(row, c, n, buf.data());
          close_block(r, 0, enc, buf.data(), n, acc);
        }
      }
      return;
    }
    const BlockScale s = scale_of(r, amax, enc);
    std::vector<float> buf(kChunk);
    bool flushed = true;
    for (int64_t row = 0; row < n_rows; ++row) {
      for (int64_t c = 0; c < v.length; c += kChunk) {
        int64_t n = std::min(kChunk, v.length - c);
        v.load(row, c, n, buf.data());
        flushed &= quantise(buf.data(), n, r, s, acc);
      }
    }
    acc.blocks += 1;
    acc.flush += flushed;
    acc.smax = std::max(acc.smax, s.log2x);
    acc.smin = std::min(acc.smin, s.log2x);
    return;
  }
  const int64_t b = r.block, tr = r.rows;
  std::vector<float> buf(b * tr);
  for (int64_t o = 0; o < v.outer; ++o) {
    for (int64_t r0 = 0; r0 < v.rows; r0 += tr) {
      const int64_t nr = std::min(tr, v.rows - r0);
      for (int64_t c0 = 0; c0 < v.length; c0 += b) {
        const int64_t nc = std::min(b, v.length - c0);
        float amax_b = 0;
        for (int64_t i = 0; i < nr; ++i) {
          float* dst = buf.data() + i * nc;
          v.load(o * v.rows + r0 + i, c0, nc, dst);
          for (int64_t j = 0; j < nc; ++j) amax_b = std::max(amax_b, dst[j]);
        }
        close_block(r, amax_b, enc, buf.data(), nr * nc, acc);
      }
    }
  }
}

struct Job {
  Value v;
  Recipe recipes[kMaxRecipes];
  int nr = 0;
  float* of = nullptr;
  int32_t* oi = nullptr;
};

ffi::Error prepare(Job& job, ffi::AnyBuffer x, ffi::Span<const float> lut,
                   ffi::Span<const int64_t> rule, ffi::Span<const int64_t> block,
                   ffi::Span<const int64_t> rows, ffi::Span<const int64_t> mantissa,
                   ffi::Span<const int64_t> emax, ffi::Span<const float> fmax,
                   ffi::Span<const float> min_normal, ffi::Span<const float> min_subnormal,
                   ffi::Result<ffi::Buffer<ffi::F32>> out_f,
                   ffi::Result<ffi::Buffer<ffi::S32>> out_i) {
  const size_t nr = rule.size();
  if (nr > kMaxRecipes || block.size() != nr || rows.size() != nr || mantissa.size() != nr ||
      emax.size() != nr || fmax.size() != nr || min_normal.size() != nr ||
      min_subnormal.size() != nr) {
    return ffi::Error::InvalidArgument("scalescope_recipes: bad recipe attributes");
  }
  if (out_f->element_count() != 3 * nr || out_i->element_count() != 4 * nr) {
    return ffi::Error::InvalidArgument("scalescope_recipes: bad output sizes");
  }
  auto dims = x.dimensions();
  if (dims.size() != 3) {
    return ffi::Error::InvalidArgument("scalescope_recipes: expects [outer, rows, length]");
  }
  const ffi::DataType dtype = x.element_type();
  const bool byte = ffi::ByteWidth(dtype) == 1;
  if (!(dtype == ffi::DataType::F32 || dtype == ffi::DataType::F16 ||
        dtype == ffi::DataType::BF16 || byte) ||
      (byte && lut.size() != 256)) {
    return ffi::Error::InvalidArgument("scalescope_recipes: unsupported input type");
  }
  job.v = Value{Loader{dtype, x.untyped_data(), lut.begin()}, dims[0], dims[1], dims[2]};
  job.nr = static_cast<int>(nr);
  for (size_t i = 0; i < nr; ++i) {
    job.recipes[i] = Recipe{static_cast<int>(rule[i]), block[i], std::max<int64_t>(rows[i], 1),
                            Elem{static_cast<int>(mantissa[i]), fmax[i], min_normal[i],
                                 min_subnormal[i], static_cast<int>(emax[i])}};
  }
  job.of = out_f->typed_data();
  job.oi = out_i->typed_data();
  return ffi::Error::Success();
}

void run_job(const Job& job) {
  const Value& v = job.v;
  // The value's finite abs-max: the tensor factor of e4m3_tensor and nvfp4, and the unit.
  float amax = 0;
  {
    std::vector<float> buf(kChunk);
    for (int64_t row = 0; row < v.outer * v.rows; ++row) {
      for (int64_t c = 0; c < v.length; c += kChunk) {
        int64_t n = std::min(kChunk, v.length - c);
        v.load(row, c, n, buf.data());
        for (int64_t i = 0; i < n; ++i) amax = std::max(amax, buf[i]);
      }
    }
  }
  const int k = amax >= kFltMin ? std::clamp(std::ilogb(amax), -126, 126) : 0;
  const double unit2 = std::ldexp(1.0, -2 * k);
  for (int i = 0; i < job.nr; ++i) {
    Acc acc;
    run_recipe(v, job.recipes[i], amax, acc);
    const float ninf = -std::numeric_limits<float>::infinity();
    job.of[3 * i] = static_cast<float>(acc.err2 * unit2);
    job.of[3 * i + 1] = acc.blocks && acc.smax > -INFINITY ? static_cast<float>(acc.smax) : ninf;
    job.of[3 * i + 2] = acc.blocks && acc.smin < INFINITY ? static_cast<float>(-acc.smin) : ninf;
    job.oi[4 * i] = static_cast<int32_t>(acc.under);
    job.oi[4 * i + 1] = static_cast<int32_t>(acc.over);
    job.oi[4 * i + 2] = static_cast<int32_t>(acc.flush);
    job.oi[4 * i + 3] = static_cast<int32_t>(acc.blocks);
  }
}

#define RECIPE_ARGS                                                                         \
  ffi::AnyBuffer x, ffi::Span<const float> lut, ffi::Span<const int64_t> rule,            \
      ffi::Span<const int64_t> block, ffi::Span<const int64_t> rows,                      \
      ffi::Span<const int64_t> mantissa, ffi::Span<const int64_t> emax,                   \
      ffi::Span<const float> fmax, ffi::Span<const float> min_normal,                     \
      ffi::Span<const float> min_subnormal, ffi::ResultBuffer<ffi::F32> out_f,            \
      ffi::ResultBuffer<ffi::S32> out_i
#define RECIPE_PASS \
  x, lut, rule, block, rows, mantissa, emax, fmax, min_normal, min_subnormal, out_f, out_i

ffi::Error RecipesImpl(RECIPE_ARGS) {
  Job job;
  ffi::Error error = prepare(job, RECIPE_PASS);
  if (error.failure()) return error;
  run_job(job);
  return ffi::Error::Success();
}

// The same, on XLA's thread pool: only the readers of the statistics wait for them.
ffi::Future RecipesAsyncImpl(ffi::ThreadPool pool, RECIPE_ARGS) {
  Job job;
  ffi::Error error = prepare(job, RECIPE_PASS);
  return scalescope::run_async(pool, std::move(error), job, run_job);
}

template <typename Binding>
auto recipes_signature(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Attr<ffi::Span<const float>>("lut")
      .template Attr<ffi::Span<const int64_t>>("rule")
      .template Attr<ffi::Span<const int64_t>>("block")
      .template Attr<ffi::Span<const int64_t>>("rows")
      .template Attr<ffi::Span<const int64_t>>("mantissa")
      .template Attr<ffi::Span<const int64_t>>("emax")
      .template Attr<ffi::Span<const float>>("fmax")
      .template Attr<ffi::Span<const float>>("min_normal")
      .template Attr<ffi::Span<const float>>("min_subnormal")
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::S32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScalescopeRecipes, RecipesImpl,
                              recipes_signature(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScalescopeRecipesAsync, RecipesAsyncImpl,
                              recipes_signature(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
