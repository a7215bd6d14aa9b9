"""An independent oracle for the engine: the plain unfused math of a cascade, in float64.

It reads only the cascade IR (the spec's meaning), never the engine's derivation: no guard, no safe value, no mask
value, no online or merge form. Each reduction runs over the whole axis, in cascade order, on the elements that the
cascade mask (for reductions over the cascade axis) and its own `where=` count, and reads the earlier results as
they are (a max of nothing is -inf, a sum of nothing is 0). An output takes its `empty:` value on a row where the
mask counts no element, and is otherwise the plain value, NaN included.

Where the plain math is NaN (0/0, inf - inf: an undefined value such as the softmax of a row of -inf) the oracle
does not judge; every other value, infinities included, must be reproduced by the online and merged forms.
Undefined propagates: on a row where a reduction's plain result is NaN, every output computed from it is
undefined too, also where the later math would wash the NaN out (a predicate compared with NaN is False, a
top-k ranks NaN keys after every number, so its indices would be numbers).

The rows it draws are adversarial as well as random: exact zeros of both signs, -inf entries, values around 0,
values whose exp overflows (1000) or underflows (-800), ties, and every tensor at once at such values.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import sympy as sp

from .evaluate import (
    ENTRY,
    NA,
    Evaluator,
    Problem,
    broadcast_to,
    evaluate_merged,
    evaluate_online,
    lift,
    random_problem,
    spread,
)
from .forms import Analysis
from .ir import CascadeIR, Reduction

# special element values: zeros of both signs, -inf, around 0, exp overflow / underflow, small and large integers
SPECIAL = (0.0, -0.0, -np.inf, 1e-300, -1e-300, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 1000.0, -1000.0, 800.0, -800.0,
           710.0, -745.5, 3.0, -3.0)


# --------------------------------------------------------------------------------------------- plain math
def _plain_select(key: NA, index: NA, valid: NA, payloads: dict[str, NA], dim: str, k: int, name: str) -> dict:
    """Top-k of counted elements: larger key first, NaN keys after every number, lower index first on ties.
    Entries no counted element fills: key -inf, index -1, payload 0, not valid."""
    arrays = [key, index, valid, *payloads.values()]
    dims = tuple(d for d in dict.fromkeys(d for a in arrays for d in a.dims) if d != dim) + (dim,)
    shape = np.broadcast_shapes(*[a.expand(dims).shape for a in arrays])
    K = np.broadcast_to(key.expand(dims), shape).astype(np.float64)
    idx = np.broadcast_to(index.expand(dims), shape).astype(np.int64)
    ok = np.broadcast_to(valid.expand(dims), shape).astype(bool)
    pays = {n: np.broadcast_to(v.expand(dims), shape).astype(np.float64) for n, v in payloads.items()}
    lead = shape[:-1]
    out_k = np.full(lead + (k,), -np.inf)
    out_i = np.full(lead + (k,), -1, dtype=np.int64)
    out_v = np.zeros(lead + (k,), dtype=bool)
    out_p = {n: np.zeros(lead + (k,)) for n in pays}
    for pos in itertools.product(*[range(s) for s in lead]):
        rows = [(0 if np.isnan(K[pos][j]) else 1, K[pos][j], -idx[pos][j], j)
                for j in range(shape[-1]) if ok[pos][j]]
        rows.sort(key=lambda t: (t[0], t[1] if t[0] else 0.0, t[2]), reverse=True)
        for slot, (_, _, _, j) in enumerate(rows[:k]):
            out_k[pos + (slot,)] = K[pos][j]
            out_i[pos + (slot,)] = idx[pos][j]
            out_v[pos + (slot,)] = True
            for n in pays:
                out_p[n][pos + (slot,)] = pays[n][pos][j]
    e = ENTRY + name
    nd = dims[:-1] + (e,)
    return {"value": NA(out_k, nd), "index": NA(out_i, nd), "__valid": NA(out_v, nd),
            **{n: NA(v, nd) for n, v in out_p.items()}}


def _plain_fold(op: str, body: NA, counted: NA, dim: str) -> NA:
    dims = tuple(dict.fromkeys(body.dims + counted.dims))
    b = body.expand(dims).astype(np.float64)
    c = counted.expand(dims).astype(bool)
    b, c = np.broadcast_arrays(b, c)
    ax = dims.index(dim)
    with np.errstate(all="ignore"):
        if op == "sum":
            data = np.sum(np.where(c, b, 0.0), axis=ax)
        elif op == "max":
            data = np.max(np.where(c, b, -np.inf), axis=ax, initial=-np.inf)
        else:
            data = np.min(np.where(c, b, np.inf), axis=ax, initial=np.inf)
    return NA(np.asarray(data), dims[:ax] + dims[ax + 1:])


class _Plain:
    def __init__(self, ir: CascadeIR, problem: Problem, round_casts: bool = False):
        self.ir = ir
        self.ev = Evaluator(ir, problem, round_casts=round_casts)  # the expression interpreter only: no analysis
        self.results: dict[str, Any] = {}
        self.undefined: dict[str, NA] = {}  # per reduction: where it is NaN or reads a result that is

    def reads(self, expr: Any) -> list[str]:
        """The reductions an expression reads (its state symbols and `name.field` entries)."""
        if not isinstance(expr, sp.Basic):
            return []
        names = {s.name for s in expr.free_symbols if isinstance(s, sp.Symbol)}
        names |= {str(a.base.label).split(".")[0] for a in expr.atoms(sp.Indexed)}
        return [r.name for r in self.ir.reductions if r.name in names]

    def undefined_from(self, exprs: list[Any]) -> NA:
        """True where one of the reductions the expressions read is undefined."""
        out = NA.scalar(False)
        for name in dict.fromkeys(n for e in exprs for n in self.reads(e)):
            out = lift(np.logical_or, out, self.undefined[name])
        return out

    def env(self) -> dict[sp.Basic, NA]:
        env = self.ev.index_env()
        for name, val in self.results.items():
            if isinstance(val, dict):
                for field, arr in val.items():
                    env[sp.IndexedBase(f"{name}.{field}")] = arr
            else:
                env[self.ir.states[name]] = val
        return env

    def reduce(self, r: Reduction) -> Any:
        ir = self.ir
        env = self.env()
        counted = lift(np.logical_and, NA.scalar(True), self.ev.ev(r.where, env))
        if r.over == ir.over:
            counted = lift(np.logical_and, counted, self.ev.ev(ir.mask, env))
        axes = [env[ir.indices[n]] for n in (*ir.rows, *r.free, r.over)]
        body = spread(self.ev.ev(r.body, env), axes)
        counted = spread(counted, axes)
        if r.selection:
            k = int(self.ev.ev(r.k, env).data)
            payloads = {n: self.ev.ev(e, env) for n, e in r.carry}
            return _plain_select(body, env[ir.indices[r.over]], counted, payloads, r.over, k, r.name)
        return _plain_fold(r.op, body, counted, r.over)

    def empty_rows(self) -> NA:
        """True on rows where the cascade mask counts no element of the cascade axis."""
        ir = self.ir
        env = self.ev.index_env()
        axes = [env[ir.indices[n]] for n in (*ir.rows, ir.over)]
        counted = spread(lift(np.logical_and, NA.scalar(True), self.ev.ev(ir.mask, env)), axes)
        return NA(~np.any(counted.expand(counted.dims), axis=counted.dims.index(ir.over)),
                  tuple(d for d in counted.dims if d != ir.over))

    def outputs(self) -> dict[str, np.ndarray]:
        out = {}
        empty = self.empty_rows()
        for o in self.ir.outputs:
            env = self.env()
            v = self.ev.ev(o.value, env)
            v = lift(lambda u, a: np.where(u, np.nan, a), self.undefined_from([o.value]), v)
            if o.empty is not None:
                v = lift(np.where, empty, self.ev.ev(o.empty, env), v)
            sizes = dict(self.ev.sizes)
            sizes.update({d: v.data.shape[v.dims.index(d)] for d in v.dims})
            out[o.name] = broadcast_to(v, o.index, sizes).expand(o.index).astype(np.float64)
        return out


def evaluate_plain(ir: CascadeIR, problem: Problem, round_casts: bool = False) -> dict[str, np.ndarray]:
    """The plain unfused math of the cascade (see the module docstring); round_casts: each cast rounds as its dtype
    does (Evaluator), where the engine's checks take casts as exact."""
    run = _Plain(ir, problem, round_casts)
    for r in ir.reductions:
        res = run.reduce(r)
        run.results[r.name] = res
        # a result that is NaN (undefined) makes everything computed from it undefined, also where the later math
        # would wash the NaN out: a comparison with NaN is False, a top-k ranks NaN keys after every number
        read = run.undefined_from([r.body, r.where, r.k, *[e for _, e in r.carry]])
        run.undefined[r.name] = read if isinstance(res, dict) else lift(np.logical_or, read, lift(np.isnan, res))
    return run.outputs()


# --------------------------------------------------------------------------------------------- judging
def judge(ref: dict[str, np.ndarray], got: dict[str, np.ndarray], rtol: float = 1e-9) -> list[str]:
    """Where the plain math is defined (not NaN), the result must be the same infinity or within rtol of the
    largest finite magnitude (at least 1) of that output."""
    problems = []
    for name, r in ref.items():
        g = got[name]
        if r.shape != g.shape:
            problems.append(f"{name}: shape {g.shape} != {r.shape}")
            continue
        judged = ~np.isnan(r)
        inf = judged & np.isinf(r)
        if np.any(inf & (g != r)):
            pos = np.argwhere(inf & (g != r))[0]
            problems.append(f"{name}{list(pos)}: {g[tuple(pos)]} where the plain math gives {r[tuple(pos)]}")
            continue
        fin = judged & ~inf
        if not fin.any():
            continue
        scale = max(1.0, float(np.max(np.abs(r[fin]))))
        with np.errstate(all="ignore"):
            err = np.where(fin, np.abs(np.nan_to_num(g, nan=np.inf) - r) / scale, 0.0)
        bad = np.argwhere(~(err <= rtol))
        if len(bad):
            pos = tuple(bad[0])
            problems.append(f"{name}{list(pos)}: {g[pos]} where the plain math gives {r[pos]}")
    return problems


def judged_fraction(ref: dict[str, np.ndarray]) -> float:
    total = sum(v.size for v in ref.values())
    return sum(int(np.sum(~np.isnan(v))) for v in ref.values()) / max(1, total)


# --------------------------------------------------------------------------------------------- adversarial rows
def adversarial_problem(ir: CascadeIR, rng: random.Random, max_size: int = 7) -> Problem:
    """A random problem whose floating tensors hold special values: per tensor one of a few patterns (every entry
    special, special and normal mixed, ties, a leading -inf run, zeros), and float arguments of either sign."""
    prob = random_problem(ir, rng, max_size=max_size)
    for arr in prob.tensors.values():
        if not np.issubdtype(arr.dtype, np.floating):
            continue
        flat = arr.reshape(-1)
        pattern = rng.randrange(6)
        for i in range(flat.size):
            if pattern == 0:
                flat[i] = rng.choice(SPECIAL)
            elif pattern == 1:
                flat[i] = rng.choice(SPECIAL) if rng.random() < 0.5 else rng.gauss(0.0, 1.0)
            elif pattern == 2:
                flat[i] = rng.choice((0.0, 1.0, -1.0, 2.0))  # ties
            elif pattern == 3:
                flat[i] = -np.inf if i % max(1, arr.shape[-1]) < rng.randint(0, 2) else rng.choice(SPECIAL[3:])
            elif pattern == 4:
                flat[i] = rng.choice((0.0, -0.0)) if rng.random() < 0.7 else rng.gauss(0.0, 1.0)
            else:
                flat[i] = rng.choice((-1000.0, -800.0, 800.0, 1000.0, 710.0, -745.5))
    for n, s in ir.scalars.items():
        if not s.is_integer and rng.random() < 0.5:
            value = rng.choice((-1.0, -0.5, 0.0, 1.0, 2.0, -3.0))
            env = {ir.axes[k]: sp.Integer(v) for k, v in prob.sizes.items()}
            env.update({ir.scalars[k]: sp.Float(value) if k == n else (sp.Integer(v) if isinstance(v, int)
                        else sp.Float(v)) for k, v in prob.scalars.items()})
            # never a value the op's checks refuse: `eps > 0` made eps a positive symbol (and its check trivial)
            signed = (s.is_positive and value <= 0) or (s.is_nonnegative and value < 0)
            if not signed and all(bool(c.xreplace(env)) for c in ir.checks):
                prob.scalars[n] = value
    return prob


def every_cut(n: int) -> list[int]:
    """Segment edges with a cut at every position and an empty segment at each end."""
    return [0] + list(range(n + 1)) + [n]


def check_forms(analysis: Analysis, problem: Problem, rng: random.Random, rtol: float = 1e-9) -> list[str]:
    """Online (random chunks and chunks of one) and merged (random segments, empty ones included, and a merge at
    every cut) results against the plain math."""
    ref = evaluate_plain(analysis.ir, problem)
    n = Evaluator(analysis.ir, problem).sizes[analysis.ir.over]
    runs = [
        ("online", evaluate_online(analysis, problem, rng)),
        ("online, chunks of one", evaluate_online(analysis, problem, rng, chunks=range(n + 1))),
        ("merged", evaluate_merged(analysis, problem, rng, segments=rng.randint(2, 4))),
        ("merged at every cut", evaluate_merged(analysis, problem, rng, edges=every_cut(n))),
    ]
    out = []
    for label, got in runs:
        out += [f"{label}: {p}" for p in judge(ref, got, rtol)]
    return out


def self_check(analysis: Analysis, seed: int = 0, trials: int = 2) -> list[str]:
    """The engine's own numeric check of the derived forms against the plain math: per trial one random problem
    and one adversarial one, each run online (random chunks, chunks of one) and merged (random segments, every
    cut)."""
    rng = random.Random(seed)
    problems: list[str] = []
    for _ in range(trials):
        for prob in (random_problem(analysis.ir, rng, max_size=5), adversarial_problem(analysis.ir, rng, 5)):
            problems += check_forms(analysis, prob, rng)
            if problems:
                return problems
    return problems


__all__ = [
    "SPECIAL",
    "adversarial_problem",
    "check_forms",
    "evaluate_plain",
    "every_cut",
    "judge",
    "judged_fraction",
    "self_check",
]
