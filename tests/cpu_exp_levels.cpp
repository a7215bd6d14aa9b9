// The CPU kernels' float exp (ops_src/cpu_math.h: redfuser::cpu::exp, in every softmax, attention, logsumexp and
// router kernel) in a loop the compiler vectorises, at every x86-64 level this CPU runs (v4: AVX-512, v3: AVX2,
// the base level: SSE2, where there is no FMA), against float64 exp: one float in 31 of the whole range with a
// normal result, [ln(FLT_MIN), ln(FLT_MAX)), both ends included, and the special values. Bounds: 5e-7 relative
// where FMA contracts the range reduction, 5e-6 where it cannot (-ffast-math folds the two-part ln2 into one
// float constant), 5e-6 at the bottom binade (a subnormal's pattern keeps fewer bits). exp(x) past the largest
// float x with a finite result is +inf, below ln(FLT_MIN) exactly 0, exp(NaN) NaN, exp(0) exactly 1. Built and
// run by tests/test_cpu_math_exhaustive.py with the kernels' flags. Prints the mismatch count per level; exits 1 on
// any.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <vector>

#include "cpu_math.h"

namespace rf = redfuser::cpu;
using Exp = void (*)(const float*, float*, int64_t);

#define EXP_AT(level, attr)                                                  \
  attr static void exp_##level(const float* x, float* y, int64_t n) {       \
    for (int64_t i = 0; i < n; ++i) y[i] = rf::exp(x[i]);                  \
  }
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
EXP_AT(v4, __attribute__((target("arch=x86-64-v4"))))
EXP_AT(v3, __attribute__((target("arch=x86-64-v3"))))
#endif
EXP_AT(base, )

static int check(const char* name, Exp f, double bound) {
  const float lo = -87.3365478515625f;         // float(ln(FLT_MIN)): the kernels' lower clamp
  const float top = 88.72283172607421875f;     // the largest float whose exp is finite
  std::vector<float> xs;
  for (uint32_t u = 0; u <= redfuser::float_bits(top); u += 31) xs.push_back(redfuser::bits_float(u));
  for (uint32_t u = 0x80000000u; u <= redfuser::float_bits(lo); u += 31) xs.push_back(redfuser::bits_float(u));
  const float special[] = {lo, top, 0.0f, -0.0f, std::nextafter(top, 100.0f), std::nextafter(lo, -100.0f), 100.0f, -100.0f,
                           std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN()};
  const size_t ns = sizeof(special) / sizeof(special[0]);
  for (const float s : special) xs.push_back(s);
  std::vector<float> ys(xs.size());
  f(xs.data(), ys.data(), static_cast<int64_t>(xs.size()));
  int bad = 0;
  double worst = 0.0;
  for (size_t i = 0; i + ns < xs.size(); ++i) {
    const double want = std::exp(static_cast<double>(xs[i]));
    const double rel = std::fabs(ys[i] - want) / want;
    worst = rel > worst ? rel : worst;
    const double b = xs[i] < lo + 0.6931472f ? 5e-6 : bound;
    if (!(rel <= b) && bad++ < 5) std::printf("%s exp(%.9g) = %.9g, want %.9g\n", name, xs[i], ys[i], want);
  }
  const float* y = ys.data() + xs.size() - ns;
  // exp(lo) is just below FLT_MIN: 0 (below the smallest normal) or its subnormal, either is right
  const double at_lo = std::exp(static_cast<double>(lo));
  const bool specials_ok = (y[0] == 0.0f || std::fabs(y[0] - at_lo) <= 5e-6 * at_lo) && y[1] < std::numeric_limits<float>::infinity() && y[1] > 3.4e38f && y[2] == 1.0f &&
                           y[3] == 1.0f && y[4] == std::numeric_limits<float>::infinity() && y[5] == 0.0f &&
                           y[6] == std::numeric_limits<float>::infinity() && y[7] == 0.0f &&
                           y[8] == std::numeric_limits<float>::infinity() && y[9] == 0.0f && y[10] != y[10];
  if (!specials_ok) {
    ++bad;
    std::printf("%s specials (lo, top, 0, -0, past top, below lo, 100, -100, inf, -inf, nan):", name);
    for (size_t i = 0; i < ns; ++i) std::printf(" %.9g", y[i]);
    std::printf("\n");
  }
  std::printf("%s mismatches: %d (worst relative error %.3g over %zu values)\n", name, bad, worst, xs.size());
  return bad;
}

int main() {
  int bad = 0;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  if (__builtin_cpu_supports("x86-64-v4"))
    bad += check("exp_v4", exp_v4, 5e-7);
  else
    std::printf("x86-64-v4 not supported here: skipped\n");
  if (__builtin_cpu_supports("x86-64-v3"))
    bad += check("exp_v3", exp_v3, 5e-7);
  else
    std::printf("x86-64-v3 not supported here: skipped\n");
#endif
  bad += check("exp_base", exp_base, 5e-6);
  return bad != 0;
}
