// The CPU kernels' tile GEMMs (ops_src/cpu_math.h: gemm_tile, C += A x B, and gemm_tile_nt, C += A x Bt^T) and the
// transposing pack of their streamed operand (pack_transposed, float and bf16 sources) at every x86-64 level this CPU
// runs (v4: AVX-512, v3: AVX2, the base level: SSE2), against a float64 loop, over shapes
// that take every register-block size and remainder (rows 1..17, columns 1..65, reduction lengths 1..256). The
// op tests reach only the level of the machine they run on; the kernels pick theirs at run time, so a bug in
// another level's code (its vector width, its lane reduction) would ship untested. Built and run by
// tests/test_cpu_math_exhaustive.py with the kernels' flags. Prints the mismatch count per level; exits 1 on any.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cpu_math.h"

namespace rf = redfuser::cpu;

using Gemm = void (*)(int64_t, int64_t, int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t, bool);

static int check(const char* name, Gemm f, bool nt) {
  int bad = 0;
  uint32_t seed = 12345;
  auto rnd = [&seed] { seed = seed * 1664525u + 1013904223u; return static_cast<float>(seed >> 8) / 16777216.0f - 0.5f; };
  for (int M : {1, 2, 3, 4, 5, 7, 8, 9, 17})
    for (int N : {1, 3, 4, 5, 8, 16, 31, 33, 65})
      for (int K : {1, 3, 8, 15, 16, 17, 64, 100, 256})
        for (bool acc : {false, true}) {
          // row strides past the row (ld = width + 3); B is [K][ldb] with ldb rounded up to 32 columns (gemm_tile's
          // rule for packed tiles), Bt is [N][K + 3]
          const int64_t lda = K + 3, ldc = N + 3, ldb = nt ? K + 3 : ((N + 31) / 32) * 32 + 3;
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

int main() {
  int bad = 0;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  if (__builtin_cpu_supports("x86-64-v4")) {
    bad += check("gemm_tile_v4", rf::gemm_tile_v4, false);
    bad += check("gemm_tile_nt_v4", rf::gemm_tile_nt_v4, true);
    bad += check_pack<float>("pack_transposed_v4 float", pack_v4<float>);
    bad += check_pack<rf::bf16_t>("pack_transposed_v4 bf16", pack_v4<rf::bf16_t>);
  } else {
    std::printf("x86-64-v4 not supported here: skipped\n");
  }
  if (__builtin_cpu_supports("x86-64-v3")) {
    bad += check("gemm_tile_v3", rf::gemm_tile_v3, false);
    bad += check("gemm_tile_nt_v3", rf::gemm_tile_nt_v3, true);
    bad += check_pack<float>("pack_transposed_v3 float", pack_v3<float>);
    bad += check_pack<rf::bf16_t>("pack_transposed_v3 bf16", pack_v3<rf::bf16_t>);
  } else {
    std::printf("x86-64-v3 not supported here: skipped\n");
  }
  bad += check("gemm_tile_base", rf::gemm_tile_base, false);
  bad += check("gemm_tile_nt_base", rf::gemm_tile_nt_base, true);
#else
  bad += check("gemm_tile", rf::gemm_tile, false);
  bad += check("gemm_tile_nt", rf::gemm_tile_nt, true);
#endif
  bad += check_pack<float>("pack_transposed_base float", pack_base<float>);
  bad += check_pack<rf::bf16_t>("pack_transposed_base bf16", pack_base<rf::bf16_t>);
  return bad != 0;
}
