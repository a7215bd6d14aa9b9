// Every float32 input through the CPU kernels' float8_e4m3fn rounding (ops_src/cpu_math.h: float_to_e4m3 and
// round_e4m3), and every e4m3 byte through their decoding (e4m3_to_float, the loads of an fp8 tensor), against
// torch's own conversion (c10's header-only Float8_e4m3fn, which is integer bit arithmetic)
// after saturation to +-448 (the kernels saturate, as the GPU's cvt .satfinite does; torch's cast gives NaN past
// 464). Built and run by tests/test_cpu_math_exhaustive.py with the kernels' flags (-O3 -ffast-math
// -fno-finite-math-only). Prints the mismatch count and the first few mismatches; exits 1 on any.
#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>
#include <cstdio>

#include "cpu_math.h"

int main() {
  uint64_t bad = 0;
  for (int b = 0; b < 256; ++b) {
    const float got = redfuser::cpu::e4m3_to_float(static_cast<uint8_t>(b));
    const float want = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
    const bool ok = want != want ? got != got && (redfuser::float_bits(got) >> 31) == (redfuser::float_bits(want) >> 31)
                                 : redfuser::float_bits(got) == redfuser::float_bits(want);
    if (!ok && bad++ < 5) std::printf("decode %02x: %g, torch %g\n", b, got, want);
  }
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; ++u) {
    const float f = redfuser::bits_float(static_cast<uint32_t>(u));
    const bool nan = f != f;
    const float sat = nan ? f : (f > 448.0f ? 448.0f : (f < -448.0f ? -448.0f : f));
    const uint8_t got = redfuser::cpu::float_to_e4m3(f);
    const uint8_t want = nan ? 0x7F : c10::Float8_e4m3fn(sat).x;
    const float back = redfuser::cpu::round_e4m3(f);
    const float back_want = nan ? f : static_cast<float>(c10::Float8_e4m3fn(sat));
    const bool back_ok = nan ? back != back : redfuser::float_bits(back) == redfuser::float_bits(back_want);
    if ((got != want || !back_ok) && bad++ < 5)
      std::printf("%08llx: %02x (%g), torch %02x (%g)\n", (unsigned long long)u, got, back, want, back_want);
  }
  std::printf("e4m3 mismatches: %llu of 2^32\n", (unsigned long long)bad);
  return bad ? 1 : 0;
}
