"""The symbolic fusion engine: cascade IR, the three fusion conditions, fused/online/merge forms."""

from __future__ import annotations

from ..errors import FusionError
from ..spec import OpSpec
from .forms import Analysis, OpAnalysis, analyze
from .oracle import self_check


def derive(spec: OpSpec, verify: bool = True, seed: int = 0, trials: int = 1) -> OpAnalysis:
    """Analyse every specialisation of a spec and check the derived forms numerically (online and merged
    evaluation against the unfused cascade on small random problems). Raises FusionError/SpecError."""
    op = analyze(spec)
    if verify:
        for case in op.cases:
            problems = self_check(case, seed=seed, trials=trials)
            if problems:
                first = case.reductions[0]
                raise FusionError(first.loc, "*", "numeric check",
                                  f"[{case.ir.label}] the derived forms disagree with the unfused cascade: "
                                  + "; ".join(problems[:3]))
    return op


__all__ = ["Analysis", "OpAnalysis", "analyze", "derive"]
