"""Order rules: when a selection's key is a strictly increasing function of one element value, the elements may be
selected on that value (the same order, ties included: equal values give equal keys) and the key computed only for
the selected ones. A softmax probability exp(x - m) / z and a sigmoid(x) are such keys of x.

`increasing_in` proves it by structure (no sampling): a sum of increasing parts and finite constants, a positive
constant times an increasing part, exp and sigmoid of an increasing argument. What it proves holds for real
numbers under the conditions it returns on the constants (finite; a coefficient positive); a kernel checks them
per row and falls back to the key where they fail (a row with m = inf or z = 0 is not ordered by x)."""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from .expr import sigmoid

INCREASING_FUNCTIONS = (sp.exp, sigmoid)


@dataclass(frozen=True)
class Condition:
    """A condition on an expression free of the element value: finite, or finite and > 0."""

    expr: sp.Expr
    positive: bool


def _constant(e: sp.Expr, v: sp.Symbol, constants: frozenset[sp.Symbol]) -> bool:
    """e is free of v and made only of numbers and symbols known constant over the elements (no tensor reads)."""
    return not e.atoms(sp.Indexed) and e.free_symbols <= constants and v not in e.free_symbols


def increasing_in(e: sp.Expr, v: sp.Symbol, constants: frozenset[sp.Symbol]) -> list[Condition] | None:
    """The conditions on constants under which e is strictly increasing in v (every other symbol of e must be in
    `constants`), or None where no rule shows it."""
    if e == v:
        return []
    if v not in e.free_symbols:
        return None
    if isinstance(e, sp.Add):
        conds: list[Condition] = []
        for part in e.args:
            if v in part.free_symbols:
                c = increasing_in(part, v, constants)
                if c is None:
                    return None
                conds += c
            elif _constant(part, v, constants):
                if not part.is_number:
                    conds.append(Condition(part, False))  # x + inf is not increasing
                elif not part.is_finite:
                    return None
            else:
                return None
        return conds
    if isinstance(e, sp.Mul):
        inside = [a for a in e.args if v in a.free_symbols]
        coef = sp.Mul(*[a for a in e.args if v not in a.free_symbols])
        if len(inside) != 1 or not _constant(coef, v, constants):
            return None
        c = increasing_in(inside[0], v, constants)
        if c is None:
            return None
        if coef.is_number:
            return c if (coef.is_positive and coef.is_finite) else None
        return c + [Condition(coef, True)]
    if isinstance(e, INCREASING_FUNCTIONS) and len(e.args) == 1:
        return increasing_in(e.args[0], v, constants)
    return None


__all__ = ["Condition", "increasing_in"]
