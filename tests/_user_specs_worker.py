"""The process that calls the CPU kernels of a library built from user specs (tests/test_user_specs.py) and judges
them against the engine's plain float64 math of the same spec (generator.symbolic.oracle.evaluate_plain).

Run as `python tests/_user_specs_worker.py LIB SPECS_DIR SEED DRAWS`: loads LIB (its ops register under
torch.ops.redfuser, so it runs in its own process, apart from an installed redfuser_ops), and for every spec in
SPECS_DIR, every specialisation (case) and every CPU dtype of the spec draws DRAWS problems: small sizes from the
engine's random_problem, the reduced axis long enough for more than one of the kernels' chunks, inputs
rounded to the dtype before the reference sees them, every third call's inputs strided, every fourth call's with
special values; from the first call of each case and dtype, bad inputs (check_bad_inputs). Prints one JSON object: {op: {"calls": n, "failures": [...]}}.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import sympy as sp
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's generator (the engine's plain math)

from layouts import layout

from generator.spec import TensorArg, load_spec
from generator.symbolic import derive
from generator.symbolic.evaluate import _domain, random_problem
from generator.symbolic.expr import Cast
from generator.symbolic.oracle import evaluate_plain, judge

# the reduced axis: one element, about a chunk, more than one (the kernels' chunks are 256 or 512 elements)
LONG = (1, 2, 255, 256, 257, 600)
# judge()'s rtol (of the output's largest finite magnitude, at least 1) for a float output of the dtype: the
# output's rounding (half an ulp) and float32 sums; integer outputs (selected ids) must be equal
RTOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}


def _over_axis(spec) -> str | None:
    """The axis the cascade reduces over, where its extent is one axis of the spec (else None)."""
    ext = {i: e for i, e, _ in spec.cascade.indices}.get(spec.cascade.over, "")
    return ext if ext in {a.name for a in spec.axes} else None


def _has_casts(op) -> bool:
    """Whether the math rounds somewhere (a cast in a let, a reduction or an output value)."""

    def walk(e) -> bool:
        return isinstance(e, Cast) or any(walk(a) for a in getattr(e, "args", ()))

    ir = op.cases[0].ir
    return any(walk(x.expr) for x in ir.lets) or any(walk(r.body) for r in ir.reductions) or \
        any(walk(o.value) for o in ir.outputs)


def _judge_rounding(ref: dict, exact: dict, got: dict, rtol: float, totals: dict) -> list[str]:
    """Where the math rounds (a cast), the kernels' fused form may round elsewhere than the plain math (ACCEPTANCE:
    a chunk quantised with the running row max, at a finer scale than the row's): judged by the error against the
    exact (unrounded) math. Per call, where few values are judged and either error may be small by chance, only a
    gross bound (4x the rounded plain math's mean error plus 5 % of the output's largest magnitude, at least 1:
    a chunk lost or a wrong scale is far past it); summed over a spec's calls (totals, per output: [error, plain
    error, values]), at most twice the plain math's error plus rtol per value (finish_rounding)."""
    problems = []
    for name, r in ref.items():
        e, g = exact[name], got[name]
        ok = ~np.isnan(r) & ~np.isnan(e) & np.isfinite(e)
        if g.shape != r.shape:
            problems.append(f"{name}: shape {g.shape} != {r.shape}")
            continue
        if not ok.any():
            continue
        scale = max(1.0, float(np.max(np.abs(e[ok]))))
        err_got = np.abs(np.nan_to_num(g[ok], nan=np.inf) - e[ok])
        err_plain = np.abs(r[ok] - e[ok])
        t = totals.setdefault(name, [0.0, 0.0, 0])
        t[0], t[1], t[2] = t[0] + float(err_got.sum()), t[1] + float(err_plain.sum()), t[2] + int(ok.sum())
        if not err_got.mean() <= 4 * err_plain.mean() + 0.05 * scale:
            problems.append(f"{name}: mean error {err_got.mean():.3g} against the exact math, the rounded plain "
                            f"math's {err_plain.mean():.3g}")
    return problems


def finish_rounding(totals: dict, rtol: float) -> list[str]:
    """The summed errors of _judge_rounding: at most twice the rounded plain math's, plus rtol per value."""
    return [f"{name}: error {got:.4g} summed over {n} values against the exact math, the rounded plain math's "
            f"{plain:.4g}" for name, (got, plain, n) in totals.items() if not got <= 2 * plain + rtol * n]


def _special_values(prob, rng: random.Random) -> None:
    """Every fourth draw: each float tensor (in place) gets one of the values that the kernels handle apart from the
    rest: ties (a few values, for the lower-index rule of selections), a leading run of -inf in each row (masked
    elements, and rows of nothing but -inf), -inf scattered, signed zeros."""
    for arr in prob.tensors.values():
        if arr.dtype.kind != "f" or arr.size == 0:
            continue
        flat = arr.reshape(-1, arr.shape[-1]) if arr.ndim else arr.reshape(1, 1)
        pattern = rng.randrange(4)
        for row in flat:
            if pattern == 0:
                row[:] = [rng.choice((0.0, 1.0, -1.0, 2.0)) for _ in range(row.size)]
            elif pattern == 1:
                row[: rng.choice((0, 1, row.size // 2, row.size))] = -np.inf
            elif pattern == 2:
                row[[rng.random() < 0.3 for _ in range(row.size)]] = -np.inf
            else:
                row[[rng.random() < 0.7 for _ in range(row.size)]] = 0.0
                row[[rng.random() < 0.5 for _ in range(row.size)] & (row == 0)] = -0.0


def _moved(v, rng):
    """v with each distinct value moved by about 1e-6 of itself (equal values alike: exact ties stay ties)."""
    uniq, inv = np.unique(v, return_inverse=True)
    with np.errstate(invalid="ignore"):
        return (uniq * (1 + 1e-6 * rng.standard_normal(uniq.shape)))[inv].reshape(v.shape)


def _row_dims(spec, name: str) -> list[tuple[int, str]]:
    """(position, row index) of each of an output's dimensions that runs over a row index."""
    index = next(o.index for o in spec.outputs if o.name == name)
    return [(i, x) for i, x in enumerate(index) if x in spec.cascade.rows]


def _tied_rows(spec, ir, prob, ref: dict, ints: set, rng):
    """Rows whose selected entries change when the float inputs move by 1e-6 of themselves: keys that differ by
    less than float32 resolves (sigmoid(x) + bias of two experts 3e-8 apart in float64, equal in float32), where
    the kernel's order of the two is its rounding's and not the lower-index rule's of the float64 math. Returns
    (row index names, a boolean array over them)."""
    name = min(ints)
    dims = _row_dims(spec, name)
    axes = tuple(i for i, _ in dims)
    rest = tuple(i for i in range(ref[name].ndim) if i not in axes)
    tied = np.zeros([ref[name].shape[i] for i in axes], dtype=bool)
    for _ in range(2):
        moved = {k: _moved(v, rng) if v.dtype.kind == "f" else v for k, v in prob.tensors.items()}
        other = evaluate_plain(ir, type(prob)(prob.sizes, prob.scalars, moved), round_casts=True)
        for k in ints:
            diff = ~((other[k] == ref[k]) | (np.isnan(other[k]) & np.isnan(ref[k])))
            tied |= np.transpose(diff, axes + rest).reshape(tied.shape + (-1,)).any(axis=-1)
    return [x for _, x in dims], tied


def _drop_rows(spec, name: str, v, ties):
    """The output with the tied rows' values NaN (not judged); an output over other row indices is kept."""
    names, tied = ties
    dims = _row_dims(spec, name)
    if not tied.any() or sorted(x for _, x in dims) != sorted(names):
        return v
    mine = [x for _, x in dims]
    mask = np.transpose(tied, [names.index(x) for x in mine])  # the row dimensions in this output's order
    shape = [1] * v.ndim
    for (i, _), n in zip(dims, mask.shape):
        shape[i] = n
    return np.where(np.broadcast_to(mask.reshape(shape), v.shape), np.nan, v.astype(np.float64))


def _call_args(spec, case, prob, dtype: str, rng: random.Random, strided: bool):
    """The op's positional arguments (spec order) and the problem with its float tensors rounded to dtype; strided:
    each tensor transposed in memory or every other element of a dimension twice as long (tests/layouts.py)."""
    special = dict(case.ir.specialization)
    args, tensors = [], dict(prob.tensors)
    for a in spec.args:
        if isinstance(a, TensorArg) and special.get(a.name) == "absent":  # an optional tensor this case leaves out
            args.append(None)
        elif isinstance(a, TensorArg):
            arr = prob.tensors[a.name]
            dts = a.dtypes or spec.arg(a.same_as).dtypes
            if arr.dtype.kind in "iu":
                t = torch.from_numpy(arr).to(getattr(torch, rng.choice([d for d in dts if d.startswith("int")])))
            else:
                t = torch.from_numpy(arr).to(getattr(torch, dtype))
                tensors[a.name] = t.double().numpy()
            args.append(layout(t, rng) if strided else t)
        elif a.name in special:
            args.append(special[a.name])
        elif a.name in prob.scalars:
            args.append(prob.scalars[a.name])
        elif a.has_default:
            args.append(a.default)
        else:
            raise ValueError(f"{spec.name}: no value for argument {a.name}")
    return args, type(prob)(prob.sizes, prob.scalars, tensors)


def _bad_calls(spec, args: list, prob) -> list[tuple[str, list, str, object]]:
    """(what, arguments, the name the error must give, None or the problem they are) for inputs derived from the
    spec: each tensor in a dtype it does not allow and with a dimension fewer, a size that disagrees with an axis an
    earlier tensor fixed (all refused), an index value just outside its declared domain (refused where the value
    is used as an index or a length; a value only compared, a class target, is legal: then the problem to judge)."""
    out, fixed = [], set()
    env = {sp.Symbol(n): v for n, v in prob.sizes.items()}
    for i, a in enumerate(spec.args):
        if not isinstance(a, TensorArg):
            continue
        t = args[i]
        if t is None:  # an optional tensor left out of this case
            continue
        other = torch.float64 if t.is_floating_point() else torch.float32
        out.append((f"{a.name} as {other}", _with(args, i, t.to(other)), a.name, None))
        out.append((f"{a.name} with a dimension fewer", _with(args, i, t[0]), a.name, None))
        for d, ax in enumerate(a.shape):
            if ax in fixed:
                shape = list(t.shape)
                shape[d] += 1
                out.append((f"{a.name}.size({d}) not {ax}", _with(args, i, torch.zeros(shape, dtype=t.dtype)), a.name,
                            None))
        fixed |= set(a.shape)
        if a.values and not t.is_floating_point():
            lo, hi = _domain(a.values, env)
            for v in (lo - 1, hi + 1):
                u = t.clone()
                u.view(-1)[0] = v
                moved = dict(prob.tensors)
                moved[a.name] = u.long().numpy()
                out.append((f"{a.name} holding {v}, outside {a.values}", _with(args, i, u), a.name,
                            type(prob)(prob.sizes, prob.scalars, moved)))
    return out


def _with(args: list, i: int, t) -> list:
    out = list(args)
    out[i] = t
    return out


def check_bad_inputs(spec, ir, fn, args: list, prob, dtype: str, casts: bool) -> list[str]:
    """Each bad call must raise a RuntimeError that names the op and the argument (not crash), or, for a value
    outside a domain that the op does not refuse, give the plain math's result of it (judge_call)."""
    problems = []
    for what, bad, name, legal in _bad_calls(spec, args, prob):
        try:
            out = fn(*bad)
        except RuntimeError as e:
            msg = str(e)
            if f"redfuser::{spec.name}" not in msg or name not in msg:
                problems.append(f"{what}: the error does not name {name}: {msg.splitlines()[0][:200]}")
            continue
        if legal is None:
            problems.append(f"{what}: no error")
        else:
            problems += [f"{what}: {p}" for p in judge_call(spec, ir, legal, out, dtype, casts, 0, {})]
    return problems


def judge_call(spec, ir, prob, out, dtype: str, casts: bool, seed: int, totals: dict) -> list[str]:
    """One call's outputs against the plain math of its (dtype-rounded) problem: judge()'s rule, or where the math
    rounds _judge_rounding's; integer outputs equal, rows tied at float32's resolution not judged."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    got = {o.name: t.double().numpy() if t.is_floating_point() else t.long().numpy()
           for o, t in zip(spec.outputs, outs)}
    ref = evaluate_plain(ir, prob, round_casts=True)
    exact = evaluate_plain(ir, prob) if casts else ref
    ints = {k for k, v in got.items() if v.dtype.kind in "iu"}
    if ints:  # a selection
        ties = _tied_rows(spec, ir, prob, ref, ints, np.random.default_rng(seed))
        ref = {k: _drop_rows(spec, k, v, ties) for k, v in ref.items()}
        exact = {k: _drop_rows(spec, k, v, ties) for k, v in exact.items()}
    floats = {k: ref[k] for k in ref if k not in ints}
    problems = judge(floats, got, RTOL[dtype]) if not casts else _judge_rounding(floats, exact, got, RTOL[dtype],
                                                                                 totals)
    for k in ints:
        r = ref[k]
        ok = ~np.isnan(r)
        if r.shape != got[k].shape or not np.array_equal(got[k][ok], r[ok].astype(np.int64)):
            problems.append(f"{k}: {got[k].tolist()} where the plain math gives {r.tolist()}")
    return problems


def check_spec(spec_path: Path, seed: int, draws: int) -> tuple[str, dict]:
    spec = load_spec(spec_path)
    op = derive(spec)
    fn = getattr(torch.ops.redfuser, spec.name)
    rng = random.Random(f"{seed}/{spec.name}")
    over = _over_axis(spec)
    casts = _has_casts(op)
    calls, failures = 0, []
    for case in op.cases:
        for dtype in spec.variants.cpu_dtypes:
            totals: dict = {}
            for n in range(draws):
                fixed = {over: LONG[n % len(LONG)]} if over else {}
                try:
                    prob = random_problem(case.ir, rng, max_size=6, fixed=fixed)
                except ValueError:  # the spec's checks reject that length (e.g. a multiple of 16)
                    prob = random_problem(case.ir, rng, max_size=6)
                if n % 4 == 3:
                    _special_values(prob, rng)
                args, prob = _call_args(spec, case, prob, dtype, rng, strided=n % 3 == 1)
                torch.set_num_threads(1 + n % 2)  # the parallel split as well as one thread
                where = f"[{case.ir.label}] {dtype} sizes {prob.sizes} scalars {prob.scalars} (draw {n})"
                if n == 0:  # bad inputs made from this call's
                    failures += [f"{where}, bad input: {p}"
                                 for p in check_bad_inputs(spec, case.ir, fn, args, prob, dtype, casts)]
                problems = judge_call(spec, case.ir, prob, fn(*args), dtype, casts, n, totals)
                calls += 1
                if problems:
                    failures.append(f"{where}: {'; '.join(problems)}")
            failures += [f"[{case.ir.label}] {dtype}, all {draws} calls: {p}" for p in finish_rounding(totals,
                                                                                                    RTOL[dtype])]
    return spec.name, {"calls": calls, "failures": failures[:5], "n_failures": len(failures)}


def main(argv: list[str]) -> int:
    lib, specs_dir, seed, draws = argv[0], Path(argv[1]), int(argv[2]), int(argv[3])
    torch.ops.load_library(lib)
    report = dict(check_spec(p, seed, draws) for p in sorted(specs_dir.glob("*.yaml")))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
