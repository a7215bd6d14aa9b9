// The CPU kernels' selection short-cuts (ops_src/cpu_math.h) against offering every element in turn, the rule they
// must reproduce exactly, at every x86-64 level this CPU runs (v4, v3, the base level):
// - sel_candidates: a chunk's k best offered elements not below the selection's last entry;
// - sel_offers with the per-set bars the insertions keep: a selection kept per set (one per group);
// - sel_mark / sel_member against sel_has.
// Random rows of several chunks whose keys are drawn from a few values (ties within and across chunks), with NaN,
// -inf, +inf, -0.0 and +0.0 among them, random offered masks and k from 1 to past the chunk. Selections compare
// entry by entry: the key's bits, the index and the filled flag. Built and run by tests/test_cpu_math_exhaustive.py
// with the kernels' flags; prints the mismatch count per level and exits 1 on any.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_math.h"

namespace rf = redfuser::cpu;

namespace {

constexpr int kChunk = 64;  // the chunk of the per-set offers (sel_offers' callers)

struct Sel {
  std::vector<float> key;
  std::vector<int64_t> idx;
  std::vector<uint8_t> ok;
  Sel(int64_t sets, int64_t k) : key(sets * k), idx(sets * k), ok(sets * k) {
    rf::sel_clear(key.data(), idx.data(), ok.data(), sets * k);
  }
  // the insertion the generated kernels emit; returns the entry position or k
  int64_t insert(int64_t set, int64_t k, float v, int64_t index) {
    float* kk = key.data() + set * k;
    int64_t* ii = idx.data() + set * k;
    uint8_t* oo = ok.data() + set * k;
    const int64_t pos = rf::sel_position(kk, ii, oo, k, v, index);
    if (pos < k) {
      rf::sel_shift(kk, pos, k);
      rf::sel_shift(ii, pos, k);
      rf::sel_shift(oo, pos, k);
      kk[pos] = v;
      ii[pos] = index;
      oo[pos] = 1;
    }
    return pos;
  }
};

uint32_t g_seed = 2024;
uint32_t rnd() {
  g_seed = g_seed * 1664525u + 1013904223u;
  return g_seed >> 8;
}

float draw_key() {
  static const float special[] = {std::numeric_limits<float>::quiet_NaN(), -rf::kInf, rf::kInf, -0.0f, 0.0f};
  const uint32_t r = rnd() % 100;
  if (r < 6) return special[rnd() % 5];
  return static_cast<float>(static_cast<int>(rnd() % 9) - 4) * 0.25f;  // few values: many ties
}

bool same(const Sel& a, const Sel& b) {
  for (size_t i = 0; i < a.key.size(); ++i) {
    if (a.ok[i] != b.ok[i] || a.idx[i] != b.idx[i]) return false;
    if (std::memcmp(&a.key[i], &b.key[i], sizeof(float)) != 0) return false;
  }
  return true;
}

// a chunk size C's candidates against `all`, the selection offered every element in turn
#define CANDIDATES(level, C)                                                                                                   \
  {                                                                                                                            \
    Sel cand(1, k);                                                                                                            \
    for (int64_t c0 = 0; c0 < n; c0 += C) {                                                                                    \
      const int64_t cn = n - c0 < C ? n - c0 : C;                                                                              \
      float ck[C];                                                                                                             \
      uint8_t co[C];                                                                                                           \
      for (int64_t j = 0; j < C; ++j) { ck[j] = j < cn ? key[c0 + j] : 1e30f; co[j] = j < cn ? offered[c0 + j] : 1; }          \
      int64_t out[C];                                                                                                          \
      const int64_t nc = rf::sel_candidates<C>(ck, co, cn, cand.key.data(), cand.ok.data(), k, out);                           \
      for (int64_t i = 0; i < nc; ++i) {                                                                                       \
        if (out[i] < 0 || out[i] >= cn || !co[out[i]]) { ++bad; break; }                                                       \
        cand.insert(0, k, ck[out[i]], c0 + out[i]);                                                                            \
      }                                                                                                                        \
    }                                                                                                                          \
    if (!same(all, cand) && bad++ < 5) std::printf(#level " sel_candidates<" #C ">: n %ld k %ld differs\n", long(n), long(k)); \
  }

#define SELECTION_AT(level, attr)                                                                               \
  attr int check_##level() {                                                                                    \
    int bad = 0;                                                                                                \
    for (int trial = 0; trial < 4000; ++trial) {                                                                \
      const int64_t n = 1 + rnd() % 600, k = 1 + rnd() % (trial % 3 == 0 ? 70 : 9);                           \
      const int64_t sets = 1 + rnd() % 5;                                                                       \
      std::vector<float> key(n);                                                                                \
      std::vector<uint8_t> offered(n);                                                                          \
      std::vector<int64_t> group(n);                                                                            \
      const uint32_t density = rnd() % 4;                                                                       \
      for (int64_t j = 0; j < n; ++j) {                                                                         \
        key[j] = draw_key();                                                                                    \
        offered[j] = density == 0 ? 1 : (rnd() % 4 < density ? 1 : 0);                                         \
        group[j] = static_cast<int64_t>(rnd() % (sets + 1)) - (rnd() % 16 == 0 ? 1 : 0); /* some out of range */ \
      }                                                                                                         \
      /* one set: every offered element in turn, against the chunk's candidates */                             \
      Sel all(1, k);                                                                                            \
      for (int64_t j = 0; j < n; ++j)                                                                           \
        if (offered[j]) all.insert(0, k, key[j], j);                                                            \
      CANDIDATES(level, 64)  /* the chunk of block kernels */                                                  \
      CANDIDATES(level, 256) /* the chunk of row kernels with a selection (rounds for k <= 16) */             \
      /* per set: every offered element of its set in turn, against sel_offers with the kept bars */           \
      Sel allg(sets, k), offg(sets, k);                                                                         \
      std::vector<int32_t> bar(sets, std::numeric_limits<int32_t>::min());                                      \
      for (int64_t j = 0; j < n; ++j)                                                                           \
        if (offered[j] && group[j] >= 0 && group[j] < sets) allg.insert(group[j], k, key[j], j);                \
      for (int64_t c0 = 0; c0 < n; c0 += kChunk) {                                                              \
        const int64_t cn = n - c0 < kChunk ? n - c0 : kChunk;                                                   \
        float ck[kChunk];                                                                                       \
        uint8_t co[kChunk];                                                                                     \
        int32_t cs[kChunk];                                                                                     \
        for (int64_t j = 0; j < cn; ++j) {                                                                      \
          ck[j] = key[c0 + j];                                                                                  \
          co[j] = offered[c0 + j];                                                                              \
          cs[j] = group[c0 + j] >= 0 && group[c0 + j] < sets ? static_cast<int32_t>(group[c0 + j]) : -1;       \
        }                                                                                                       \
        for (int64_t j = cn; j < kChunk; ++j) { ck[j] = 1e30f; co[j] = 1; cs[j] = 1 << 30; } /* never read as set */ \
        for (int64_t j0 = 0; j0 < cn; j0 += 16) {                                                               \
          int64_t out[16];                                                                                      \
          const int64_t no = rf::sel_offers<16>(ck + j0, co + j0, cs + j0, bar.data(), cn - j0, out);          \
          for (int64_t i = 0; i < no; ++i) {                                                                    \
            const int64_t jj = j0 + out[i];                                                                     \
            if (jj >= cn || !co[jj]) { ++bad; break; }                                                          \
            const int64_t s = cs[jj];                                                                           \
            if (s < 0) continue;                                                                                \
            if (offg.insert(s, k, ck[jj], c0 + jj) < k)                                                         \
              bar[s] = offg.ok[s * k + k - 1] ? rf::sel_okey(offg.key[s * k + k - 1])                          \
                                              : std::numeric_limits<int32_t>::min();                           \
          }                                                                                                     \
        }                                                                                                       \
      }                                                                                                         \
      if (!same(allg, offg) && bad++ < 5) std::printf(#level " sel_offers: n %ld k %ld sets %ld differs\n", long(n), long(k), long(sets)); \
      /* membership tables */                                                                                   \
      std::vector<uint8_t> mem(sets + 1);                                                                       \
      rf::sel_mark(mem.data(), sets + 1, all.idx.data(), all.ok.data(), k);                                     \
      for (int64_t v = -2; v < sets + 3; ++v)                                                                   \
        if (rf::sel_member(mem.data(), sets + 1, v) != (v < sets + 1 && rf::sel_has(all.idx.data(), all.ok.data(), k, v)) && bad++ < 5) \
          std::printf(#level " sel_member(%ld) differs from sel_has\n", long(v));                              \
    }                                                                                                           \
    std::printf(#level " selection mismatches: %d\n", bad);                                                     \
    return bad;                                                                                                 \
  }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
SELECTION_AT(v4, __attribute__((target("arch=x86-64-v4"))))
SELECTION_AT(v3, __attribute__((target("arch=x86-64-v3"))))
#endif
SELECTION_AT(base, )

}  // namespace

int main() {
  int bad = 0;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  if (__builtin_cpu_supports("x86-64-v4"))
    bad += check_v4();
  else
    std::printf("x86-64-v4 not supported here: skipped\n");
  if (__builtin_cpu_supports("x86-64-v3"))
    bad += check_v3();
  else
    std::printf("x86-64-v3 not supported here: skipped\n");
#endif
  bad += check_base();
  return bad != 0;
}
