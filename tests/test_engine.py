"""The symbolic fusion engine: derived online and merge forms against the unfused cascade, guards, rejections.

Every shipped spec and the extra cascades in tests/specs/ are run in float64: the online form chunk by chunk with
random chunk sizes (1 included) and the merge form over random segment splits (empty segments included) must
reproduce the plain unfused math (generator/symbolic/oracle.py: no guard, no mask value) to 1e-12, and to 1e-9 on
adversarial rows, including rows that are fully masked, all zero
or -inf, where the guards must give the exact defined values.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from generator.errors import FusionError, SpecError
from generator.spec import load_spec, spec_files
from generator.symbolic import derive
from generator.symbolic.evaluate import evaluate_merged, evaluate_online, random_problem
from generator.symbolic.forms import analyze
from generator.symbolic.oracle import (
    adversarial_problem,
    check_forms,
    evaluate_plain,
    judge,
)

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = spec_files(ROOT / "specs")
EXTRA = spec_files(ROOT / "tests" / "specs")
ALL = SHIPPED + EXTRA


# how to make awkward rows per spec: (tensor, kind) with kind in "-inf row", "-inf some", "zero row"
POISON = {
    "logsumexp": [("x", "-inf row"), ("x", "-inf some")],
    "softmax": [("x", "-inf row"), ("x", "-inf some")],
    "softmax_topk_renorm": [("x", "-inf some")],
    "cross_entropy": [("logits", "-inf some")],
    "moe_route": [("logits", "-inf some"), ("logits", "-inf row")],
    "sigmoid_topk_bias": [("logits", "-inf some")],
    "absmax_quant_dot": [("x", "zero row")],
    "fp8_quant_gemm": [("x", "zero row")],
    "rms_norm_fp8_quant": [("x", "zero row")],
    "row_softmax": [("x", "-inf row"), ("x", "-inf some")],
    "tempered_entropy": [("x", "-inf row"), ("x", "-inf some")],
    "vocab_topk": [("logits", "-inf row"), ("logits", "-inf some")],
    "causal_attention": [("lens", "zero row")],
    "rbf_attention": [("lens", "zero row")],
    "mla_decode": [("cache_seqlens", "zero row")],
}


def poison(problem, name: str, rng: random.Random) -> None:
    for tensor, kind in POISON.get(name, []):
        arr = problem.tensors[tensor]
        if arr.ndim == 1:
            if kind == "zero row":
                arr[rng.randrange(arr.shape[0])] = 0
            continue
        row = rng.randrange(arr.shape[0])
        if kind == "-inf row":
            arr[row] = -np.inf
        elif kind == "zero row":
            arr[row] = 0.0
        elif kind == "-inf some":
            cols = rng.sample(range(arr.shape[1]), max(1, arr.shape[1] // 3))
            arr[row, cols] = -np.inf


@pytest.fixture(scope="module")
def analyses():
    # the engine's forms without the generator's numeric self-check, so that the value tests below judge the forms
    # themselves (a broken form fails them by value, not by an error in this fixture); the self-check has its own test
    return {p.stem: analyze(load_spec(p)) for p in ALL}


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_every_spec_passes_the_generators_numeric_self_check(path):
    """derive() = analyze() + the self-check (online and merged forms against the plain math on a random and an
    adversarial problem per specialisation); it raises on a disagreement."""
    op = derive(load_spec(path), trials=2)
    assert op.cases


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_online_and_merge_forms_match_the_unfused_cascade(path, analyses):
    op = analyses[path.stem]
    for case in op.cases:
        for seed in range(3):
            rng = random.Random(seed * 7919 + hash(case.ir.label) % 1000)
            prob = random_problem(case.ir, rng, max_size=6)
            poison(prob, op.spec.name, rng)
            assert not check_forms(case, prob, rng, 1e-12), (case.ir.label, check_forms(case, prob, rng, 1e-12))
            adversarial = adversarial_problem(case.ir, rng, 6)
            assert not check_forms(case, adversarial, rng), (case.ir.label, check_forms(case, adversarial, rng))


def test_the_self_checks_judge_holds_every_defined_value():
    """oracle.judge, by which derive() and the tests above accept a form: where the plain math is an infinity the
    result must be that infinity, where it is a number within rtol of the output's scale; only where the plain math
    is NaN (undefined) is anything accepted."""
    inf, nan = np.inf, np.nan
    ref = {"o": np.array([2.0, inf, -inf, nan]), "n": np.array([3, 4])}
    assert not judge(ref, {"o": np.array([2.0, inf, -inf, 5.0]), "n": np.array([3, 4])})
    assert not judge(ref, {"o": np.array([2.0 + 1e-10, inf, -inf, -inf]), "n": np.array([3, 4])})
    for bad in ([2.1, inf, -inf, nan], [nan, inf, -inf, nan], [2.0, -inf, -inf, nan], [2.0, inf, 1e30, nan],
                [2.0, nan, -inf, nan], [2.0, inf, inf, 0.0], [-inf, inf, -inf, 0.0]):
        assert judge(ref, {"o": np.array(bad), "n": np.array([3, 4])}), bad
    assert judge(ref, {"o": np.array([2.0, inf, -inf, nan]), "n": np.array([3, 5])})
    assert judge(ref, {"o": np.array([2.0, inf]), "n": np.array([3, 4])})  # a shape that differs


def _runs(case, prob, rng):
    return [evaluate_online(case, prob, rng), evaluate_merged(case, prob, rng), evaluate_plain(case.ir, prob)]


def test_attention_fully_masked_rows_give_zero_and_minus_inf(analyses):
    case = analyses["fused_attention"].case(causal=True)
    rng = random.Random(5)
    prob = random_problem(case.ir, rng, fixed={"Sq": 7, "Sk": 3, "B": 2, "H": 2, "Hk": 1, "D": 3})
    for out in _runs(case, prob, rng):
        # bottom-right alignment: query i sees keys j <= i + Sk - Sq = i - 4; rows 0..3 see nothing
        assert np.all(out["out"][:, :4] == 0.0)
        assert np.all(out["lse"][:, :, :4] == -np.inf)
        assert np.all(np.isfinite(out["out"][:, 4:])) and np.all(np.isfinite(out["lse"][:, :, 4:]))


def test_mla_empty_sequence_gives_zero_and_minus_inf(analyses):
    case = analyses["mla_decode"].case(causal=False)
    rng = random.Random(6)
    prob = random_problem(case.ir, rng, fixed={"B": 3, "Sq": 2, "Hq": 2, "NB": 4, "MB": 2, "head_dim_v": 3})
    prob.tensors["cache_seqlens"][1] = 0
    prob.tensors["block_table"][1] = 10**6  # unused entries may hold any value
    for out in _runs(case, prob, rng):
        assert np.all(out["out"][1] == 0.0) and np.all(out["lse"][1] == -np.inf)
        assert np.all(np.isfinite(out["out"][[0, 2]]))


def test_logsumexp_and_softmax_of_minus_inf_rows(analyses):
    rng = random.Random(7)
    lse = analyses["logsumexp"].cases[0]
    sm = analyses["softmax"].cases[0]
    prob = random_problem(lse.ir, rng, fixed={"T": 3, "E": 5})
    prob.tensors["x"][1] = -np.inf
    prob.tensors["x"][2, :2] = -np.inf
    # a row of -inf: the plain math of the stabilised form is nan (exp(-inf - -inf)); the engine's guard gives the
    # limit (lse -inf, probabilities 0), which the oracle leaves unjudged
    assert np.isnan(evaluate_plain(lse.ir, prob)["out"][1])
    for out in _runs(lse, prob, rng)[:2]:
        assert out["out"][1] == -np.inf and np.isfinite(out["out"][[0, 2]]).all()
    for out in _runs(sm, prob, rng)[:2]:
        assert np.all(out["out"][1] == 0.0)
        assert np.all(out["out"][2, :2] == 0.0) and np.isclose(out["out"][2].sum(), 1.0)


def test_very_negative_rows_do_not_overflow_the_correction(analyses):
    """A row whose scores are all far below 0: the first correction from the empty prefix must not compute
    exp(0 - m) (which overflows) and multiply the zero state by it."""
    lse = analyses["logsumexp"].cases[0]
    rng = random.Random(9)
    prob = random_problem(lse.ir, rng, fixed={"T": 2, "E": 9})
    prob.tensors["x"][1] = -1000.0 - np.arange(9)
    for out in _runs(lse, prob, rng):
        assert np.isfinite(out["out"]).all()
        assert abs(out["out"][1] - (-1000.0 + np.log(np.exp(-np.arange(9.0)).sum()))) < 1e-9


def test_all_zero_rows_quantize_to_exact_zero(analyses):
    case = analyses["fp8_quant_gemm"].case(bias="absent")
    rng = random.Random(8)
    prob = random_problem(case.ir, rng, fixed={"M": 3, "N": 16, "K": 16, "NS": 16})
    prob.tensors["x"][1] = 0.0
    for out in _runs(case, prob, rng):
        assert np.all(out["out"][1] == 0.0) and np.all(np.isfinite(out["out"]))


def test_attention_forms_are_derived(analyses):
    """The online softmax update, its guard and merge form come out of the engine."""
    import sympy as sp

    case = analyses["fused_attention"].case(causal=False)
    l_form, o_form = case.form("l"), case.form("o")
    m_old, m_new = case.sym("m", "old"), case.sym("m", "new_safe")
    # exp(m_old - m_new) where the old max is finite; 1 (the state is still 0) where it is -inf
    expected = sp.Piecewise((1, sp.Eq(m_old, sp.S.NegativeInfinity)), (sp.exp(m_old - m_new), True))
    assert l_form.kind == "*" and l_form.correction == expected
    assert o_form.correction == expected
    guard = case.guard("m")
    assert guard is not None and guard.points == ((sp.S.NegativeInfinity, 0),)
    lse = next(o for o in case.outputs if o.name == "lse")
    m, l_ = case.ir.states["m"], case.ir.states["l"]
    assert sp.simplify(lse.value - (m + sp.log(l_))) == 0
    assert [p.reductions for p in case.passes] == [("m", "l", "o")]


def test_explain_prints_the_online_softmax():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "generator", "explain", str(ROOT / "specs" / "fused_attention.yaml")],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert ("l_new = l_old * (1 if m_old == -inf else exp(m_old - m_new_safe)) + sum_{j in chunk} exp(s - m_new_safe)"
            in out)
    assert "m_safe = (0 if m == -inf else m)" in out
    assert "l = sum_p l_p * (1 if m_p == -inf else exp(m_p - m_safe))" in out
    assert "lse[b, h, i] = m + log(l)" in out
    assert "out[b, i, h, d] = (0 if l == 0 else o/l)" in out


# --------------------------------------------------------------------------------------------- rejections
@pytest.mark.parametrize(
    "name, reduction, condition, detail",
    [
        ("median", "md", "operator", "'median' is not a supported reduction"),
        ("sin_product", "y", "decomposable", "sin(m_new*x[t, e])/sin(m_old*x[t, e]) depends on x[t, e]"),
        ("max_unknown_sign", "y", "distributive", "the factor total_new/total_old has unknown sign"),
        ("later_dependency", "l", "dependency order", "depends on 'm', which is reduced later"),
        # a selection's entries are never corrected (the CPU emitter's correct() relies on it)
        ("corrected_topk_key", "top", "exact order", "the key exp(-m + y) of a selection would be corrected"),
        ("corrected_topk_payload", "top", "exact order", "a payload of the selection would be corrected as m"),
    ],
)
def test_rejections_name_reduction_condition_and_expression(name, reduction, condition, detail):
    spec = load_spec(ROOT / "tests" / "specs" / "reject" / f"{name}.yaml")
    with pytest.raises(FusionError) as exc:
        analyze(spec)
    assert exc.value.reduction == reduction
    assert exc.value.condition == condition
    assert detail in exc.value.detail
    assert f"{name}.yaml:" in str(exc.value)  # the file and line


def test_pass_budget_is_enforced():
    text = (ROOT / "specs" / "moe_route.yaml").read_text().replace("passes: 3", "passes: 1")
    from generator.spec import parse_spec

    with pytest.raises(FusionError) as exc:
        analyze(parse_spec(text, "moe_route_one_pass.yaml"))
    assert exc.value.condition in ("passes", "decomposable", "distributive", "exact order")


@pytest.mark.parametrize(
    "mutation, message",
    [
        (("max(s)", "max(s, 1)"), "max() takes 1 positional argument(s), got 2"),
        (("dtype: q}", "dtype: qq}"), "'qq' is not an earlier tensor argument"),
        (("over: j", "over: zz"), "reduction index 'zz' is not declared"),
        (("v[b, j, g, d]", "v[b, j, d]"), "'v' has 4 dims, indexed with 3"),
        (("exp(s - m)", "exq(s - m)"), "unknown function 'exq'"),
    ],
)
def test_spec_errors_name_file_line_and_key(mutation, message):
    from generator.spec import parse_spec

    text = (ROOT / "specs" / "fused_attention.yaml").read_text().replace(*mutation, 1)
    with pytest.raises((SpecError, FusionError)) as exc:
        op = parse_spec(text, "broken.yaml")
        analyze(op)
    assert message in str(exc.value)
    assert "broken.yaml:" in str(exc.value)
    line = int(str(exc.value).split(":")[1])
    assert line > 0


def test_check_command_passes_on_shipped_specs():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "generator", "check"], cwd=ROOT, capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok ") == len(SHIPPED)


# --------------------------------------------------------------------------------------------- order rules
def _order_symbols():
    import sympy as sp

    from generator.symbolic.expr import sigmoid

    x, m, z, c, b = sp.symbols("x m z c b", real=True)
    return sp, sigmoid, x, m, z, c, b


def test_increasing_in_proves_the_keys_a_selection_may_order_by_value():
    """The structural rule behind selecting a softmax router on its logits: what it proves, under which conditions,
    and what it refuses (a term that also varies per element, a decreasing or non-monotone one, an unknown symbol)."""
    from generator.symbolic.order import Condition, increasing_in

    sp, sigmoid, x, m, z, c, b = _order_symbols()
    const = frozenset({m, z, c})
    assert increasing_in(sp.exp(x - m) / z, x, const) == [Condition(-m, False), Condition(1 / z, True)]
    assert increasing_in(sigmoid(x), x, const) == []
    assert increasing_in(2 * x + 3, x, const) == []
    assert increasing_in(c * sp.exp(x), x, const) == [Condition(c, True)]
    bias = sp.IndexedBase("bias")[sp.Symbol("e", integer=True)]
    for refused in (sp.exp(x - m) / z + bias,  # a tensor read: varies per element
                    x + b,  # b is not known constant
                    -x, sp.exp(-x), x * x, sp.cos(x), x + sp.oo, 0 * x + m):
        assert increasing_in(refused, x, const) is None, refused


def test_increasing_in_holds_on_random_numbers():
    """Where the conditions hold, x1 < x2 gives f(x1) < f(x2) (float64, moderate values): every proved expression,
    on constants drawn at random, including values near the conditions' edges."""
    from generator.symbolic.order import increasing_in

    sp, sigmoid, x, m, z, c, _ = _order_symbols()
    const = frozenset({m, z, c})
    rng = random.Random(7)
    exprs = [sp.exp(x - m) / z, sigmoid(x), 2 * x + 3, c * sp.exp(x), c * sigmoid(x - m) + z, sp.exp(c * x) / z]
    for e in exprs:
        conds = increasing_in(e, x, const)
        assert conds is not None, e
        f = sp.lambdify([x, m, z, c], e.rewrite(sp.exp), "math")
        checked = 0
        while checked < 200:
            vals = {m: rng.uniform(-5, 5), z: rng.choice([1e-3, 1.0, 7.5, rng.uniform(-2, 2)]),
                    c: rng.choice([1e-3, 2.0, rng.uniform(-2, 2)])}
            if not all((cv := float(cd.expr.subs(vals))) == cv and abs(cv) != float("inf") and (not cd.positive or cv > 0)
                       for cd in conds):
                continue
            x1 = rng.uniform(-6, 6)
            x2 = x1 + rng.choice([1e-6, 1e-3, 0.5, 3.0])
            assert f(x1, vals[m], vals[z], vals[c]) < f(x2, vals[m], vals[z], vals[c]), (e, vals, x1, x2)
            checked += 1
