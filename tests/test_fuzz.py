"""Fuzzing every op on the CPU: no input crashes the process, hangs, or gives a silently wrong answer.

Hypothesis draws tiny inputs with sizes 0, 1, awkward and mismatched, the ops' dtypes and wrong ones, strided
layouts (transposed, expanded, sliced), scalar values 0, negative and huge, and index values inside and outside
their domains. The calls run in a worker process (tests/_fuzz_worker.py) that is restarted when it dies: a crash
or a hang is a failure naming the example, not a dead test run. Each call must either
- match the reference (redfuser_ops.reference, judged by the ACCEPTANCE.md rules), when the input is valid by the
  op's contract (an oracle written here from ACCEPTANCE.md, not from the generated checks), or
- raise RuntimeError/ValueError whose message names an argument (or an axis) involved in what is wrong, when not.
The number of examples tried per op is printed.
"""

from __future__ import annotations

import math
import multiprocessing
import re
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layouts import LAYOUTS, make

from redfuser_ops import reference as ref

EXAMPLES = 2000  # per op
CALL_TIMEOUT_S = 60.0
FLOATS = [torch.float32, torch.float16, torch.bfloat16]


# --------------------------------------------------------------------------------------------- worker
class Worker:
    """One op-calling process; restarted after it dies or hangs."""

    def __init__(self):
        self.proc = None
        self.conn = None
        self.restarts = 0

    def start(self):
        from _fuzz_worker import serve

        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent
        if not self.conn.poll(120):
            raise RuntimeError("the fuzz worker did not start")
        assert self.conn.recv() == ("ready",)

    def call(self, name, args, kwargs):
        """("ok", outputs) | ("error", type, message) | ("crash", exit code) | ("hang",)."""
        if self.proc is None or not self.proc.is_alive():
            self.start()
        self.conn.send((name, args, kwargs))
        try:
            if not self.conn.poll(CALL_TIMEOUT_S):
                self.kill()
                return ("hang",)
            return self.conn.recv()
        except (EOFError, ConnectionResetError, BrokenPipeError):
            self.proc.join(5)
            code = self.proc.exitcode
            self.kill()
            return ("crash", code)

    def kill(self):
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(5)
        self.proc = None
        self.restarts += 1

    def close(self):
        if self.proc is not None and self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    w.start()
    yield w
    w.close()


def mentions(message, names):
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message) for n in names)


class Tally:
    def __init__(self, op):
        self.op = op
        self.n = self.ok = self.err = 0
        self.t0 = time.perf_counter()

    def report(self, capsys, worker):
        with capsys.disabled():
            print(f"\nfuzz {self.op}: {self.n} examples ({self.ok} results matched the reference, {self.err} "
                  f"errors named the argument) in {time.perf_counter() - self.t0:.1f} s; "
                  f"worker restarts {worker.restarts}")


def run_and_judge(worker, tally, name, args, kwargs, bad, judge):
    """Calls the op; `bad` is None for a valid input, else the names an error may cite."""
    tally.n += 1
    res = worker.call(name, args, kwargs)
    desc = f"{name}({_show(args)}, {kwargs})"
    assert res[0] not in ("crash", "hang"), f"{res}: {desc}"
    if res[0] == "error":
        _, typ, msg = res
        assert bad is not None, f"valid input rejected: {typ}: {msg}\n  {desc}"
        assert typ in ("RuntimeError", "ValueError"), f"{typ}: {msg}\n  {desc}"
        assert mentions(msg, bad), f"the error names none of {sorted(bad)}: {msg}\n  {desc}"
        tally.err += 1
        return
    assert bad is None, f"invalid input ({sorted(bad)}) accepted\n  {desc}"
    judge(res[1])
    tally.ok += 1


def _show(args):
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(f"Tensor{tuple(a.shape)}:{str(a.dtype)[6:]}:stride{a.stride()}")
        else:
            parts.append(repr(a))
    return ", ".join(parts)


SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


def _err_bound(out, r, plain):
    return (out - r).abs().max().item() <= 2 * (plain - r).abs().max().item() + 1e-5


def _check_lse(lse, r_lse):
    finite = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse infinities differ"
    assert torch.equal(lse[~finite], r_lse[~finite])
    if finite.any():
        tol = 1e-3 * max(1.0, r_lse[finite].abs().max().item())
        assert (lse[finite] - r_lse[finite]).abs().max().item() <= tol


# --------------------------------------------------------------------------------------------- fused_attention
SCALES = [None, 0.0, -1.0, 0.37, 1e4]


@st.composite
def attention_case(draw):
    B = draw(st.sampled_from([0, 1, 2, 2]))
    Sq, Sk = draw(st.sampled_from([0, 1, 2, 5, 5])), draw(st.sampled_from([0, 1, 3, 7, 7]))
    Hk = draw(st.sampled_from([0, 1, 1, 2, 2, 3]))
    H = Hk * draw(st.sampled_from([1, 2, 3])) if draw(st.integers(0, 4)) else draw(st.sampled_from([0, 1, 3, 4]))
    D = draw(st.sampled_from([0, 1, 3, 8, 8, 8]))
    dt = draw(st.sampled_from(FLOATS * 3 + [torch.float64, torch.int32]))
    kshape = [B, Sk, Hk, D]
    vshape = list(kshape)
    qshape = [B, Sq, H, D]
    mismatch = draw(st.sampled_from([None] * 12 + ["k", "v", "q_ndim"]))
    if mismatch in ("k", "v"):
        dim = draw(st.sampled_from([0, 1, 2, 3]))
        (kshape if mismatch == "k" else vshape)[dim] += 1
    if mismatch == "q_ndim":
        qshape = qshape[:3]
    kdt = draw(st.sampled_from([dt] * 8 + [torch.float32, torch.float16]))
    causal = draw(st.booleans())
    scale = draw(st.sampled_from(SCALES))
    lays = [(draw(st.sampled_from(LAYOUTS)), draw(st.integers(0, 3))) for _ in range(3)]
    return qshape, kshape, vshape, dt, kdt, causal, scale, lays, draw(st.integers(0, 2**31))


def attention_oracle(q, k, v):
    """None if valid by the contract, else the names an error may cite."""
    bad = set()
    if q.dim() != 4:
        return {"q"}
    if k.dim() != 4 or v.dim() != 4:
        return {"k", "v"}
    if q.dtype not in FLOATS:
        bad |= {"q"}
    if k.dtype != q.dtype:
        bad |= {"k"}
    if v.dtype != q.dtype:
        bad |= {"v"}
    B, _, H, D = q.shape
    if tuple(k.shape) != (B, k.shape[1], k.shape[2], D):
        bad |= {"k"}
    if tuple(v.shape) != tuple(k.shape):
        bad |= {"v"}
    Hk = k.shape[2]
    if D < 1:
        bad |= {"D", "q"}
    if Hk < 1 or H % Hk != 0:
        bad |= {"H", "Hk", "k"}
    return bad or None


@SETTINGS
@given(case=attention_case())
def _fuzz_attention(worker, tally, case):
    qshape, kshape, vshape, dt, kdt, causal, scale, lays, seed = case
    gen = torch.Generator().manual_seed(seed)
    q = make(qshape, dt, *lays[0], gen)
    k = make(kshape, kdt, *lays[1], gen)
    v = make(vshape, kdt, *lays[2], gen)
    bad = attention_oracle(q, k, v)

    def judge(res):
        out, lse = res
        rdt = torch.float64 if q.dtype == torch.float32 else torch.float32
        r_out, r_lse = ref.fused_attention(q, k, v, causal, scale, dtype=rdt)
        p_out, _ = ref.fused_attention(q, k, v, causal, scale, dtype=q.dtype)
        assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        if out.numel():
            assert _err_bound(out.to(rdt), r_out, p_out.to(rdt)), "out differs from the reference"
        _check_lse(lse.to(rdt), r_lse)

    run_and_judge(worker, tally, "fused_attention", (q, k, v, causal, scale), {}, bad, judge)



# --------------------------------------------------------------------------------------------- mla_decode
@st.composite
def mla_case(draw):
    B, Sq, Hq = draw(st.sampled_from([0, 1, 2])), draw(st.sampled_from([0, 1, 3])), draw(st.sampled_from([0, 1, 2]))
    NB, MB = draw(st.sampled_from([0, 1, 3])), draw(st.sampled_from([0, 1, 2]))
    dt = draw(st.sampled_from(FLOATS * 3 + [torch.float64]))
    qshape, kvshape, btshape, slshape = [B, Sq, Hq, 576], [NB, 64, 1, 576], [B, MB], [B]
    mismatch = draw(st.sampled_from([None] * 24 + ["q", "kv_cache", "block_table", "cache_seqlens"]))
    if mismatch == "q":
        qshape[3] = 575
    elif mismatch == "kv_cache":
        kvshape[draw(st.sampled_from([1, 2, 3]))] += 1
    elif mismatch == "block_table":
        btshape[0] += 1
    elif mismatch == "cache_seqlens":
        slshape = draw(st.sampled_from([[B + 1], [B, 1]]))
    # lengths: in the domain mostly, sometimes above 64 * MB or negative
    lens = [draw(st.sampled_from([0, 1, 63, 64, 65, 128, 64 * MB, 64 * MB + 1, -1, 2**31 - 1])) for _ in range(B)]
    lens = [max(0, min(x, 64 * MB)) if draw(st.integers(0, 7)) else x for x in lens]
    # table entries: in [0, NB) mostly, sometimes out of it (in a used or an unused slot)
    table = [[draw(st.sampled_from([0, 1, 2, NB - 1, NB, -1, 10**6, -(2**31)])) for _ in range(MB)] for _ in range(B)]
    table = [[x if (0 <= x < NB or not draw(st.integers(0, 7))) else max(0, min(x, NB - 1)) for x in row]
             for row in table]
    tdt = draw(st.sampled_from([torch.int32] * 12 + [torch.int64, torch.float32]))
    head_dim_v = draw(st.sampled_from([512, 512, 512, 1, 64, 64, 576, 576, 0, 577, -3]))
    scale = draw(st.sampled_from(SCALES))
    causal = draw(st.booleans())
    lays = [(draw(st.sampled_from(LAYOUTS)), draw(st.integers(0, 3))) for _ in range(4)]
    return qshape, kvshape, btshape, slshape, lens, table, dt, tdt, head_dim_v, scale, causal, lays, draw(
        st.integers(0, 2**31))


def _fill_int(shape, entries):
    flat = [x for row in entries for x in row] if entries and isinstance(entries[0], list) else list(entries)
    n = math.prod(shape)
    flat = (flat + [0] * n)[:n]
    return torch.tensor(flat, dtype=torch.int64).reshape(shape)


def mla_oracle(q, kv, bt, sl, head_dim_v, causal):
    if q.dim() != 4 or kv.dim() != 4 or bt.dim() != 2 or sl.dim() != 1:
        return {"q", "kv_cache", "block_table", "cache_seqlens"}
    bad = set()
    if q.dtype not in FLOATS:
        bad |= {"q"}
    if kv.dtype != q.dtype:
        bad |= {"kv_cache"}
    if bt.dtype != torch.int32:
        bad |= {"block_table"}
    if sl.dtype != torch.int32:
        bad |= {"cache_seqlens"}
    B, Sq, _, C = q.shape
    if C != 576:
        bad |= {"q"}
    if tuple(kv.shape[1:]) != (64, 1, 576):
        bad |= {"kv_cache"}
    if bt.shape[0] != B:
        bad |= {"block_table"}
    if sl.shape[0] != B:
        bad |= {"cache_seqlens"}
    if not 1 <= head_dim_v <= 576:
        bad |= {"head_dim_v"}
    if bad:
        return bad
    NB, MB = kv.shape[0], bt.shape[1]
    for b in range(B):
        n = int(sl[b])
        if not 0 <= n <= 64 * MB:
            return {"cache_seqlens"}
    for b in range(B):
        used = (int(sl[b]) + 63) // 64
        if causal and Sq == 0:
            used = 0  # no query, no key is used
        for m in range(used):
            if not 0 <= int(bt[b, m]) < NB:
                return {"block_table"}
    return None


@SETTINGS
@given(case=mla_case())
def _fuzz_mla(worker, tally, case):
    qshape, kvshape, btshape, slshape, lens, table, dt, tdt, head_dim_v, scale, causal, lays, seed = case
    gen = torch.Generator().manual_seed(seed)
    q = make(qshape, dt, *lays[0], gen)
    kv = make(kvshape, dt, *lays[1], gen)
    bt = make(btshape, tdt, *lays[2], gen, values=_fill_int(btshape, table))
    sl = make(slshape, tdt if tdt != torch.int64 else torch.int32, *lays[3], gen, values=_fill_int(slshape, lens))
    bad = mla_oracle(q, kv, bt, sl, head_dim_v, causal)

    def judge(res):
        out, lse = res
        assert out.shape == (*q.shape[:3], head_dim_v) and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        if not out.numel() and not lse.numel():
            return  # no query row: nothing to compare (the reference would still read the table)
        rdt = torch.float64 if q.dtype == torch.float32 else torch.float32
        r_out, r_lse = ref.mla_decode(q, kv, bt, sl, head_dim_v, scale, causal, dtype=rdt)
        p_out, _ = ref.mla_decode(q, kv, bt, sl, head_dim_v, scale, causal, dtype=q.dtype)
        assert out.shape == (*q.shape[:3], head_dim_v) and out.dtype == q.dtype
        if out.numel():
            assert _err_bound(out.to(rdt), r_out, p_out.to(rdt)), "out differs from the reference"
        _check_lse(lse.to(rdt), r_lse)

    run_and_judge(worker, tally, "mla_decode", (q, kv, bt, sl, head_dim_v, scale, causal), {}, bad, judge)



# --------------------------------------------------------------------------------------------- moe_route
@st.composite
def moe_case(draw):
    """A valid call, then (one time in three) one thing made wrong or extreme."""
    T, E = draw(st.sampled_from([0, 1, 3, 3])), draw(st.sampled_from([1, 2, 5, 8, 12, 12, 0]))
    dt = draw(st.sampled_from(FLOATS))
    shape = [T, E]
    n_group = draw(st.sampled_from([g for g in (1, 2, 3, 4) if E % g == 0] or [1]))
    topk_group = draw(st.sampled_from(sorted({1, n_group})))
    topk = draw(st.sampled_from(sorted({1, 2, 3} & set(range(1, topk_group * (E // n_group) + 1))) or [1]))
    scoring = draw(st.sampled_from(["softmax", "sigmoid"]))
    bias = draw(st.sampled_from([None, "ok"]))
    rsf = draw(st.sampled_from([1.0, 1.0, 0.0, -2.5, 1e6]))
    wrong = draw(st.sampled_from([None, None] + ["shape", "dtype", "topk", "n_group", "topk_group", "scoring",
                                                 "bias"]))
    if wrong == "shape":
        shape = draw(st.sampled_from([[T], [T, E, 1]]))
    elif wrong == "dtype":
        dt = draw(st.sampled_from([torch.float64, torch.int32]))
    elif wrong == "topk":
        topk = draw(st.sampled_from([0, -1, 2**40, E + 1]))
    elif wrong == "n_group":
        n_group = draw(st.sampled_from([0, -2, 2**40, 3, 5]))
    elif wrong == "topk_group":
        topk_group = draw(st.sampled_from([0, -1, 2**40, n_group + 1]))
    elif wrong == "scoring":
        scoring = "relu"
    elif wrong == "bias":
        bias = draw(st.sampled_from(["size", "dtype"]))
    renorm = draw(st.booleans())
    lay = (draw(st.sampled_from(LAYOUTS)), draw(st.integers(0, 1)))
    ties = draw(st.booleans())
    return shape, dt, topk, scoring, renorm, bias, n_group, topk_group, rsf, lay, ties, draw(st.integers(0, 2**31))


def moe_oracle(logits, topk, scoring, bias, n_group, topk_group):
    if logits.dim() != 2:
        return {"logits"}
    bad = set()
    if logits.dtype not in FLOATS:
        bad |= {"logits"}
    E = logits.shape[1]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != E or bias.dtype != torch.float32):
        bad |= {"bias"}
    if scoring not in ("softmax", "sigmoid"):
        bad |= {"scoring"}
    if topk < 1:
        bad |= {"topk"}
    if n_group < 1 or E % n_group:
        bad |= {"n_group", "E"}
    if topk_group < 1 or topk_group > n_group:
        bad |= {"topk_group", "n_group"}
    if not bad and topk > topk_group * (E // n_group):
        bad |= {"topk", "topk_group", "n_group", "E"}
    return bad or None


def _near_tie(v: torch.Tensor, exact: bool) -> bool:
    """Two entries of a row within float32 resolution of each other (exact: equal ones count too)."""
    d = (v.unsqueeze(-1) - v.unsqueeze(-2)).abs()
    scale = torch.maximum(v.abs().unsqueeze(-1), v.abs().unsqueeze(-2)).clamp(min=1.0)
    near = d <= 1e-6 * scale
    near &= ~torch.eye(v.shape[-1], dtype=torch.bool)
    if not exact:
        near &= d > 0
    return bool(near.any())


@SETTINGS
@given(case=moe_case())
def _fuzz_moe(worker, tally, case):
    shape, dt, topk, scoring, renorm, bias_kind, n_group, topk_group, rsf, lay, ties, seed = case
    gen = torch.Generator().manual_seed(seed)
    vals = torch.randn(shape, generator=gen)
    if ties:
        vals = (vals * 2).round() / 2  # exact ties in every dtype
    logits = make(shape, dt, *lay, gen, values=vals)
    E = shape[1] if len(shape) > 1 else 0
    bias = None
    if bias_kind is not None:
        bias = (torch.randn(E + (bias_kind == "size"), generator=gen) * 2).round() / 4
        bias = bias.to(torch.float16 if bias_kind == "dtype" else torch.float32)
    bad = moe_oracle(logits, topk, scoring, bias, n_group, topk_group)

    def judge(res):
        w, ids = res
        r_w, r_ids = ref.moe_route(logits.float(), topk, scoring, renorm, bias, n_group, topk_group, rsf)
        assert w.shape == r_w.shape and w.dtype == torch.float32 and ids.dtype == torch.int32
        if not torch.equal(ids.long(), r_ids):
            # keys or group scores that tie in real arithmetic but not after float32 rounding (all logits equal,
            # biases in quarters: (1/12 + 0.25) + (1/12 + 0.25) > (1/12 + 0.5) + 1/12 in float32): the kernel must
            # then select as the same math in float32 does, and the float64 values must be a near-tie
            args = (logits.float(), topk, scoring, renorm, bias, n_group, topk_group, rsf)
            r_w, r32_ids, _, _ = ref.moe_route(*args, dtype=torch.float32, return_keys=True)
            _, _, key64, gs64 = ref.moe_route(*args, return_keys=True)
            assert _near_tie(key64, exact=False) or _near_tie(gs64, exact=True), (
                f"ids {ids.tolist()} != {r_ids.tolist()}")
            assert torch.equal(ids.long(), r32_ids), f"ids {ids.tolist()} != {r32_ids.tolist()} (float32 math)"
        tol = (1e-5 if logits.dtype == torch.float32 else 2e-2) * max(1.0, abs(rsf))
        if w.numel():
            assert (w.double() - r_w).abs().max().item() <= tol

    run_and_judge(worker, tally, "moe_route", (logits, topk, scoring, renorm, bias, n_group, topk_group, rsf), {},
                  bad, judge)



# --------------------------------------------------------------------------------------------- fp8_quant_gemm
@st.composite
def gemm_case(draw):
    """A valid call, then (one time in three) one thing made wrong."""
    M, N, K = draw(st.sampled_from([0, 1, 3, 3])), draw(st.sampled_from([0, 16, 32])), draw(st.sampled_from([0, 16, 32]))
    xdt, wdt = draw(st.sampled_from(FLOATS)), torch.float8_e4m3fn
    wshape, ns = [N, K], draw(st.sampled_from([N, 1]))
    bias = draw(st.sampled_from([None, "ok"]))
    bdt = draw(st.sampled_from(FLOATS))
    out_dtype = draw(st.sampled_from([None, None, *FLOATS]))
    wrong = draw(st.sampled_from([None] * 4 + ["K", "N", "x", "w", "wshape", "w_scale", "bias", "out_dtype"]))
    if wrong == "K":
        K = draw(st.sampled_from([15, 8, 1]))
        wshape = [N, K]
    elif wrong == "N":
        N = draw(st.sampled_from([8, 1]))
        wshape, ns = [N, K], N
    elif wrong == "x":
        xdt = torch.float64
    elif wrong == "w":
        wdt = draw(st.sampled_from([torch.float16, torch.float8_e5m2]))
    elif wrong == "wshape":
        wshape = [N, K + 16]
    elif wrong == "w_scale":
        ns = N + 2
    elif wrong == "bias":
        bias, bdt = draw(st.sampled_from([("size", torch.float32), ("ok", torch.int32)]))
    elif wrong == "out_dtype":
        out_dtype = draw(st.sampled_from([torch.int32, torch.float64]))
    zero_row = draw(st.booleans())
    lays = [(draw(st.sampled_from(LAYOUTS)), draw(st.integers(0, 1))) for _ in range(2)]
    return M, N, K, xdt, wdt, wshape, ns, bias, bdt, out_dtype, zero_row, lays, draw(st.integers(0, 2**31))


def gemm_oracle(x, w, ws, bias, out_dtype):
    if x.dim() != 2 or w.dim() != 2 or ws.dim() != 1 or (bias is not None and bias.dim() != 1):
        return {"x", "w", "w_scale", "bias"}
    bad = set()
    if x.dtype not in FLOATS:
        bad |= {"x"}
    if w.dtype != torch.float8_e4m3fn:
        bad |= {"w"}
    K = x.shape[1]
    N = w.shape[0]
    if w.shape[1] != K:
        bad |= {"w"}
    if K % 16:
        bad |= {"K"}
    if N % 16:
        bad |= {"N"}
    if ws.shape[0] not in (N, 1):
        bad |= {"w_scale"}
    if bias is not None and (bias.shape[0] != N or bias.dtype not in FLOATS):
        bad |= {"bias"}
    if out_dtype is not None and out_dtype not in FLOATS:
        bad |= {"out_dtype"}
    return bad or None


@SETTINGS
@given(case=gemm_case())
def _fuzz_gemm(worker, tally, case):
    M, N, K, xdt, wdt, wshape, ns, bias_kind, bdt, out_dtype, zero_row, lays, seed = case
    gen = torch.Generator().manual_seed(seed)
    x = make([M, K], xdt, *lays[0], gen)
    if zero_row and M:
        x = x.clone()
        x[0] = 0
    w = make(wshape, wdt, *lays[1], gen)
    ws = torch.rand(ns, generator=gen) + 0.01
    bias = None
    if bias_kind is not None:
        bias = torch.randn(N + (bias_kind == "size"), generator=gen).to(bdt)
    bad = gemm_oracle(x, w, ws, bias, out_dtype)

    def judge(out):
        r = ref.fp8_quant_gemm(x, w, ws, bias)
        two = ref.fp8_quant_gemm_two_pass(x, w, ws, bias).double() if K else r  # K = 0: nothing to quantise
        assert out.shape == (M, w.shape[0]) and out.dtype == (out_dtype or x.dtype)
        if out.numel():
            tol = 2 * (two - r).abs().max().item() + 1e-2 * r.abs().max().item()
            assert (out.double() - r).abs().max().item() <= tol
            assert torch.isfinite(out).all()
            if zero_row and bias is None:
                assert (out[0] == 0).all()

    run_and_judge(worker, tally, "fp8_quant_gemm", (x, w, ws, bias, out_dtype), {}, bad, judge)


FUZZ = {"fused_attention": _fuzz_attention, "mla_decode": _fuzz_mla, "moe_route": _fuzz_moe,
        "fp8_quant_gemm": _fuzz_gemm}


@pytest.mark.parametrize("op", list(FUZZ))
def test_fuzz(op, worker, capsys):
    tally = Tally(op)
    FUZZ[op](worker, tally)
    tally.report(capsys, worker)
    # both sides of the contract were exercised: results judged and errors judged
    assert tally.n >= EXAMPLES and tally.ok > EXAMPLES // 10 and tally.err > EXAMPLES // 10
