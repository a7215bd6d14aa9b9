"""The spec expression language, parsed directly (generator/symbolic/expr.py's ExprParser): what each construct
means. The shipped specs reach only some of them (no spec writes `x is None`, a symbolic `where(...)` or `or`),
so a construct that parses to the wrong meaning would pass every op test; each is pinned here by its value."""

from __future__ import annotations

import pytest
import sympy as sp

from generator.errors import Loc, SpecError
from generator.symbolic.expr import ExprParser, Scope, cast_bfloat16, idiv, sigmoid

X, Y = sp.symbols("x y", real=True)
I = sp.Symbol("i", integer=True)


def parse(text, *, bias_present=True, flags=None):
    scope = Scope(
        values={"x": X, "y": Y},
        tensors={"bias": sp.IndexedBase("bias")},
        tensor_ndim={"bias": 1},
        optional_tensors={"bias": bias_present},
        flags={"causal": True, "mode": "softmax", "scale": None} if flags is None else flags,
        indices={"i": I},
        extents={"i": sp.Integer(8)},
    )
    return ExprParser(scope, Loc("t.yaml", 1, "k")).parse(text)


def at(expr, x, y=0.0):
    return float(sp.sympify(expr).subs({X: x, Y: y}))


@pytest.mark.parametrize("present", [True, False])
def test_is_none_and_is_not_none_of_an_optional_tensor(present):
    assert parse("bias is None", bias_present=present) is (not present)
    assert parse("bias is not None", bias_present=present) is present
    got = parse("x + bias[i] if bias is not None else x - 1", bias_present=present)
    assert got == (X + sp.IndexedBase("bias")[I] if present else X - 1)
    assert parse("x if bias is None else y", bias_present=present) == (Y if present else X)


@pytest.mark.parametrize("value, is_none", [(None, True), (0.5, False)])
def test_is_none_of_an_optional_scalar(value, is_none):
    flags = {"scale": value}
    assert parse("scale is None", flags=flags) is is_none
    assert parse("scale is not None", flags=flags) is (not is_none)


def test_conditional_expressions_pick_their_branch():
    assert parse("x if causal else y") == X
    assert parse("x if not causal else y") == Y
    assert parse("x if mode == 'softmax' else y") == X
    assert parse("x if mode != 'softmax' else y") == Y
    # a condition on values: a Piecewise whose first branch holds where the condition does
    pw = parse("x if x > y else y")
    assert at(pw, 3.0, 1.0) == 3.0 and at(pw, 1.0, 3.0) == 3.0
    pw = parse("x if x < y else y")
    assert at(pw, 3.0, 1.0) == 1.0 and at(pw, 1.0, 3.0) == 1.0
    w = parse("where(x >= 0, x, 2 * x)")
    assert at(w, 2.0) == 2.0 and at(w, -2.0) == -4.0
    assert parse("where(causal, x, y)") == X


def test_and_or_not_with_constants_and_conditions():
    assert parse("causal and x > 0") == sp.Gt(X, 0)
    assert parse("not causal and x > 0") is False
    assert parse("causal or x > 0") is True
    assert parse("not causal or x > 0") == sp.Gt(X, 0)
    both = parse("x > 0 and y > 0")
    either = parse("x > 0 or y > 0")
    for x, y in ((1, 1), (1, -1), (-1, 1), (-1, -1)):
        subs = {X: x, Y: y}
        assert bool(both.subs(subs)) == (x > 0 and y > 0)
        assert bool(either.subs(subs)) == (x > 0 or y > 0)
    assert bool(parse("not x > 0").subs({X: -1})) and not bool(parse("not x > 0").subs({X: 1}))


@pytest.mark.parametrize("text, want", [("x < y", (True, False, False)), ("x <= y", (True, True, False)),
                                        ("x > y", (False, False, True)), ("x >= y", (False, True, True)),
                                        ("x == y", (False, True, False)), ("x != y", (True, False, True))])
def test_comparisons(text, want):
    c = parse(text)
    assert tuple(bool(c.subs({X: x, Y: 1})) for x in (0, 1, 2)) == want


def test_arithmetic_and_functions():
    assert at(parse("x - y / 2 * 3"), 5.0, 2.0) == 2.0
    assert at(parse("-x ** 2"), 3.0) == -9.0
    assert at(parse("+x"), 3.0) == 3.0
    assert parse("i // 3") == idiv(I, 3)
    assert [int(parse("i // 3").subs(I, v)) for v in (0, 2, 3, 7)] == [0, 0, 1, 2]
    assert [int(parse("i % 3").subs(I, v)) for v in (0, 2, 3, 7)] == [0, 2, 0, 1]
    assert at(parse("max(x, y)"), 1.0, 2.0) == 2.0 and at(parse("min(x, y)"), 1.0, 2.0) == 1.0
    c = parse("clamp(x, -1, 2)")
    assert [at(c, v) for v in (-5.0, 0.5, 5.0)] == [-1.0, 0.5, 2.0]
    for name, f in (("exp", sp.exp), ("log", sp.log), ("sqrt", sp.sqrt), ("abs", sp.Abs), ("tanh", sp.tanh),
                    ("sin", sp.sin), ("cos", sp.cos), ("sigmoid", sigmoid)):
        assert parse(f"{name}(x)") == f(X)
    assert parse("bfloat16(x)") == cast_bfloat16(X)
    assert parse("inf") == sp.oo and parse("-inf") == -sp.oo
    assert parse("0.5") == sp.Float(0.5) and parse("2.0") == sp.Integer(2)
    s = parse("sum(x * i, i)")
    assert isinstance(s, sp.Sum) and float(s.subs(X, 1.0).doit()) == 28.0


@pytest.mark.parametrize("text, message", [
    ("x < y < 2", "chained comparisons"),
    ("x / 0", "division by zero"),
    ("bias + x", "is read without a test"),
    ("y is None", "is not an optional argument"),
    ("mode < 'a'", "strings compare with == or !="),
    ("exp(x, y)", "exp() takes 1 argument(s), got 2"),
    ("max(x)", "is a reduction"),
    ("sum(x)", "is a reduction"),
    ("foo(x)", "unknown function 'foo'"),
    ("z + 1", "unknown name 'z'"),
    ("x +", "cannot parse expression"),
    ("x & y", "unsupported operator"),
])
def test_mistakes_are_refused_with_the_reason(text, message):
    with pytest.raises(SpecError) as exc:
        parse(text)
    assert message in str(exc.value) and str(exc.value).startswith("t.yaml:1: k")


def test_an_absent_optional_tensor_is_not_read():
    with pytest.raises(SpecError, match="optional tensor 'bias' is absent here"):
        parse("x + bias[i]", bias_present=False)
