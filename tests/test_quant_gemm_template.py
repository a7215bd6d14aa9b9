"""The quant_gemm template (generator/codegen/templates/quant_gemm.py) and its bridge from the engine's forms
(quant_gemm_bridge.py), checked on the CPU.

- the QuantMath is the engine's (states, quantisation argument, correction, merge form, output of every
  specialisation), bound by role: a copy of the spec with other names gives the same kernels up to names;
- `simulate` executes the emitted schedule (X tiles zero-filled past depth, state updates, corrections, the
  saturating e4m3 cast, the per-tile product and its promotion, split-K segments and the merge) in numpy, and is
  judged against float64 and the two-pass path by the rule of ACCEPTANCE.md (fp8_quant_gemm);
- both quantisation forms (online, second pass over the CTA's own rows) are measured on error and bytes read;
- the split-K plan's C++ agrees with its Python;
- where tilelang is installed, the sm_90a and sm_89 programs lower to fp8 tensor-core code.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from generator.codegen.templates import quant_gemm as qg
from generator.codegen.templates import quant_gemm_bridge as qb
from generator.spec import load_spec, parse_spec
from generator.symbolic import derive

ml_dtypes = pytest.importorskip("ml_dtypes")
ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "fp8_quant_gemm.yaml"
E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16


@pytest.fixture(scope="module")
def engine():
    spec = load_spec(SPEC)
    return qb.quant_math(spec, derive(spec))


def inputs(rng, M, N, K, per_channel=True, x_scale=1.0):
    x = (rng.standard_normal((M, K)) * x_scale).astype(BF16).astype(np.float32)
    if K >= 32:
        x[:, K // 2:] *= 8.0  # the running row maximum grows half-way: the online correction is exercised
    w = (rng.standard_normal((N, K)) * 0.3).astype(E4M3).astype(np.float32)
    ws = rng.uniform(0.5, 2.0, N if per_channel else 1).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    return x, w, ws, bias


def reference(x, w, ws, bias):
    """float64 x @ (w * w_scale)^T (+ bias): no quantisation (the contract's ref)."""
    wsf = np.broadcast_to(ws.astype(np.float64), (w.shape[0],))
    out = x.astype(np.float64) @ (w.astype(np.float64) * wsf[:, None]).T
    return out + bias.astype(np.float64) if bias is not None else out


def two_pass(x, w, ws, bias):
    """quantise with the final row scale, then GEMM, in float32 (the contract's two_pass)."""
    s = np.maximum(np.abs(x).max(axis=1, keepdims=True), np.float32(1e-12)) / np.float32(448.0)
    q = np.clip(x / s, -448, 448).astype(E4M3).astype(np.float32)
    out = (q @ w.T) * s * np.broadcast_to(ws, (w.shape[0],))[None, :]
    return out + bias if bias is not None else out


def run(math, x, w, ws, bias, **kw):
    vec = {"v_w_scale": ws, "v_bias": bias if bias is not None else np.zeros(w.shape[0], np.float32)}
    return qg.simulate(math, x, w, vec, {"has_bias": int(bias is not None)}, **kw)


def judge(out, x, w, ws, bias):
    r = reference(x, w, ws, bias)
    tp = two_pass(x, w, ws, bias)
    err = np.abs(out - r).max()
    bound = 2 * np.abs(tp - r).max() + 1e-2 * np.abs(r).max()
    assert np.isfinite(out).all()
    assert err <= bound, (err, bound)
    return err, np.abs(tp - r).max()


# ------------------------------------------------------------------------------------------------ the math
def test_math_is_the_engines(engine):
    math, roles = engine
    assert (roles.x, roles.w, roles.rows, roles.cols, roles.depth) == ("x", "w", "M", "N", "K")
    (a,) = math.states
    assert (a.op, a.term, a.correction) == ("max", "T.abs(x)", None)
    # the scale, the eps clamp and the correction are the engine's, printed from its forms
    assert "T.max(T.float32(1e-12), a_new)" in math.quant and "T.float32(448.0)" in math.quant
    assert math.acc_correction == "(T.max(T.float32(1e-12), a_old) / (T.max(T.float32(1e-12), a_new)))"
    assert math.merge_states == (("a", "a_seg"),)
    assert math.merge_acc.startswith("(acc_seg * T.max(T.float32(1e-12), a_seg)")
    # one output for both specialisations: the bias is a run-time flag
    assert math.out.startswith("T.if_then_else(has_bias != 0, ")
    assert [v.name for v in math.vectors] == ["v_w_scale", "v_bias"] and math.flags == ("has_bias",)
    # none of the op's constants are typed into the template: 448 only as the e4m3 format's largest value
    text = (ROOT / "generator" / "codegen" / "templates" / "quant_gemm.py").read_text().split('"""', 2)[2]
    assert "1e-12" not in text and "w_scale" not in text
    assert text.count("448") == 1


_RENAMES = {"M": "T", "N": "O", "K": "D", "NS": "G", "x": "act", "w": "weight", "w_scale": "wsc", "bias": "b",
            "m": "t", "n": "o", "k": "d", "a": "amax", "acc": "dot", "s": "scale", "out": "y"}


def _renamed_spec():
    """The spec with every axis, index, argument, state, let and output renamed (whole words after `axes:`)."""
    head, rest = SPEC.read_text().split("axes:", 1)
    for old, new in _RENAMES.items():
        rest = re.sub(rf"(?<![A-Za-z_0-9.]){old}(?![A-Za-z_0-9])", new, rest)
    return parse_spec(head.replace("op: fp8_quant_gemm", "op: other_quant") + "axes:" + rest, "renamed.yaml")


def _back(text: str) -> str:
    """The renamed spec's kernel names mapped back (the template's own names are the same in both)."""
    text = text.replace("amax", "a").replace("wsc", "w_scale")
    text = re.sub(r"\bv_b\b", "v_bias", re.sub(r"\bhas_b\b", "has_bias", text))
    return re.sub(r"# math: \w+", "", text)


def test_bridge_binds_by_role(engine):
    spec2 = _renamed_spec()
    math2, roles2 = qb.quant_math(spec2, derive(spec2))
    assert (roles2.x, roles2.w, roles2.rows, roles2.cols, roles2.depth, roles2.out) == ("act", "weight", "T", "O",
                                                                                       "D", "y")
    math, _ = engine
    for fam in qg.FAMILIES:
        for split in (False, True):
            cfg = qg.default_config(fam, "bfloat16", "bfloat16", split=split)
            a = qg.emit_program(math, cfg, "k")
            assert "amax" not in a and "wsc" not in a
            assert re.sub(r"# math: \w+", "", a) == _back(qg.emit_program(math2, cfg, "k"))
        cfg = qg.default_config(fam, "float16", "float32")
        m1 = qg.emit_merge_program(math, cfg, "m")
        assert re.sub(r"# math: \w+", "", m1) == _back(qg.emit_merge_program(math2, cfg, "m"))


def test_bridge_refuses_other_shapes():
    for name, msg in (("absmax_quant_dot.yaml", "exactly one sum carried over a free index"),  # a GEMV
                      ("causal_attention.yaml", "needs one row index, found 2"),
                      ("softmax.yaml", "found 0")):
        spec = load_spec(ROOT / "tests" / "specs" / name)
        with pytest.raises(qb.QuantBridgeError, match=msg):
            qb.quant_math(spec, derive(spec))


def test_every_variant_emits_valid_python(engine):
    math, _ = engine
    for fam in qg.FAMILIES:
        for xdt in qg.X_DTYPES:
            for odt in qg.OUT_DTYPES:
                for split in (False, True):
                    for form in qg.FORMS:
                        cfg = qg.default_config(fam, xdt, odt, split=split, form=form)
                        compile(qg.emit_program(math, cfg, cfg.variant_name("op")), "v.py", "exec")
                compile(qg.emit_merge_program(math, cfg, cfg.merge_variant_name("op")), "m.py", "exec")


def test_plan_lists_the_variants():
    from generator.codegen.templates.quant_gemm_bridge import quant_plan

    spec = load_spec(SPEC)
    plan = quant_plan(spec, derive(spec), ["sm80", "sm89", "sm90a", "sm100a"])
    names = sorted(j.symbol for j in plan.jobs)
    assert len(names) == len(set(names)) == 4 * (2 + 2 + 3)
    assert "fp8_quant_gemm__bf16_bf16__sm90a" in names and "fp8_quant_gemm__fp16_splitk__sm89" in names
    assert "fp8_quant_gemm_merge__fp32__sm80" in names
    # every (family, X dtype, output dtype) has a path: the single-segment kernel only where output == X
    assert len(plan.entries) == 4 * 2 * 3
    assert sum(e[4] is not None for e in plan.entries) == 4 * 2


# ------------------------------------------------------------------------------------------------ the schedule
# (M, N, K): the sizes of ACCEPTANCE.md; the DeepSeek-V3 shapes (7168, 2048) and (24576, 1536) run in full at M 7 and
# M 1, and at M 128 and 1000 with N shrunk to 512 (in full, the float64 reference alone is 10^10+ multiply-adds)
SHAPES = [
    (1, 16, 16), (7, 16, 16), (128, 16, 16), (1000, 16, 16),
    (7, 7168, 2048), (1, 24576, 1536),
    (128, 512, 2048), (1000, 512, 1536), (7, 48, 272), (128, 64, 1008),
]


@pytest.mark.parametrize("M, N, K", SHAPES)
@pytest.mark.parametrize("splits", [1, 3])
def test_schedule_meets_the_acceptance_rule(engine, M, N, K, splits):
    math, _ = engine
    rng = np.random.default_rng(M * 7 + N + K + splits)
    x, w, ws, bias = inputs(rng, M, N, K, per_channel=(M + splits) % 2 == 0)
    b = bias if (M + N) % 2 else None
    out, _ = run(math, x, w, ws, b, num_splits=splits)
    judge(out, x, w, ws, b)


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_zero_rows_are_exact_and_huge_rows_stay_finite(engine, per_channel, with_bias):
    math, _ = engine
    rng = np.random.default_rng(5)
    M, N, K = 9, 64, 384
    x, w, ws, bias = inputs(rng, M, N, K, per_channel)
    b = bias if with_bias else None
    x[2] = 0.0  # an all-zero row
    x[4] = (rng.standard_normal(K) * 3e4).astype(BF16).astype(np.float32)  # about the largest fp16 values
    x[6, : K // 3] = 0.0  # zero only in its first segment: an empty prefix, then a real maximum
    for splits in (1, 3, 5):  # 5 segments of 3 tiles: two segments are empty
        out, _ = run(math, x, w, ws, b, num_splits=splits)
        expect = b if with_bias else np.zeros(N, np.float32)
        assert np.array_equal(out[2], expect)
        judge(out, x, w, ws, b)


def test_quantised_values_saturate_and_nan_stays_in_its_row(engine):
    math, _ = engine
    rng = np.random.default_rng(6)
    x, w, ws, bias = inputs(rng, 6, 32, 256)
    x[3, 17] = np.nan
    out, _ = run(math, x, w, ws, bias, num_splits=2)
    assert np.isnan(out[3]).all()
    keep = [0, 1, 2, 4, 5]
    judge(out[keep], x[keep], w, ws, bias)
    # the cast saturates at 448 (ml_dtypes alone would give NaN above it) and keeps NaN
    loud = qg.QuantMath(**{**math.__dict__, "quant": "x * T.float32(4.0)"})
    xs = np.array([[96.0, -300.0, 52.0] + [1.0] * 13, [2.0, np.nan] + [1.0] * 14], np.float32)
    eye = np.eye(16, dtype=np.float32)
    got, _ = qg.simulate(loud, xs, eye, {"v_w_scale": np.ones(16, np.float32), "v_bias": np.zeros(16, np.float32)},
                         {"has_bias": 0}, block_k=16)
    # q = sat(4 x): 384, -1200 -> -448, 208 (e4m3 values); the output scales back by the row's s = 300 / 448
    assert np.allclose(got[0, :3], np.array([384.0, -448.0, 208.0]) * (300.0 / 448.0))
    assert np.isnan(got[1]).all()


def test_bf16_widening_is_exact(engine):
    """sm80 multiplies the quantised tiles as bf16: every e4m3 value is a bf16 value, so the result is the same."""
    math, _ = engine
    rng = np.random.default_rng(7)
    x, w, ws, bias = inputs(rng, 33, 48, 512)
    a, _ = run(math, x, w, ws, bias, num_splits=2)
    b, _ = run(math, x, w, ws, bias, num_splits=2, fp8_mma=False)
    assert np.array_equal(a, b)


def test_online_form_is_chosen_by_error_and_bytes(engine):
    """Both forms meet the rule with the same error statistics; the online form reads X once, the second pass
    twice (per CTA), so the online form is the one the plan builds."""
    math, _ = engine
    errs = {f: [] for f in qg.FORMS}
    xbytes = {}
    for seed in range(8):
        rng = np.random.default_rng(100 + seed)
        x, w, ws, bias = inputs(rng, 64, 256, 1024)
        r = reference(x, w, ws, bias)
        for form in qg.FORMS:
            out, stats = run(math, x, w, ws, bias, form=form)
            judge(out, x, w, ws, bias)
            errs[form].append(np.abs(out - r).max() / np.abs(r).max())
            xbytes[form] = stats.x_bytes
    online, second = np.mean(errs["online"]), np.mean(errs["second_pass"])
    assert online <= 1.25 * second  # no worse than quantising with the final scale
    assert xbytes["second_pass"] == 2 * xbytes["online"]
    spec = load_spec(SPEC)
    from generator.codegen.templates.quant_gemm_bridge import quant_plan

    assert all("2pass" not in j.symbol for j in quant_plan(spec, derive(spec), ["sm90a"]).jobs)


# ------------------------------------------------------------------------------------------------ split plan
def test_split_plan():
    f = qg.choose_num_splits
    assert f(4096, 7168, 2048, 64, 128, 128, 132) == 1  # a full grid never splits
    n = f(1, 7168, 2048, 64, 128, 128, 132)  # 56 CTAs on 132 SMs: split
    assert 2 <= n <= 8 and (56 * n) <= 2 * 132 + 56
    assert f(16, 2048, 7168, 64, 128, 128, 132) > 1
    assert f(1, 16, 16, 64, 128, 128, 132) == 1  # one K tile: nothing to split
    assert f(1, 16, 512, 64, 128, 128, 132) == 2  # 4 tiles: at most 2 segments of 2
    for args in [(1, 2112, 7168, 64, 128, 128, 132), (7, 512, 1280, 64, 128, 128, 108), (3, 4096, 2048, 64, 128, 64, 58)]:
        n, tiles = f(*args), -(-args[2] // args[5])
        per = -(-tiles // n)
        assert (n - 1) * per < tiles  # no empty segment


def test_split_plan_cpp_matches_python(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed (it builds the library too)"
    rng = np.random.default_rng(0)
    cases = [(int(rng.choice([1, 7, 16, 128, 1000, 4096, 16384])), int(rng.choice([16, 512, 2048, 7168, 24576])),
              int(rng.choice([16, 256, 1536, 2048, 7168])), 64, 128, int(rng.choice([64, 128])),
              int(rng.choice([58, 108, 132]))) for _ in range(300)]
    src = tmp_path / "t.cpp"
    src.write_text("#include <cstdint>\n#include <cstdio>\n" + qg.NUM_SPLITS_CPP + "int main() {\n" + "".join(
        f"  std::printf(\"%d\\n\", quant_gemm_num_splits({', '.join(map(str, c))}));\n" for c in cases) + "}\n")
    subprocess.run([cxx, "-O1", str(src), "-o", str(tmp_path / "t")], check=True)
    got = subprocess.run([str(tmp_path / "t")], capture_output=True, text=True, check=True).stdout.split()
    want = [qg.choose_num_splits(*c) for c in cases]
    assert [int(g) for g in got] == want
    assert any(w > 1 for w in want) and any(w == 1 for w in want)


# ------------------------------------------------------------------------------------------------ lowering
def _lower(tmp_path, text, arch):
    tilelang = pytest.importorskip("tilelang")
    tvm = pytest.importorskip("tvm")
    path = tmp_path / "variant.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("variant", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    target = {"kind": "cuda", "arch": arch}
    with tvm.transform.PassContext(opt_level=3, config=mod.PASS_CONFIGS), tvm.target.Target(target):
        return tilelang.lower(mod.make_prim_func(), target=target).kernel_source


def test_lower_sm90a_uses_fp8_wgmma_and_tma(engine, tmp_path):
    math, _ = engine
    cfg = qg.default_config("sm90a", "bfloat16", "bfloat16")
    src = _lower(tmp_path, qg.emit_program(math, cfg, "k"), cfg.arch)
    assert "tl::tma_load(X_desc" in src and "tl::tma_load(W_desc" in src
    assert "wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3" in src


def test_lower_sm89_uses_fp8_mma_sync(engine, tmp_path):
    math, _ = engine
    cfg = qg.default_config("sm89", "float16", "float16", split=True)
    src = _lower(tmp_path, qg.emit_program(math, cfg, "k"), cfg.arch)
    assert "mma_sync<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3" in src
