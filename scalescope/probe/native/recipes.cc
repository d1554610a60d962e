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

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using scalescope::Loader;

constexpr int kMaxRecipes = 16;
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
    q = (a + magic) - magic;
  }
  return q < el.max ? q : el.max;
}

// How to quantise one block: d -> round(d * num / den) * den / num, with `zero` forcing
// 0. `num` and `den` are float32 values: a power of two (MX, block128) or the float32
// tensor factor (den 1), or NVFP4's factor over its E4M3 block scale. `g` is den / num
// in units of 2^-k (the value's abs-max exponent), for the error sums. `key` orders the
// blocks' dequantisation scales: log2 X itself, or for NVFP4 the block scale s_b (log2 X
// = log2 s_b - log2 S_enc is taken once per value).
struct BlockScale {
  float num = 1, den = 1, g = 1;
  double key = 0;
  bool zero = false;
};

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
inline float from_bits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}
// 2^e as a float32 for integer e, 0 below the normal range (e <= 127).
inline float pow2f(int e) { return e < -126 ? 0.0f : from_bits(uint32_t(e + 127) << 23); }

inline __attribute__((always_inline)) BlockScale scale_of(const Recipe& r, float amax_b,
                                                             float enc, int k) {
  BlockScale s;
  const Elem& el = r.el;
  const uint32_t b = bits_of(amax_b);  // a positive normal float32
  const int e = int(b >> 23) - 127;
  const float mant = from_bits((b & 0x007fffffu) | 0x3f800000u);  // amax_b / 2^e
  const float top = pow2f(el.emax);
  int ex = 0;  // log2 X, for the power-of-two rules
  switch (r.rule) {
    case kTensor:
      s.num = enc;  // f32(448 / amax)
      s.g = static_cast<float>(1.0 / double(enc) * double(pow2f(-k)));
      s.key = -std::log2(double(enc));
      return s;
    case kMxFloor:
    case kMxRceil:
      ex = e - el.emax + (r.rule == kMxRceil && mant * top > el.max ? 1 : 0);
      ex = std::clamp(ex, -127, 127);
      break;
    case kPow2Floor:
      ex = -std::min(el.emax - e - (mant * top > el.max ? 1 : 0), 127);
      break;
    default: {  // kNvfp4: an E4M3 block scale under the float32 tensor factor enc
      const double sb = round_to(double(amax_b) * double(enc) / 6.0, kE4m3);
      s.zero = sb == 0;
      s.num = enc;
      s.den = s.zero ? 1.0f : static_cast<float>(sb);  // an E4M3 value: exact
      s.g = static_cast<float>(double(s.den) / double(enc) * double(pow2f(-k)));
      s.key = sb;
      return s;
    }
  }
  s.num = pow2f(-ex);  // ex <= 127 - emax + 1: 2^-ex is a normal float32
  s.g = pow2f(ex - k);
  s.key = ex;
  return s;
}

// Vectors of kL float32 lanes (AVX-512 where the CPU has it; split by the compiler
// elsewhere), as in stats.cc.
constexpr int kL = 16;
typedef float vf __attribute__((vector_size(4 * kL)));
typedef int32_t vi __attribute__((vector_size(4 * kL)));
typedef uint32_t vu __attribute__((vector_size(4 * kL)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf splat(float x) { return x - vf{}; }
// Horizontal maximum / OR by halving shuffles (a scalar loop over lanes is several times
// slower, and it runs once per block).
inline float hmax(vf v) {
  const vi h8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  const vi h4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  const vi h2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  const vi h1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  vf w = __builtin_shuffle(v, h8);
  v = v > w ? v : w;
  w = __builtin_shuffle(v, h4);
  v = v > w ? v : w;
  w = __builtin_shuffle(v, h2);
  v = v > w ? v : w;
  w = __builtin_shuffle(v, h1);
  v = v > w ? v : w;
  return v[0];
}
#if defined(__AVX512F__)
inline bool any(vi v) {
  __m512i x;
  std::memcpy(&x, &v, sizeof x);
  return _mm512_test_epi32_mask(x, x) != 0;
}
inline float block_hmax(vf v) {
  __m512 x;
  std::memcpy(&x, &v, sizeof x);
  return _mm512_reduce_max_ps(x);
}
#else
inline bool any(vi v) { return hmax((vf)(v & 0x3f800000)) > 0; }  // true lanes -> 1.0f
inline float block_hmax(vf v) { return hmax(v); }
#endif
inline double hsum(vf v) {
  double t = 0;
  for (int j = 0; j < kL; ++j) t += v[j];
  return t;
}
inline int64_t hcount(vi v) {  // lanes hold negated counts (true masks are -1)
  int64_t t = 0;
  for (int j = 0; j < kL; ++j) t -= v[j];
  return t;
}
// a * b - p exactly, lane by lane (a fused multiply-add).
inline vf residual(vf a, vf b, vf p) {
  vf r;
  for (int j = 0; j < kL; ++j) r[j] = std::fmaf(a[j], b[j], -p[j]);
  return r;
}

// An element format, for rounding float32 lanes: normal range by integer rounding of the
// dropped mantissa bits, subnormal range by adding a number whose step is the format's.
struct ElemV {
  uint32_t shift, half_bit, low, keep;
  float max, min_normal, magic, half_sub;
};

ElemV elem_v(const Elem& el) {
  ElemV e;
  e.shift = 23 - el.mant;
  e.half_bit = 1u << (e.shift - 1);
  e.low = (1u << e.shift) - 1;
  e.keep = ~e.low;
  e.max = static_cast<float>(el.max);
  e.min_normal = static_cast<float>(el.min_normal);
  e.magic = static_cast<float>(el.min_sub * 0x1p23);
  e.half_sub = static_cast<float>(el.min_sub / 2);
  return e;
}

// y >= 0 rounded to the element grid, nearest even, saturating. With kExact, r is the
// residual of y's exact value (|r| below y's float32 step) and decides where y is a tie.
template <bool kExact>
inline vf round_v(vf y, vf r, const ElemV& E) {
  const vu b = (vu)y;
  vu rn = (b + (E.half_bit - 1) + ((b >> E.shift) & 1u)) & E.keep;
  vf qs = (y + E.magic) - E.magic;
  if (kExact) {
    const vi up = r > 0, down = r < 0;
    const vi tie_n = (vi)((b & E.low) == E.half_bit);
    rn = (tie_n & up) ? (b + E.half_bit) & E.keep : ((tie_n & down) ? (b & E.keep) : rn);
    const vf ds = y - qs;
    const vi tie_s = (ds == E.half_sub) | (ds == -E.half_sub);
    qs = (tie_s & up) ? y + E.half_sub : ((tie_s & down) ? y - E.half_sub : qs);
  }
  const vf q = y >= E.min_normal ? (vf)rn : qs;
  return q < E.max ? q : splat(E.max);
}

// Per-lane accumulators of one recipe, folded into totals now and then.
struct Lanes {
  vf e2{};
  vi under{}, over{};
};

struct Totals {
  double err2 = 0;
  double smax = -std::numeric_limits<double>::infinity();
  double smin = std::numeric_limits<double>::infinity();
  int64_t under = 0, over = 0, flush = 0, blocks = 0;

  void fold(Lanes& l) {
    err2 += hsum(l.e2);
    under += hcount(l.under);
    over += hcount(l.over);
    l = Lanes{};
  }
};

// One block: magnitudes a and the same in units of 2^-k (au), n a multiple of kL (padded
// with zeros). Returns whether every element quantised to zero.
// Inlined into the chunk loops, whose accumulators are locals the compiler keeps in
// registers.
inline __attribute__((always_inline)) bool quantise(const float* a, const float* au,
                                                    int64_t n, const Recipe& r,
                                                    const ElemV& E, const BlockScale& s,
                                                    Lanes& l) {
  // Dequantisation back to units of 2^-k (tiny blocks may underflow: they add nothing
  // measurable to sums in those units).
  const float g = s.g;
  vi nonzero{};
  if (s.zero) {
    for (int64_t i = 0; i < n; i += kL) {
      const vf va = load(a + i), vu_ = load(au + i);
      l.under += va > 0;
      l.e2 += vu_ * vu_;
    }
    return true;
  }
  const vf vg = splat(g);
  if (r.rule == kNvfp4) {
    // y = d * S_enc / s_b. Its float32 quotient y0 (of the rounded product p) lies
    // between the right two E2M1 neighbours except exactly on one, where either pair
    // gives the same answer; the exact product p + rr is then compared with the pair's
    // midpoint times s_b (exact: a few significant bits each).
    const float sb = static_cast<float>(s.den), enc = static_cast<float>(s.num);
    const vf venc = splat(enc), vsb = splat(sb), lim = splat(6.0f * sb), six = splat(6.0f);
    const vf half = splat(0.5f), one = splat(1.0f);
    for (int64_t i = 0; i < n; i += kL) {
      const vf va = load(a + i), vau = load(au + i);
      const vf p = va * venc;
      const vf rr = residual(va, venc, p);
      const vf y0 = p / vsb;
      // Lower neighbour on the E2M1 grid (step 0.5 below 2, then a quarter of the binade).
      const vu yb = (vu)y0;
      const vf lo_n = (vf)(yb & 0xffc00000u);  // keep one mantissa bit: floor in [1, 8)
      const vf y2 = y0 < one ? y0 * 2.0f : vf{};  // below 1: the step is 0.5
      const vf lo_s = __builtin_convertvector(__builtin_convertvector(y2, vi), vf) * 0.5f;
      vf lo = y0 >= one ? lo_n : lo_s;
      lo = lo < six ? lo : six;
      const vf step = lo >= one ? (vf)(((vu)lo & 0x7f800000u)) * half : half;
      const vf hi = lo + step;
      const vf c = (lo + hi) * half * vsb;  // the decision point, exact
      const vi lo_even = lo >= one ? (vi)((((vu)lo >> 22) & 1u) == 0u) : (lo == 0);
      const vi up = (p > c) | ((p == c) & ((rr > 0) | ((rr == 0) & ~lo_even)));
      vf q = up ? hi : lo;
      q = q < six ? q : six;
      l.over += (p > lim) | ((p == lim) & (rr > 0));
      l.under += (va > 0) & (q == 0);
      nonzero |= q != 0;
      const vf err = vau - q * vg;
      l.e2 += err * err;
    }
  } else {
    const vf mul = splat(static_cast<float>(s.num)), mx = splat(E.max);
    const bool exact = r.rule == kTensor;  // an FP32 scale: d * s is not exact
    for (int64_t i = 0; i < n; i += kL) {
      const vf va = load(a + i), vau = load(au + i);
      const vf y = va * mul;
      vf q;
      if (exact) {
        const vf rr = residual(va, mul, y);
        q = round_v<true>(y, rr, E);
        l.over += (y > mx) | ((y == mx) & (rr > 0));
      } else {
        q = round_v<false>(y, vf{}, E);
        l.over += y > mx;
      }
      l.under += (va > 0) & (q == 0);
      nonzero |= q != 0;
      const vf err = vau - q * vg;
      l.e2 += err * err;
    }
  }
  return !any(nonzero);
}

inline __attribute__((always_inline)) void close_block(const Recipe& r, const ElemV& E,
                                                       float amax_b, float enc, const float* a,
                                                       const float* au, int64_t n, int k,
                                                       Totals& t, Lanes& l) {
  if (!(amax_b > 0)) return;  // no non-zero finite element: nothing to quantise
  const BlockScale s = scale_of(r, amax_b, enc, k);
  const bool flushed = quantise(a, au, n, r, E, s, l);
  ++t.blocks;
  t.flush += flushed;
  if (!s.zero) {
    t.smax = std::max(t.smax, s.key);
    t.smin = std::min(t.smin, s.key);
  }
}

struct Value {
  Loader in;
  int64_t outer, rows, length;
};

// Elements [c0, c0 + n) of row `row` as magnitudes (zeros, float32 subnormals and
// non-finite elements as 0) and in units of 2^-k, zero-padded to a multiple of kL;
// returns the padded size.
int64_t load_row(const Value& v, int64_t row, int64_t c0, int64_t n, int k, float* a,
                 float* au) {
  v.in.load(row * v.length + c0, n, a);
  const int64_t np = (n + kL - 1) / kL * kL;
  std::fill(a + n, a + np, 0.0f);
  const vf unit = splat(pow2f(-k)), lo = splat(kFltMin);
  const vf hi = splat(std::numeric_limits<float>::max());
  for (int64_t i = 0; i < np; i += kL) {
    const vf m = (vf)((vu)load(a + i) & 0x7fffffffu);
    const vf x = (m >= lo) & (m <= hi) ? m : vf{};
    const vf xu = x * unit;
    std::memcpy(a + i, &x, sizeof x);
    std::memcpy(au + i, &xu, sizeof xu);
  }
  return np;
}

inline float block_max(const float* a, int64_t n) {
  vf m{};
  for (int64_t i = 0; i < n; i += kL) {
    const vf x = load(a + i);
    m = x > m ? x : m;
  }
  return block_hmax(m);
}

constexpr int64_t kRowChunk = 4096;  // a multiple of every 1-D block size

// The float32 tensor factor of a rule: 448 / amax (e4m3_tensor), 448 * 6 / amax (NVFP4's
// S_enc), float32's max where that overflows (amax below ~1.3e-36, as Transformer Engine
// clamps it); 1 for the others and for an all-zero value.
inline float tensor_factor(int rule, float amax) {
  if (!(amax > 0) || (rule != kTensor && rule != kNvfp4)) return 1.0f;
  const float f = (rule == kTensor ? 448.0f : 2688.0f) / amax;
  return std::isinf(f) ? std::numeric_limits<float>::max() : f;
}

// The maxima of a chunk's blocks, per block size, computed once per chunk.
struct MaximaCache {
  int64_t size[4] = {0, 0, 0, 0};
  std::vector<float> maxima[4];
  int used = 0;
  void clear() { used = 0; }
};

float* block_maxima(const float* a, int64_t n, int64_t block, MaximaCache& c) {
  for (int i = 0; i < c.used; ++i) {
    if (c.size[i] == block) return c.maxima[i].data();
  }
  const int i = c.used < 4 ? c.used++ : 3;
  c.size[i] = block;
  std::vector<float>& m = c.maxima[i];
  m.resize((n + block - 1) / block);
  for (int64_t b0 = 0, j = 0; b0 < n; b0 += block, ++j) {
    const int64_t nb = std::min(block, n - b0);
    m[j] = block_max(a + b0, (nb + kL - 1) / kL * kL);
  }
  return m.data();
}

// Every recipe of `rs` that cuts rows into 1-D blocks (or takes the whole tensor), in one
// pass over the value.
void run_rows(const Value& v, const Recipe* rs, const int* which, int n_which, float amax,
              int k, Totals* totals) {
  std::vector<float> a(kRowChunk + kL), au(kRowChunk + kL);
  std::vector<Lanes> lanes(n_which);
  std::vector<BlockScale> whole(n_which);
  std::vector<ElemV> elems(n_which);
  for (int w = 0; w < n_which; ++w) elems[w] = elem_v(rs[which[w]].el);
  for (int w = 0; w < n_which; ++w) {
    if (rs[which[w]].block == 0 && amax > 0) {
      whole[w] = scale_of(rs[which[w]], amax, tensor_factor(rs[which[w]].rule, amax), k);
    }
  }
  std::vector<bool> whole_flushed(n_which, true);
  MaximaCache cache;
  int64_t since_fold = 0;
  for (int64_t row = 0; row < v.outer * v.rows; ++row) {
    for (int64_t c = 0; c < v.length; c += kRowChunk) {
      const int64_t n = std::min(kRowChunk, v.length - c);
      load_row(v, row, c, n, k, a.data(), au.data());
      cache.clear();
      for (int w = 0; w < n_which; ++w) {
        const Recipe& r = rs[which[w]];
        const ElemV E = elems[w];
        Totals t = totals[w];
        Lanes l = lanes[w];
        if (r.block == 0) {
          if (amax > 0) {
            const int64_t np = (n + kL - 1) / kL * kL;
            whole_flushed[w] =
                quantise(a.data(), au.data(), np, r, E, whole[w], l) && whole_flushed[w];
          }
        } else {
          const float enc = tensor_factor(r.rule, amax);
          // Block maxima are shared by the recipes of one block size (the four MX ones).
          float* maxima = block_maxima(a.data(), n, r.block, cache);
          for (int64_t b0 = 0, j = 0; b0 < n; b0 += r.block, ++j) {
            const int64_t nb = std::min(r.block, n - b0);
            const int64_t np = (nb + kL - 1) / kL * kL;  // the rest of the buffer is zeros
            close_block(r, E, maxima[j], enc, a.data() + b0, au.data() + b0, np, k, t, l);
          }
        }
        totals[w] = t;
        lanes[w] = l;
      }
      // Fold the float lanes before they lose precision or the counts could wrap.
      if ((since_fold += n) >= (int64_t{1} << 20)) {
        for (int w = 0; w < n_which; ++w) totals[w].fold(lanes[w]);
        since_fold = 0;
      }
    }
  }
  for (int w = 0; w < n_which; ++w) {
    totals[w].fold(lanes[w]);
    const Recipe& r = rs[which[w]];
    if (r.block == 0 && amax > 0) {
      totals[w].blocks += 1;
      totals[w].flush += whole_flushed[w];
      totals[w].smax = totals[w].smin = whole[w].key;
    }
  }
}

// A recipe of 2-D tiles (rows x block over the last two axes).
void run_tiles(const Value& v, const Recipe& r, float amax, int k, Totals& t) {
  const int64_t b = r.block, tr = r.rows;
  const int64_t bp = (b + kL - 1) / kL * kL;
  std::vector<float> a(tr * bp), au(tr * bp);
  const ElemV E = elem_v(r.el);
  Lanes l;
  const float enc = tensor_factor(r.rule, amax);
  int64_t since_fold = 0;
  for (int64_t o = 0; o < v.outer; ++o) {
    for (int64_t r0 = 0; r0 < v.rows; r0 += tr) {
      const int64_t nr = std::min(tr, v.rows - r0);
      for (int64_t c0 = 0; c0 < v.length; c0 += b) {
        const int64_t nc = std::min(b, v.length - c0);
        int64_t np = 0;
        for (int64_t i = 0; i < nr; ++i) {
          np += load_row(v, o * v.rows + r0 + i, c0, nc, k, a.data() + np, au.data() + np);
        }
        close_block(r, E, block_max(a.data(), np), enc, a.data(), au.data(), np, k, t, l);
        if ((since_fold += np) >= (int64_t{1} << 20)) {
          t.fold(l);
          since_fold = 0;
        }
      }
    }
  }
  t.fold(l);
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
  // The value's finite abs-max (the tensor factor of e4m3_tensor and nvfp4, and the unit
  // of the error sums) and its infinities (clipped under every recipe).
  float amax = 0;
  int64_t n_inf = 0;
  {
    std::vector<float> buf(kRowChunk + kL);
    const vf big = splat(std::numeric_limits<float>::max());
    const vf inf = splat(std::numeric_limits<float>::infinity());
    vf m{};
    vi infs{};
    for (int64_t row = 0; row < v.outer * v.rows; ++row) {
      for (int64_t c = 0; c < v.length; c += kRowChunk) {
        const int64_t n = std::min(kRowChunk, v.length - c);
        v.in.load(row * v.length + c, n, buf.data());
        std::fill(buf.data() + n, buf.data() + (n + kL - 1) / kL * kL, 0.0f);
        for (int64_t i = 0; i < n; i += kL) {
          const vf x = (vf)((vu)load(buf.data() + i) & 0x7fffffffu);
          infs += x == inf;
          m = (x <= big) & (x > m) ? x : m;
        }
      }
    }
    amax = hmax(m);
    n_inf = hcount(infs);
  }
  if (amax < kFltMin) amax = 0;
  const int k = amax > 0 ? std::clamp(std::ilogb(amax), -126, 126) : 0;
  Totals totals[kMaxRecipes];
  int rows_of[kMaxRecipes];
  int n_rows = 0;
  for (int i = 0; i < job.nr; ++i) {
    if (job.recipes[i].rows > 1) {
      run_tiles(v, job.recipes[i], amax, k, totals[i]);
    } else {
      rows_of[n_rows++] = i;
    }
  }
  Totals row_totals[kMaxRecipes];
  run_rows(v, job.recipes, rows_of, n_rows, amax, k, row_totals);
  for (int w = 0; w < n_rows; ++w) totals[rows_of[w]] = row_totals[w];
  const float ninf = -std::numeric_limits<float>::infinity();
  const double log2_enc_nv = std::log2(double(tensor_factor(kNvfp4, amax)));
  for (int i = 0; i < job.nr; ++i) {
    Totals& t = totals[i];
    const bool scaled = t.smax > -std::numeric_limits<double>::infinity();
    if (scaled && job.recipes[i].rule == kNvfp4) {  // keys are block scales s_b
      t.smax = std::log2(t.smax) - log2_enc_nv;
      t.smin = std::log2(t.smin) - log2_enc_nv;
    }
    job.of[3 * i] = static_cast<float>(t.err2);
    job.of[3 * i + 1] = scaled ? static_cast<float>(t.smax) : ninf;
    job.of[3 * i + 2] = scaled ? static_cast<float>(-t.smin) : ninf;
    job.oi[4 * i] = static_cast<int32_t>(t.under);
    job.oi[4 * i + 1] = static_cast<int32_t>(t.over + n_inf);
    job.oi[4 * i + 2] = static_cast<int32_t>(t.flush);
    job.oi[4 * i + 3] = static_cast<int32_t>(t.blocks);
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
