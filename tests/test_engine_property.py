"""Property test: random cascades from a small grammar. The engine either rejects a cascade with a precise reason
or returns forms whose online and merged evaluations reproduce the unfused cascade. It must never accept a cascade
whose online form is wrong."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from generator.errors import FusionError
from generator.spec import parse_spec
from generator.symbolic.evaluate import (
    compare,
    evaluate_direct,
    evaluate_merged,
    evaluate_online,
    random_problem,
)
from generator.symbolic.forms import analyze

UNARY = ["exp({})", "abs({})", "sigmoid({})", "sin({})", "-({})", "sqrt(abs({}))"]
BINARY = ["({}) + ({})", "({}) - ({})", "({}) * ({})", "max({}, {})", "({}) / (1 + abs({}))"]
OPS = ["sum", "max", "min", "topk"]


@st.composite
def expression(draw, atoms: list[str], depth: int) -> str:
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        return draw(st.sampled_from(atoms))
    if draw(st.booleans()):
        return draw(st.sampled_from(UNARY)).format(draw(expression(atoms, depth - 1)))
    a = draw(expression(atoms, depth - 1))
    b = draw(expression(atoms, depth - 1))
    return draw(st.sampled_from(BINARY)).format(a, b)


@st.composite
def cascade(draw) -> str:
    n = draw(st.integers(1, 3))
    reduce_lines, outputs, scalars = [], [], []
    for i in range(n):
        name = f"r{i}"
        atoms = ["x[t, e]", "y[t, e]", "0.5"] + scalars
        body = draw(expression(atoms, 2))
        op = draw(st.sampled_from(OPS))
        if op == "topk":
            reduce_lines.append(f'    {name}: "topk({body}, 2)"')
            outputs.append(f'  {name}_v: {{shape: [T, 2], dtype: float32, index: [t, r], value: "{name}.value[r]"}}')
            outputs.append(f'  {name}_i: {{shape: [T, 2], dtype: int32, index: [t, r], value: "{name}.index[r]"}}')
        else:
            reduce_lines.append(f'    {name}: "{op}({body})"')
            outputs.append(f'  {name}_o: {{shape: [T], dtype: float32, index: [t], value: "{name}"}}')
            scalars.append(name)
    passes = draw(st.integers(1, 2))
    return "\n".join(
        [
            "op: random_cascade",
            "axes: {T: rows, E: columns}",
            "args:",
            "  x: {shape: [T, E], dtype: [float32]}",
            "  y: {shape: [T, E], dtype: [float32]}",
            "checks:",
            '  - {expr: "E >= 2", message: "two candidates at least"}',
            "outputs:",
            *outputs,
            "cascade:",
            "  indices: {t: T, e: E, r: 2}",
            "  rows: [t]",
            "  over: e",
            "  reduce:",
            *reduce_lines,
            f"  passes: {passes}",
        ]
    )


@settings(max_examples=int(__import__("os").environ.get("ENGINE_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], derandomize=not __import__("os").environ.get("ENGINE_RANDOM"))
@given(text=cascade(), seed=st.integers(0, 10**6))
def test_random_cascades_are_rejected_or_correct(text, seed):
    spec = parse_spec(text, "random.yaml")
    try:
        op = analyze(spec)
    except FusionError as exc:
        assert exc.reduction and exc.condition and exc.detail  # a precise reason
        return
    case = op.cases[0]
    rng = random.Random(seed)
    prob = random_problem(case.ir, rng, max_size=7)
    ref = evaluate_direct(case, prob)
    assume(all(np.all(np.isfinite(v)) for v in ref.values()))
    for got in (evaluate_online(case, prob, rng), evaluate_merged(case, prob, rng, segments=3)):
        problems = compare(ref, got, 1e-8)
        assert not problems, (text, problems)
