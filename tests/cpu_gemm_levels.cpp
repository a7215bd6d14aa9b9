// The CPU kernels' tile GEMMs (ops_src/cpu_math.h: gemm_tile, C += A x B, and gemm_tile_nt, C += A x Bt^T) and the
// transposing pack of their streamed operand (pack_transposed, float and bf16 sources), gemm_tile_tc (the product
// stored transposed) and e4m3_to_floats, at every x86-64 level this CPU runs (v4: AVX-512, v3: AVX2, the base
// level: SSE2; the panel-major pack and tile that the kernels call, pack_transposed_panels and
// gemm_tile_panels, at the machine's own), against a float64 loop, over shapes
// that take every register-block size and remainder (rows 1..33, columns 1..65, reduction lengths 1..600); and
// first_rows, the row of a run each packed element is read with, against a search per element. The
// op tests reach only the level of the machine they run on; the kernels pick theirs at run time, so a bug in
// another level's code (its vector width, its lane reduction) would ship untested. Built and run by
// tests/test_cpu_math_exhaustive.py with the kernels' flags. Prints the mismatch count per level; exits 1 on any.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_math.h"

namespace rf = redfuser::cpu;

// the tests' pseudo-random numbers: a linear congruential step, its top 24 bits, or those as a float in [-0.5, 0.5)
static uint32_t lcg(uint32_t& seed) {
  seed = seed * 1664525u + 1013904223u;
  return seed >> 8;
}
static float uniform(uint32_t& seed) { return static_cast<float>(lcg(seed)) / 16777216.0f - 0.5f; }

using Gemm = void (*)(int64_t, int64_t, int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t, bool);

static int check(const char* name, Gemm f, bool nt) {
  int bad = 0;
  uint32_t seed = 12345;
  auto rnd = [&seed] { return uniform(seed); };
  // pad 0 with N <= 32: one contiguous panel (ldb 32), as the kernels' panel-major tiles pass it (gemm_tile_panels)
  for (int pad : {3, 0})
  for (int M : {1, 2, 3, 4, 5, 7, 8, 9, 17, 33})
    for (int N : {1, 3, 4, 5, 8, 16, 31, 33, 65})
      for (int K : {0, 1, 3, 8, 15, 16, 17, 64, 100, 256, 600})  // K = 0: C is zeros (or kept)
        for (bool acc : {false, true}) {
          if (nt && pad == 0) continue;
          // row strides past the row (ld = width + 3); B is [K][ldb] with ldb rounded up to 32 columns (gemm_tile's
          // rule for packed tiles) plus pad, Bt is [N][K + 3]
          const int64_t lda = K + 3, ldc = N + 3, ldb = nt ? K + 3 : ((N + 31) / 32) * 32 + pad;
          std::vector<float> A(M * lda), B(nt ? N * ldb : K * ldb), C0(M * ldc), C;
          for (auto& v : A) v = rnd();
          for (auto& v : B) v = rnd();
          for (auto& v : C0) v = rnd();
          C = C0;
          f(M, N, K, A.data(), lda, B.data(), ldb, C.data(), ldc, acc);
          for (int m = 0; m < M; ++m)
            for (int n = 0; n < N; ++n) {
              double r = acc ? C0[m * ldc + n] : 0.0;
              for (int k = 0; k < K; ++k) r += double(A[m * lda + k]) * (nt ? B[n * ldb + k] : B[k * ldb + n]);
              if (std::fabs(C[m * ldc + n] - r) > 1e-5 * (K + 1) && bad++ < 5)
                std::printf("%s M%d N%d K%d acc%d [%d, %d]: %g, want %g\n", name, M, N, K, int(acc), m, n,
                            C[m * ldc + n], r);
            }
          for (int m = 0; m < M; ++m)  // columns past N untouched
            for (int64_t n = N; n < ldc; ++n)
              if (C[m * ldc + n] != C0[m * ldc + n] && bad++ < 5) std::printf("%s wrote past N at [%d, %ld]\n", name, m, long(n));
        }
  std::printf("%s mismatches: %d\n", name, bad);
  return bad;
}

// dst[c][r] == rows[r][c] for every block size and remainder, rows placed in reverse (as pages may be), the
// destination's columns past R untouched; a copy, so exact
template <class T>
using Pack = void (*)(int64_t, int64_t, const T* const*, float*, int64_t);
template <class T>
static int check_pack(const char* name, Pack<T> f) {
  int bad = 0;
  uint32_t seed = 777;
  for (int R : {1, 7, 8, 9, 16, 23, 63, 64})
    for (int C : {1, 7, 8, 9, 17, 128, 576}) {
      const int64_t lds = C + 5, ldd = 64 + 3;
      std::vector<T> src(R * lds);
      std::vector<const T*> rows(R);
      for (int r = 0; r < R; ++r) rows[r] = src.data() + (R - 1 - r) * lds;
      std::vector<float> dst(C * ldd, -7.0f);
      for (auto& v : src) {
        seed = seed * 1664525u + 1013904223u;
        v = rf::from_float<T>(static_cast<float>(seed >> 8) / 65536.0f - 128.0f);
      }
      f(R, C, rows.data(), dst.data(), ldd);
      for (int c = 0; c < C; ++c)
        for (int64_t r = 0; r < ldd; ++r) {
          const float want = r < R ? rf::ld(rows[r][c]) : -7.0f;
          if (dst[c * ldd + r] != want && bad++ < 5)
            std::printf("%s R%d C%d [%d][%ld]: %g, want %g\n", name, R, C, c, long(r), dst[c * ldd + r], want);
        }
    }
  std::printf("%s mismatches: %d\n", name, bad);
  return bad;
}
// The kernels' panel-major tiles: pack_transposed_panels (rows 32p .. 32p + 31 of the source as panel p, [c][32],
// pstride apart) checked element by element, panels' columns past R untouched, and gemm_tile_panels over them
// against a float64 loop (C += A x B with B[c][r] = rows[r][c]), at the machine's level (gemm_tile's choice)
static int check_panels() {
  int bad = 0;
  uint32_t seed = 31337;
  auto rnd = [&seed] { return uniform(seed); };
  for (int R : {1, 9, 31, 32, 33, 64, 65, 256})
    for (int C : {1, 8, 17, 128, 300})
      for (int M : {1, 9, 17, 33}) {
        const int64_t lds = C + 5, pstride = int64_t(C) * 32 + 8, lda = C + 3, ldc = R + 3;
        const int64_t np = (R + 31) / 32;
        std::vector<float> src(R * lds), dst(np * pstride, -7.0f), A(M * lda), C0(M * ldc), Cm;
        for (auto& v : src) v = rnd();
        for (auto& v : A) v = rnd();
        for (auto& v : C0) v = rnd();
        std::vector<const float*> rows(R);
        for (int r = 0; r < R; ++r) rows[r] = src.data() + (R - 1 - r) * lds;  // rows in reverse, as pages may be
        rf::pack_transposed_panels(R, C, rows.data(), dst.data(), pstride);
        for (int64_t p = 0; p < np; ++p)
          for (int64_t i = 0; i < pstride; ++i) {
            const int64_t c = i / 32, r = p * 32 + i % 32;
            const float want = c < C && r < R ? rows[r][c] : -7.0f;
            if (dst[p * pstride + i] != want && bad++ < 5)
              std::printf("pack_transposed_panels R%d C%d panel %ld [%ld]: %g, want %g\n", R, C, long(p), long(i),
                          dst[p * pstride + i], want);
          }
        for (bool acc : {false, true}) {
          Cm = C0;
          rf::gemm_tile_panels(M, R, C, A.data(), lda, dst.data(), pstride, Cm.data(), ldc, acc);
          for (int m = 0; m < M; ++m)
            for (int64_t n = 0; n < ldc; ++n) {
              double r = acc || n >= R ? C0[m * ldc + n] : 0.0;
              if (n < R)
                for (int k = 0; k < C; ++k) r += double(A[m * lda + k]) * rows[n][k];
              if (std::fabs(Cm[m * ldc + n] - r) > 1e-5 * (C + 1) && bad++ < 5)
                std::printf("gemm_tile_panels M%d N%d K%d acc%d [%d, %ld]: %g, want %g\n", M, R, C, int(acc), m, long(n),
                            Cm[m * ldc + n], r);
            }
        }
      }
  std::printf("panels mismatches: %d\n", bad);
  return bad;
}

// gemm_tile_tc (gemm_tile_panels_tc's tile: the product stored transposed, C[n * ldc + m] (+)= sum_k A[m, k] *
// B(k, n), B in 32-column panels pstride apart, passed as ldb) against float64 over shapes that take every register
// block and remainder (the 8 x 8 transposed stores of AVX-512's 8- and 16-row blocks, the 16-row blocks of one
// vector of B at N <= 16, and their partial last group of columns); C's columns past M untouched
static int check_tc(const char* name, Gemm f) {
  int bad = 0;
  uint32_t seed = 4242;
  auto rnd = [&seed] { return uniform(seed); };
  for (int M : {1, 3, 4, 5, 7, 8, 9, 12, 16, 17, 28, 31, 33, 64})
    for (int N : {1, 3, 8, 9, 15, 16, 17, 31, 32, 33, 65, 128})
      for (int K : {0, 1, 3, 16, 17, 256, 300})
        for (bool acc : {false, true}) {
          const int64_t lda = K + 3, ldc = M + 3, pstride = int64_t(K) * 32 + 8, np = (N + 31) / 32;
          std::vector<float> A(M * lda), B(np * pstride), C0(N * ldc), C;
          for (auto& v : A) v = rnd();
          for (auto& v : B) v = rnd();
          for (auto& v : C0) v = rnd();
          C = C0;
          f(M, N, K, A.data(), lda, B.data(), pstride, C.data(), ldc, acc);
          for (int n = 0; n < N; ++n)
            for (int64_t m = 0; m < ldc; ++m) {
              double r = acc || m >= M ? C0[n * ldc + m] : 0.0;
              if (m < M)
                for (int k = 0; k < K; ++k) r += double(A[m * lda + k]) * B[n / 32 * pstride + k * 32 + n % 32];
              if (std::fabs(C[n * ldc + m] - r) > 1e-5 * (K + 1) && bad++ < 5)
                std::printf("%s M%d N%d K%d acc%d [%d, %ld]: %g, want %g\n", name, M, N, K, int(acc), n, long(m),
                            C[n * ldc + m], r);
            }
        }
  std::printf("%s mismatches: %d\n", name, bad);
  return bad;
}

// e4m3_to_floats (a weight row's stretch decoded into a float tile): every byte value at every position of the
// vector steps and the tail (lengths 1..70, the values rotated through), bit for bit against e4m3_to_float, NaN
// for NaN, and its flag true exactly where a NaN byte (0x7F / 0xFF) is among the n
using Decode = bool (*)(const uint8_t*, int64_t, float*);
static int check_e4m3_floats(const char* name, Decode f) {
  int bad = 0;
  for (int n = 1; n <= 70; ++n)
    for (int start = 0; start < 256; start += 7) {
      std::vector<uint8_t> src(n);
      std::vector<float> dst(n + 1, -3.0f);
      bool want_nan = false;
      for (int k = 0; k < n; ++k) {
        src[k] = static_cast<uint8_t>(start + k * 37);
        want_nan = want_nan || (src[k] & 0x7F) == 0x7F;
      }
      const bool got = f(src.data(), n, dst.data());
      if (got != want_nan && bad++ < 5)
        std::printf("%s n%d start%d: NaN flag %d, want %d\n", name, n, start, got, want_nan);
      for (int k = 0; k < n; ++k) {
        const float want = rf::e4m3_to_float(src[k]);
        const bool same = std::isnan(want) ? std::isnan(dst[k])
                                           : redfuser::float_bits(dst[k]) == redfuser::float_bits(want);
        if (!same && bad++ < 5)
          std::printf("%s n%d byte 0x%02x at %d: %g, want %g\n", name, n, src[k], k, dst[k], want);
      }
      if (redfuser::float_bits(dst[n]) != redfuser::float_bits(-3.0f) && bad++ < 5)
        std::printf("%s n%d wrote past n\n", name, n);
    }
  std::printf("%s mismatches: %d\n", name, bad);
  return bad;
}

#define PACK_AT(level, attr)                                                                                    \
  template <class T>                                                                                            \
  attr static void pack_##level(int64_t R, int64_t C, const T* const* rows, float* d, int64_t ldd) {           \
    rf::pack_transposed(R, C, rows, d, ldd);                                                                    \
  }
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
PACK_AT(v4, __attribute__((target("arch=x86-64-v4"))))
PACK_AT(v3, __attribute__((target("arch=x86-64-v3"))))
#endif
PACK_AT(base, )

// pack_row_panels (an element row of a fold tile into its panels of 32 columns, pstride apart): every column x < n
// at panel x / 32, slot x % 32, bit for bit as ld() reads it; nothing else of the panels written; and the result
// true exactly where a packed value is an inf or NaN (none, one at the first, a middle, the last column, in the
// tail past the whole panels), for row lengths that end inside, at and past a panel, float and bf16 sources.
template <class T>
using RowPanels = bool (*)(const T*, int64_t, float*, int64_t);
#define ROW_PANELS_AT(level, attr)                                                                              \
  template <class T>                                                                                            \
  attr static bool row_panels_##level(const T* src, int64_t n, float* dst, int64_t pstride) {                  \
    return rf::pack_row_panels(src, n, dst, pstride);                                                           \
  }
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
ROW_PANELS_AT(v4, __attribute__((target("arch=x86-64-v4"))))
ROW_PANELS_AT(v3, __attribute__((target("arch=x86-64-v3"))))
#endif
ROW_PANELS_AT(base, )

template <class T>
static int check_row_panels(const char* name, RowPanels<T> f) {
  int bad = 0;
  uint32_t seed = 7;
  const float specials[3] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                             std::numeric_limits<float>::quiet_NaN()};
  for (int n : {1, 5, 15, 16, 17, 31, 32, 33, 47, 64, 80, 96, 127, 200, 256}) {
    const int64_t pstride = 32 * 9 + 32;  // panels further apart than the tile's rows, so a wrong stride shows
    const int64_t panels = (n + 31) / 32;
    for (int at : {-1, 0, n / 2, n - 1, n / 32 * 32}) {  // where a non-finite value sits (-1: none)
      if (at >= n) continue;
      std::vector<T> src(n);
      for (int x = 0; x < n; ++x) src[x] = rf::from_float<T>(uniform(seed) * 64.0f);
      if (at >= 0) src[at] = rf::from_float<T>(specials[lcg(seed) % 3]);
      std::vector<float> dst(panels * pstride + 64, -3.0f);
      const bool got = f(src.data(), n, dst.data() + 32, pstride);  // the element's row 32 floats into each panel
      if (got != (at >= 0) && bad++ < 5) std::printf("%s n%d non-finite at %d: returned %d\n", name, n, at, got);
      for (int64_t i = 0; i < int64_t(dst.size()); ++i) {
        const int64_t rel = i - 32, x = rel % pstride < 32 && rel >= 0 ? rel / pstride * 32 + rel % pstride : -1;
        const float want = x >= 0 && x < n ? rf::ld(src[x]) : -3.0f;
        if (redfuser::float_bits(dst[i]) != redfuser::float_bits(want) && bad++ < 5)
          std::printf("%s n%d at %d: dst[%ld] = %g, want %g\n", name, n, at, long(i), dst[i], want);
      }
    }
  }
  std::printf("%s mismatches: %d\n", name, bad);
  return bad;
}

// first_rows (the first row of a run that reads or counts each element of a chunk, for the packs) against a search
// per element, on flag patterns of every kind the kernels make: all set, none, a causal diagonal (row q sees
// elements up to q + shift), random with a density from sparse to full, runs that start past row 0 and chunks
// shorter than the row stride; entries past n untouched.
#define FIRST_ROWS_AT(level, attr)                                                                              \
  attr static void first_rows_##level(const uint8_t* f, int64_t ld, int64_t r0, int64_t r1, int64_t n,         \
                                      int8_t* first) {                                                          \
    rf::first_rows(f, ld, r0, r1, n, first);                                                                    \
  }
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
FIRST_ROWS_AT(v4, __attribute__((target("arch=x86-64-v4"))))
FIRST_ROWS_AT(v3, __attribute__((target("arch=x86-64-v3"))))
#endif
FIRST_ROWS_AT(base, )
using FirstRows = void (*)(const uint8_t*, int64_t, int64_t, int64_t, int64_t, int8_t*);

static int check_first_rows(const char* name, FirstRows f) {
  int bad = 0;
  uint32_t seed = 12345u;
  const int64_t ld = 256;
  std::vector<uint8_t> flags(128 * ld);
  std::vector<int8_t> first(ld + 1);
  for (int kind = 0; kind < 4; ++kind)
    for (int64_t n : {1, 15, 16, 17, 100, 128, 255, 256})
      for (int64_t r0 : {0, 3})
        for (int64_t r1 : {r0 + 1, r0 + 2, int64_t(64), int64_t(128)})
          for (int trial = 0; trial < (kind == 3 ? 8 : kind == 2 ? 3 : 1); ++trial) {  // kind 2: shifts 0..2
            const uint32_t density = static_cast<uint32_t>(trial) * 37u;  // of 256
            for (int64_t q = 0; q < 128; ++q)
              for (int64_t j = 0; j < ld; ++j) {
                seed = seed * 1664525u + 1013904223u;
                const uint8_t v = kind == 0 ? 1 : kind == 1 ? 0 : kind == 2 ? (j <= q - r0 + (trial % 3)) : ((seed >> 24) < density);
                flags[q * ld + j] = v;
              }
            std::fill(first.begin(), first.end(), int8_t(77));
            f(flags.data(), ld, r0, r1, n, first.data());
            for (int64_t j = 0; j <= ld; ++j) {
              int32_t want = 77;
              if (j < n) {
                want = -1;
                for (int64_t q = r0; q < r1; ++q)
                  if (flags[q * ld + j]) {
                    want = static_cast<int32_t>(q - r0);
                    break;
                  }
              }
              if (first[j] != want && bad++ < 5)
                std::printf("%s kind %d n%ld rows [%ld, %ld) trial %d: element %ld row %d, want %d\n", name, kind,
                            long(n), long(r0), long(r1), trial, long(j), int(first[j]), want);
            }
          }
  std::printf("%s mismatches: %d\n", name, bad);
  return bad;
}

// The bf16 pair tile (gemm_tile_bf16, where the CPU has AVX512_BF16) with its packs: the row factor rounded to
// pairs (pairs_from_floats, odd lengths padded with 0), a fold's [element][n] tile interleaved from element rows
// (pack_pairs_interleaved, its inf/NaN report) and a contraction's [c / 2][element] tile transposed from rows read as
// words (pack_transposed<bf16x2_t>); against a float64 loop over the bf16-rounded operands, for every register
// block and remainder. The products of bf16 values are exact in float, so the bound is the float tile's.
static int check_bf16_pairs() {
  int bad = 0;
  uint32_t seed = 4242;
  auto rnd = [&seed] { return uniform(seed); };
  auto r16 = [](float v) { return redfuser::bf16_to_float(redfuser::float_to_bf16(v)); };
  for (int M : {1, 3, 4, 5, 8, 9, 13, 17})
    for (int N : {1, 5, 16, 17, 31, 32, 33, 65})
      for (int K : {1, 2, 3, 16, 17, 64, 129})
        for (bool acc : {false, true}) {
          const int KP = (K + 1) / 2;
          const int64_t lda = K + 3, ldw = KP + 2, ldc = N + 3, ldb = ((N + 31) / 32) * 32 + 32;
          std::vector<float> A(M * lda), C0(M * ldc), C;
          std::vector<rf::bf16_t> Bsrc((2 * KP) * (N + 7)), zero(N + 7);
          for (auto& v : A) v = rnd();
          for (auto& v : Bsrc) v.bits = redfuser::float_to_bf16(rnd());
          for (auto& v : C0) v = rnd();
          std::vector<const rf::bf16_t*> rows(2 * KP);
          for (int k = 0; k < 2 * KP; ++k) rows[k] = k < K ? Bsrc.data() + (2 * KP - 1 - k) * (N + 7) : zero.data();
          std::vector<uint32_t> A2(M * ldw), B2(KP * ldb);
          rf::pairs_from_floats(M, K, A.data(), lda, A2.data(), ldw);
          if (rf::pack_pairs_interleaved(KP, N, rows.data(), 2, B2.data(), ldb) && bad++ < 5)
            std::printf("pack_pairs_interleaved reported inf/NaN in finite values\n");
          C = C0;
          rf::gemm_tile_bf16(M, N, KP, A2.data(), ldw, B2.data(), ldb, C.data(), ldc, acc);
          for (int m = 0; m < M; ++m)
            for (int n = 0; n < N; ++n) {
              double r = acc ? C0[m * ldc + n] : 0.0;
              for (int k = 0; k < K; ++k) r += double(r16(A[m * lda + k])) * rf::ld(rows[k][2 + n]);
              if (std::fabs(C[m * ldc + n] - r) > 1e-5 * (K + 1) && bad++ < 5)
                std::printf("gemm_tile_bf16 M%d N%d K%d acc%d [%d, %d]: %g, want %g\n", M, N, K, int(acc), m, n,
                            C[m * ldc + n], r);
            }
          for (int m = 0; m < M; ++m)  // columns past N untouched
            for (int64_t n = N; n < ldc; ++n)
              if (C[m * ldc + n] != C0[m * ldc + n] && bad++ < 5) std::printf("gemm_tile_bf16 wrote past N\n");
        }
  // an inf or NaN anywhere in the interleaved tile is reported
  for (uint16_t special : {uint16_t(0x7F80), uint16_t(0xFF80), uint16_t(0x7FC1)}) {
    std::vector<rf::bf16_t> a(40), b(40);
    for (auto& v : a) v.bits = redfuser::float_to_bf16(1.5f);
    for (auto& v : b) v.bits = redfuser::float_to_bf16(-2.0f);
    b[37].bits = special;
    const rf::bf16_t* rows[2] = {a.data(), b.data()};
    std::vector<uint32_t> d(64);
    if (!rf::pack_pairs_interleaved(1, 38, rows, 0, d.data(), 64) && bad++ < 5)
      std::printf("pack_pairs_interleaved missed 0x%x\n", unsigned(special));
    if ((d[37] >> 16) != special || (d[36] & 0xFFFFu) != redfuser::float_to_bf16(1.5f)) ++bad;
  }
  // words of two bf16 transposed: dst[p][r] == the pair (rows[r][2p], rows[r][2p + 1]) bit for bit
  for (int R : {1, 8, 9, 128})
    for (int P : {1, 8, 9, 64}) {
      std::vector<rf::bf16_t> src(R * (2 * P + 1));
      for (auto& v : src) v.bits = static_cast<uint16_t>((seed = seed * 1664525u + 1013904223u) >> 16);
      std::vector<const rf::bf16x2_t*> rows(R);
      for (int r = 0; r < R; ++r) rows[r] = reinterpret_cast<const rf::bf16x2_t*>(src.data() + r * (2 * P + 1) + 1);
      std::vector<float> dst(P * R);
      rf::pack_transposed(R, P, rows.data(), dst.data(), R);
      for (int p = 0; p < P; ++p)
        for (int r = 0; r < R; ++r) {
          uint32_t w;
          std::memcpy(&w, &dst[p * R + r], 4);
          const uint32_t want = src[r * (2 * P + 1) + 1 + 2 * p].bits | (uint32_t(src[r * (2 * P + 1) + 2 + 2 * p].bits) << 16);
          if (w != want && bad++ < 5) std::printf("pack_transposed bf16x2 R%d P%d [%d][%d]\n", R, P, p, r);
        }
    }
  // pairs_from_floats' vcvtne2ps2bf16 words against the portable loop's, bit for bit, for every length's body and
  // tail, over floats of every kind (any bit pattern, subnormals, magnitudes 2^-150..2^150: NaNs, infinities,
  // roundings up to inf); the one allowed difference: a float below 2^-126 in magnitude gives a signed zero there
  // where the loop gives a subnormal bf16 or 2^-126 (both taken as a negligible factor, see cpu_math.h)
  int flushed = 0;
  for (int K : {1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 100, 129, 256})
    for (int M : {1, 3}) {
      const int64_t lds = K + 5, ldd = K / 2 + 3;
      std::vector<float> src(M * lds);
      for (auto& v : src) {
        uint32_t u = (lcg(seed) << 8) ^ lcg(seed);  // any 32-bit pattern
        const uint32_t kind = lcg(seed) % 8;
        if (kind == 1) u &= 0x807FFFFFu;  // a subnormal or zero
        std::memcpy(&v, &u, 4);
        if (kind > 1) v = std::ldexp(uniform(seed), int(lcg(seed) % 300) - 150);
      }
      std::vector<uint32_t> a(M * ldd, 0xDEADBEEFu), b = a;
      rf::pairs_from_floats_lanes(M, K, src.data(), lds, a.data(), ldd);
      rf::pairs_from_floats_bf16(M, K, src.data(), lds, b.data(), ldd);
      for (size_t i = 0; i < a.size(); ++i)
        for (int h = 0; h < 2; ++h) {
          const uint16_t x = uint16_t(a[i] >> (16 * h)), y = uint16_t(b[i] >> (16 * h));
          if (x == y) continue;
          if ((x & 0x7FFFu) <= 0x80u && (y & 0x7FFFu) == 0 && (x & 0x8000u) == (y & 0x8000u)) {
            ++flushed;
            continue;
          }
          if (bad++ < 5) std::printf("pairs_from_floats_bf16 K%d M%d word %zu half %d: %04x, want %04x\n", K, M, i, h, y, x);
        }
    }
  if (flushed == 0 && bad++ < 5) std::printf("pairs_from_floats_bf16: no value below 2^-126 was drawn\n");
  std::printf("bf16 pairs mismatches: %d\n", bad);
  return bad;
}

// e4m3 weight rows x a vector (e4m3_row_dots): every byte value exact in each lane position (a row of zeros but one
// byte, x = 1 there: the product is the decoded value itself, against the exact integer decode), random rows against
// a float64 loop for lengths that take the vector body, its tail and chunks of 512 (K up to 1100), and the NaN
// bytes (0x7F, 0xFF) reported per row wherever they sit (body or tail) while the other rows keep their sums, and x
// past 2^119 (which the AVX levels' x times 256 would overflow) summed finite.
using RowDots = bool (*)(int64_t, int64_t, const uint8_t*, int64_t, const float*, float*, uint8_t*);
static int check_e4m3_rows(const char* name, RowDots f) {
  int bad = 0;
  uint32_t seed = 99;
  auto rnd = [&seed] { return lcg(seed); };
  for (int pos : {0, 5, 31, 32, 47, 63, 70}) {  // body lanes and the tail (K = 71)
    const int K = 71;
    std::vector<uint8_t> W(256 * (K + 2), 0);
    std::vector<float> x(K, 0.0f), out(256);
    std::vector<uint8_t> nan(256);
    x[pos] = 1.0f;
    for (int b = 0; b < 256; ++b) W[b * (K + 2) + pos] = static_cast<uint8_t>(b);
    const bool any = f(256, K, W.data(), K + 2, x.data(), out.data(), nan.data());
    if (!any && bad++ < 5) std::printf("%s: NaN bytes not reported (pos %d)\n", name, pos);
    for (int b = 0; b < 256; ++b) {
      const bool is_nan = (b & 0x7F) == 0x7F;
      if (nan[b] != is_nan && bad++ < 5) std::printf("%s: byte %02x at %d: NaN flag %d\n", name, b, pos, int(nan[b]));
      const float want = rf::e4m3_to_float(static_cast<uint8_t>(b));
      if (!is_nan && std::fabs(out[b]) != std::fabs(want) && bad++ < 5)
        std::printf("%s: byte %02x at %d: %g, want %g\n", name, b, pos, out[b], want);
      if (!is_nan && want != 0.0f && out[b] != want && bad++ < 5)
        std::printf("%s: byte %02x at %d: %g, want %g\n", name, b, pos, out[b], want);
    }
  }
  for (int N : {1, 3, 17})
    for (int K : {1, 15, 16, 31, 32, 33, 100, 256, 511, 512, 513, 1100}) {
      const int64_t ldw = K + 9;
      std::vector<uint8_t> W(N * ldw);
      for (auto& v : W) {
        v = static_cast<uint8_t>(rnd());
        if ((v & 0x7F) == 0x7F) v ^= 1;  // finite
      }
      std::vector<float> x(K), out(N);
      std::vector<uint8_t> nan(N, 7);
      for (auto& v : x) v = rf::round_e4m3(static_cast<float>(rnd() % 2000) / 4.0f - 250.0f);
      const bool nan_row = N == 17 && K >= 2;
      if (nan_row) W[5 * ldw + K - 1] = 0xFF;  // the last element of row 5: a NaN byte in the tail or the body
      const bool any = f(N, K, W.data(), ldw, x.data(), out.data(), nan.data());
      if (any != nan_row && bad++ < 5) std::printf("%s N%d K%d: reported %d\n", name, N, K, int(any));
      for (int n = 0; n < N; ++n) {
        const bool want_nan = nan_row && n == 5;
        if (nan[n] != want_nan && bad++ < 5) std::printf("%s N%d K%d row %d: NaN flag %d\n", name, N, K, n, int(nan[n]));
        if (want_nan) continue;
        double r = 0.0, mag = 0.0;
        for (int k = 0; k < K; ++k) {
          const double t = double(rf::e4m3_to_float(W[n * ldw + k])) * x[k];
          r += t;
          mag += std::fabs(t);
        }
        if (std::fabs(out[n] - r) > 1e-6 * mag * (K + 1) && bad++ < 5)
          std::printf("%s N%d K%d row %d: %g, want %g\n", name, N, K, n, out[n], r);
      }
    }
  // huge x (past 2^119, where x times 256 would overflow) with small weights: a finite sum
  for (int K : {40, 600}) {
    std::vector<uint8_t> W(2 * K, 0x08);  // 2^-6
    std::vector<float> x(K, 3e37f), out(2);
    std::vector<uint8_t> nan(2);
    x[K / 2] = -1.0f;
    f(2, K, W.data(), K, x.data(), out.data(), nan.data());
    const double want = (K - 1) * 3e37 / 64.0 - 1.0 / 64.0;
    for (int n = 0; n < 2; ++n)
      if (!(std::fabs(out[n] - want) <= 1e-5 * std::fabs(want)) && bad++ < 5)
        std::printf("%s huge x K%d: %g, want %g\n", name, K, out[n], want);
  }
  std::printf("%s mismatches: %d\n", name, bad);
  return bad;
}

int main() {
  int bad = 0;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  if (__builtin_cpu_supports("x86-64-v4")) {
    bad += check("gemm_tile_v4", rf::gemm_tile_v4, false);
    bad += check("gemm_tile_nt_v4", rf::gemm_tile_nt_v4, true);
    bad += check_pack<float>("pack_transposed_v4 float", pack_v4<float>);
    bad += check_pack<rf::bf16_t>("pack_transposed_v4 bf16", pack_v4<rf::bf16_t>);
    bad += check_e4m3_rows("e4m3_row_dots_v4", rf::e4m3_row_dots_v4);
    bad += check_tc("gemm_tile_tc_v4", rf::gemm_tile_tc_v4);
    bad += check_e4m3_floats("e4m3_to_floats_v4", rf::e4m3_to_floats_v4);
    bad += check_first_rows("first_rows_v4", first_rows_v4);
    bad += check_row_panels<float>("pack_row_panels_v4 float", row_panels_v4<float>);
    bad += check_row_panels<rf::bf16_t>("pack_row_panels_v4 bf16", row_panels_v4<rf::bf16_t>);
  } else {
    std::printf("x86-64-v4 not supported here: skipped\n");
  }
  if (__builtin_cpu_supports("x86-64-v3")) {
    bad += check("gemm_tile_v3", rf::gemm_tile_v3, false);
    bad += check("gemm_tile_nt_v3", rf::gemm_tile_nt_v3, true);
    bad += check_pack<float>("pack_transposed_v3 float", pack_v3<float>);
    bad += check_pack<rf::bf16_t>("pack_transposed_v3 bf16", pack_v3<rf::bf16_t>);
    bad += check_e4m3_rows("e4m3_row_dots_v3", rf::e4m3_row_dots_v3);
    bad += check_tc("gemm_tile_tc_v3", rf::gemm_tile_tc_v3);
    bad += check_e4m3_floats("e4m3_to_floats_v3", rf::e4m3_to_floats_v3);
    bad += check_first_rows("first_rows_v3", first_rows_v3);
    bad += check_row_panels<float>("pack_row_panels_v3 float", row_panels_v3<float>);
    bad += check_row_panels<rf::bf16_t>("pack_row_panels_v3 bf16", row_panels_v3<rf::bf16_t>);
  } else {
    std::printf("x86-64-v3 not supported here: skipped\n");
  }
  bad += check("gemm_tile_base", rf::gemm_tile_base, false);
  bad += check("gemm_tile_nt_base", rf::gemm_tile_nt_base, true);
  bad += check_e4m3_rows("e4m3_row_dots_base", rf::e4m3_row_dots_base);
  bad += check_tc("gemm_tile_tc_base", rf::gemm_tile_tc_base);
#else
  bad += check("gemm_tile", rf::gemm_tile, false);
  bad += check("gemm_tile_nt", rf::gemm_tile_nt, true);
  bad += check_tc("gemm_tile_tc", rf::gemm_tile_tc);
#endif
  bad += check_e4m3_floats("e4m3_to_floats_base", rf::e4m3_to_floats_base);
  if (rf::bf16_dot_supported())  // checked wherever the instruction exists, whether or not the kernels pick it here
    bad += check_bf16_pairs();
  else
    std::printf("AVX512_BF16 not supported here: bf16 pairs skipped\n");
  bad += check_pack<float>("pack_transposed_base float", pack_base<float>);
  bad += check_pack<rf::bf16_t>("pack_transposed_base bf16", pack_base<rf::bf16_t>);
  bad += check_panels();
  bad += check_first_rows("first_rows_base", first_rows_base);
  bad += check_row_panels<float>("pack_row_panels_base float", row_panels_base<float>);
  bad += check_row_panels<rf::bf16_t>("pack_row_panels_base bf16", row_panels_base<rf::bf16_t>);
  return bad != 0;
}
