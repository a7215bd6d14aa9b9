// The chunk helpers of ops_src/cpu_math.h that the generated kernels call in place of their own lane loops, at every
// x86-64 level this CPU runs (v4: AVX-512, v3: AVX2, the base level: SSE2):
// - exp_sum(w, n): w[j] = exp(w[j]) in place, returning their sum in the lane loops' order. The values against
//   float64 exp on one float in 31 of the whole range with a normal result and on the special values (the bounds
//   of tests/cpu_exp_levels.cpp: 5e-7 relative at v4/v3, 5e-6 at the base level and at the bottom binade; 0 below
//   ln(FLT_MIN), +inf past the top, NaN for NaN), and the sum against float64 sums of the results on lengths around
//   the 16-lane steps (n % 16 tails, n = 0), each term at least 0.05 (a lost term moves the sum by more than 5e-5
//   relative; the bound is 5e-6: the lane order is not checked bit for bit, -ffast-math may reassociate the tail).
// - max_of(w, n): the NaN-propagating maximum (-inf for n = 0) against a scalar fold with rf::max, on random rows
//   of those lengths with NaN, +-inf and all -inf rows, NaN placed in the vector part and in the tail.
// Built and run by tests/test_cpu_math_exhaustive.py with the kernels' flags. Prints the mismatch count per helper
// and level; exits 1 on any.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "cpu_math.h"

namespace rf = redfuser::cpu;
using ExpSum = float (*)(float*, int64_t);
using MaxOf = float (*)(const float*, int64_t);

static const int64_t kLengths[] = {0, 1, 7, 15, 16, 17, 31, 32, 33, 100, 255, 256, 257, 512};

static int check_exp_sum(const char* name, ExpSum f, double bound) {
  const float lo = -87.3365478515625f;      // float(ln(FLT_MIN))
  const float top = 88.72283172607421875f;  // the largest float whose exp is finite
  std::vector<float> xs;
  for (uint32_t u = 0; u <= redfuser::float_bits(top); u += 31) xs.push_back(redfuser::bits_float(u));
  for (uint32_t u = 0x80000000u; u <= redfuser::float_bits(lo); u += 31) xs.push_back(redfuser::bits_float(u));
  const float inf = std::numeric_limits<float>::infinity();
  const float special[] = {lo, top, 0.0f, -0.0f, std::nextafter(top, 100.0f), std::nextafter(lo, -100.0f), 100.0f,
                           -100.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN()};
  const size_t ns = sizeof(special) / sizeof(special[0]);
  int bad = 0;
  double worst = 0.0;
  // the specials at every position of a 16-lane step and in the tail: each in a run of its own
  for (size_t s = 0; s < ns; ++s) {
    for (int64_t pos = 0; pos < 19; ++pos) {
      std::vector<float> y(19, 0.0f);
      y[pos] = special[s];
      f(y.data(), 19);
      const float v = y[pos];
      const double at_lo = std::exp(static_cast<double>(lo));
      bool ok = true;
      switch (s) {
        case 0: ok = v == 0.0f || std::fabs(v - at_lo) <= 5e-6 * at_lo; break;  // 0 or its subnormal
        case 1: ok = v < inf && v > 3.4e38f; break;
        case 2: case 3: ok = v == 1.0f; break;
        case 4: case 6: case 8: ok = v == inf; break;
        case 5: case 7: case 9: ok = v == 0.0f; break;
        default: ok = v != v; break;
      }
      for (int64_t j = 0; j < 19; ++j)
        if (j != pos && y[j] != 1.0f) ok = false;  // exp(0) beside it
      if (!ok && bad++ < 5) std::printf("%s special %.9g at %lld: %.9g\n", name, special[s], (long long)pos, v);
    }
  }
  // the whole range in chunks of 256 (the attention chunk), the last one shorter
  for (size_t c = 0; c < xs.size(); c += 256) {
    const int64_t n = static_cast<int64_t>(std::min<size_t>(256, xs.size() - c));
    std::vector<float> y(xs.begin() + c, xs.begin() + c + n);
    f(y.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const float x = xs[c + i];
      const double want = std::exp(static_cast<double>(x));
      const double rel = std::fabs(y[i] - want) / want;
      worst = rel > worst ? rel : worst;
      const double b = x < lo + 0.6931472f ? 5e-6 : bound;
      if (!(rel <= b) && bad++ < 5) std::printf("%s exp(%.9g) = %.9g, want %.9g\n", name, x, y[i], want);
    }
  }
  // the returned sum on lengths around the steps
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-3.0f, 2.0f);
  for (const int64_t n : kLengths) {
    for (int rep = 0; rep < 8; ++rep) {
      std::vector<float> y(n + 1);
      for (auto& v : y) v = u(gen);
      const float guard = y[n];
      const float got = f(y.data(), n);
      double want = 0.0;
      for (int64_t j = 0; j < n; ++j) want += y[j];
      if (!(std::fabs(got - want) <= 5e-6 * want) || y[n] != guard) {
        if (bad++ < 5) std::printf("%s sum n=%lld: %.9g, want %.9g\n", name, (long long)n, got, want);
      }
    }
  }
  std::printf("%s mismatches: %d (worst relative error %.3g)\n", name, bad, worst);
  return bad;
}

static int check_max_of(const char* name, MaxOf f) {
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> u(-50.0f, 50.0f);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  int bad = 0, cases = 0;
  for (const int64_t n : kLengths) {
    for (int kind = 0; kind < 6; ++kind) {
      for (int64_t at = 0; at < (n ? n : 1); at += (n > 40 ? 13 : 1)) {
        std::vector<float> y(n);
        for (auto& v : y) v = kind == 4 ? -inf : u(gen);
        if (n && kind == 1) y[at] = nan;
        if (n && kind == 2) y[at] = inf;
        if (n && kind == 3) y[at] = -inf;
        if (n && kind == 5) y[at] = -nan;  // a NaN with the sign bit
        float want = -inf;
        for (int64_t j = 0; j < n; ++j) want = rf::max(want, y[j]);
        const float got = f(y.data(), n);
        ++cases;
        const bool ok = (want != want) ? got != got : got == want;
        if (!ok && bad++ < 5)
          std::printf("%s n=%lld kind %d at %lld: %.9g, want %.9g\n", name, (long long)n, kind, (long long)at, got, want);
        if (kind == 4 || kind == 0) break;  // one row of these is enough
      }
    }
  }
  std::printf("%s mismatches: %d of %d rows\n", name, bad, cases);
  return bad;
}

int main() {
  int bad = 0;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  if (__builtin_cpu_supports("x86-64-v4")) {
    bad += check_exp_sum("exp_sum_v4", rf::exp_sum_v4, 5e-7);
    bad += check_max_of("max_of_v4", rf::max_of_v4);
  } else {
    std::printf("x86-64-v4 not supported here: skipped\n");
  }
  if (__builtin_cpu_supports("x86-64-v3")) {
    bad += check_exp_sum("exp_sum_v3", rf::exp_sum_v3, 5e-7);
    bad += check_max_of("max_of_v3", rf::max_of_v3);
  } else {
    std::printf("x86-64-v3 not supported here: skipped\n");
  }
  bad += check_exp_sum("exp_sum_base", rf::exp_sum_base, 5e-6);
#else
  bad += check_exp_sum("exp_sum_base", rf::exp_sum, 5e-6);
#endif
  bad += check_max_of("max_of_base", rf::max_of_lanes);
  return bad != 0;
}
