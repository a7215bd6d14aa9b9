// redfuser-ops CPU kernel helpers: element types, loads/stores, a vectorisable exp, rounding casts and
// the selection (top-k) primitives that generated CPU kernels call. Hand-written, op-agnostic: no op's math
// lives here. Kernel objects are compiled with -O3 and reassociation but WITHOUT -ffinite-math-only, so that
// the -inf/NaN guards the engine emits keep their meaning.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#endif

#include "runtime.h"

namespace redfuser::cpu {

// ------------------------------------------------------------------------------------------ element types
struct half_t {
  uint16_t bits;
};
struct bf16_t {
  uint16_t bits;
};
struct e4m3_t {
  uint8_t bits;
};

// ld: an element as a compute value (float for floating tensors, int64_t for integer tensors)
inline float ld(float v) { return v; }
// fp16 -> float without branches (so that loops over it vectorise), bit-exact for every value and without
// any subnormal float arithmetic (which DAZ/FTZ, set by other code in the process, would flush): normals by
// rebiasing the exponent, subnormals as mantissa * 2^-24 (exact, and a normal float), inf/NaN with exponent 255.
inline float half_bits_to_float(uint16_t h) {
  const uint32_t body = static_cast<uint32_t>(h & 0x7FFFu) << 13;
  const uint32_t exp = h & 0x7C00u;
  const uint32_t normal = body + (112u << 23);
  const uint32_t special = body | 0x7F800000u;
  const uint32_t sub = float_bits(static_cast<float>(h & 0x03FFu) * 5.9604644775390625e-8f);  // * 2^-24
  const uint32_t mag = exp == 0x7C00u ? special : (exp == 0 ? sub : normal);
  return bits_float(mag | (static_cast<uint32_t>(h & 0x8000u) << 16));
}
inline float ld(half_t v) { return half_bits_to_float(v.bits); }
inline float ld(bf16_t v) { return bf16_to_float(v.bits); }
inline int64_t ld(int32_t v) { return v; }
inline int64_t ld(int64_t v) { return v; }

// float8 e4m3fn (finite-only: max 448, NaN = 0x7F/0xFF, no infinities) <-> float. Decoding is branch-free integer
// arithmetic (so that a loop decoding a weight row vectorises; a 256-entry table lookup did not, and cost ~2.5 ns
// per weight byte on a Zen 3 EPYC), exact for all 256 values (tests/cpu_math_exhaustive.cpp, against torch):
// normals by rebiasing the exponent (7 -> 127), subnormals as mantissa * 2^-9 (a normal float, so DAZ/FTZ cannot
// flush it), 0x7F as NaN.
inline float e4m3_to_float(uint8_t b) {
  const uint32_t em = b & 0x7Fu;
  const uint32_t normal = (em << 20) + (120u << 23);
  const uint32_t sub = float_bits(static_cast<float>(static_cast<int32_t>(em)) * 0.001953125f);  // em * 2^-9
  uint32_t mag = em < 8u ? sub : normal;
  mag = em == 0x7Fu ? 0x7FC00000u : mag;
  return bits_float(mag | (static_cast<uint32_t>(b & 0x80u) << 24));
}
inline float ld(e4m3_t v) { return e4m3_to_float(v.bits); }

// round-to-nearest-even to e4m3fn with saturation to +-448 (NaN stays NaN). Branch-free (so that loops over it
// vectorise) and bit-exact for every float (checked against a frexp/ldexp reference over all 2^32 inputs):
// - normals (|f| >= 2^-6): the float's mantissa rounded to 3 bits in its bits (a carry moves into the exponent),
//   the exponent rebiased 127 -> 7, anything past 448 (inf included) saturated to 0x7E;
// - subnormals (|f| < 2^-6): units of 2^-9, |f| * 512 rounded to the nearest integer, ties to even (8 is the
//   smallest normal, 0x08, which is the same bits).
inline uint8_t float_to_e4m3(float f) {
  const uint32_t bits = float_bits(f);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t mag = bits & 0x7FFFFFFFu;
  const bool small = mag < 0x3C800000u;  // below 2^-6
  const uint32_t rounded = (mag + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20;  // exponent << 3 | 3 mantissa bits
  const uint32_t normal = std::min<uint32_t>(rounded - (120u << 3), 0x7Eu);  // (wraps where small: not used)
  const float units = (small ? bits_float(mag) : 0.0f) * 512.0f;  // in [0, 8]
  const uint32_t sub = static_cast<uint32_t>(static_cast<int32_t>(std::nearbyint(units)));
  const uint32_t code = sign | (small ? sub : normal);
  return static_cast<uint8_t>(mag > 0x7F800000u ? 0x7Fu : code);
}

template <class T>
inline T from_float(float v);
template <>
inline e4m3_t from_float<e4m3_t>(float v) { return {float_to_e4m3(v)}; }
template <>
inline float from_float<float>(float v) { return v; }
template <>
inline half_t from_float<half_t>(float v) { return {float_to_half(v)}; }
template <>
inline bf16_t from_float<bf16_t>(float v) { return {float_to_bf16(v)}; }
template <>
inline int32_t from_float<int32_t>(float v) { return static_cast<int32_t>(v); }

template <class T>
inline void store(T* p, float v) {
  *p = from_float<T>(v);
}
inline void store_index(int32_t* p, int64_t v) { *p = static_cast<int32_t>(v); }

// rounding casts used by specs (exact-up-to-rounding in the proof; real rounding here)
inline float round_e4m3(float v) { return e4m3_to_float(float_to_e4m3(v)); }
inline float round_half(float v) { return half_to_float(float_to_half(v)); }
inline float round_bf16(float v) { return bf16_to_float(float_to_bf16(v)); }

// ------------------------------------------------------------------------------------------ math
// exp for float: Cody-Waite range reduction + a degree-6 polynomial on |r| <= ln2/2, written branch-free so that
// loops over it vectorise. exp(-inf) and anything below the smallest normal give exactly 0, exp(+inf) and overflow
// give +inf, NaN stays NaN (a signalling one comes back quiet). 2^n is applied by adding n to p's exponent field,
// an integer add: p is in (0.70, 1.42) and n in [-126, 128], so the sum is the float p * 2^n (at the bottom a
// subnormal's pattern); a float 2^n is +inf at n = 128, which made exp(x) inf for x in (88.38, 88.72].
// Nothing is clamped: outside [lo, hi] (and for NaN) the two selects at the end replace y whatever it holds, and n
// becomes an integer by adding 1.5 * 2^23 and reading the low bits (defined for any float, where a conversion out
// of range is not). Clamping x, or n for a conversion, gave GCC compares to share with the selects', and it made
// them a tangle of mask operations (7-11 of the loop's ~30 vector instructions at AVX-512). In [lo, hi] n is the
// same, so the result is the same bit for bit (every float checked at x86-64-v4, v3 and the base level, against
// the clamp on x; only the base level's last bits moved with the clamp's removal, -ffast-math reassociating the
// range reduction without FMA, inside the same bound); a loop of exp(s - m), 256 elements in L1, took 24 % less
// time at AVX-512 than with n clamped for a conversion, which took 7-12 % less than with x clamped.
// The polynomial is 1 + r + r^2 (c2 + c3 r + ... + c6 r^4), c2..c6 fitted by Remez exchange for the least relative
// error on [-ln2/2, ln2/2] (3.1e-9 in exact arithmetic; the degree-7 Taylor polynomial it replaced had 5.6e-9 and one
// FMA more). One select gives both +inf past the top and NaN (x + inf): the nested selects before kept more mask
// registers live than AVX-512 has, and GCC spilled them to the stack. Measured relative error, x in [ln(FLT_MIN),
// ln(FLT_MAX)): 3.0e-7 where FMA contracts the range reduction (x86-64-v3, v4), 4.1e-6 without FMA (-ffast-math
// reassociates the two-part ln2 into one float constant; 3.7e-6 with the clamp on x), 3.2e-6 at the very bottom
// (subnormal results keep fewer bits); against the degree-7 Taylor form, a loop of exp(s - m) with a mask select,
// 256 elements in L1, took 16 % less time on AVX-512 and 18 % less on AVX2 (Xeon, family 6 model 207).
inline float exp(float x) {
  const float hi = 88.72283172607421875f;  // the largest float below ln(FLT_MAX)
  const float lo = -87.33654475f;        // ln(FLT_MIN)
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 split: hi + lo parts
  float p = 1.3814613e-3f;
  p = p * r + 8.3687100e-3f;
  p = p * r + 4.1668389e-2f;
  p = p * r + 1.6666521e-1f;
  p = p * r + 4.9999994e-1f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const uint32_t ni = float_bits(n + 12582912.0f) - 0x4B400000u;  // n as an integer, through 1.5 * 2^23
  float y = bits_float(float_bits(p) + (ni << 23));
  y = x < lo ? 0.0f : y;
  return x <= hi ? y : x + std::numeric_limits<float>::infinity();  // past the top: +inf; NaN: NaN
}
inline double exp(double x) { return std::exp(x); }

inline float log(float x) { return std::log(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float sigmoid(float x) { return 1.0f / (1.0f + redfuser::cpu::exp(-x)); }

// max/min that propagate NaN (as torch.max and the engine's evaluator do)
// (one select each, so that loops over them vectorise: b where b is NaN or at least a, unless a is NaN)
inline float max(float a, float b) { return (a > b || a != a) ? a : b; }
inline float min(float a, float b) { return (a < b || a != a) ? a : b; }
inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }
// int32 keys whose signed order is the order of the floats (-0 just below +0), for vectorised lane-wise max/min:
// fkey_hi puts every NaN above +inf (a max keeps it), fkey_lo below -inf (a min keeps it); unkey gives the float
// back (a NaN as a quiet NaN). An integer max/min vectorises where a NaN-propagating float select does not.
inline int32_t fkey_bits(uint32_t b) {
  return static_cast<int32_t>(b ^ (static_cast<uint32_t>(static_cast<int32_t>(b) >> 31) & 0x7FFFFFFFu));
}
inline int32_t fkey_hi(float f) {
  const uint32_t b = float_bits(f);
  return fkey_bits((b & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : b);
}
inline int32_t fkey_lo(float f) {
  const uint32_t b = float_bits(f);
  return fkey_bits((b & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFC00000u : b);
}
inline float unkey(int32_t k) { return bits_float(static_cast<uint32_t>(fkey_bits(static_cast<uint32_t>(k)))); }
inline int32_t kmax(int32_t a, int32_t b) { return a > b ? a : b; }
// a ? b : c of floats through bit masks (both evaluated): vectorises where the generated ternary does not
inline float sel(bool c, float a, float b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return bits_float((float_bits(a) & m) | (float_bits(b) & ~m));
}
inline int32_t kmin(int32_t a, int32_t b) { return a < b ? a : b; }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// floor division and modulo of integers (index arithmetic; operands are non-negative in specs)
inline int64_t idiv(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
inline int64_t imod(int64_t a, int64_t b) {
  const int64_t r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}


// ------------------------------------------------------------------------------------------ tile GEMM
// C[m, n] (+)= sum_k A[m, k] * B[k, n] for m < M, n < N, all row-major with leading dimensions lda, ldb, ldc:
// the contractions of a block of rows against a packed tile of the streamed operand (scores = Q_block x K_tile^T,
// out += P x V_tile). Register-blocked: MR rows x 32 columns of C stay in vector registers (GCC vector
// extensions: one zmm per 16 floats on AVX-512, two ymm on AVX2) while k runs, so each element of B is loaded
// once per MR rows and each element of A once per 32 columns. Every row of B must have round_up(N, 32)
// readable floats (packed tiles are allocated that wide; the extra columns are computed and dropped).
// The panel and row loops are always inlined into one entry point per x86-64 level (gemm_tile_v4/_v3/_base,
// chosen once at run time), so that each is compiled with its level's vector width: once per source file, not
// once per kernel specialisation that calls it. Each level names its own native vector type: GCC lowers a vector
// wider than the function's ISA piece by piece through memory (a 64-byte vector on AVX2 ran at 1.6 GFLOP/s on a
// Zen 3 EPYC, 1 thread, tile 64 x 256 x 64).
// GCC's -Wpsabi ("AVX vector return without AVX enabled changes the ABI") fires on the vector-valued helpers here
// (ld8, ...) in files whose base-level code includes them (which helper it names moved with unrelated edits); every
// such helper is always_inline within the file that uses it, so no call crosses an ABI boundary: the note is noise
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef float vf16 __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef int32_t vi4 __attribute__((vector_size(16)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef int32_t vi16 __attribute__((vector_size(64)));

// y[c] = column c of the 8 x 8 block x (y[c][r] = x[r][c]) by three rounds of two-source shuffles (pairs of rows,
// pairs of pairs, halves), 24 shuffles (V is vf8; a template, so that it is compiled only where a caller inlines it)
template <class V>
__attribute__((always_inline)) inline void transpose8(const V* x, V* y) {
  const vi8 ev{0, 8, 2, 10, 4, 12, 6, 14}, od{1, 9, 3, 11, 5, 13, 7, 15};
  const vi8 lo2{0, 1, 8, 9, 4, 5, 12, 13}, hi2{2, 3, 10, 11, 6, 7, 14, 15};
  const vi8 lo4{0, 1, 2, 3, 8, 9, 10, 11}, hi4{4, 5, 6, 7, 12, 13, 14, 15};
  vf8 p[8], q[8];
  for (int i = 0; i < 8; i += 2) {  // rows (i, i + 1) interleaved: even and odd columns
    p[i] = __builtin_shuffle(x[i], x[i + 1], ev);
    p[i + 1] = __builtin_shuffle(x[i], x[i + 1], od);
  }
  for (int i = 0; i < 8; i += 4)  // pairs (i, i + 2): columns 0/4, 2/6 from the evens, 1/5, 3/7 from the odds
    for (int o = 0; o < 2; ++o) {
      q[i + o] = __builtin_shuffle(p[i + o], p[i + 2 + o], lo2);
      q[i + 2 + o] = __builtin_shuffle(p[i + o], p[i + 2 + o], hi2);
    }
  // q[0..3] (rows 0-3) and q[4..7] (rows 4-7) hold columns {0/4, 1/5, 2/6, 3/7} in their two halves
  for (int t = 0; t < 4; ++t) {
    y[t] = __builtin_shuffle(q[t], q[4 + t], lo4);
    y[t + 4] = __builtin_shuffle(q[t], q[4 + t], hi4);
  }
}

// C[n * ldc + i] (+)= t[i][n] for i < MR, n < nv: a register block of the tile stored transposed (gemm_panel's
// TC). Eight rows at a time by transpose8, each column then one 8-float add and store; MR not a multiple of 8
// element by element
template <int MR>
__attribute__((always_inline)) inline void store_transposed(const float (*t)[32], int64_t nv, float* C, int64_t ldc,
                                                            bool accumulate) {
  if constexpr (MR % 8 == 0) {
    for (int r = 0; r < MR; r += 8)
    for (int64_t g = 0; g < nv; g += 8) {
      vf8 x[8], y[8];
      for (int i = 0; i < 8; ++i) std::memcpy(&x[i], t[r + i] + g, sizeof(vf8));
      transpose8(x, y);
      const int64_t ne = nv - g < 8 ? nv - g : 8;
      for (int64_t n = 0; n < ne; ++n) {
        float* cr = C + (g + n) * ldc + r;
        vf8 o = y[n];
        if (accumulate) {
          vf8 a;
          std::memcpy(&a, cr, sizeof(a));
          o += a;
        }
        std::memcpy(cr, &o, sizeof(o));
      }
    }
  } else {
    for (int64_t n = 0; n < nv; ++n)
      for (int i = 0; i < MR; ++i) C[n * ldc + i] = accumulate ? C[n * ldc + i] + t[i][n] : t[i][n];
  }
}

// MR rows x 32 columns of C in registers: NV vectors of type V per row (NV * lanes = 32)
// TC: C is stored transposed, C[n * ldc + i] (+)= the product's [i, n] (gemm_tile_panels_tc); there NV * lanes may
// be 16, the first half of the panel's columns (nv <= 16)
template <class V, int NV, int MR, bool TC = false>
__attribute__((always_inline)) inline void gemm_panel(int64_t K, const float* A, int64_t lda, const float* B,
                                                      int64_t ldb, float* C, int64_t ldc, int64_t nv,
                                                      bool accumulate) {
  constexpr int L = sizeof(V) / sizeof(float);
  static_assert(NV * L == 32 || (TC && NV * L == 16), "a block covers the panel's 32 columns (or 16, stored transposed)");
  V c[MR][NV];
  #pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
    #pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) c[i][v] = V{};
  for (int64_t k = 0; k < K; ++k) {
    V b[NV];
    #pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) std::memcpy(&b[v], B + k * ldb + v * L, sizeof(V));
    #pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const float a = A[i * lda + k];
      #pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) c[i][v] += a * b[v];
    }
  }
  if constexpr (TC) {
    alignas(64) float t[MR][32];
    #pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
      #pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) std::memcpy(t[i] + v * L, &c[i][v], sizeof(V));
    store_transposed<MR>(t, nv, C, ldc, accumulate);
    return;
  }
  #pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    float* cr = C + i * ldc;
    if (nv == 32) {
      #pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) {
        V o;
        if (accumulate) {
          std::memcpy(&o, cr + v * L, sizeof(V));
          o += c[i][v];
        } else {
          o = c[i][v];
        }
        std::memcpy(cr + v * L, &o, sizeof(V));
      }
    } else {
      float t[32];
      #pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) std::memcpy(t + v * L, &c[i][v], sizeof(V));
      for (int64_t n = 0; n < nv; ++n) cr[n] = accumulate ? cr[n] + t[n] : t[n];
    }
  }
}

// A register block sums at most GEMM_KC products in a row before it is added to C: the rounding error of one long
// running sum grows with its length, and fused_attention fp32 at D 256 with scores of tens (softmax_scale 1-3) had
// 1.1-5.5x the error of torch's attention, past ACCEPTANCE's 2x-plain rule in most draws (the scores sum D
// products, out a chunk's 256 keys). In blocks of 128 its error is torch's (0.9-1.1x in the same draws); blocks of
// 64 halve it again but cost 2-3 % of fp32 prefill at D 128 (Zen 4, 1 thread), 128 nothing measurable there: the
// score GEMM of D <= 128 stays one block, and C is an L1-resident tile, read and written once more per block.
// Not the tile stored transposed (TC, fp8_quant_gemm's acc^T): each block's store there transposes 8 x 8 blocks,
// and a second block per chunk made fp8_quant_gemm bf16 N4096 K4096 8-11 % slower (M16, M128); its products are of
// e4m3 values (exact in float32) and its error is the quantisation's, orders of magnitude above the sums' rounding.
constexpr int64_t GEMM_KC = 128;

// MR rows at a time, as many as the vector registers hold beside the NV vectors of B: 8 x 2 zmm of AVX-512's 32
// registers, 3 x 4 ymm of AVX2's 16, 1 x 8 xmm of SSE2's 16. Measured on a Zen 4 EPYC at 1 thread (tile 32 x 64 x
// 128, a loaded machine): 41 GFLOP/s with 4 rows, 47 with 8.
// A panel is read in place. The kernels pass contiguous ones (ldb 32: pack_transposed_panels, gemm_tile_panels):
// rows 1-2 KiB apart (ldb 256 or 512 floats) put a panel into a few L1 sets, fetched again from L2 by every MR rows,
// and copying each panel into a contiguous buffer here on every call made fused_attention fp32 at 1 thread 2-7 %
// faster (Xeon, family 6 model 207; best of 6 alternating runs); packing the tiles panel by panel removed the copy.
// TC: C stored transposed (C[n * ldc + m]), for gemm_tile_panels_tc; B is read panel by panel there (ldb 32,
// pstride apart), here at B + n0 (one panel of ldb-wide rows) where pstride is 0
template <class V, int NV, int MR, bool TC = false>
__attribute__((always_inline)) inline void gemm_rows(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                                                     const float* B, int64_t ldb, float* C, int64_t ldc,
                                                     bool accumulate, int64_t pstride = 0) {
  for (int64_t n0 = 0; n0 < N; n0 += 32) {  // one 32-column panel of B stays in L1 while the rows pass over it
    const int64_t nv = N - n0 < 32 ? N - n0 : 32;
    const float* Bp = pstride ? B + n0 / 32 * pstride : B + n0;
    const auto at = [&](int64_t m) { return TC ? C + n0 * ldc + m : C + m * ldc + n0; };
    // r rows (an integral_constant) from m against the panel, kc values of k at a time; always inlined, so that its
    // vectors are those of the calling level (out of line, a lambda is compiled for the default target: GCC left
    // the 16-row transposed block out of line, and fp8_quant_gemm M16 ran 7.5x slower)
    // (at least one block: K = 0 writes C's zeros where it does not accumulate)
    const int64_t kc = TC ? K : GEMM_KC;
    const auto rows = [&](auto r, int64_t m) __attribute__((always_inline)) {
      int64_t k0 = 0;
      do {
        const int64_t kn = K - k0 < kc ? K - k0 : kc;
        gemm_panel<V, NV, decltype(r)::value, TC>(kn, A + m * lda + k0, lda, Bp + k0 * ldb, ldb, at(m), ldc, nv,
                                                  accumulate || k0 > 0);
        k0 += kn;
      } while (k0 < K);
    };
    int64_t m = 0;
    for (; m + MR <= M; m += MR) rows(std::integral_constant<int, MR>{}, m);
    if (MR > 8 && m + 8 <= M) {
      rows(std::integral_constant<int, (MR > 8 ? 8 : 1)>{}, m);
      m += 8;
    }
    if (MR > 4 && m + 4 <= M) {
      rows(std::integral_constant<int, (MR > 4 ? 4 : 1)>{}, m);
      m += 4;
    }
    for (; m < M; ++m) rows(std::integral_constant<int, 1>{}, m);
  }
}

// the sum of the two halves of a vector (a vector of half the width), in registers
template <class H, class V>
__attribute__((always_inline)) inline H add_halves(const V& v) {
  static_assert(2 * sizeof(H) == sizeof(V), "H is half of V");
  H lo, hi;
  std::memcpy(&lo, &v, sizeof(H));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(H), sizeof(H));
  return lo + hi;
}

// the sum of a vector's lanes, halving in registers (a store and a scalar loop cost as much as the dot product
// of a 256-element chunk at one row)
__attribute__((always_inline)) inline float lane_sum(const vf4& v) { return (v[0] + v[2]) + (v[1] + v[3]); }
__attribute__((always_inline)) inline float lane_sum(const vf8& v) { return lane_sum(add_halves<vf4>(v)); }
__attribute__((always_inline)) inline float lane_sum(const vf16& v) { return lane_sum(add_halves<vf8>(v)); }

// the sum of N partial sums (a vectorised fold's lanes), pairwise by halving: l[i] + l[i + N / 2], then the same on
// the first half, down to one (the order of lane_sum, whose halving in registers it is for N = 16: the loop over
// the array, after the lanes were accumulated in a vector register, read them back one by one through a store,
// 7-9 % of fused_attention's block function on a Zen 4); overwrites l
template <int N>
__attribute__((always_inline)) inline float lanes_total(float* l) {
  static_assert(N > 0 && (N & (N - 1)) == 0, "a power of two");
  if constexpr (N == 16) {
    vf16 v;
    std::memcpy(&v, l, sizeof(v));
    return lane_sum(v);
  }
  for (int w = N / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) l[i] = l[i] + l[i + w];
  return l[0];
}

// {sum(a), sum(b), sum(c), sum(d)}: four lane sums at once by two rounds of pairwise interleaved adds (each group
// of four lanes then holds partial sums of a, b, c, d) and a halving of the groups
__attribute__((always_inline)) inline vf4 lane_sums4(const vf4& a, const vf4& b, const vf4& c, const vf4& d) {
  const vi4 e{0, 4, 2, 6}, o{1, 5, 3, 7}, lo{0, 1, 4, 5}, hi{2, 3, 6, 7};
  const vf4 x = __builtin_shuffle(a, b, e) + __builtin_shuffle(a, b, o);
  const vf4 y = __builtin_shuffle(c, d, e) + __builtin_shuffle(c, d, o);
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}
__attribute__((always_inline)) inline vf4 lane_sums4(const vf8& a, const vf8& b, const vf8& c, const vf8& d) {
  const vi8 e{0, 8, 2, 10, 4, 12, 6, 14}, o{1, 9, 3, 11, 5, 13, 7, 15};
  const vi8 lo{0, 1, 8, 9, 4, 5, 12, 13}, hi{2, 3, 10, 11, 6, 7, 14, 15};
  const vf8 x = __builtin_shuffle(a, b, e) + __builtin_shuffle(a, b, o);
  const vf8 y = __builtin_shuffle(c, d, e) + __builtin_shuffle(c, d, o);
  return add_halves<vf4>(vf8(__builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi)));
}
__attribute__((always_inline)) inline vf4 lane_sums4(const vf16& a, const vf16& b, const vf16& c, const vf16& d) {
  const vi16 e{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const vi16 o{1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  const vi16 lo{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const vi16 hi{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const vf16 x = __builtin_shuffle(a, b, e) + __builtin_shuffle(a, b, o);
  const vf16 y = __builtin_shuffle(c, d, e) + __builtin_shuffle(c, d, o);
  return add_halves<vf4>(add_halves<vf8>(vf16(__builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi))));
}

// The same product with B given transposed, Bt[n, k] (C[m, n] (+)= sum_k A[m, k] * Bt[n, k]): for a streamed
// operand whose reduction index is its last (a weight W[n, k] read along k), packed row by row with contiguous
// reads where the [k][n] pack above gathers across rows. MR x NR dot products in vectors over k, summed across
// lanes once per tile.
template <class V, int MR, int NR>
__attribute__((always_inline)) inline void gemm_nt_block(int64_t K, const float* A, int64_t lda, const float* B,
                                                         int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  constexpr int L = sizeof(V) / sizeof(float);
  V c[MR][NR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) c[i][j] = V{};
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    V a[MR], b[NR];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) std::memcpy(&a[i], A + i * lda + k, sizeof(V));
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) std::memcpy(&b[j], B + j * ldb + k, sizeof(V));
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) c[i][j] += a[i] * b[j];
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    float sums[NR];
    if constexpr (NR == 4) {  // a row's four sums in one reduction
      const vf4 r = lane_sums4(c[i][0], c[i][1], c[i][2], c[i][3]);
      std::memcpy(sums, &r, sizeof(r));
    } else {
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) sums[j] = lane_sum(c[i][j]);
    }
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      float s = sums[j];
      for (int64_t kk = k; kk < K; ++kk) s += A[i * lda + kk] * B[j * ldb + kk];
      float* cij = C + i * ldc + j;
      *cij = accumulate ? *cij + s : s;
    }
  }
}

template <class V, int MR, int NR>
__attribute__((always_inline)) inline void gemm_nt_rows(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                                                        const float* Bt, int64_t ldb, float* C, int64_t ldc,
                                                        bool accumulate) {
  for (int64_t n0 = 0; n0 < N; n0 += 32) {  // 32 rows of Bt stay in L1 while the rows of A pass over them
    const int64_t ne = N - n0 < 32 ? N : n0 + 32;
    int64_t m = 0;
    for (; m + MR <= M; m += MR) {
      int64_t n = n0;
      for (; n + NR <= ne; n += NR)
        gemm_nt_block<V, MR, NR>(K, A + m * lda, lda, Bt + n * ldb, ldb, C + m * ldc + n, ldc, accumulate);
      for (; n < ne; ++n)
        gemm_nt_block<V, MR, 1>(K, A + m * lda, lda, Bt + n * ldb, ldb, C + m * ldc + n, ldc, accumulate);
    }
    for (; m < M; ++m) {
      int64_t n = n0;
      for (; n + NR <= ne; n += NR)
        gemm_nt_block<V, 1, NR>(K, A + m * lda, lda, Bt + n * ldb, ldb, C + m * ldc + n, ldc, accumulate);
      for (; n < ne; ++n)
        gemm_nt_block<V, 1, 1>(K, A + m * lda, lda, Bt + n * ldb, ldb, C + m * ldc + n, ldc, accumulate);
    }
  }
}

#define REDFUSER_GEMM_ARGS                                                                                    \
  int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, \
      bool accumulate
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
inline int x86_level() {
  static const int level = __builtin_cpu_supports("x86-64-v4") ? 4 : (__builtin_cpu_supports("x86-64-v3") ? 3 : 0);
  return level;
}
__attribute__((target("arch=x86-64-v4"))) inline void gemm_tile_v4(REDFUSER_GEMM_ARGS) {
  gemm_rows<vf16, 2, 8>(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}
__attribute__((target("arch=x86-64-v3"))) inline void gemm_tile_v3(REDFUSER_GEMM_ARGS) {
  gemm_rows<vf8, 4, 3>(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}
inline void gemm_tile_base(REDFUSER_GEMM_ARGS) { gemm_rows<vf4, 8, 1>(M, N, K, A, lda, B, ldb, C, ldc, accumulate); }
// the entry point of the CPU's x86-64 level among a kernel's three
// (any function pointer type: the tiles here, the chunk helpers below)
template <class Fn>
inline Fn by_level(Fn v4, Fn v3, Fn base) {
  const int level = x86_level();
  return level == 4 ? v4 : (level == 3 ? v3 : base);
}
inline void gemm_tile(REDFUSER_GEMM_ARGS) {
  by_level(gemm_tile_v4, gemm_tile_v3, gemm_tile_base)(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}
__attribute__((target("arch=x86-64-v4"))) inline void gemm_tile_nt_v4(REDFUSER_GEMM_ARGS) {
  gemm_nt_rows<vf16, 4, 4>(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}
__attribute__((target("arch=x86-64-v3"))) inline void gemm_tile_nt_v3(REDFUSER_GEMM_ARGS) {
  gemm_nt_rows<vf8, 3, 4>(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}
inline void gemm_tile_nt_base(REDFUSER_GEMM_ARGS) {
  gemm_nt_rows<vf4, 2, 4>(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}
inline void gemm_tile_nt(REDFUSER_GEMM_ARGS) {
  by_level(gemm_tile_nt_v4, gemm_tile_nt_v3, gemm_tile_nt_base)(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}
// the tile of gemm_tile_panels_tc below (B in panels pstride apart, passed as ldb); at most 16 columns (a run of 16
// rows or fewer) in blocks of 16 columns and twice the rows of A (16 x one zmm, 6 x two ymm), where the 32-column
// block would compute half its columns for nothing (fp8_quant_gemm M16 N4096 K4096 at 1 thread 8.4 -> 7.6 ms, Xeon)
__attribute__((target("arch=x86-64-v4"))) inline void gemm_tile_tc_v4(REDFUSER_GEMM_ARGS) {
  if (N <= 16)
    gemm_rows<vf16, 1, 16, true>(M, N, K, A, lda, B, 32, C, ldc, accumulate, ldb);
  else
    gemm_rows<vf16, 2, 8, true>(M, N, K, A, lda, B, 32, C, ldc, accumulate, ldb);
}
__attribute__((target("arch=x86-64-v3"))) inline void gemm_tile_tc_v3(REDFUSER_GEMM_ARGS) {
  if (N <= 16)
    gemm_rows<vf8, 2, 6, true>(M, N, K, A, lda, B, 32, C, ldc, accumulate, ldb);
  else
    gemm_rows<vf8, 4, 3, true>(M, N, K, A, lda, B, 32, C, ldc, accumulate, ldb);
}
inline void gemm_tile_tc_base(REDFUSER_GEMM_ARGS) {
  gemm_rows<vf4, 8, 1, true>(M, N, K, A, lda, B, 32, C, ldc, accumulate, ldb);
}
inline void gemm_tile_tc(REDFUSER_GEMM_ARGS) {
  by_level(gemm_tile_tc_v4, gemm_tile_tc_v3, gemm_tile_tc_base)(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}
#else
inline void gemm_tile(REDFUSER_GEMM_ARGS) { gemm_rows<vf4, 8, 1>(M, N, K, A, lda, B, ldb, C, ldc, accumulate); }
inline void gemm_tile_nt(REDFUSER_GEMM_ARGS) { gemm_nt_rows<vf4, 2, 4>(M, N, K, A, lda, B, ldb, C, ldc, accumulate); }
inline void gemm_tile_tc(REDFUSER_GEMM_ARGS) {
  gemm_rows<vf4, 8, 1, true>(M, N, K, A, lda, B, 32, C, ldc, accumulate, ldb);
}
#endif
#undef REDFUSER_GEMM_ARGS

// C (+)= A x B for a B laid out panel by panel: its 32-column panels one after another, panel p (columns 32p ..
// 32p + 31) at B + p * pstride, K rows of 32 floats each (the kernels' score and weight tiles come so from
// pack_transposed_panels, their fold tiles are written so element row by element row). Each panel is contiguous,
// so the tile reads it in place (a row-major tile had to be copied panel by panel on every call, also one kept for
// many blocks in rf::TileMemo).
// Columns of the last panel past N are computed and dropped (the panel has 32 readable floats per row).
inline void gemm_tile_panels(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                             int64_t pstride, float* C, int64_t ldc, bool accumulate) {
  for (int64_t n0 = 0; n0 < N; n0 += 32)
    gemm_tile(M, N - n0 < 32 ? N - n0 : 32, K, A, lda, B + n0 / 32 * pstride, 32, C + n0, ldc, accumulate);
}

// The same product stored transposed: C[n * ldc + m] (+)= sum_k A[m, k] * B(k, n), B in panels as above. For an NT
// fold over many rows (acc[rows, n] += w[rows, j] x W[n, j]^T) computed as acc^T = W x w^T: the weight's rows,
// as decoded ([n][element], contiguous along the chunk), are the broadcast operand, and the rows' weights, packed
// once per chunk into panels of 32 rows, the streamed one; each register block (8 n x 32 rows on AVX-512) is added
// to acc transposed 8 x 8 at a time once per chunk (transpose8), where transposing every weight tile into panels
// cost a shuffle per element.
inline void gemm_tile_panels_tc(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                                int64_t pstride, float* C, int64_t ldc, bool accumulate) {
  gemm_tile_tc(M, N, K, A, lda, B, pstride, C, ldc, accumulate);
}

// ------------------------------------------------------------------------------------------ exp of a chunk
// w[j] = exp(w[j]) for j < n, in place, returning the sum of the results in the order of the generated kernels' lane
// folds (cpu._Kernel.element_loop): lane u adds the elements u, u + 16, ... of the whole 16-element steps, the tail
// (n % 16 elements) is added from 0 (in an order -ffast-math may change), and the result is tail +
// lanes_total<16>(lanes). For a GEMM fold whose weights are exp(x): they and their sum (softmax's denominator) in one
// pass over the chunk. On AVX-512 a step applies 2^n to p with vscalefps, which saturates by itself: +inf past the
// top (x clamped to 89 first, NaN kept: the clamp returns x when it is NaN), and the integer n, the exponent add and
// the select for the top of rf::exp go (GCC 11: 23 instructions a step for the weights and their sum, where
// fused_attention's generated weights loop took 27 and its sum loop 4 more). Below ln(FLT_MIN) the
// result is 0 as in rf::exp, by a zeroing mask, and those lanes are computed at x = -87 meanwhile: a subnormal or
// underflowing result of vscalefps costs a microcode assist each (an exp(-inf) per masked element made causal
// attention 1.7x slower). The values are rf::exp's up to the last bits (the same reduction and polynomial; the two
// parts of ln2 as two FMAs where -ffast-math folds them into one in rf::exp's vectorised loops). Other levels (and
// the tail) run rf::exp itself.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("arch=x86-64-v4"))) inline float exp_sum_v4(float* w, int64_t n) {
  const __m512 lo = _mm512_set1_ps(-87.33654475f), safe = _mm512_set1_ps(-87.0f), hi = _mm512_set1_ps(89.0f);
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(w + j);
    const __mmask16 under = _mm512_cmp_ps_mask(v, lo, _CMP_LT_OQ);  // NaN: not under
    const __m512 x = _mm512_min_ps(hi, _mm512_mask_blend_ps(under, v, safe));  // NaN: x (the second operand)
    const __m512 t = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(t, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(t, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.3814613e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3687100e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1668389e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666521e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.9999994e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512 y = _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), _mm512_scalef_ps(p, t));
    _mm512_storeu_ps(w + j, y);
    acc = _mm512_add_ps(acc, y);
  }
  float tail = 0.0f;
  for (; j < n; ++j) {
    w[j] = exp(w[j]);
    tail = tail + w[j];
  }
  vf16 l;
  std::memcpy(&l, &acc, sizeof(l));
  return tail + lane_sum(l);
}
#endif
// The NaN-propagating maximum of w[0 .. n) (-inf where n is 0; NaN where an element is NaN; the sign of a zero
// maximum is either), for a max fold over a chunk whose values are in a buffer: on AVX-512 one vmaxps and one
// unordered compare a 16-element step (the generated keyed lane loop: 8-10 instructions).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("arch=x86-64-v4"))) inline float max_of_v4(const float* w, int64_t n) {
  __m512 m = _mm512_set1_ps(-kInf);
  __mmask16 nan = 0;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_loadu_ps(w + j);
    m = _mm512_max_ps(m, x);
    nan = _kor_mask16(nan, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q));
  }
  float r = _mm512_reduce_max_ps(m);
  for (; j < n; ++j) r = max(r, w[j]);
  return nan ? std::numeric_limits<float>::quiet_NaN() : r;
}
#endif
inline float max_of_lanes(const float* w, int64_t n) {
  int32_t l[16];
  for (int u = 0; u < 16; ++u) l[u] = fkey_hi(-kInf);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
#pragma GCC unroll 1
    for (int u = 0; u < 16; ++u) l[u] = kmax(l[u], fkey_hi(w[j + u]));
  }
  float r = -kInf;
  for (; j < n; ++j) r = max(r, w[j]);
  for (int u = 1; u < 16; ++u) l[0] = kmax(l[0], l[u]);
  return max(r, unkey(l[0]));
}
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("arch=x86-64-v3"))) inline float max_of_v3(const float* w, int64_t n) { return max_of_lanes(w, n); }
inline float max_of(const float* w, int64_t n) { return by_level(max_of_v4, max_of_v3, max_of_lanes)(w, n); }
#else
inline float max_of(const float* w, int64_t n) { return max_of_lanes(w, n); }
#endif
template <int L>
__attribute__((always_inline)) inline float exp_sum_lanes(float* w, int64_t n) {
  float l[L];
  for (int u = 0; u < L; ++u) l[u] = 0.0f;
  int64_t j = 0;
  for (; j + L <= n; j += L) {
#pragma GCC unroll 1
    for (int u = 0; u < L; ++u) {
      const float e = exp(w[j + u]);
      w[j + u] = e;
      l[u] = l[u] + e;
    }
  }
  float tail = 0.0f;
  for (; j < n; ++j) {
    w[j] = exp(w[j]);
    tail = tail + w[j];
  }
  return tail + lanes_total<L>(l);
}
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("arch=x86-64-v3"))) inline float exp_sum_v3(float* w, int64_t n) { return exp_sum_lanes<16>(w, n); }
inline float exp_sum_base(float* w, int64_t n) { return exp_sum_lanes<16>(w, n); }
inline float exp_sum(float* w, int64_t n) { return by_level(exp_sum_v4, exp_sum_v3, exp_sum_base)(w, n); }
#else
inline float exp_sum(float* w, int64_t n) { return exp_sum_lanes<16>(w, n); }
#endif

// ------------------------------------------------------------------------------------- e4m3 weight rows x a vector
// out[n] = sum_k decode(W[n * ldw + k]) * x[k] for n < N, k < K (a GEMV over float8 e4m3fn weights, the one-row case
// of a quantised GEMM: decoding into a tile and reading it back costs more than the products there). Returns
// whether some row holds a NaN byte (0x7F / 0xFF): such a row's out[n] is not meaningful, and bad[n] = 1 marks it
// (the caller sums it again under its own rules); the other rows' bad[n] = 0. The AVX levels decode through
// float16: the byte's bits shifted into an fp16 (sign to bit 15, exponent and mantissa to bits 13..7) are the value
// times 2^-8 exactly (normal and subnormal alike), widened by vcvtph2ps, so x is taken times 256 (exact) once
// (a chunk of x with a value past 2^119, which that would overflow, is summed by the exact loop instead).
// The sums are in 16 (AVX-512) or 8 (AVX2) lanes added by lane_sum, so they round differently from a plain loop.
// the rows through a level's body (below), 512 elements of x (times 256) at a time; the tail by the exact decode
template <class Level>
inline bool e4m3_row_dots_with(int64_t N, int64_t K, const uint8_t* W, int64_t ldw, const float* x, float* out,
                               uint8_t* bad) {
  float xs[512];
  bool any = false;
  for (int64_t k0 = 0; k0 < K; k0 += 512) {
    const int64_t kn = K - k0 < 512 ? K - k0 : 512;
    bool huge = false;  // an x past 2^119 would overflow times 256: that chunk takes the exact loop alone
    for (int64_t k = 0; k < kn; ++k) {
      xs[k] = x[k0 + k] * 256.0f;
      huge = huge || std::fabs(x[k0 + k]) > 6.6e35f;
    }
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* w = W + n * ldw + k0;
      for (int64_t k = 0; k < kn; k += 64) __builtin_prefetch(w + 16 * ldw + k);  // row n + 16 (no fault past W)
      int64_t k = 0;
      bool b = false;
      float part = huge ? 0.0f : Level::body(w, xs, kn, k, b);
      for (; k < kn; ++k) {
        part += e4m3_to_float(w[k]) * x[k0 + k];
        b = b || (w[k] & 0x7Fu) == 0x7Fu;
      }
      out[n] = k0 == 0 ? part : out[n] + part;
      bad[n] = k0 == 0 ? uint8_t(b) : uint8_t(bad[n] | b);
      any = any || b;
    }
  }
  return any;
}
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// the fp16 bit patterns of 32 (AVX-512) or 16 (AVX2) e4m3 bytes: sign to bit 15, exponent and mantissa to bits
// 13..7, which is the value times 2^-8 exactly, normal and subnormal alike (a NaN byte comes out finite)
__attribute__((target("arch=x86-64-v4"))) inline __m512i e4m3_fp16_v4(__m256i b) {
  const __m512i h = _mm512_cvtepu8_epi16(b);
  return _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(h, 7), _mm512_set1_epi16(0x3F80)),
                         _mm512_and_si512(_mm512_slli_epi16(h, 8), _mm512_set1_epi16(-32768)));
}
__attribute__((target("arch=x86-64-v3"))) inline __m256i e4m3_fp16_v3(__m128i b) {
  const __m256i h = _mm256_cvtepu8_epi16(b);
  return _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(0x3F80)),
                         _mm256_and_si256(_mm256_slli_epi16(h, 8), _mm256_set1_epi16(-32768)));
}
// one weight row's vector body at each AVX level: elements [k, kn) while a whole vector remains (k advanced past
// them), NaN bytes or'ed into nan; the products with xs (x times 256) summed into one float
struct E4m3RowV4 {
  __attribute__((target("arch=x86-64-v4"))) static float body(const uint8_t* w, const float* xs, int64_t kn,
                                                                int64_t& k, bool& nan) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    __mmask32 m = 0;
    const __m256i m7f = _mm256_set1_epi8(0x7F);
    for (; k + 32 <= kn; k += 32) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
      m |= _mm256_cmpeq_epi8_mask(_mm256_and_si256(b, m7f), m7f);
      const __m512i f16 = e4m3_fp16_v4(b);
      acc0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(f16)), _mm512_loadu_ps(xs + k), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(f16, 1)), _mm512_loadu_ps(xs + k + 16), acc1);
    }
    nan = nan || m != 0;
    vf16 v, v1;
    std::memcpy(&v, &acc0, sizeof(v));
    std::memcpy(&v1, &acc1, sizeof(v1));
    return lane_sum(v + v1);
  }
};
struct E4m3RowV3 {
  __attribute__((target("arch=x86-64-v3"))) static float body(const uint8_t* w, const float* xs, int64_t kn,
                                                                int64_t& k, bool& nan) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m128i m = _mm_setzero_si128();
    const __m128i m7f = _mm_set1_epi8(0x7F);
    for (; k + 16 <= kn; k += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k));
      m = _mm_or_si128(m, _mm_cmpeq_epi8(_mm_and_si128(b, m7f), m7f));
      const __m256i f16 = e4m3_fp16_v3(b);
      acc0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(f16)), _mm256_loadu_ps(xs + k), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(f16, 1)), _mm256_loadu_ps(xs + k + 8), acc1);
    }
    nan = nan || _mm_movemask_epi8(m) != 0;
    vf8 v, v1;
    std::memcpy(&v, &acc0, sizeof(v));
    std::memcpy(&v1, &acc1, sizeof(v1));
    return lane_sum(v + v1);
  }
};
inline bool e4m3_row_dots_v4(int64_t N, int64_t K, const uint8_t* W, int64_t ldw, const float* x, float* out,
                             uint8_t* bad) {
  return e4m3_row_dots_with<E4m3RowV4>(N, K, W, ldw, x, out, bad);
}
inline bool e4m3_row_dots_v3(int64_t N, int64_t K, const uint8_t* W, int64_t ldw, const float* x, float* out,
                             uint8_t* bad) {
  return e4m3_row_dots_with<E4m3RowV3>(N, K, W, ldw, x, out, bad);
}
#endif
// no AVX: no vector body, every element through the exact integer decode
struct E4m3RowExact {
  static float body(const uint8_t*, const float*, int64_t, int64_t&, bool&) { return 0.0f; }
};
inline bool e4m3_row_dots_base(int64_t N, int64_t K, const uint8_t* W, int64_t ldw, const float* x, float* out,
                               uint8_t* bad) {
  return e4m3_row_dots_with<E4m3RowExact>(N, K, W, ldw, x, out, bad);
}
inline bool e4m3_row_dots(int64_t N, int64_t K, const uint8_t* W, int64_t ldw, const float* x, float* out,
                          uint8_t* bad) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  const int level = x86_level();
  if (level == 4) return e4m3_row_dots_v4(N, K, W, ldw, x, out, bad);
  if (level == 3) return e4m3_row_dots_v3(N, K, W, ldw, x, out, bad);
#endif
  return e4m3_row_dots_base(N, K, W, ldw, x, out, bad);
}

// dst[k] = decode(src[k]) for k < n: a stretch of an e4m3 weight row decoded into a float tile, returning whether
// some byte is NaN (0x7F / 0xFF; its float is NaN as in e4m3_to_float). The AVX levels decode as e4m3_row_dots
// does, through float16 (the bits shifted into an fp16 are the value times 2^-8, widened by vcvtph2ps), then times
// 256, exact: 32 (AVX-512) or 16 (AVX2) bytes a step, where the integer decode of a generated loop took a compare
// and a select for the subnormals, another for NaN and a finite test per element. The tail, the base level and the
// NaN bytes' floats by e4m3_to_float.
inline bool e4m3_to_floats_base(const uint8_t* src, int64_t n, float* dst) {
  uint32_t nan = 0;
  for (int64_t k = 0; k < n; ++k) {
    dst[k] = e4m3_to_float(src[k]);
    nan |= (src[k] & 0x7Fu) == 0x7Fu;
  }
  return nan != 0;
}
// dst[j] = NaN for the NaN bytes among src[0, k) (the vector decode widened them to finite floats)
inline void e4m3_nan_bytes(const uint8_t* src, int64_t k, float* dst) {
  for (int64_t j = 0; j < k; ++j)
    if ((src[j] & 0x7Fu) == 0x7Fu) dst[j] = e4m3_to_float(src[j]);
}
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("arch=x86-64-v4"))) inline bool e4m3_to_floats_v4(const uint8_t* src, int64_t n, float* dst) {
  const __m256i m7f = _mm256_set1_epi8(0x7F);
  const __m512 x256 = _mm512_set1_ps(256.0f);
  __mmask32 m = 0;
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k));
    m |= _mm256_cmpeq_epi8_mask(_mm256_and_si256(b, m7f), m7f);
    const __m512i f16 = e4m3_fp16_v4(b);
    _mm512_storeu_ps(dst + k, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(f16)), x256));
    _mm512_storeu_ps(dst + k + 16, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(f16, 1)), x256));
  }
  if (m != 0) e4m3_nan_bytes(src, k, dst);  // the NaN bytes' floats (fp16 widening made them finite)
  return e4m3_to_floats_base(src + k, n - k, dst + k) || m != 0;
}
__attribute__((target("arch=x86-64-v3"))) inline bool e4m3_to_floats_v3(const uint8_t* src, int64_t n, float* dst) {
  const __m128i m7f = _mm_set1_epi8(0x7F);
  const __m256 x256 = _mm256_set1_ps(256.0f);
  __m128i m = _mm_setzero_si128();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
    m = _mm_or_si128(m, _mm_cmpeq_epi8(_mm_and_si128(b, m7f), m7f));
    const __m256i f16 = e4m3_fp16_v3(b);
    _mm256_storeu_ps(dst + k, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(f16)), x256));
    _mm256_storeu_ps(dst + k + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(f16, 1)), x256));
  }
  const bool nan = _mm_movemask_epi8(m) != 0;
  if (nan) e4m3_nan_bytes(src, k, dst);
  return e4m3_to_floats_base(src + k, n - k, dst + k) || nan;
}
inline bool e4m3_to_floats(const uint8_t* src, int64_t n, float* dst) {
  return by_level(e4m3_to_floats_v4, e4m3_to_floats_v3, e4m3_to_floats_base)(src, n, dst);
}
#else
inline bool e4m3_to_floats(const uint8_t* src, int64_t n, float* dst) { return e4m3_to_floats_base(src, n, dst); }
#endif

// eight consecutive elements widened to float, as one vector: one 32-byte load for float, one 16-byte load and a
// shift for bf16 (written element by element, GCC assembled pack_transposed's float rows from scalar inserts)
template <class T>
__attribute__((always_inline)) inline vf8 ld8(const T* p) {
  vf8 v;
  for (int e = 0; e < 8; ++e) v[e] = ld(p[e]);
  return v;
}
template <>
__attribute__((always_inline)) inline vf8 ld8<float>(const float* p) {
  vf8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <>
__attribute__((always_inline)) inline vf8 ld8<bf16_t>(const bf16_t* p) {
  typedef uint16_t vu16x8 __attribute__((vector_size(16)));
  vu16x8 h;
  std::memcpy(&h, p, sizeof(h));
  const vi8 w = __builtin_convertvector(h, vi8) << 16;
  vf8 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

// dst[c * ldd + r] = rows[r][c] widened to float, for r < R, c < C: a streamed operand read along its contraction
// index (K[j, c] for scores = Q x K^T, rows anywhere: pages of a paged cache) packed as the [c][j] tile gemm_tile
// reads. 8 x 8 blocks are transposed in registers (transpose8: 24 shuffles per 64 elements), with contiguous loads
// and stores; the element-wise pack stored every element to its own cache line (14 % of fused_attention's fp32 time
// at S 1024, 75 % of mla_decode's). Remainder rows and columns element by element.
template <class T>
__attribute__((always_inline)) inline void pack_transposed(int64_t R, int64_t C, const T* const* rows,
                                                           float* __restrict__ dst, int64_t ldd) {
  int64_t r0 = 0;
  for (; r0 + 8 <= R; r0 += 8) {
    int64_t c0 = 0;
    for (; c0 + 8 <= C; c0 += 8) {
      vf8 x[8], y[8];
      for (int i = 0; i < 8; ++i) x[i] = ld8(rows[r0 + i] + c0);
      transpose8(x, y);
      for (int t = 0; t < 8; ++t) std::memcpy(dst + (c0 + t) * ldd + r0, &y[t], sizeof(vf8));
    }
    for (; c0 < C; ++c0)
      for (int i = 0; i < 8; ++i) dst[c0 * ldd + r0 + i] = ld(rows[r0 + i][c0]);
  }
  for (; r0 < R; ++r0)
    for (int64_t c = 0; c < C; ++c) dst[c * ldd + r0] = ld(rows[r0][c]);
}

// pack_transposed into the panel-by-panel layout of gemm_tile_panels: rows 32p .. 32p + 31 become panel p, at
// dst + p * pstride, [c][32]
template <class T>
__attribute__((always_inline)) inline void pack_transposed_panels(int64_t R, int64_t C, const T* const* rows,
                                                                  float* __restrict__ dst, int64_t pstride) {
  for (int64_t r0 = 0; r0 < R; r0 += 32)
    pack_transposed(R - r0 < 32 ? R - r0 : 32, C, rows + r0, dst + r0 / 32 * pstride, 32);
}

// whether a float is finite (bit test: -ffast-math cannot fold it away)
__attribute__((always_inline)) inline bool is_finite_bits(float v) { return (float_bits(v) & 0x7F800000u) != 0x7F800000u; }

// One element row of a fold tile into the tile's panels of 32 columns ([element][32] each, pstride floats apart, dst
// at the element's row of the first panel): src[x] (read as float) to dst[(x / 32) * pstride + x % 32] for x < n.
// Returns whether one of them is an inf or NaN. A whole panel's 32 columns are a loop of fixed length, which the
// compiler vectorises at every x86-64 level; the generated loop it replaced (bounds min(nt, x0 + 32), a finite flag
// per element) took ~1.5x (AVX2) to ~2x (AVX-512) the time on a Zen 4 EPYC, 2 MiB of fp32 V in L2/L3.
template <class T>
inline bool pack_row_panels(const T* __restrict__ src, int64_t n, float* __restrict__ dst, int64_t pstride) {
  uint32_t bad = 0;
  int64_t x0 = 0;
  for (; x0 + 32 <= n; x0 += 32) {
    float* dp = dst + x0 / 32 * pstride;
    for (int u = 0; u < 32; ++u) {
      const float v = ld(src[x0 + u]);
      dp[u] = v;
      bad |= is_finite_bits(v) ? 0u : 1u;
    }
  }
  for (; x0 < n; ++x0) {
    const float v = ld(src[x0]);
    dst[x0 / 32 * pstride + x0 % 32] = v;
    bad |= is_finite_bits(v) ? 0u : 1u;
  }
  return bad != 0;
}

// ------------------------------------------------------------------------------------------ bf16 pair tiles
// Where the CPU has AVX512_BF16 (Zen 4, Cooper Lake, Sapphire Rapids and later), the GEMM tiles of a block kernel
// over bf16 operands can multiply them as pairs of bf16 (vdpbf16ps: two products added into each float lane, with
// float accumulation), twice the products per instruction of the float tile on their widened values. The
// operands are uint32 words holding elements 2p (low half) and 2p + 1 (high half) of the contraction. The
// instruction takes subnormal bf16 inputs as 0, flushes subnormal results and rounds to nearest-even, whatever
// MXCSR says. Whether that is faster depends on the core, not on the flag: measured at 1 thread, on a Zen 4 EPYC
// (tile 128 x 128 x 128) 108 -> 220 GFLOP/s, pairs twice the float tile; on a Xeon with AVX512_BF16 and AVX512_FP16
// (family 6 model 207, no AMX exposed; tile 128 x 256 x 128 in L1/L2) 83 against the float tile's 178, half its
// rate: there bf16 attention ran 1.1-1.7x and fp8_quant_gemm at M 128 1.2-1.4x faster with the float tiles
// (single alternating runs).
// So the kernels use the pairs by default on AMD CPUs only; REDFUSER_CPU_BF16_DOT (read once per process) = 0
// keeps the float tiles everywhere, = 1 takes the pairs wherever the instruction exists.
inline bool bf16_dot_supported() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  return x86_level() == 4 && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}
inline bool bf16_dot() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  static const bool on = [] {
    const char* e = std::getenv("REDFUSER_CPU_BF16_DOT");
    if (!bf16_dot_supported() || (e != nullptr && std::strcmp(e, "0") == 0)) return false;
    return (e != nullptr && std::strcmp(e, "1") == 0) || __builtin_cpu_is("amd");
  }();
  return on;
#else
  return false;
#endif
}

// a word of two bf16 moved as its bit pattern (the rows of a bf16 operand read as pairs; may_alias: the storage
// is bf16_t), for pack_transposed
struct __attribute__((may_alias)) bf16x2_t {
  uint32_t bits;
};
inline float ld(bf16x2_t v) { return bits_float(v.bits); }
template <>
__attribute__((always_inline)) inline vf8 ld8<bf16x2_t>(const bf16x2_t* p) {
  vf8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// dst[m * ldd + p] = the pair (src[m * lds + 2p], src[m * lds + 2p + 1]) rounded to bf16 (nearest-even; 0 past K),
// m < M, p < ceil(K / 2): a tile's row factor (exact where it was read from bf16) or a fold's weights. The portable
// loop (float_to_bf16, bit-exact for every float); pairs_from_floats below takes vcvtne2ps2bf16 where the CPU has it.
inline void pairs_from_floats_lanes(int64_t M, int64_t K, const float* src, int64_t lds, uint32_t* __restrict__ dst,
                                    int64_t ldd) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "a pair word holds element 2p in its low half");
  typedef uint16_t __attribute__((may_alias)) half_word;
  for (int64_t m = 0; m < M; ++m) {
    const float* s = src + m * lds;
    // the words' halves in memory order (little-endian): element k at half k, one vectorised rounding loop
    half_word* d = reinterpret_cast<half_word*>(dst + m * ldd);
    for (int64_t k = 0; k < K; ++k) d[k] = float_to_bf16(s[k]);
    if (K % 2) d[K] = 0;
  }
}
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// The same words by vcvtne2ps2bf16 (32 floats to 32 bf16 per instruction, where the loop above takes ~8 instructions
// per 16: with the pair tiles' packs, ~40 % of bf16 attention's block function under perf on a Zen 4). Nearest-even
// and a NaN stays a quiet NaN as there, but a float below 2^-126 in magnitude gives a signed zero (the instruction
// takes subnormal inputs and results as 0), where the loop gives a subnormal bf16 or, from just below, 2^-126.
// vdpbf16ps takes a subnormal bf16 as 0 as well, so a pair product differs only by the last case, at most 2^-126
// times the other factor.
// the lane masks of the first n (<= 32) of 32 floats held in two 16-lane vectors
inline void halves_mask(int64_t n, __mmask16& lo, __mmask16& hi) {
  lo = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
  hi = n >= 32 ? __mmask16(0xFFFF) : (n <= 16 ? __mmask16(0) : __mmask16((1u << (n - 16)) - 1u));
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))) inline void pairs_from_floats_bf16(
    int64_t M, int64_t K, const float* src, int64_t lds, uint32_t* __restrict__ dst, int64_t ldd) {
  typedef uint16_t __attribute__((may_alias)) half_word;  // the words' halves (the storage is uint32_t)
  for (int64_t m = 0; m < M; ++m) {
    const float* s = src + m * lds;
    half_word* d = reinterpret_cast<half_word*>(dst + m * ldd);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32)
      _mm512_storeu_si512(d + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + k + 16), _mm512_loadu_ps(s + k)));
    if (k < K) {
      const int64_t r = K - k;  // 1..31 left
      __mmask16 lo, hi;
      halves_mask(r, lo, hi);
      const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, s + k + 16), _mm512_maskz_loadu_ps(lo, s + k));
      _mm512_mask_storeu_epi16(d + k, __mmask32((1ull << r) - 1u), v);
    }
    if (K % 2) d[K] = 0;
  }
}
#endif
inline void pairs_from_floats(int64_t M, int64_t K, const float* src, int64_t lds, uint32_t* __restrict__ dst,
                              int64_t ldd) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  static const bool fast = bf16_dot_supported();
  if (fast) return pairs_from_floats_bf16(M, K, src, lds, dst, ldd);
#endif
  pairs_from_floats_lanes(M, K, src, lds, dst, ldd);
}

// dst[p * ldd + x] = the pair (rows[2p][off + x], rows[2p + 1][off + x]), p < P, x < N: a fold's streamed tile
// [element][n] as pairs of elements. Returns whether any value is inf or NaN (the caller then folds in float).
inline bool pack_pairs_interleaved(int64_t P, int64_t N, const bf16_t* const* rows, int64_t off,
                                   uint32_t* __restrict__ dst, int64_t ldd) {
  uint32_t bad = 0;
  for (int64_t p = 0; p < P; ++p) {
    const bf16_t* a = rows[2 * p] + off;
    const bf16_t* b = rows[2 * p + 1] + off;
    uint32_t* d = dst + p * ldd;
    for (int64_t x = 0; x < N; ++x) {
      const uint32_t lo = a[x].bits, hi = b[x].bits;
      d[x] = lo | (hi << 16);
      bad |= ((lo & 0x7F80u) == 0x7F80u) | ((hi & 0x7F80u) == 0x7F80u);
    }
  }
  return bad != 0;
}

// C[m, n] (+)= sum_p A[m * lda + p] . B[p * ldb + n] over pairs p < KP, m < M, n < N; B's rows are read in whole
// 32-word panels (ldb and the buffer cover them; the lanes past N are not stored)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define REDFUSER_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
template <int MR>
REDFUSER_BF16_TARGET __attribute__((always_inline)) inline void bf16_panel(int64_t KP, const uint32_t* A, int64_t lda,
                                                                           const uint32_t* B, int64_t ldb, float* C,
                                                                           int64_t ldc, int64_t nv, bool accumulate) {
  __m512 c[MR][2];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) c[i][0] = c[i][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < KP; ++p) {
    const __m512i b0 = _mm512_loadu_si512(B + p * ldb), b1 = _mm512_loadu_si512(B + p * ldb + 16);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(A[i * lda + p]));
      c[i][0] = _mm512_dpbf16_ps(c[i][0], (__m512bh)a, (__m512bh)b0);
      c[i][1] = _mm512_dpbf16_ps(c[i][1], (__m512bh)a, (__m512bh)b1);
    }
  }
  __mmask16 m0, m1;
  halves_mask(nv, m0, m1);
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    float* cr = C + i * ldc;
    __m512 o0 = c[i][0], o1 = c[i][1];
    if (accumulate) {
      o0 = _mm512_add_ps(o0, _mm512_maskz_loadu_ps(m0, cr));
      o1 = _mm512_add_ps(o1, _mm512_maskz_loadu_ps(m1, cr + 16));
    }
    _mm512_mask_storeu_ps(cr, m0, o0);
    _mm512_mask_storeu_ps(cr + 16, m1, o1);
  }
}
REDFUSER_BF16_TARGET inline void gemm_tile_bf16(int64_t M, int64_t N, int64_t KP, const uint32_t* A, int64_t lda,
                                                const uint32_t* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t n0 = 0; n0 < N; n0 += 32) {  // one 32-column panel of B stays in L1 while the rows pass over it
    const int64_t nv = N - n0 < 32 ? N - n0 : 32;
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) bf16_panel<8>(KP, A + m * lda, lda, B + n0, ldb, C + m * ldc + n0, ldc, nv, accumulate);
    for (; m + 4 <= M; m += 4) bf16_panel<4>(KP, A + m * lda, lda, B + n0, ldb, C + m * ldc + n0, ldc, nv, accumulate);
    for (; m < M; ++m) bf16_panel<1>(KP, A + m * lda, lda, B + n0, ldb, C + m * ldc + n0, ldc, nv, accumulate);
  }
}
#undef REDFUSER_BF16_TARGET
#else
// never called where bf16_dot() is false (every other compiler and CPU); the same product in float
inline void gemm_tile_bf16(int64_t M, int64_t N, int64_t KP, const uint32_t* A, int64_t lda, const uint32_t* B,
                           int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float s = 0.0f;
      for (int64_t p = 0; p < KP; ++p) {
        const uint32_t a = A[m * lda + p], b = B[p * ldb + n];
        s += bits_float(a << 16) * bits_float(b << 16) + bits_float(a & 0xFFFF0000u) * bits_float(b & 0xFFFF0000u);
      }
      C[m * ldc + n] = accumulate ? C[m * ldc + n] + s : s;
    }
}
#endif

// ------------------------------------------------------------------------------------------ a run's first rows
// first[j] = the first row q in [r0, r1) whose flag for element j is set (flags[q * ld + j] != 0), as q - r0, or
// -1, for j < n (r1 - r0 <= 128, a block's rows): the row whose bindings address element j of a run's packed tile.
// Row by row over all the elements (the loop vectorises, 64 elements a step at AVX-512), until every element has
// its row: one row where the first row sees the whole chunk, every row of the block on a causal diagonal, whose
// element j is seen first by row j. A search per element down the rows (byte loads ld apart) was 18 % of causal
// fused_attention's block function (fp32, S256, 1 thread); this pass with int32 entries (16 elements a step) 8 %.
__attribute__((always_inline)) inline void first_rows(const uint8_t* flags, int64_t ld, int64_t r0, int64_t r1,
                                                      int64_t n, int8_t* first) {
  for (int64_t j = 0; j < n; ++j) first[j] = -1;
  for (int64_t q = r0; q < r1; ++q) {
    const uint8_t* fq = flags + q * ld;
    const int8_t at = static_cast<int8_t>(q - r0);
    int8_t missing = 0;  // the OR of the rows found so far: negative while some element has none
    for (int64_t j = 0; j < n; ++j) {
      const int8_t v = ((first[j] < 0) & (fq[j] != 0)) ? at : first[j];
      first[j] = v;
      missing = static_cast<int8_t>(missing | v);
    }
    if (missing >= 0) return;
  }
}

// ------------------------------------------------------------------------------------------ packed-tile memo
// The packed tiles of a block kernel's streamed operand, kept for the rest of the call: the blocks of rows that
// share a key (the 128-query blocks of one attention head, the heads of one GQA group) each pack the same tiles,
// and packing is most of a block kernel's own time beside its GEMM tiles (the K transposes and the V pack: 40 %
// of fused_attention's block function at fp32 d128 S1024). A tile is identified by its index (chunk and column
// tile), its tag (the run's key values, the chunk's start, the column tile's start) and its per-element flags
// (which elements were packed from the operand and which as the zero row): a lookup that matches all three
// returns a tile equal word for word to the one a repack would write. Tiles with an index at or past `slots`
// share one scratch slot that never matches (a call whose tiles exceed the byte budget packs those as before).
// Slots are allocated lazily (calloc: zero pages until touched). One per tile site per call; not thread-shared.
// REDFUSER_CPU_TILE_MEMO=0 (read once per process) keeps none: every tile is packed where it is used.
inline bool tile_memo_on() {
  static const bool on = [] {
    const char* e = std::getenv("REDFUSER_CPU_TILE_MEMO");
    return !(e != nullptr && std::strcmp(e, "0") == 0);
  }();
  return on;
}
class TileMemo {
 public:
  TileMemo(int64_t tiles, int64_t tile_floats, int64_t nflags, int64_t ntag, int64_t budget_bytes)
      : floats_(std::max<int64_t>(1, tile_floats)), nflags_(nflags), ntag_(ntag) {
    if (!tile_memo_on()) tiles = 0;
    slots_ = std::max<int64_t>(0, std::min<int64_t>(tiles, budget_bytes / (floats_ * 4) - 1));
    data_ = static_cast<float*>(std::calloc(static_cast<size_t>((slots_ + 1) * floats_), sizeof(float)));
    if (data_ == nullptr) redfuser::fail("cpu", "out of memory for a packed tile");
    tags_.assign(static_cast<size_t>(slots_ * (ntag_ + 1)), 0.0);
    flags_.assign(static_cast<size_t>(slots_ * nflags_), 0);
    words_.assign(static_cast<size_t>(slots_ + 1), 0u);
  }
  ~TileMemo() { std::free(data_); }
  TileMemo(const TileMemo&) = delete;
  TileMemo& operator=(const TileMemo&) = delete;

  // the slot for tile `index` with tag[0, ntag) and flags[0, nflags): hit = it holds exactly that tile already;
  // on a miss the slot is claimed for it (the caller packs it now)
  int64_t find(int64_t index, const double* tag, const uint8_t* flags, bool& hit) {
    if (index < 0 || index >= slots_) {
      hit = false;
      return slots_;
    }
    double* t = tags_.data() + index * (ntag_ + 1);
    uint8_t* f = flags_.data() + index * nflags_;
    hit = t[ntag_] != 0.0 && std::equal(tag, tag + ntag_, t) && std::equal(flags, flags + nflags_, f);
    if (!hit) {
      std::copy(tag, tag + ntag_, t);
      t[ntag_] = 1.0;
      std::copy(flags, flags + nflags_, f);
    }
    return index;
  }
  float* tile(int64_t slot) { return data_ + slot * floats_; }
  // a word kept with the slot's tile (its pack's inf/NaN report)
  uint32_t& word(int64_t slot) { return words_[static_cast<size_t>(slot)]; }

 private:
  int64_t floats_, nflags_, ntag_, slots_ = 0;
  float* data_ = nullptr;
  std::vector<double> tags_;
  std::vector<uint8_t> flags_;
  std::vector<uint32_t> words_;
};

// ------------------------------------------------------------------------------------------ selections
// A selection keeps k entries sorted by: filled first, larger key first, NaN keys after all others,
// lower element index first. Unfilled entries hold key -inf and index -1.
inline bool sel_better(float ka, int64_t ia, float kb, int64_t ib) {
  const bool na = ka != ka, nb = kb != kb;
  if (na != nb) return nb;  // a non-NaN key beats a NaN key
  if (!na && ka != kb) return ka > kb;
  return ia < ib;
}

// Position at which (key, index) enters the k sorted entries (filled: ok[]), or k if it does not.
inline int64_t sel_position(const float* keys, const int64_t* idx, const uint8_t* ok, int64_t k, float key,
                            int64_t index) {
  // the common case first: the selection is full and this element does not beat its last entry (NaN keys,
  // which compare false, take the general path)
  if (k > 0 && ok[k - 1] && (key < keys[k - 1] || (key == keys[k - 1] && index > idx[k - 1]))) return k;
  int64_t pos = k;
  if (key == key) {
    // a non-NaN key (the usual case): sel_better without its NaN branches, one test per entry; it beats an
    // unfilled entry, a NaN entry (!(kp >= key) holds for NaN), a smaller key, an equal key of a higher index
    while (pos > 0) {
      const float kp = keys[pos - 1];
      const bool beats = !ok[pos - 1] | !(kp >= key) | ((kp == key) & (index < idx[pos - 1]));
      if (!beats) break;
      --pos;
    }
    return pos;
  }
  while (pos > 0 && (!ok[pos - 1] || sel_better(key, index, keys[pos - 1], idx[pos - 1]))) --pos;
  return pos;
}

// int32 key of a float in the selection order (larger first): -0 as +0 (they compare equal), every NaN below
// -inf at INT32_MIN + 1; INT32_MIN is left for "not offered"
__attribute__((always_inline)) inline int32_t sel_okey(float v) {
  const uint32_t b = float_bits(v), a = b & 0x7FFFFFFFu;
  const int32_t k = fkey_bits(a == 0u ? 0u : b);
  return a > 0x7F800000u ? std::numeric_limits<int32_t>::min() + 1 : k;
}

// The elements of a chunk of N (n of them used) that may enter a selection of k entries (keys/ok, sorted as
// sel_position keeps them), written to out (their positions in the chunk), returning how many: among the
// offered elements (offered[j] != 0) whose key is above the selection's last entry when it is full (the others
// sel_position refuses: the chunk's elements come after every entry, so an equal key loses on its index), the k
// best of the chunk in the selection order (larger key, NaN last, lower position on equal keys). Offering only
// these, in any order, leaves the selection as offering every element in turn would: an element with k better
// ones in its chunk has k better ones in the row. The k best are found by k vectorised min scans over int keys
// (sel_okey; below), which costs less than offering every element to the scalar insertion when k is small beside
// the chunk (16 k <= N: a router's k = 6 or 8 in chunks of 256; a sampler's k = 50 offers every element above the
// last entry). (Always inlined: a kernel's target clone then compiles it for its own instruction set.)
template <int N>
__attribute__((always_inline)) inline int64_t sel_candidates(const float* key, const uint8_t* offered, int64_t n,
                                                             const float* keys, const uint8_t* ok, int64_t k,
                                                             int64_t* out) {
  constexpr int32_t kNone = std::numeric_limits<int32_t>::min();
  const int32_t floor = (k > 0 && ok[k - 1]) ? sel_okey(keys[k - 1]) : kNone;
  // the scans cover the used elements rounded up to 16 (a short row in a long chunk: a router of 64 experts)
  const int nr = n >= N ? N : static_cast<int>((n + 15) & ~int64_t{15});
  int32_t w[N];
  int32_t live = 0;
  for (int j = 0; j < nr; ++j) {
    const int32_t v = j < n ? sel_okey(key[j]) : kNone;
    const bool e = j < n && offered[j] != 0 && v > floor;
    w[j] = e ? v : kNone;
    live += e;
  }
  if (live <= k || 16 * k > N) {
    int64_t c = 0;
    for (int j = 0; j < n; ++j) {
      out[c] = j;
      c += w[j] != kNone;
    }
    return c;
  }
  // the k best in turn, each the nearest below the one before in distinct 64-bit keys (the int key times 256 plus
  // the complement of the position: a tie goes to the lower position): the least (last - 1 - key) as unsigned,
  // where the keys at or above the last wrap to the top, so a scan is a plain min with no condition (vectorised)
  // and nothing is stored between the scans; live > k, so every one finds an offered element
  static_assert(N <= 256, "a position takes 8 bits of the 64-bit key");
  const auto code = [](int64_t j) { return 255 - j; };  // a position's code, its own inverse
  int64_t wide[N];
  for (int j = 0; j < nr; ++j) wide[j] = int64_t(w[j]) * 256 + code(j);
  int64_t last = int64_t(1) << 39;  // above every key: w[j] < 2^31
  for (int64_t r = 0; r < k; ++r) {
    uint64_t least = ~uint64_t{0};
    for (int j = 0; j < nr; ++j) {
      const uint64_t gap = static_cast<uint64_t>(last - 1 - wide[j]);
      least = gap < least ? gap : least;
    }
    last = last - 1 - static_cast<int64_t>(least);
    out[r] = code(last & 255);
  }
  return k;
}

// Which of the L elements of a chunk from key/offered/set (n of them written; L readable) are worth offering to
// a selection kept per set (k entries for each value of a free index): the offered ones whose set is out of range
// (set -1: their insertion refuses them itself) or whose key is above their set's bar (the sel_okey of its last
// entry when that is full, else INT32_MIN: kept by the insertions; elements come in index order, so an equal key
// loses on its index). Their positions go to out (returned: how many): a superset of those the insertion keeps,
// marked in one vectorisable loop.
template <int L>
__attribute__((always_inline)) inline int64_t sel_offers(const float* key, const uint8_t* offered,
                                                         const int32_t* set, const int32_t* bar, int64_t n,
                                                         int64_t* out) {
  uint8_t e[L];
  for (int u = 0; u < L; ++u) {
    const int32_t used = int64_t{u} < n;  // set[u] past n is not written
    const int32_t s = set[u], in = (s >= 0) & used;
    const int32_t b = bar[s & -in];
    e[u] = static_cast<uint8_t>(used & (offered[u] != 0) & (!in | (sel_okey(key[u]) > b)));
  }
  int64_t c = 0;
  for (int u = 0; u < L; ++u) {
    out[c] = u;
    c += e[u];
  }
  return c;
}

template <class T>
inline void sel_shift(T* a, int64_t pos, int64_t k) {
  for (int64_t r = k - 1; r > pos; --r) a[r] = a[r - 1];
}

inline void sel_clear(float* keys, int64_t* idx, uint8_t* ok, int64_t k) {
  for (int64_t r = 0; r < k; ++r) {
    keys[r] = -kInf;
    idx[r] = -1;
    ok[r] = 0;
  }
}

inline float sel_sum(const float* v, const uint8_t* ok, int64_t k) {
  float s = 0.0f;
  for (int64_t r = 0; r < k; ++r)
    if (ok[r]) s += v[r];
  return s;
}

// A selection's indices marked in a table of its index's extent n (once it is complete), and membership read
// from it: what sel_has answers, in one load
inline void sel_mark(uint8_t* mem, int64_t n, const int64_t* idx, const uint8_t* ok, int64_t k) {
  std::memset(mem, 0, static_cast<size_t>(n));
  for (int64_t r = 0; r < k; ++r)
    if (ok[r] && idx[r] >= 0 && idx[r] < n) mem[idx[r]] = 1;
}
inline bool sel_member(const uint8_t* mem, int64_t n, int64_t value) {
  const bool in = static_cast<uint64_t>(value) < static_cast<uint64_t>(n);
  return in & (mem[in ? value : 0] != 0);
}

// (every entry tested, no early exit: the membership of a row's elements is a coin toss to a branch predictor)
inline bool sel_has(const int64_t* idx, const uint8_t* ok, int64_t k, int64_t value) {
  bool has = false;
  for (int64_t r = 0; r < k; ++r) has |= (ok[r] != 0) & (idx[r] == value);
  return has;
}

// ------------------------------------------------------------------------------------------ dispatch
template <class T>
struct type_tag {
  using type = T;
};

template <class T>
constexpr ScalarType scalar_type_of();
template <>
constexpr ScalarType scalar_type_of<float>() { return ScalarType::Float; }
template <>
constexpr ScalarType scalar_type_of<half_t>() { return ScalarType::Half; }
template <>
constexpr ScalarType scalar_type_of<bf16_t>() { return ScalarType::BFloat16; }
template <>
constexpr ScalarType scalar_type_of<e4m3_t>() { return ScalarType::Float8_e4m3fn; }
template <>
constexpr ScalarType scalar_type_of<int32_t>() { return ScalarType::Int; }
template <>
constexpr ScalarType scalar_type_of<int64_t>() { return ScalarType::Long; }

// f(type_tag<T>{}) for the one T among Allowed whose ScalarType is t; only those are instantiated.
template <class... Allowed, class F>
inline void with_type(std::string_view op, std::string_view arg, ScalarType t, F&& f) {
  bool done = false;
  ((!done && t == scalar_type_of<Allowed>() ? (f(type_tag<Allowed>{}), done = true) : false), ...);
  if (!done) failf(op, arg, ": unsupported dtype ", dtype_name(t), " on CPU");
}

}  // namespace redfuser::cpu
