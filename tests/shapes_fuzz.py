"""Random medium-sized calls of the shipped CPU ops against the judges of their tests (ACCEPTANCE.md's rules).

The op tests take fixed shapes and parameters, tests/test_fuzz.py tiny ones; this draws what lies between: head
dimensions that are not powers of two, softmax_scale up to 3, GQA groups of 1-16, windows and soft-caps, fp8 GEMMs of
K up to 3,040, rows up to 200,000 long, transposed and sliced layouts, every dtype. Each case has its own seed, printed
with any failure; `--case SEED` replays one. A draw of this kind found fused_attention fp32 at D 256 and scale 1-3
past the 2x-plain rule (the tile GEMM's one long running sum; rf::GEMM_KC): on the library before that fix,
`--ops fa --cases 1500 --seed 3` fails 2 cases (2561837108, 1950384626), after it none.

    python -m tests.shapes_fuzz [--minutes M | --cases N] [--seed S] [--threads T] [--ops fa,sw,mla,fp8,row,topk,moe]

Run it from the source tree with the package installed (the installed one is imported, as the tests do). The exit
status is 1 if a case failed. tests/test_shapes_fuzz.py runs a fixed sample in the test suite.

The rules judge a maximum over a call's outputs, so they are statistical where a call has few: with one row of
logits of magnitude 100 the plain float32 loss can be exact by luck, or an fp8 GEMM of 16 outputs can draw a
quantisation 2.5x worse than two-pass's in 0.2 % of calls (the fused form is allowed to quantise chunk by chunk and
is as accurate on average). The draws here give the row ops, the GEMM and the selections at least 64 judged values
each and scores of at most a few hundred, where a failure is a finding (an attention call judges B x Sq x H x D
outputs, at least 8).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
_ROOT = _TESTS.parent
# as tests/conftest.py: the installed redfuser_ops before the source tree's (which has no library), the source tree
# still on the path (last) for `generator`; and the tests' helpers importable
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != str(_ROOT)] + [str(_ROOT)]
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))

import torch
from layouts import layout

OPS = ("fa", "sw", "mla", "fp8", "row", "topk", "moe")
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def fit(Sq: int, Sk: int, rest: int) -> tuple[int, int]:
    """Sq and Sk halved, the longer first, until an attention call of rest x Sq x Sk (B x H x D) takes about a
    second at most for the float64 reference."""
    while rest * Sq * Sk > 3e8:
        Sq, Sk = (Sq // 2, Sk) if Sq > Sk else (Sq, Sk // 2)
    return Sq, Sk


def _gen(rng: random.Random) -> torch.Generator:
    return torch.Generator().manual_seed(rng.randint(0, 2**31))


def case_fa(rng):
    import test_fused_attention as t

    dt = rng.choice(FLOATS)
    Hk = rng.choice([1, 1, 2, 3, 4])
    H = Hk * rng.choice([1, 2, 3, 4, 5, 8, 16])
    B = rng.choice([1, 1, 2, 3])
    Sq = rng.choice([1, 2, rng.randint(1, 300), rng.randint(1, 1200)])
    Sk = rng.choice([1, Sq, rng.randint(1, 300), rng.randint(1, 1500)])
    # the models' head dims more often (256: the longest sums), and others
    D = rng.choice([64, 128, 256, 256, 8, 32, 48, 80, 96, 112, 160, 192, rng.randint(1, 320)])
    Sq, Sk = fit(Sq, Sk, B * H * D)
    causal = rng.random() < 0.5
    scale = rng.choice([None, rng.uniform(0.01, 3.0)])
    # scores of tens to hundreds at most: larger ones make lse's absolute 1e-3 bound finer than float32 resolves
    amp = rng.choice([1.0, 1.0, 4.0, 0.1]) if scale is None else rng.choice([1.0, 1.0, 0.5])
    g = _gen(rng)
    q = layout((amp * torch.randn(B, Sq, H, D, generator=g)).to(dt), rng)
    k = layout((amp * torch.randn(B, Sk, Hk, D, generator=g)).to(dt), rng)
    v = layout(torch.randn(B, Sk, Hk, D, generator=g).to(dt), rng)
    desc = f"fused_attention {dt} B{B} H{H} Hk{Hk} Sq{Sq} Sk{Sk} D{D} causal={causal} scale={scale} amp={amp}"
    return desc, lambda: t.judge(q, k, v, causal, scale)


def case_sw(rng):
    import test_sliding_window_attention as t

    dt = rng.choice(FLOATS)
    Hk = rng.choice([1, 2])
    H, B = Hk * rng.choice([1, 2, 4, 7]), rng.choice([1, 2])
    Sq = rng.choice([1, rng.randint(1, 400), rng.randint(1, 1200)])
    Sk = rng.choice([Sq, rng.randint(1, 1300)])
    D = rng.choice([32, 64, 80, 128, 256, rng.randint(1, 200)])
    Sq, Sk = fit(Sq, Sk, B * H * D)
    window = rng.choice([1, 2, rng.randint(1, 300), rng.randint(1, 2000)])
    softcap = rng.choice([50.0, rng.uniform(0.5, 100.0)])
    scale = rng.choice([None, rng.uniform(0.05, 2.0)])
    q, k, v = t.inputs(B, Sq, Sk, H, Hk, D, dt, "cpu", _gen(rng))
    desc = f"sliding_window_attention {dt} B{B} H{H} Hk{Hk} Sq{Sq} Sk{Sk} D{D} window={window} softcap={softcap} " \
           f"scale={scale}"
    return desc, lambda: t.judge(q, k, v, window, softcap, scale)


def case_mla(rng):
    import test_mla_decode as t

    B = rng.randint(1, 5)
    lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(0, 3000)]) for _ in range(B)]
    lens[rng.randrange(B)] = rng.randint(1, 3000)  # at least one sequence with keys
    Sq, Hq, causal = rng.randint(1, 4), rng.choice([1, 2, 3, 8, 16, 20, 32, 64, 128]), rng.random() < 0.5
    q, kv, table, seqlens = t._paged(lens, Sq, Hq, torch.bfloat16, _gen(rng), "cpu")

    def run():
        out, lse = torch.ops.redfuser.mla_decode(q, kv, table, seqlens, 512, None, causal)
        t._judge(q, kv, table, seqlens, causal, out, lse)

    return f"mla_decode bf16 lens={lens} Sq{Sq} Hq{Hq} causal={causal}", run


def case_fp8(rng):
    import test_fp8_quant_gemm as t

    dt = rng.choice(FLOATS)
    M = rng.choice([1, 2, 3, rng.randint(1, 40), rng.randint(1, 300)])
    N = 16 * rng.choice([rng.randint(4, 44), rng.randint(4, 190)])
    K = 16 * rng.choice([1, rng.randint(1, 44), rng.randint(1, 190)])
    while M * N * K > 2e8:
        M = max(1, M // 2)
    per_channel, bias = rng.random() < 0.5, rng.random() < 0.5
    bias_dtype = rng.choice([torch.float32, torch.bfloat16])
    x, w, ws, b = t.inputs(M, N, K, dt, "cpu", _gen(rng), per_channel=per_channel, bias=bias, bias_dtype=bias_dtype)
    x = layout(x, rng)
    desc = f"fp8_quant_gemm {dt} M{M} N{N} K{K} per_channel={per_channel} bias={bias and bias_dtype}"
    return desc, lambda: t.judge(torch.ops.redfuser.fp8_quant_gemm(x, w, ws, b), x, w, ws, b)


def case_row(rng):
    import spec_references as ref
    import test_row_ops as t

    dt = rng.choice(FLOATS)
    T = rng.choice([rng.randint(64, 100), rng.randint(64, 300)])
    V = rng.choice([1, rng.randint(1, 3000), rng.randint(1, 200000)])
    while T * V > 4e6:
        V //= 2
    amp = rng.choice([1.0, 4.0, 20.0])
    g = _gen(rng)
    x = layout((amp * torch.randn(T, V, generator=g)).to(dt), rng)
    target = torch.randint(0, V, (T,), generator=g)
    eps = rng.choice([0.0, 0.1, rng.random()])

    def run():
        t.judge(torch.ops.redfuser.logsumexp(x), ref.logsumexp(x), ref.logsumexp(x, dtype=dt))
        t.judge(torch.ops.redfuser.softmax_cross_entropy(x, target, eps), ref.softmax_cross_entropy(x, target, eps),
                ref.softmax_cross_entropy(x, target, eps, dtype=dt))

    return f"logsumexp, softmax_cross_entropy {dt} T{T} V{V} amp={amp} label_smoothing={eps}", run


def case_topk(rng):
    import test_vocab_topk as t

    dt = rng.choice(FLOATS)
    T = rng.randint(1, 40)
    V = rng.choice([rng.randint(1, 3000), rng.randint(1, 150000)])
    k = rng.choice([1, rng.randint(1, min(V, 64)), rng.randint(1, min(V, 600))])
    while T * V > 3e6:
        T = max(1, T // 2)
    T = max(T, -(-64 // k))  # at least 64 judged probabilities
    g = _gen(rng)
    if rng.random() < 0.3:  # many exact ties
        x = torch.randint(-3, 4, (T, V), generator=g).float().to(dt)
    else:
        x = (rng.choice([1.0, 4.0, 30.0]) * torch.randn(T, V, generator=g)).to(dt)
    x = layout(x, rng)
    return f"vocab_topk {dt} T{T} V{V} k{k}", lambda: t.check(x, k)


def case_moe(rng):
    import test_moe_route as t

    dt = rng.choice(FLOATS)
    E = rng.choice([6, 8, 16, 32, 64, 72, 128, 160, 256, 320, 384, 512, rng.randint(2, 512)])
    T = rng.choice([rng.randint(1, 50), rng.randint(1, 700)])
    scoring, bias, renorm = rng.choice(["softmax", "sigmoid"]), rng.random() < 0.5, rng.random() < 0.5
    ng = rng.choice([g for g in (1, 2, 4, 8, 16) if E % g == 0])
    tg = rng.randint(1, ng)
    topk = rng.randint(1, min(E // ng * tg, 16))
    T = max(T, -(-64 // topk))
    scale = rng.choice([1.0, 2.5])
    lg, b = t.draw(T, E, dt, bias, ng, topk, tg, scoring, _gen(rng))
    desc = f"moe_route {dt} T{T} E{E} topk{topk} {scoring} bias={bias} renormalize={renorm} n_group={ng} " \
           f"topk_group={tg} scale={scale}"
    return desc, lambda: t.check(lg, topk, scoring, renorm, b, ng, tg, scale, "cpu")


CASES = {"fa": case_fa, "sw": case_sw, "mla": case_mla, "fp8": case_fp8, "row": case_row, "topk": case_topk,
         "moe": case_moe}


def run_case(seed: int, ops: tuple[str, ...] = OPS) -> tuple[str, str | None]:
    """(what was drawn, None or why it failed) for the case of `seed`: its op drawn among `ops`, then its call."""
    rng = random.Random(seed)
    desc, call = CASES[rng.choice(ops)](rng)
    try:
        call()
    except Exception as e:  # noqa: BLE001 - an assertion of the judge or an error of the op: both are findings
        return desc, f"{type(e).__name__}: {e}" + ("" if isinstance(e, AssertionError) else "\n" +
                                                  traceback.format_exc(limit=3))
    return desc, None


def case_seeds(seed: int):
    """The seeds of a run's cases, one after another."""
    rng = random.Random(seed)
    while True:
        yield rng.randrange(2**32)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.shapes_fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="run cases for this long (default 10)")
    p.add_argument("--cases", type=int, help="run this many cases instead")
    p.add_argument("--seed", type=int, help="the run's seed (default: time-derived, printed)")
    p.add_argument("--case", type=int, help="replay the one case of this seed")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {','.join(OPS)}")
    a = p.parse_args(argv)
    ops = tuple(a.ops.split(","))
    if not set(ops) <= set(OPS):
        p.error(f"unknown ops: {sorted(set(ops) - set(OPS))}")
    import redfuser_ops  # the installed library

    torch.set_num_threads(a.threads)
    if a.case is not None:
        desc, why = run_case(a.case, ops)
        print(f"case {a.case}: {desc}: {why or 'passed'}")
        return 1 if why else 0
    seed = a.seed if a.seed is not None else int(time.time())
    print(f"seed {seed}, ops {','.join(ops)}, {a.threads} thread(s), {Path(redfuser_ops.__file__).parent}", flush=True)
    end, n, failed = time.time() + 60 * a.minutes, 0, 0
    for s in case_seeds(seed):
        if (a.cases is not None and n >= a.cases) or (a.cases is None and time.time() >= end):
            break
        desc, why = run_case(s, ops)
        n += 1
        if why:
            failed += 1
            print(f"FAIL case {s}: {desc}: {why}", flush=True)
    print(f"{n} cases, {failed} failed (replay one: python -m tests.shapes_fuzz --case SEED --ops {a.ops})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
