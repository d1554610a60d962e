// Block-scaled recipe statistics of one value, as an XLA FFI custom call (CPU).
//
// The value arrives as [outer, rows, length] with its block axis last (the caller
// transposes). For each recipe it is cut into blocks (`block` elements of a row, or
// `rows` x `block` tiles, or the whole tensor), each block gets its dequantisation scale
// X from its abs-max by the recipe's rule, and every element is rounded to the element
// format as d / X. The arithmetic is exact where it decides a rounding: d * s (float32
// times float32) carries its residual where s is no power of two, and the scale rules
// that need more than float32 (NVFP4's block scale) are computed in double, so the one
// rounding to the element format is the exact one (see scalescope/core/recipes.py).
//
// Results per recipe: floats [squared error in units of 2^k (k the exponent of the
// value's finite abs-max), largest log2 X, -smallest log2 X] (-inf without a scaled
// block); ints [underflowed, clipped (inf included), flushed blocks, non-empty blocks].
//
// How: one pass finds the value's abs-max (and the tiles' abs-maxima, for 2-D tiles);
// the main pass loads chunks of rows into L1 (short rows packed several to a chunk) and
// runs every recipe over each chunk. Per-block work is done across blocks, one block per
// vector lane: the chunk's abs-max per vector (a transposing reduction), blocks' maxima
// from those, then every block's scale, counters and flush test in lanes (a block is
// flushed exactly when its abs-max quantises to zero: rounding is monotone). The element
// loop then only loads each block's scale and accumulates errors and counts.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using scalescope::Loader;

constexpr int kMaxRecipes = 16;
constexpr float kFltMin = 1.17549435e-38f;
constexpr float kFltMax = std::numeric_limits<float>::max();
constexpr float kInf = std::numeric_limits<float>::infinity();
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

// How to quantise with one scale: d -> round(d * num / den) * den / num. `num` and `den`
// are float32 values: a power of two (MX, block128) or the float32 tensor factor (den
// 1), or NVFP4's factor over its E4M3 block scale s_b; num = 0 where s_b is 0 (every
// element quantises to 0). `g` is den / num in units of 2^-k (the value's abs-max
// exponent), for the error sums. `key` orders the dequantisation scales: log2 X itself,
// or for NVFP4 the block scale s_b (log2 X = log2 s_b - log2 S_enc is taken once).
struct BlockScale {
  float num = 1, den = 1, rden = 1, g = 1;  // rden: 1 / den rounded (NVFP4's quotients)
  double key = 0;
  bool zero = false;
};

// The scale of a block with abs-max amax_b (a positive normal float32) under the tensor
// factor enc; computed once per value for whole-tensor recipes (`scales` computes the
// same for many blocks at once).
BlockScale scale_of(const Recipe& r, float amax_b, float enc, int k) {
  BlockScale s;
  const Elem& el = r.el;
  const uint32_t b = bits_of(amax_b);
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
      s.num = s.zero ? 0.0f : enc;
      s.den = s.zero ? 1.0f : static_cast<float>(sb);  // an E4M3 value: exact
      s.rden = 1.0f / s.den;
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

// Vectors of kL float32 lanes, as wide as the CPU's vectors (AVX-512, AVX, else SSE-
// sized; wider generic vectors than the CPU has compile to scalar code).
#if defined(__AVX512F__)
constexpr int kL = 16;
#elif defined(__AVX__)
constexpr int kL = 8;
#else
constexpr int kL = 4;
#endif
typedef float vf __attribute__((vector_size(4 * kL)));
typedef int32_t vi __attribute__((vector_size(4 * kL)));
typedef uint32_t vu __attribute__((vector_size(4 * kL)));
typedef double vd __attribute__((vector_size(8 * kL)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return x - vf{}; }
inline vi splat_i(int32_t x) { return x - vi{}; }

// Shuffles of the transposing reduction (see `vector_maxima`): at level l (lane pairs
// kL / 2^(l+1) apart), lanes of two vectors x, y paired so that max(shuffle(x, y, A),
// shuffle(x, y, B)) keeps half of each.
#if defined(__AVX512F__)
constexpr int kMaxLevels = 4;
const vi kPickA[4] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
    {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
    {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
const vi kPickB[4] = {
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
    {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
    {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
    {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};
#elif defined(__AVX__)
constexpr int kMaxLevels = 3;
const vi kPickA[3] = {
    {0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 8, 9, 4, 5, 12, 13}, {0, 8, 2, 10, 4, 12, 6, 14}};
const vi kPickB[3] = {
    {4, 5, 6, 7, 12, 13, 14, 15}, {2, 3, 10, 11, 6, 7, 14, 15}, {1, 9, 3, 11, 5, 13, 7, 15}};
#else
constexpr int kMaxLevels = 2;
const vi kPickA[2] = {{0, 1, 4, 5}, {0, 4, 2, 6}};
const vi kPickB[2] = {{2, 3, 6, 7}, {1, 5, 3, 7}};
#endif

inline vf mx(vf a, vf b) { return a > b ? a : b; }
inline vf mn(vf a, vf b) { return a < b ? a : b; }

// Horizontal reductions (once per value or per fold: simple loops).
inline float hmax(vf v) {
  float m = v[0];
  for (int j = 1; j < kL; ++j) m = std::max(m, v[j]);
  return m;
}
inline float hmin(vf v) {
  float m = v[0];
  for (int j = 1; j < kL; ++j) m = std::min(m, v[j]);
  return m;
}
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

// a * b - p exactly, lane by lane: a fused multiply-add, or without one the double
// product (exact for two float32 factors) less p, exact and rounded once to float32
// (the same value).
inline vf residual(vf a, vf b, vf p) {
#if defined(__AVX512F__)
  __m512 x, y, z;
  std::memcpy(&x, &a, sizeof x);
  std::memcpy(&y, &b, sizeof y);
  std::memcpy(&z, &p, sizeof z);
  const __m512 r = _mm512_fmsub_ps(x, y, z);
  vf out;
  std::memcpy(&out, &r, sizeof out);
  return out;
#elif defined(__AVX__) && defined(__FMA__)
  __m256 x, y, z;
  std::memcpy(&x, &a, sizeof x);
  std::memcpy(&y, &b, sizeof y);
  std::memcpy(&z, &p, sizeof z);
  const __m256 r = _mm256_fmsub_ps(x, y, z);
  vf out;
  std::memcpy(&out, &r, sizeof out);
  return out;
#else
  const vd ad = __builtin_convertvector(a, vd), bd = __builtin_convertvector(b, vd);
  return __builtin_convertvector(ad * bd - __builtin_convertvector(p, vd), vf);
#endif
}

// The abs-max of each of n vectors at a (a multiple of kL vectors: the caller pads with
// zero vectors) into out[0, n): kL vectors at a time, reduced by halving shuffles that
// keep each vector's partial maxima in its own lanes (log2(kL) levels of 2 shuffles and a
// max for every two vectors, instead of a horizontal reduction per vector).
void vector_maxima(const float* a, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += kL) {
    vf v[kL];
    for (int j = 0; j < kL; ++j) v[j] = load(a + (i + j) * kL);
    int count = kL;
    for (int level = 0; level < kMaxLevels; ++level) {
      const int h = count / 2;
      for (int j = 0; j < h; ++j) {
        v[j] = mx(__builtin_shuffle(v[j], v[j + h], kPickA[level]),
                  __builtin_shuffle(v[j], v[j + h], kPickB[level]));
      }
      count = h;
    }
    store(out + i, v[0]);
  }
}

// out[i] = max(in[2i], in[2i + 1]) for i < round_up(n, kL) (in: 2 * round_up(n, kL)
// entries).
void pair_maxima(const float* in, int64_t n, float* out) {
#if defined(__AVX512F__)
  const vi even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const vi odd = even + 1;
#elif defined(__AVX__)
  const vi even = {0, 2, 4, 6, 8, 10, 12, 14};
  const vi odd = even + 1;
#else
  const vi even = {0, 2, 4, 6};
  const vi odd = even + 1;
#endif
  for (int64_t i = 0; i < n; i += kL) {
    const vf x = load(in + 2 * i), y = load(in + 2 * i + kL);
    store(out + i, mx(__builtin_shuffle(x, y, even), __builtin_shuffle(x, y, odd)));
  }
}

// Block sizes of up to 2^(kLevels - 1) vectors find their maxima through pair_maxima.
constexpr int kLevels = 6;

// An element format, for rounding float32 lanes: normal range by integer rounding of the
// dropped mantissa bits, subnormal range by adding a number whose step is the format's.
struct ElemV {
  uint32_t shift, half_bit, low, keep;
  float max, min_normal, magic, half_sub;
  uint32_t cshift;  // (23 - mantissa bits) << 23: 2^e's bits to the grid step's magic number
  bool fast;        // values below 2^(emax + 1) have magic numbers below float32's max
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
  e.cshift = uint32_t(23 - el.mant) << 23;
  e.fast = el.emax + 23 - el.mant <= 126;
  return e;
}

// y >= 0 rounded to the element grid, nearest even, saturating (any y; quant's kCatPow2
// path is shorter for y below 2^(emax + 1)). With kExact, r is the residual of y's exact
// value (|r| below y's float32 step) and decides where y is a tie.
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

// How a rule quantises elements: a power-of-two scale (d * num exact), an FP32 scale
// (d * num carries its residual), NVFP4 (d * enc / s_b).
// (kCatPow2Wide: a power-of-two scale for element formats too wide for round_fast.)
enum Cat { kCatPow2 = 0, kCatExact = 1, kCatNv = 2, kCatPow2Wide = 3 };
inline int cat_of(int rule, const ElemV& E) {
  return rule == kTensor ? kCatExact : rule == kNvfp4 ? kCatNv : E.fast ? kCatPow2 : kCatPow2Wide;
}

// NVFP4's element rounding, exact for every lane: y = d * S_enc / s_b with p + rr the
// exact product d * S_enc. Its float32 approximation y0 (the rounded product p times the
// rounded 1 / s_b, within a few float32 steps of y) lies between the right two E2M1
// neighbours except where y is that close to one of them, g, and then either pair has g
// as an end and gives it; the exact product is compared with the pair's midpoint times
// s_b (exact: a few significant bits each).
inline vf nv_exact(vf p, vf rr, vf y0, vf den) {
  const vf half = splat(0.5f), one = splat(1.0f), six = splat(6.0f);
  // Lower neighbour on the E2M1 grid (step 0.5 below 2, then a quarter of the binade).
  const vu yb = (vu)y0;
  const vf lo_n = (vf)(yb & 0xffc00000u);  // keep one mantissa bit: floor in [1, 8)
  const vf y2 = y0 < one ? y0 * 2.0f : vf{};  // below 1: the step is 0.5
  const vf lo_s = __builtin_convertvector(__builtin_convertvector(y2, vi), vf) * 0.5f;
  vf lo = y0 >= one ? lo_n : lo_s;
  lo = lo < six ? lo : six;
  const vf step = lo >= one ? (vf)(((vu)lo & 0x7f800000u)) * half : half;
  const vf hi = lo + step;
  const vf c = (lo + hi) * half * den;  // the decision point, exact
  const vi lo_even = lo >= one ? (vi)((((vu)lo >> 22) & 1u) == 0u) : (lo == 0);
  const vi up = (p > c) | ((p == c) & ((rr > 0) | ((rr == 0) & ~lo_even)));
  const vf q = up ? hi : lo;
  return q < six ? q : six;
}

// Whether any lane of a mask is set.
inline bool any(vi m) {
#if defined(__AVX512F__)
  __m512i x;
  std::memcpy(&x, &m, sizeof x);
  return _mm512_test_epi32_mask(x, x) != 0;
#elif defined(__AVX__)
  __m256i x;
  std::memcpy(&x, &m, sizeof x);
  return !_mm256_testz_si256(x, x);
#else
  int64_t t[kL / 2];
  std::memcpy(t, &m, sizeof t);
  int64_t o = 0;
  for (int j = 0; j < kL / 2; ++j) o |= t[j];
  return o != 0;
#endif
}

// Magnitudes va (>= 0) quantised to the element grid as va * num / den; `over` gets the
// lanes that clip (their exact scaled value above the format's max).
template <int kCat>
inline __attribute__((always_inline)) vf quant(vf va, vf num, vf den, vf rden,
                                               const ElemV& E, vi& over) {
  if (kCat == kCatNv) {
    // y0 rounded as it is (E is E2M1) unless it lies within a few float32 steps of a
    // midpoint of the grid, where y0's error could decide: those vectors take nv_exact.
    const vf p = va * num;
    const vf rr = residual(va, num, p);
    const vf y0 = p * rden;
    const vu b = (vu)y0;
    const vu rn = (b + (E.half_bit - 1) + ((b >> E.shift) & 1u)) & E.keep;
    const vf qs = (y0 + E.magic) - E.magic;
    const vi normal = y0 >= E.min_normal;
    vf q = normal ? (vf)rn : qs;
    q = q < E.max ? q : splat(E.max);
    const vi near_n = (vi)(((b & E.low) - (E.half_bit - 8u)) <= 16u);
    const vf ds = (vf)((vu)(y0 - qs) & 0x7fffffffu);
    const vi near_s = ds >= E.half_sub - 0x1p-21f;
    if (__builtin_expect(any(normal ? near_n : near_s), 0)) q = nv_exact(p, rr, y0, den);
    const vf lim = den * 6.0f;
    over = (p > lim) | ((p == lim) & (rr > 0));
    return q;
  } else if (kCat == kCatExact) {
    const vf y = va * num;
    const vf rr = residual(va, num, y);
    const vf mxv = splat(E.max);
    over = (y > mxv) | ((y == mxv) & (rr > 0));
    // The residual decides only where y is a tie of the grid (rare): those vectors take
    // round_v<true>.
    const vu b = (vu)y;
    const vf qs = (y + E.magic) - E.magic;
    const vi tie = y >= E.min_normal ? (vi)((b & E.low) == E.half_bit)
                                     : (vi)((vf)((vu)(y - qs) & 0x7fffffffu) == E.half_sub);
    if (__builtin_expect(any(tie), 0)) return round_v<true>(y, rr, E);
    return round_v<false>(y, vf{}, E);
  } else if (kCat == kCatPow2) {
    // y < 2^(emax + 1) (every power-of-two rule keeps the block's abs-max below it):
    // y + c, with c = 2^(e + 23 - mant) for y in [2^e, 2^(e + 1)) (the grid step's magic
    // number; the subnormal range's below it), rounds y to the grid, nearest even.
    const vf y = va * num;
    over = y > splat(E.max);
    const vf c = mx((vf)(((vu)y & 0x7f800000u) + E.cshift), splat(E.magic));
    return mn((y + c) - c, splat(E.max));
  } else {
    const vf y = va * num;
    over = y > splat(E.max);
    return round_v<false>(y, vf{}, E);
  }
}

// Per-lane accumulators of one recipe, folded into totals now and then: squared errors,
// elements quantised to zero (negated), elements clipped (negated). Underflows are the
// zeros less the elements that were zero already (counted once per chunk for all).
struct Acc {
  vf e2{};
  vi zq{}, over{};
};

// Elements between folds of the float32 lanes into double totals: 2^16 per lane (as many
// as 16 lanes every 2^20 elements).
constexpr int64_t kFold = int64_t{kL} << 16;

struct Totals {
  double err2 = 0;
  double smax = -std::numeric_limits<double>::infinity();
  double smin = std::numeric_limits<double>::infinity();
  int64_t zq = 0, over = 0, flush = 0, blocks = 0;
  double log2_enc = 0;  // NVFP4: log2 S_enc (keys are block scales)

  void fold(Acc& l) {
    err2 += hsum(l.e2);
    zq += hcount(l.zq);
    over += hcount(l.over);
    l = Acc{};
  }
};

// Per-lane block counters of one recipe (scales of many blocks at once).
struct BlockLanes {
  vi blocks{}, flush{};
  vi clips{};  // blocks whose abs-max clips (only their elements can)
  vf kmax = splat(-kInf), kmin = splat(kInf);

  void fold(Totals& t) {
    t.blocks += hcount(blocks);
    t.flush += hcount(flush);
    const float hi = hmax(kmax), lo = hmin(kmin);
    if (hi > -kInf) t.smax = std::max(t.smax, double(hi));
    if (lo < kInf) t.smin = std::min(t.smin, double(lo));
    *this = BlockLanes{};
  }
  // Whether any block since the last call clips; then forgets.
  bool take_clips() {
    const bool c = any(clips);
    clips = vi{};
    return c;
  }
};

struct Slots {  // scales per block of the chunk (1-D blocks) or of the value (tiles)
  std::vector<float> num, den, rden, g;
  void resize(int64_t n) {
    num.assign(n, 0.0f);
    den.assign(n, 1.0f);
    rden.assign(n, 1.0f);
    g.assign(n, 0.0f);
  }
};

// NVFP4's block scales s_b = RN_e4m3(amax_b * enc / 6) and g = (s_b or 1) / enc in
// units of 2^-k (`scale_of`'s double arithmetic, lane by lane), half a vector of lanes at
// a time: a vector of doubles as wide as the CPU's.
typedef double vdh __attribute__((vector_size(4 * kL)));
typedef uint64_t vuh __attribute__((vector_size(4 * kL)));
typedef int64_t vih __attribute__((vector_size(4 * kL)));
typedef float vfh __attribute__((vector_size(2 * kL)));

// What NVFP4's block scales need once per value: S_enc, 2^-k, and for g the quotients
// RN(m / S_enc) * 2^-k of the eight E4M3 significands m = 1 + j / 8 (a block scale
// s_b = m 2^e has RN(s_b / S_enc) = 2^e RN(m / S_enc): no division per block).
struct NvConst {
  float enc;
  double unit;
  double quot[8];
};
NvConst nv_const(float enc, int k) {
  NvConst c;
  c.enc = enc;
  c.unit = double(pow2f(-k));
  for (int j = 0; j < 8; ++j) c.quot[j] = (1.0 + j / 8.0) / double(enc) * c.unit;
  return c;
}

inline void nv_scales(vf a, const NvConst& c, vf& sb_out, vf& g_out) {
  constexpr int kH = kL / 2;
  const uint64_t shift = 52 - kE4m3.mant, one = 1;
  const uint64_t half = one << (shift - 1), low = (one << shift) - 1;
  const double magic = kE4m3.min_sub * 0x1p52;
  // round_to(p, E4M3) lane by lane
  auto e4m3 = [&](vdh p) {
    const vuh b = (vuh)p;
    const vuh rn = (b + (half - 1) + ((b >> shift) & one)) & ~low;
    const vdh qs = (p + magic) - magic;
    const vdh sb = p >= kE4m3.min_normal ? (vdh)rn : qs;
    return sb < kE4m3.max ? sb : kE4m3.max - vdh{};
  };
  for (int h = 0; h < 2; ++h) {
    vfh ah;
    std::memcpy(&ah, reinterpret_cast<const float*>(&a) + h * kH, sizeof ah);
    const vdh x = __builtin_convertvector(ah, vdh) * double(c.enc);  // exact
    // x / 6 within a few double steps, unless near a midpoint of the E4M3 grid where
    // only the rounded quotient itself decides as scale_of does (rare).
    const vdh t = x * (1.0 / 6.0);
    const vuh tb = (vuh)t;
    const vdh ds = t - ((t + magic) - magic);
    const vih near = t >= kE4m3.min_normal ? (vih)(((tb & low) - (half - 16)) <= 32u)
                                           : (vih)((ds >= kE4m3.min_sub / 2 * (1 - 0x1p-40)) |
                                                   (ds <= -kE4m3.min_sub / 2 * (1 - 0x1p-40)));
    bool any_near = false;
    for (int j = 0; j < kH; ++j) any_near |= near[j] != 0;
    vdh q6 = t;
    if (__builtin_expect(any_near, 0)) q6 = x / 6.0;
    const vdh sb = e4m3(q6);
    const vfh sbf = __builtin_convertvector(sb, vfh);
    // g = RN(den / S_enc) * 2^-k with den = s_b, or 1 where s_b is 0.
#if defined(__AVX512F__)
    const vuh db = (vuh)(sb == 0 ? 1.0 - vdh{} : sb);
    __m512i idx;
    const vuh j3 = (db >> 49) & 7u;
    std::memcpy(&idx, &j3, sizeof idx);
    __m512d tab;
    std::memcpy(&tab, c.quot, sizeof tab);
    const __m512d qv = _mm512_permutexvar_pd(idx, tab);
    vdh quot;
    std::memcpy(&quot, &qv, sizeof quot);
    const vdh p2 = (vdh)(db & 0x7ff0000000000000u);  // 2^e
    const vfh gf = __builtin_convertvector(quot * p2, vfh);
#else
    const vdh den = sb == 0 ? 1.0 - vdh{} : sb;
    const vfh gf = __builtin_convertvector(den / double(c.enc) * c.unit, vfh);
#endif
    std::memcpy(reinterpret_cast<float*>(&sb_out) + h * kH, &sbf, sizeof sbf);
    std::memcpy(reinterpret_cast<float*>(&g_out) + h * kH, &gf, sizeof gf);
  }
}

// Scales of n blocks from their abs-maxima m (zero-padded to a multiple of kL; 0: a block
// without non-zero finite elements, which is not counted) into num, den, g (as many
// entries), and the blocks' counters: non-empty, flushed (the abs-max quantises to zero),
// and the range of their scales' keys.
template <int rule>
void scales_rule(const Recipe& r, const ElemV& E, const float* m, int64_t n, float enc, int k,
                 Slots& out, BlockLanes& bl) {
  const int emax = r.el.emax;
  const vf fmax = splat(static_cast<float>(r.el.max)), top = splat(pow2f(emax));
  const vf zero{};
  const BlockScale t = rule == kTensor ? scale_of(r, 1.0f, enc, k) : BlockScale{};
  const NvConst nc = rule == kNvfp4 ? nv_const(enc, k) : NvConst{};
  for (int64_t i = 0; i < n; i += kL) {
    const vf a = load(m + i);
    const vi has = a > zero;
    vf vnum, vden = splat(1.0f), vg, key;
    vi ok = has;
    if (rule == kTensor) {
      vnum = splat(t.num);
      vg = splat(t.g);
      key = zero;  // constant: set from t.key at the end
    } else if (rule == kNvfp4) {
      vf sbf, gf;
      nv_scales(a, nc, sbf, gf);
      const vi zs = sbf == zero;  // s_b rounded to 0: the block quantises to 0
      vnum = zs ? zero : splat(enc);
      vden = zs ? splat(1.0f) : sbf;
      vg = gf;
      key = sbf;
      ok = has & ~zs;
    } else {
      const vu b = (vu)a;
      const vi e = (vi)(b >> 23) - 127;
      const vf mant = (vf)((b & 0x007fffffu) | 0x3f800000u);
      const vi big = mant * top > fmax;  // -1 where amax_b / 2^e * 2^emax > max
      vi ex;
      if (rule == kPow2Floor) {
        vi t2 = emax - e + big;
        t2 = t2 < 127 ? t2 : splat_i(127);
        ex = -t2;
      } else {
        ex = e - emax - (rule == kMxRceil ? big : vi{});
        ex = ex < -127 ? splat_i(-127) : ex;
        ex = ex > 127 ? splat_i(127) : ex;
      }
      const vi en = -ex, eg = ex - k;  // 2^en, 2^eg: 0 below the normal range
      vnum = en < -126 ? zero : (vf)((vu)(en + 127) << 23);
      vg = eg < -126 ? zero : (vf)((vu)(eg + 127) << 23);
      key = __builtin_convertvector(ex, vf);
    }
    const vf vrden = splat(1.0f) / vden;
    store(out.num.data() + i, vnum);
    store(out.den.data() + i, vden);
    store(out.rden.data() + i, vrden);
    store(out.g.data() + i, vg);
    vi dummy;
    vf q;
    if (rule == kNvfp4) {
      q = quant<kCatNv>(a, vnum, vden, vrden, E, dummy);
    } else if (rule == kTensor) {
      q = quant<kCatExact>(a, vnum, vden, vrden, E, dummy);
    } else if (E.fast) {
      q = quant<kCatPow2>(a, vnum, vden, vrden, E, dummy);
    } else {
      q = quant<kCatPow2Wide>(a, vnum, vden, vrden, E, dummy);
    }
    bl.clips |= has & dummy;
    bl.blocks += has;
    bl.flush += has & (q == zero);
    bl.kmax = ok ? mx(bl.kmax, key) : bl.kmax;
    bl.kmin = ok ? mn(bl.kmin, key) : bl.kmin;
  }
}

void scales(const Recipe& r, const ElemV& E, const float* m, int64_t n, float enc, int k,
            Slots& out, BlockLanes& bl) {
  switch (r.rule) {
    case kTensor:
      return scales_rule<kTensor>(r, E, m, n, enc, k, out, bl);
    case kMxFloor:
      return scales_rule<kMxFloor>(r, E, m, n, enc, k, out, bl);
    case kMxRceil:
      return scales_rule<kMxRceil>(r, E, m, n, enc, k, out, bl);
    case kNvfp4:
      return scales_rule<kNvfp4>(r, E, m, n, enc, k, out, bl);
    default:
      return scales_rule<kPow2Floor>(r, E, m, n, enc, k, out, bl);
  }
}

struct Value {
  Loader in;
  int64_t outer, rows, length;
};

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
inline int64_t gcd(int64_t a, int64_t b) { return b == 0 ? a : gcd(b, a % b); }

// n float32 elements from `start` of the value: read where they are (float32 values), or
// widened into buf; the caller reads whole vectors below n & -kL and the rest by `tail`.
inline const float* elements(const Value& v, int64_t start, int64_t n, float* buf) {
  if (v.in.dtype == ffi::DataType::F32) return static_cast<const float*>(v.in.data) + start;
  v.in.load(start, n, buf);
  return buf;
}
// The elements [i, n) of src (fewer than kL), zero-padded to a vector.
inline vf tail(const float* src, int64_t i, int64_t n) {
  float t[kL] = {};
  std::memcpy(t, src + i, (n - i) * sizeof(float));
  return load(t);
}

// Elements [c0, c0 + n) of row `row` as magnitudes (zeros, float32 subnormals and
// non-finite elements as 0) into a and in units of 2^-k into au, zero-padded to a
// multiple of kL; counts the zero lanes into `zeros` (negated).
inline void load_row(const Value& v, int64_t row, int64_t c0, int64_t n, float unit_k, float* a,
                     float* au, vi& zeros) {
  const float* src = elements(v, row * v.length + c0, n, a);
  const int64_t np = round_up(n, kL), nf = n / kL * kL;
  const vf unit = splat(unit_k), lo = splat(kFltMin), hi = splat(kFltMax);
  auto one = [&](int64_t i, vf d) {
    const vf m = (vf)((vu)d & 0x7fffffffu);
    const vi keep = (m >= lo) & (m <= hi);
    const vf x = keep ? m : vf{};
    zeros += ~keep;
    store(a + i, x);
    store(au + i, x * unit);
  };
  for (int64_t i = 0; i < nf; i += kL) one(i, load(src + i));
  if (nf < np) one(nf, tail(src, nf, n));
}

// The float32 tensor factor of a rule: 448 / amax (e4m3_tensor), 448 * 6 / amax (NVFP4's
// S_enc), float32's max where that overflows (amax below ~1.3e-36, as Transformer Engine
// clamps it); 1 for the others and for an all-zero value.
inline float tensor_factor(int rule, float amax) {
  if (!(amax > 0) || (rule != kTensor && rule != kNvfp4)) return 1.0f;
  const float f = (rule == kTensor ? 448.0f : 2688.0f) / amax;
  return std::isinf(f) ? std::numeric_limits<float>::max() : f;
}

// The value's finite abs-max and its infinities in one pass; with `tile` also the abs-max
// of each of its tiles (0 for tiles without a normal non-zero element) into tmax,
// indexed [outer][row group][column block].
void scan(const Value& v, const Recipe* tile, float& amax, int64_t& n_inf,
          std::vector<float>& tmax) {
  const int64_t tr = tile ? tile->rows : 1, tb = tile ? tile->block : 1;
  constexpr int64_t kSeg = 4096;
  const int64_t seg = tile ? std::max(tb, kSeg / tb * tb) : kSeg;
  const int64_t groups = (v.rows + tr - 1) / tr, ncb = (v.length + tb - 1) / tb;
  std::vector<float> buf(round_up(seg, kL)), colmax(tile ? round_up(seg, kL) : 0);
  if (tile) tmax.assign(round_up(v.outer * groups * ncb, kL) + kL, 0.0f);
  const vf big = splat(kFltMax), inf = splat(kInf);
  vf m{};
  vi infs{};
  for (int64_t o = 0; o < v.outer; ++o) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r1 = std::min(v.rows, (g + 1) * tr);
      for (int64_t c = 0; c < v.length; c += seg) {
        const int64_t n = std::min(seg, v.length - c), np = round_up(n, kL);
        if (tile) std::fill(colmax.begin(), colmax.begin() + np, 0.0f);
        for (int64_t r = g * tr; r < r1; ++r) {
          const float* src = elements(v, (o * v.rows + r) * v.length + c, n, buf.data());
          const int64_t nf = n / kL * kL;
          auto one = [&](int64_t i, vf d) {
            const vf x = (vf)((vu)d & 0x7fffffffu);
            infs += x == inf;
            const vi fin = x <= big;
            m = fin & (x > m) ? x : m;
            if (tile) store(colmax.data() + i, mx(load(colmax.data() + i), fin ? x : vf{}));
          };
          if (tile) {
            for (int64_t i = 0; i < nf; i += kL) one(i, load(src + i));
          } else {
            for (int64_t i = 0; i < nf; i += kL) {
              const vf x = (vf)((vu)load(src + i) & 0x7fffffffu);
              infs += x == inf;
              m = (x <= big) & (x > m) ? x : m;
            }
          }
          if (nf < np) one(nf, tail(src, nf, n));
        }
        if (tile) {
          float* out = tmax.data() + (o * groups + g) * ncb + c / tb;
          for (int64_t j = 0; j * tb < n; ++j) {
            float t = 0;
            for (int64_t i = j * tb; i < std::min(n, (j + 1) * tb); ++i) t = std::max(t, colmax[i]);
            out[j] = t < kFltMin ? 0.0f : t;
          }
        }
      }
    }
  }
  amax = hmax(m);
  n_inf = hcount(infs);
}

// How a recipe finds each element's scale in the main pass.
enum Mode {
  kConst = 0,  // one scale (whole tensor)
  kShift = 1,  // slot base[row] + (vector >> shift): blocks of 2^shift whole vectors
  kLane = 2,   // slot base[row] + (off + element) / block, lane by lane (any block size)
};

struct SP {  // where quantise_chunk finds the scales (Slots' arrays)
  const float *num = nullptr, *den = nullptr, *rden = nullptr, *g = nullptr;
};
inline SP sp_of(const Slots& s) {
  return SP{s.num.data(), s.den.data(), s.rden.data(), s.g.data()};
}

struct Chunk {
  int64_t row0, nrows;  // rows row0 .. row0 + nrows - 1 of the [outer * rows, length] view
  int64_t c0, n, stride;  // columns c0 .. c0 + n - 1 of each, at a stride of `stride` floats
};

// One recipe over one chunk: every element quantised, errors and counts into acc
// (clipped elements only with kOver: without, no block of the chunk clips).
template <int kCat, int kMode, bool kOver>
void quantise_chunk(const Chunk& ch, const float* a, const float* au, const ElemV& E,
                    const BlockScale& s, const SP& sp, const int64_t* base, int shift,
                    int64_t off, int64_t block, Acc& acc) {
  Acc l = acc;
  const vf zero{};
  const int64_t nv = ch.stride / kL;
  for (int64_t r = 0; r < ch.nrows; ++r) {
    const float* pa = a + r * ch.stride;
    const float* pu = au + r * ch.stride;
    for (int64_t v = 0; v < nv; ++v) {
      vf vnum{}, vden{}, vrden{}, vg{};
      if (kMode == kConst) {
        vnum = splat(s.num);
        vden = splat(s.den);
        vrden = splat(s.rden);
        vg = splat(s.g);
      } else if (kMode == kShift) {
        const int64_t i = base[r] + (v >> shift);
        vnum = splat(sp.num[i]);
        vden = splat(sp.den[i]);
        vrden = splat(sp.rden[i]);
        vg = splat(sp.g[i]);
      } else {
        for (int j = 0; j < kL; ++j) {
          const int64_t i = base[r] + (off + v * kL + j) / block;
          vnum[j] = sp.num[i];
          vden[j] = sp.den[i];
          vrden[j] = sp.rden[i];
          vg[j] = sp.g[i];
        }
      }
      const vf va = load(pa + v * kL), vau = load(pu + v * kL);
      vi over;
      const vf q = quant<kCat>(va, vnum, vden, vrden, E, over);
      // Counts as masked decrements (one instruction with AVX-512 masks).
      if (kOver) l.over = over ? l.over - 1 : l.over;
      l.zq = q == zero ? l.zq - 1 : l.zq;
      const vf err = vau - q * vg;
      l.e2 += err * err;
    }
  }
  acc = l;
}

template <int kCat, bool kOver>
void quantise_mode(int mode, const Chunk& ch, const float* a, const float* au, const ElemV& E,
                   const BlockScale& s, const SP& sp, const int64_t* base, int shift,
                   int64_t off, int64_t block, Acc& acc) {
  switch (mode) {
    case kConst:
      return quantise_chunk<kCat, kConst, kOver>(ch, a, au, E, s, sp, base, shift, off, block,
                                                 acc);
    case kShift:
      return quantise_chunk<kCat, kShift, kOver>(ch, a, au, E, s, sp, base, shift, off, block,
                                                 acc);
    default:
      return quantise_chunk<kCat, kLane, kOver>(ch, a, au, E, s, sp, base, shift, off, block,
                                                acc);
  }
}

template <int kCat>
void quantise_cat(int mode, bool clips, const Chunk& ch, const float* a, const float* au,
                  const ElemV& E, const BlockScale& s, const SP& sp, const int64_t* base,
                  int shift, int64_t off, int64_t block, Acc& acc) {
  if (clips) {
    quantise_mode<kCat, true>(mode, ch, a, au, E, s, sp, base, shift, off, block, acc);
  } else {
    quantise_mode<kCat, false>(mode, ch, a, au, E, s, sp, base, shift, off, block, acc);
  }
}

void quantise(int cat, int mode, bool clips, const Chunk& ch, const float* a, const float* au,
              const ElemV& E, const BlockScale& s, const SP& sp, const int64_t* base, int shift,
              int64_t off, int64_t block, Acc& acc) {
  switch (cat) {
    case kCatNv:
      return quantise_cat<kCatNv>(mode, clips, ch, a, au, E, s, sp, base, shift, off, block,
                                  acc);
    case kCatExact:
      return quantise_cat<kCatExact>(mode, clips, ch, a, au, E, s, sp, base, shift, off, block,
                                     acc);
    case kCatPow2Wide:
      return quantise_cat<kCatPow2Wide>(mode, clips, ch, a, au, E, s, sp, base, shift, off,
                                        block, acc);
    default:
      return quantise_cat<kCatPow2>(mode, clips, ch, a, au, E, s, sp, base, shift, off, block,
                                    acc);
  }
}

// log2(x) for x a power of two, -1 otherwise.
inline int log2_exact(int64_t x) {
  if (x <= 0 || (x & (x - 1))) return -1;
  int s = 0;
  while ((int64_t{1} << s) < x) ++s;
  return s;
}

struct RecipeState {
  const Recipe* r;
  ElemV E;
  int cat, mode, shift;
  bool clips = true;  // whether a block being quantised may clip
  int64_t vpb;  // vectors per block (kShift)
  float enc;
  BlockScale whole;  // kConst
  Slots tiles;       // 2-D tiles: scales of every tile of the value
  int64_t groups = 0, ncb = 0;
  Acc acc;
  BlockLanes bl;
  Totals t;
};

void run_job_impl(const Value& v, const Recipe* recipes, int nr, Totals* out) {
  // The value's finite abs-max (the tensor factor of e4m3_tensor and nvfp4, and the unit
  // of the error sums), its infinities (clipped under every recipe) and tile maxima.
  int first_tile = -1;
  for (int i = 0; i < nr; ++i) {
    if (recipes[i].rows > 1 && recipes[i].block > 0) {
      first_tile = i;
      break;
    }
  }
  float amax = 0;
  int64_t n_inf = 0;
  std::vector<float> tmax;
  scan(v, first_tile >= 0 ? &recipes[first_tile] : nullptr, amax, n_inf, tmax);
  if (amax < kFltMin) amax = 0;
  for (int i = 0; i < nr; ++i) out[i] = Totals{};
  for (int i = 0; i < nr; ++i) out[i].over = n_inf;
  if (!(amax > 0)) return;  // nothing to quantise: every statistic stays 0
  const int k = std::clamp(std::ilogb(amax), -126, 126);

  RecipeState st[kMaxRecipes];
  // Columns per chunk segment: a multiple of every 1-D block size (blocks never straddle
  // segments), and of the tile widths where that keeps it small (whole vectors of a tile
  // then share its scale).
  int64_t lcm = kL;
  for (int i = 0; i < nr; ++i) {
    const int64_t b = recipes[i].block;
    if (b > 0 && recipes[i].rows == 1) lcm = lcm / gcd(lcm, b) * b;
  }
  for (int i = 0; i < nr; ++i) {
    const int64_t b = recipes[i].block;
    const int64_t with = b > 0 ? lcm / gcd(lcm, b) * b : lcm;
    if (recipes[i].rows > 1 && with <= std::max<int64_t>(lcm, 1 << 16)) lcm = with;
  }
  constexpr int64_t kChunk = 4096;  // floats per chunk (L1-resident with their units)
  const int64_t seg = std::max(lcm, kChunk / lcm * lcm);
  bool need_vmax = false;
  for (int i = 0; i < nr; ++i) {
    const Recipe& r = recipes[i];
    RecipeState& s = st[i];
    s.r = &r;
    s.E = elem_v(r.el);
    s.cat = cat_of(r.rule, s.E);
    s.enc = tensor_factor(r.rule, amax);
    const int sh = r.block % kL == 0 ? log2_exact(r.block / kL) : -1;
    if (r.block == 0) {
      s.mode = kConst;
      s.whole = scale_of(r, amax, s.enc, k);
      // One block: flushed when the abs-max itself quantises to zero.
      vi over;
      const vf am = splat(amax), wn = splat(s.whole.num), wd = splat(s.whole.den),
               wr = splat(s.whole.rden);
      const vf q = s.cat == kCatNv      ? quant<kCatNv>(am, wn, wd, wr, s.E, over)
                   : s.cat == kCatExact ? quant<kCatExact>(am, wn, wd, wr, s.E, over)
                   : s.cat == kCatPow2  ? quant<kCatPow2>(am, wn, wd, wr, s.E, over)
                                        : quant<kCatPow2Wide>(am, wn, wd, wr, s.E, over);
      s.clips = over[0] != 0;
      s.t.blocks = 1;
      s.t.flush = q[0] == 0;
      s.t.smax = s.t.smin = s.whole.key;
    } else {
      const bool whole_vectors = r.rows > 1 ? seg % r.block == 0 : sh < kLevels;
      s.mode = sh >= 0 && whole_vectors ? kShift : kLane;
      s.shift = sh;
      s.vpb = sh >= 0 ? r.block / kL : 0;
      if (r.rows > 1) {
        std::vector<float> own;
        if (i != first_tile) {
          float am;
          int64_t ni;
          scan(v, &r, am, ni, own);
        }
        const std::vector<float>& m = i == first_tile ? tmax : own;
        s.groups = (v.rows + r.rows - 1) / r.rows;
        s.ncb = (v.length + r.block - 1) / r.block;
        const int64_t n = v.outer * s.groups * s.ncb;
        s.tiles.resize(round_up(n, kL) + kL);
        scales(r, s.E, m.data(), round_up(n, kL), s.enc, k, s.tiles, s.bl);
        s.clips = s.bl.take_clips();
      } else {
        need_vmax |= s.mode == kShift;
      }
    }
  }

  // The main pass: chunks of rows (several short rows, or a segment of a long one).
  const int64_t nrows = v.outer * v.rows;
  const int64_t n_max = std::min(v.length, seg);
  const int64_t per_chunk =
      v.length <= seg ? std::max<int64_t>(1, kChunk / round_up(n_max, kL)) : 1;
  const int64_t cap = round_up(per_chunk * round_up(n_max, kL), kL * kL);
  std::vector<float> a(cap), au(cap), bmax(cap / kL + kL);
  std::vector<int64_t> base(per_chunk);
  Slots slots;
  slots.resize(cap / kL + 2 * kL);
  const float unit_k = pow2f(-k);
  int64_t zeros = 0, since_fold = 0;

  // Abs-maxima of blocks of 2^t vectors of the chunk's rows (nrows rows of vr vectors),
  // [row][block], computed once per chunk for all recipes of that block size: pairs of
  // the next smaller ones where every row has whole pairs, else from the vectors'.
  std::vector<float> levels[kLevels];
  for (auto& l : levels) l.assign(cap / kL + 2 * kL, 0.0f);
  bool level_done[kLevels] = {};
  auto level_maxima = [&](int t, int64_t nrows, int64_t vr) -> float* {
    for (int u = 1; u <= t; ++u) {  // level 0 is always done
      if (level_done[u]) continue;
      level_done[u] = true;
      float* out = levels[u].data();
      const int64_t vpb = int64_t{1} << u, spr = (vr + vpb - 1) / vpb, n_out = nrows * spr;
      if (vr % vpb == 0) {
        pair_maxima(levels[u - 1].data(), n_out, out);
      } else {
        for (int64_t j = 0; j < nrows; ++j) {
          const float* src = levels[0].data() + j * vr;
          for (int64_t b = 0; b < spr; ++b) {
            float m = 0;
            for (int64_t q = b * vpb; q < std::min(vr, (b + 1) * vpb); ++q) {
              m = std::max(m, src[q]);
            }
            out[j * spr + b] = m;
          }
        }
      }
      std::fill(out + n_out, out + round_up(n_out, 2 * kL), 0.0f);
    }
    return levels[t].data();
  };

  auto process = [&](const Chunk& ch) {
    const int64_t used = ch.nrows * ch.stride;
    const int64_t vr = ch.stride / kL;
    std::fill(level_done, level_done + kLevels, false);
    if (need_vmax) {
      std::fill(a.begin() + used, a.begin() + round_up(used, kL * kL), 0.0f);
      vector_maxima(a.data(), round_up(used / kL, kL), levels[0].data());
      std::fill(levels[0].data() + round_up(used / kL, kL),
                levels[0].data() + round_up(used / kL, 2 * kL), 0.0f);
      level_done[0] = true;
    }
    for (int i = 0; i < nr; ++i) {
      RecipeState& s = st[i];
      const Recipe& r = *s.r;
      if (s.mode == kConst) {
        quantise(s.cat, kConst, s.clips, ch, a.data(), au.data(), s.E, s.whole, SP{}, nullptr, 0,
                 0, 1,
                 s.acc);
        continue;
      }
      SP sp;
      int64_t off = 0;
      if (r.rows > 1) {
        for (int64_t j = 0; j < ch.nrows; ++j) {
          const int64_t gr = ch.row0 + j, o = gr / v.rows, rr = gr % v.rows;
          base[j] = (o * s.groups + rr / r.rows) * s.ncb;
          if (s.mode == kShift) base[j] += ch.c0 / r.block;
        }
        off = ch.c0;
        sp = sp_of(s.tiles);
      } else {
        // The blocks' abs-maxima, from the vectors' (kShift) or from the elements (kLane).
        int64_t spr;
        float* m;
        if (s.mode == kShift) {
          spr = (vr + s.vpb - 1) / s.vpb;
          m = level_maxima(s.shift, ch.nrows, vr);
        } else {
          spr = (ch.n + r.block - 1) / r.block;
          if (int64_t(bmax.size()) < ch.nrows * spr + kL) bmax.resize(ch.nrows * spr + kL);
          m = bmax.data();
          for (int64_t j = 0; j < ch.nrows; ++j) {
            const float* src = a.data() + j * ch.stride;
            for (int64_t b = 0; b < spr; ++b) {
              float t = 0;
              for (int64_t q = b * r.block; q < std::min(ch.n, (b + 1) * r.block); ++q) {
                t = std::max(t, src[q]);
              }
              m[j * spr + b] = t;
            }
          }
        }
        const int64_t ns = ch.nrows * spr, nsp = round_up(ns, kL);
        std::fill(m + ns, m + nsp, 0.0f);
        if (int64_t(slots.num.size()) < nsp + kL) slots.resize(nsp + kL);
        scales(r, s.E, m, nsp, s.enc, k, slots, s.bl);
        s.clips = s.bl.take_clips();
        for (int64_t j = 0; j < ch.nrows; ++j) base[j] = j * spr;
        sp = sp_of(slots);
      }
      quantise(s.cat, s.mode, s.clips, ch, a.data(), au.data(), s.E, s.whole, sp, base.data(),
               s.shift, off, r.block, s.acc);
    }
    // Fold the float lanes before they lose precision or the counts could wrap.
    if (since_fold >= kFold) {
      for (int i = 0; i < nr; ++i) st[i].t.fold(st[i].acc);
      since_fold = 0;
    }
  };

  if (v.length <= seg) {
    // Short rows: as many to a chunk as fit, until the accumulators are due to be folded.
    const int64_t stride = round_up(v.length, kL);
    for (int64_t row = 0; row < nrows;) {
      Chunk ch{row, 0, 0, v.length, stride};
      vi z{};
      while (row < nrows && ch.nrows < per_chunk) {
        load_row(v, row, 0, v.length, unit_k, a.data() + ch.nrows * stride,
                 au.data() + ch.nrows * stride, z);
        ++ch.nrows;
        ++row;
        if ((since_fold += v.length) >= kFold) break;
      }
      zeros += hcount(z);
      process(ch);
    }
  } else {
    for (int64_t row = 0; row < nrows; ++row) {
      for (int64_t c = 0; c < v.length; c += seg) {
        const int64_t n = std::min(seg, v.length - c);
        Chunk ch{row, 1, c, n, round_up(n, kL)};
        vi z{};
        load_row(v, row, c, n, unit_k, a.data(), au.data(), z);
        zeros += hcount(z);
        since_fold += n;
        process(ch);
      }
    }
  }
  for (int i = 0; i < nr; ++i) {
    RecipeState& s = st[i];
    s.t.fold(s.acc);
    if (s.mode != kConst) {
      s.bl.fold(s.t);
      if (s.r->rule == kTensor && s.t.smax > -std::numeric_limits<double>::infinity()) {
        s.t.smax = s.t.smin = scale_of(*s.r, 1.0f, s.enc, k).key;
      }
    }
    s.t.zq -= zeros;
    s.t.log2_enc = std::log2(double(tensor_factor(kNvfp4, amax)));
    s.t.over += n_inf;
    out[i] = s.t;
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
  Totals totals[kMaxRecipes];
  run_job_impl(job.v, job.recipes, job.nr, totals);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < job.nr; ++i) {
    Totals& t = totals[i];
    const bool scaled = t.smax > -std::numeric_limits<double>::infinity();
    if (scaled && job.recipes[i].rule == kNvfp4) {  // keys are block scales s_b
      t.smax = std::log2(t.smax) - t.log2_enc;
      t.smin = std::log2(t.smin) - t.log2_enc;
    }
    job.of[3 * i] = static_cast<float>(t.err2);
    job.of[3 * i + 1] = scaled ? static_cast<float>(t.smax) : ninf;
    job.of[3 * i + 2] = scaled ? static_cast<float>(-t.smin) : ninf;
    job.oi[4 * i] = static_cast<int32_t>(t.zq);
    job.oi[4 * i + 1] = static_cast<int32_t>(t.over);
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

// Float32 lanes per vector the kernel was built with (tests tell the builds apart).
extern "C" int scalescope_recipes_lanes() { return kL; }
