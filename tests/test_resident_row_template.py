"""The resident-row template (generator/codegen/templates/resident_row.py), carried by moe_route.

The moe_route step program below is written by hand as a fixture; in production the symbolic
engine produces it from specs/moe_route.yaml.

Where TileLang and a C++ compiler are present, the template's ``cpu_sim`` emission of the same
program (the 32 lanes of a warp made explicit, shuffles as reads of another lane's registers) is
lowered for TileLang's ``"c"`` target, compiled and run against a float64 reference of the
moe_route contract, including ties, NaN/inf rows, grouped selection and odd expert counts.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import numpy as np
import pytest
from tl_c_sim import compile_c_program

from generator.codegen.templates import resident_row as rr
from generator.codegen.templates.resident_row import (
    Epilogue,
    GroupReduce,
    GroupSelect,
    If,
    Input,
    Load,
    Map,
    Output,
    Param,
    Reduce,
    RowVariant,
    StepProgram,
    Store,
    TopK,
)

SOFTMAX, SIGMOID = 0, 1


def moe_route_program() -> StepProgram:
    """moe_route as a step program (what the engine derives from specs/moe_route.yaml)."""
    group_size = "E // n_group"
    steps = (
        Load("x", "logits", fill="-T.infinity('float32')"),
        If(
            "scoring == 0",
            (  # softmax over all E, in fp32
                Reduce("m", "max", "x"),
                Map("ex", "T.exp(x - m)"),
                Reduce("z", "sum", "ex"),
                Map("score", "ex / z"),
            ),
            (Map("score", "1.0 / (1.0 + T.exp(-x))"),),  # sigmoid
        ),
        If(  # the bias shifts the selection key only
            "has_bias != 0",
            (Load("b", "bias", fill="0.0"), Map("key", "score + b")),
            (Map("key", "score"),),
        ),
        If(  # DeepSeek-V3 grouped selection
            "n_group > 1",
            (
                If(
                    "has_bias != 0",
                    (GroupReduce("gscore", "topk_sum", "key", group_size, "n_group", k=2),),
                    (GroupReduce("gscore", "max", "key", group_size, "n_group"),),
                ),
                GroupSelect("keep", "gscore", group_size, "n_group", "topk_group"),
            ),
            (Map("keep", "True", dtype="bool"),),
        ),
        TopK("sel", key="key", k="topk", where="keep", gather=(("w", "score"),)),
        If(
            "renormalize != 0",
            (
                Reduce("wsum", "sum", "w", over="k"),
                Epilogue("wout", "w / T.if_then_else(wsum == 0.0, 1.0, wsum) * routed_scaling_factor"),
            ),
            (Epilogue("wout", "w * routed_scaling_factor"),),
        ),
        Store("weights", "wout"),
        Store("ids", "sel"),
    )
    return StepProgram(
        name="moe_route",
        inputs=(Input("logits"), Input("bias", dtype="float32", per_row=False)),
        outputs=(Output("weights", "float32"), Output("ids", "int32")),
        params=(
            Param("scoring", "int32"),
            Param("renormalize", "int32"),
            Param("has_bias", "int32"),
            Param("n_group", "int32"),
            Param("topk_group", "int32"),
            Param("routed_scaling_factor", "float32"),
        ),
        steps=steps,
        rows="num_tokens",
        length="E",
        k="topk",
    )


# --------------------------------------------------------------------------------------------
# float64 reference of the moe_route contract (NaN orders as -inf, as the template defines)
# --------------------------------------------------------------------------------------------


def _order_key(v: np.ndarray) -> np.ndarray:
    return np.where(np.isnan(v), -np.inf, v)


def _pick(keys: np.ndarray, allowed: np.ndarray, k: int) -> list[int]:
    """k best of ``keys`` (NaN as -inf, ties -> lower index); allowed ones first, then the rest in index order."""
    idx = np.arange(len(keys))
    kk = _order_key(keys)
    # lexsort: last key is primary
    order = np.lexsort((idx, -kk, ~allowed))
    return [int(i) for i in order[:k]]


def reference_moe_route(logits, topk, scoring, renormalize, bias, n_group, topk_group, scale):
    x = np.asarray(logits, dtype=np.float64)
    T_, E = x.shape
    weights = np.zeros((T_, topk))
    ids = np.zeros((T_, topk), dtype=np.int64)
    with np.errstate(all="ignore"):
        for t in range(T_):
            r = x[t]
            if scoring == SOFTMAX:
                m = np.nanmax(r) if not np.all(np.isnan(r)) else np.nan  # maxNum semantics
                ex = np.exp(r - m)
                score = ex / ex.sum()
            else:
                score = 1.0 / (1.0 + np.exp(-r))
            key = score + bias if bias is not None else score
            allowed = np.ones(E, dtype=bool)
            if n_group > 1:
                gs = E // n_group
                gscore = np.empty(n_group)
                for g in range(n_group):
                    vals = key[g * gs:(g + 1) * gs]
                    vals = vals[~np.isnan(vals)]
                    if bias is not None:
                        top = np.sort(vals)[::-1][:2]
                        gscore[g] = top.sum() if len(top) == 2 else -np.inf
                    else:
                        gscore[g] = vals.max() if len(vals) else -np.inf
                kept = _pick(gscore, np.ones(n_group, dtype=bool), topk_group)
                allowed = np.zeros(E, dtype=bool)
                for g in kept:
                    allowed[g * gs:(g + 1) * gs] = True
            sel = _pick(key, allowed, topk)
            w = score[sel]
            if renormalize:
                s = w.sum()
                w = w / (s if s != 0 else 1.0)
            weights[t] = w * scale
            ids[t] = sel
    return weights, ids


# --------------------------------------------------------------------------------------------
# Static checks of the template (no TileLang needed)
# --------------------------------------------------------------------------------------------


def test_program_checks_and_symbols():
    syms = rr.check_program(moe_route_program())
    assert syms["score"] == ("elem", "float32")
    assert syms["keep"] == ("elem", "bool")
    assert syms["sel"] == ("k", "int32")
    assert syms["wout"] == ("k", "float32")
    assert "m" not in syms  # defined in one branch only


def test_program_errors_name_the_step():
    p = moe_route_program()
    bad = StepProgram(p.name, p.inputs, p.outputs, p.params, (Map("y", "x + 1"),) + p.steps)
    with pytest.raises(ValueError, match=r"step 0 \(Map\).*unknown name 'x'"):
        rr.check_program(bad)
    bad = StepProgram(p.name, p.inputs, p.outputs, p.params, p.steps[:1] + (Reduce("s", "sum", "w", over="k"),))
    with pytest.raises(ValueError, match="unknown name 'w'"):
        rr.check_program(bad)
    bad = StepProgram(p.name, p.inputs, p.outputs, p.params, p.steps[:-1])
    with pytest.raises(ValueError, match="never stored"):
        rr.check_program(bad)
    bad = StepProgram(p.name, p.inputs, p.outputs, p.params, (Load("x", "logits"), Map("y", "T.foo(x)")))
    with pytest.raises(ValueError, match="T.foo is not an allowed intrinsic"):
        rr.check_program(bad)


def test_preconditions_follow_branches():
    conds = dict(rr.preconditions(moe_route_program(), RowVariant("float32", 256)))
    assert "1 <= E <= 256" in conds
    assert "1 <= topk <= E" in conds
    assert "topk <= 32" in conds
    assert "not (n_group > 1) or (1 <= topk_group <= n_group)" in conds


@pytest.mark.parametrize("backend", ["cuda", "cpu_sim"])
def test_emission_is_deterministic_python(backend):
    v = RowVariant("bfloat16", 256, "sm90a")
    a = rr.emit_resident_row_program(moe_route_program(), v, backend=backend)
    b = rr.emit_resident_row_program(moe_route_program(), v, backend=backend)
    assert a == b
    compile(a, "<generated>", "exec")
    assert "moe_route__bf16_e256__sm90a" in a
    assert "DYNAMIC_DIMS = ('num_tokens', 'E', 'topk')" in a
    if backend == "cuda":
        assert "T.shfl_xor" in a and "T.vectorized(8)" in a
    else:
        assert "T.shfl" not in a and "for lane in T.serial(32)" in a


def _normalised(text: str, sim: bool) -> list[str]:
    out = []
    for line in text.splitlines():
        st = line.strip()
        if not st or st.startswith("#") or "alloc_" in st or st.split(" ")[0].isupper():
            continue
        if sim:
            if st == "for lane in T.serial(32):":
                continue
            st = st.replace("[lane, ", "[").replace("[lane]", "")
        for loop in ("T.serial(", "T.unroll(", "T.vectorized("):
            st = st.replace(loop, "T.LOOP(")
        out.append(st)
    return out


@pytest.mark.parametrize("warp_argmax", ["shfl64", "redux"])
def test_cuda_and_sim_emissions_differ_only_in_warp_primitives(warp_argmax):
    """What the CPU simulation checks is the CUDA program: only headers and warp primitives differ."""
    import difflib

    v = RowVariant("float16", 128, warp_argmax=warp_argmax)
    a = _normalised(rr.emit_resident_row_program(moe_route_program(), v, "K", backend="cuda"), sim=False)
    b = _normalised(rr.emit_resident_row_program(moe_route_program(), v, "K", backend="cpu_sim"), sim=True)
    header_cuda = {"with T.Kernel(T.ceildiv(num_tokens, 4), threads=128) as bx:", "i_tx = T.get_thread_binding(0)",
                   "lane = i_tx % 32", "i_row = bx * 4 + i_tx // 32", "if i_row < num_tokens:"}
    header_sim = {"with T.Kernel(num_tokens, threads=1) as bx:", "i_row = bx"}
    n_prims = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        cuda, sim = a[i1:i2], b[j1:j2]
        if set(cuda) <= header_cuda and set(sim) <= header_sim:
            continue
        assert all("T.shfl_" in x or "__reduce_" in x for x in cuda), (cuda, sim)
        assert all("[lane ^ (16 >> i_bf)]" in x or "i_o_" in x or "i_l" in x for x in sim), (cuda, sim)
        n_prims += len(cuda)
    assert n_prims >= 8


def test_layout_is_a_bijection():
    for dt in rr.DTYPES:
        for cap in (64, 96, 128, 160, 256, 512, 1024):
            v = RowVariant(dt, cap)
            S, V = v.slots, v.vec
            seen = set()
            for lane in range(32):
                for s in range(S):
                    e = (s // V) * 32 * V + lane * V + s % V
                    assert (e % (32 * V)) // V == lane  # the owner formula of the top-k rounds
                    seen.add(e)
                es = [(s // V) * 32 * V + lane * V + s % V for s in range(S)]
                assert es == sorted(es)  # slots ascend in e: strict '>' keeps the lowest index
            assert seen == set(range(cap))


# --------------------------------------------------------------------------------------------
# CPU simulation of the emitted program (TileLang "c" target + a C++ compiler)
# --------------------------------------------------------------------------------------------


def signed_topk_program() -> StepProgram:
    """A second, op-free program: top-k of raw signed values, minus the row minimum."""
    return StepProgram(
        name="signed_topk",
        inputs=(Input("x"),),
        outputs=(Output("vals", "float32"), Output("ids", "int32")),
        params=(),
        steps=(
            Load("v", "x", fill="0.0"),
            Reduce("mn", "min", "v"),
            TopK("sel", key="v", k="topk", gather=(("top", "v"),)),
            Epilogue("out", "top - mn"),
            Store("vals", "out"),
            Store("ids", "sel"),
        ),
    )


def engine_moe_route_program() -> StepProgram:
    """The moe_route step program as the engine derives it from specs/moe_route.yaml (generator/codegen/templates/resident_row_bridge.py)."""
    from pathlib import Path

    from generator.codegen.templates.resident_row_bridge import row_program
    from generator.spec import load_spec
    from generator.symbolic import derive

    spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / "moe_route.yaml")
    return row_program(spec, derive(spec))


PROGRAMS = {"moe_route": moe_route_program, "moe_route_engine": engine_moe_route_program,
            "signed_topk": signed_topk_program}


@functools.cache
def build_sim(dtype: str, e_cap: int, k_max: int = 32, g_max: int = 32, program: str = "moe_route",
              warp_argmax: str = "shfl64"):
    """Emit, lower (TileLang "c"), compile and load the CPU simulation of one variant."""
    v = RowVariant(dtype, e_cap, k_max=k_max, g_max=g_max, warp_argmax=warp_argmax)
    symbol = "sim_" + v.variant_name(program)
    text = rr.emit_resident_row_program(PROGRAMS[program](), v, symbol=symbol, backend="cpu_sim")
    lib, mod = compile_c_program(text, symbol)
    return lib, mod, text


def run_sim(logits, topk, scoring=SOFTMAX, renormalize=False, bias=None, n_group=1, topk_group=1,
            scale=1.0, e_cap=None, dtype="float32", k_max=32, g_max=32, misalign=False, warp_argmax="shfl64",
            program="moe_route"):
    T_, E = logits.shape
    e_cap = e_cap or max(64, 1 << (E - 1).bit_length())
    lib, _mod, _ = build_sim(dtype, e_cap, k_max, g_max, program=program, warp_argmax=warp_argmax)
    if dtype == "float32":
        x = np.ascontiguousarray(logits, dtype=np.float32)
    elif dtype == "float16":
        x = np.ascontiguousarray(logits, dtype=np.float16)
    else:  # bfloat16 as raw bits (round to nearest even)
        f = np.ascontiguousarray(logits, dtype=np.float32).view(np.uint32)
        rnd = ((f >> 16) & 1) + 0x7FFF
        bits = np.where(np.isnan(logits.astype(np.float32)), (f >> 16) | 0x40, (f + rnd) >> 16)
        x = np.ascontiguousarray(bits.astype(np.uint16))
    if misalign:  # same values, base pointer one element past a 16-byte boundary
        store = np.empty(x.size + 8, dtype=x.dtype)
        off = (-(store.ctypes.data // x.itemsize) % 8) + 1
        store[off:off + x.size] = x.ravel()
        x = store[off:off + x.size].reshape(x.shape)
        assert x.ctypes.data % 16 != 0
    b = np.ascontiguousarray(bias if bias is not None else np.zeros(E), dtype=np.float32)
    w = np.full((T_, topk), -777.0, dtype=np.float32)  # poisoned
    ids = np.full((T_, topk), -777, dtype=np.int32)
    P = ctypes.c_void_p
    rc = lib.call(
        P(x.ctypes.data), P(b.ctypes.data), P(w.ctypes.data), P(ids.ctypes.data),
        ctypes.c_int32(scoring), ctypes.c_int32(int(renormalize)), ctypes.c_int32(int(bias is not None)),
        ctypes.c_int32(n_group), ctypes.c_int32(topk_group), ctypes.c_float(scale),
        ctypes.c_int32(T_), ctypes.c_int32(E), ctypes.c_int32(topk),
    )
    assert rc == 0
    return w, ids, x


def _as_input(x_dev, dtype):
    """The values the kernel actually saw (after fp16/bf16 rounding), as float64."""
    if dtype == "bfloat16":
        return (x_dev.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x_dev.astype(np.float64)


def _separated(logits, E):
    """Logits with well separated scores (no near-ties that fp32 could flip), shuffled per row."""
    rng = np.random.default_rng(E)
    base = np.linspace(-2.0, 2.0, E)
    return np.stack([rng.permutation(base) for _ in range(logits)])


CASES = [
    # (T, E, topk, scoring, renormalize, bias, n_group, topk_group, scale, dtype) -- path exercised
    (5, 8, 2, SOFTMAX, True, False, 1, 1, 1.0, "float32"),      # tiny E, renormalised top-2 (Mixtral)
    (7, 17, 3, SOFTMAX, False, False, 1, 1, 2.5, "float32"),    # odd E, scalar (unaligned) load path
    (3, 64, 8, SIGMOID, True, True, 8, 4, 2.5, "float32"),      # DeepSeek-style on a small E
    (4, 160, 6, SOFTMAX, False, False, 8, 3, 1.0, "float32"),   # DeepSeek-V2 shape: 20-expert groups, no bias
    (3, 256, 8, SIGMOID, True, True, 8, 4, 2.5, "float32"),     # DeepSeek-V3: 256 experts, bias, top-2 sums
    (2, 113, 4, SIGMOID, False, True, 1, 1, 1.0, "float32"),    # odd E, bias without groups
    (2, 512, 32, SOFTMAX, True, False, 1, 1, 1.0, "float32"),   # largest E_cap, k = 32 (every lane keeps one)
    (3, 257, 9, SOFTMAX, True, True, 1, 1, 1.0, "float32"),     # E just over a bucket (E_cap 512)
    (3, 128, 8, SOFTMAX, True, False, 1, 1, 1.0, "float16"),    # fp16 input, vectorized half8 loads
    (3, 72, 8, SIGMOID, True, True, 8, 4, 2.5, "bfloat16"),     # bf16 input, E % 8 == 0, 9-expert groups
    (2, 100, 5, SIGMOID, True, True, 4, 2, 1.0, "bfloat16"),    # bf16, E % 8 != 0: scalar load path
]


@pytest.mark.parametrize("program", ["moe_route", "moe_route_engine"])
@pytest.mark.parametrize("warp_argmax", ["shfl64", "redux"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}_E{c[1]}_k{c[2]}_{c[9]}_g{c[6]}")
def test_cpu_sim_matches_reference(case, warp_argmax, program):
    T_, E, topk, scoring, renorm, has_bias, n_group, topk_group, scale, dtype = case
    rng = np.random.default_rng(1000 + E + topk)
    logits = _separated(T_, E)
    bias = None
    if has_bias:
        # a coarse grid, so that key = score + bias has no near-ties either
        bias = (rng.integers(0, 4, size=E) * 0.25).astype(np.float32)
    w, ids, x_dev = run_sim(logits, topk, scoring, renorm, bias, n_group, topk_group, scale, dtype=dtype,
                            warp_argmax=warp_argmax, program=program)
    rw, rids = reference_moe_route(_as_input(x_dev, dtype), topk, scoring, renorm, bias, n_group, topk_group, scale)
    np.testing.assert_array_equal(ids, rids)
    np.testing.assert_allclose(w, rw, rtol=0, atol=1e-5 * max(1.0, scale))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cpu_sim_misaligned_rows_take_the_scalar_path(dtype):
    logits = _separated(3, 64)
    w, ids, x_dev = run_sim(logits, 5, SOFTMAX, True, dtype=dtype, misalign=True)
    rw, rids = reference_moe_route(_as_input(x_dev, dtype), 5, SOFTMAX, True, None, 1, 1, 1.0)
    np.testing.assert_array_equal(ids, rids)
    np.testing.assert_allclose(w, rw, atol=1e-5)


def test_cpu_sim_wide_variant_two_registers_per_lane():
    """e_cap 96 (3 slots, VEC 1), k_max 64 and g_max 64: results j and groups g live in register j // 32."""
    E, topk, n_group, topk_group = 96, 40, 48, 30
    rng = np.random.default_rng(11)
    logits = _separated(3, E)
    bias = (rng.integers(0, 4, size=E) * 0.25).astype(np.float32)
    for b in (None, bias):
        w, ids, _ = run_sim(logits, topk, SIGMOID, True, b, n_group, topk_group, 1.5, e_cap=96, k_max=64, g_max=64)
        rw, rids = reference_moe_route(logits, topk, SIGMOID, True, b, n_group, topk_group, 1.5)
        np.testing.assert_array_equal(ids, rids)
        np.testing.assert_allclose(w, rw, atol=1e-5)


@pytest.mark.parametrize("grouped", [False, True])
def test_cpu_sim_negative_keys(grouped):
    """A strongly negative bias: every selection key (and group score) is negative."""
    E, topk = 64, 6
    n_group, topk_group = (8, 3) if grouped else (1, 1)
    logits = _separated(4, E)
    bias = (-3.0 - np.random.default_rng(5).integers(0, 4, size=E) * 0.25).astype(np.float32)
    for scoring in (SOFTMAX, SIGMOID):
        w, ids, _ = run_sim(logits, topk, scoring, True, bias, n_group, topk_group)
        rw, rids = reference_moe_route(logits, topk, scoring, True, bias, n_group, topk_group, 1.0)
        np.testing.assert_array_equal(ids, rids)
        np.testing.assert_allclose(w, rw, atol=1e-5)


def test_cpu_sim_generic_program_signed_values():
    """Template rules beyond moe_route: negative keys, -0.0 == +0.0, NaN as -inf, min ignoring NaN."""
    lib, _mod, _ = build_sim("float32", 64, program="signed_topk")
    rng = np.random.default_rng(9)
    E, topk = 50, 12
    x = rng.normal(size=(5, E)).astype(np.float32) - 1.0
    x[1, [4, 20, 33]] = -0.0          # ties between -0.0 and +0.0 go to the lower index
    x[1, [7, 40]] = 0.0
    x[1, x[1] > 0] = -5.0
    x[2, [0, 1, 2]] = np.nan          # NaN ranks as -inf, and the minimum ignores it
    x[3, :] = -np.inf
    x[3, 10] = np.nan
    x[4, ::3] = -2.5                  # many exact ties among negatives
    vals = np.full((5, topk), -777.0, dtype=np.float32)
    ids = np.full((5, topk), -777, dtype=np.int32)
    P = ctypes.c_void_p
    assert lib.call(P(x.ctypes.data), P(vals.ctypes.data), P(ids.ctypes.data),
                    ctypes.c_int32(5), ctypes.c_int32(E), ctypes.c_int32(topk)) == 0
    with np.errstate(invalid="ignore"):
        for r in range(5):
            key = np.where(np.isnan(x[r]), -np.inf, x[r]).astype(np.float64) + 0.0  # -0.0 -> +0.0
            want = list(np.lexsort((np.arange(E), -key))[:topk])
            assert ids[r].tolist() == want, (r, ids[r], want)
            mn = np.nanmin(x[r]) if not np.all(np.isnan(x[r])) else np.nan
            np.testing.assert_allclose(vals[r], x[r][want] - mn, rtol=0, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("warp_argmax", ["shfl64", "redux"])
def test_cpu_sim_ties_go_to_lower_id(warp_argmax):
    E = 64
    logits = np.zeros((4, E))
    logits[0, [5, 9, 40, 63]] = 3.0          # equal maxima across lanes and slots
    logits[1, :] = 1.0                       # all equal: ids 0..k-1
    logits[2, [33, 1]] = 2.0                 # lane order != index order
    logits[3, [62, 63, 31, 30]] = 5.0
    w, ids, _ = run_sim(logits, 4, warp_argmax=warp_argmax)
    assert ids[0].tolist() == [5, 9, 40, 63]
    assert ids[1].tolist() == [0, 1, 2, 3]
    assert ids[2].tolist()[:2] == [1, 33]
    assert ids[3].tolist() == [30, 31, 62, 63]
    rw, rids = reference_moe_route(logits, 4, SOFTMAX, False, None, 1, 1, 1.0)
    np.testing.assert_array_equal(ids, rids)
    np.testing.assert_allclose(w, rw, atol=1e-6)


def test_cpu_sim_group_ties_go_to_lower_group():
    E, n_group = 64, 8
    logits = np.full((1, E), -1.0)
    for g in (1, 3, 6):  # three groups with the same best score
        logits[0, g * 8 + 2] = 2.0
    _w, ids, _ = run_sim(logits, 2, SOFTMAX, True, None, n_group, 2)
    assert ids[0].tolist() == [10, 26]


@pytest.mark.parametrize("warp_argmax", ["shfl64", "redux"])
@pytest.mark.parametrize("scoring", [SOFTMAX, SIGMOID])
@pytest.mark.parametrize("grouped", [False, True])
def test_cpu_sim_nan_inf_rows_give_distinct_valid_ids(scoring, grouped, warp_argmax):
    E, topk = 40, 8
    n_group, topk_group = (8, 3) if grouped else (1, 1)
    nan, inf = np.nan, np.inf
    rows = np.random.default_rng(7).normal(size=(8, E))
    rows[0, :] = nan
    rows[1, :] = -inf
    rows[2, :] = inf
    rows[3, [3, 17]] = nan
    rows[4, [0, 39]] = inf
    rows[5, ::2] = -inf
    rows[6, 5:] = nan
    rows[7, [1, 2, 3]] = -inf
    bias = np.linspace(0, 0.1, E).astype(np.float32)
    for b in (None, bias):
        w, ids, _ = run_sim(rows, topk, scoring, True, b, n_group, topk_group, warp_argmax=warp_argmax)
        for r in range(rows.shape[0]):
            assert len(set(ids[r].tolist())) == topk, (r, ids[r])
            assert ids[r].min() >= 0 and ids[r].max() < E
        rw, rids = reference_moe_route(rows, topk, scoring, True, b, n_group, topk_group, 1.0)
        np.testing.assert_array_equal(ids, rids)
        np.testing.assert_allclose(w, rw, atol=1e-5, equal_nan=True)


def test_cpu_sim_zero_weight_sum_divides_by_one():
    E = 64
    logits = np.full((1, E), -200.0)  # sigmoid underflows to 0 everywhere but two experts
    logits[0, 7] = 0.0
    w, ids, _ = run_sim(logits, 3, SIGMOID, True, np.where(np.arange(E) > 60, 5.0, 0.0).astype(np.float32))
    assert ids[0].tolist() == [61, 62, 63]
    assert np.all(w[0] == 0.0)


def test_cpu_sim_random_against_reference_many_rows():
    """Random normal logits; rows whose decisions sit within fp32 noise are only checked for validity."""
    rng = np.random.default_rng(3)
    for E, topk, n_group, topk_group, has_bias in [(256, 8, 8, 4, True), (160, 6, 1, 1, False), (48, 4, 4, 2, False)]:
        logits = rng.normal(size=(64, E)).astype(np.float32)
        bias = rng.normal(scale=0.05, size=E).astype(np.float32) if has_bias else None
        for scoring in (SOFTMAX, SIGMOID):
            w, ids, _ = run_sim(logits, topk, scoring, True, bias, n_group, topk_group, 2.0)
            rw, rids = reference_moe_route(logits, topk, scoring, True, bias, n_group, topk_group, 2.0)
            same = np.all(ids == rids, axis=1)
            assert same.mean() > 0.95
            for r in range(len(ids)):
                assert len(set(ids[r].tolist())) == topk and 0 <= ids[r].min() and ids[r].max() < E
            np.testing.assert_allclose(w[same], rw[same], atol=2e-5)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
