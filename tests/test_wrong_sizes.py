"""A wrong size for every dimension of every tensor argument of every op, derived from the specs (specs/*.yaml):
each call must be refused with an error (and a correctly sized call, the baseline, must run).

The dimensions come from the spec: every dim of every tensor argument (optional ones passed) is made one larger,
except the dims whose size is free -- an axis named by that one dim only, where one more still passes every
check of the spec -- and those are checked to accept one more. Only the valid baseline call of each op is written here
(small shapes that pass the spec's checks); a spec without one fails, so that a new op gets its wrong-size tests.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import redfuser_ops  # noqa: F401 - loads the library
from generator.spec import load_spec, spec_files

SPECS = {s.name: s for s in (load_spec(p) for p in spec_files(Path(__file__).resolve().parent.parent / "specs"))}


def _valid(op: str) -> dict:
    """Arguments of a call that passes every check of the op's spec, by name."""
    g = torch.Generator().manual_seed(0)
    if op == "fused_attention":
        return {"q": torch.randn(2, 3, 4, 8, generator=g), "k": torch.randn(2, 5, 2, 8, generator=g),
                "v": torch.randn(2, 5, 2, 8, generator=g), "causal": False, "softmax_scale": None}
    if op == "sliding_window_attention":
        return {"q": torch.randn(2, 3, 4, 8, generator=g), "k": torch.randn(2, 5, 2, 8, generator=g),
                "v": torch.randn(2, 5, 2, 8, generator=g), "window": 2, "softcap": 50.0, "softmax_scale": None}
    if op in ("logsumexp", "row_softmax"):
        return {"x": torch.randn(3, 7, generator=g)}
    if op == "rms_norm_fp8_quant":
        return {"x": torch.randn(3, 7, generator=g), "weight": torch.rand(7, generator=g) + 0.5, "eps": 1e-6}
    if op == "vocab_topk":
        return {"logits": torch.randn(3, 7, generator=g), "k": 3}
    if op == "softmax_cross_entropy":
        return {"logits": torch.randn(3, 7, generator=g), "target": torch.tensor([0, 6, 2]),
                "label_smoothing": 0.0, "ignore_index": -100}
    if op == "moe_route":
        return {"logits": torch.randn(3, 16, generator=g), "topk": 2, "scoring": "softmax", "renormalize": False,
                "bias": torch.randn(16, generator=g), "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.0}
    if op == "mla_decode":
        return {"q": torch.randn(2, 1, 2, 576, generator=g), "kv_cache": torch.randn(4, 64, 1, 576, generator=g),
                "block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                "cache_seqlens": torch.tensor([70, 128], dtype=torch.int32), "head_dim_v": 512,
                "softmax_scale": None, "causal": False}
    if op == "fp8_quant_gemm":
        return {"x": torch.randn(3, 32, generator=g), "w": torch.randn(16, 32, generator=g).to(torch.float8_e4m3fn),
                "w_scale": torch.rand(16, generator=g) + 0.5, "bias": torch.randn(16, generator=g), "out_dtype": None}
    raise KeyError(op)


def _sizes(op: str, args: dict) -> dict:
    """The axis sizes and scalar values of a call (the names the spec's checks read)."""
    env = {a.name: args[a.name] for a in SPECS[op].scalars}
    for t in SPECS[op].tensors:
        for d, dim in enumerate(t.shape):
            if not dim.isdigit():
                env.setdefault(dim, args[t.name].shape[d])
    return env


def _checks_hold(op: str, env: dict) -> bool:
    return all(eval(c.expr, {"__builtins__": {}}, dict(env)) for c in SPECS[op].checks)


def _free_dims(op: str) -> set[tuple[str, int]]:
    """(tensor, dim) pairs whose size is free: the only use of an axis, where one more still passes every check of
    the spec (a kv_cache's number of pages, a block table's width, the number of queries or tokens)."""
    spec = SPECS[op]
    uses: dict[str, list[tuple[str, int]]] = {}
    for t in spec.tensors:
        for d, dim in enumerate(t.shape):
            uses.setdefault(dim, []).append((t.name, d))
    env = _sizes(op, _valid(op))
    out = set()
    for dim, where in uses.items():
        if len(where) == 1 and not dim.isdigit() and _checks_hold(op, {**env, dim: env[dim] + 1}):
            out.add(where[0])
    return out


def _cases(free: bool = False) -> list[tuple[str, str, int]]:
    out = []
    for name, spec in sorted(SPECS.items()):
        fd = _free_dims(name)
        for t in spec.tensors:
            for d in range(len(t.shape)):
                if ((t.name, d) in fd) == free:
                    out.append((name, t.name, d))
    return out


def _call(op: str, args: dict):
    spec = SPECS[op]
    return getattr(torch.ops.redfuser, op)(*[args[a.name] for a in spec.args])


def _grow(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t one larger along dim, the new entries copies of its last slice (valid values for index tensors)."""
    return torch.cat([t, t.narrow(dim, t.shape[dim] - 1, 1)], dim=dim)


def test_every_spec_has_a_valid_call_and_runs_it():
    for op in sorted(SPECS):
        out = _call(op, _valid(op))  # KeyError: a new op needs its valid call above
        outs = out if isinstance(out, (tuple, list)) else [out]
        assert all(torch.isfinite(o.double()).all() for o in outs if o.is_floating_point()), op


def test_cases_cover_every_op_and_the_index_tensors():
    covered = {(op, t) for op, t, _ in _cases()}
    # every op with a size two arguments share has cases (logsumexp's one tensor takes any size)
    assert {op for op, _ in covered} == {op for op, s in SPECS.items() if len(s.tensors) > 1}
    for op, spec in SPECS.items():
        for t in spec.tensors:
            if t.values:  # index tensors (block_table, cache_seqlens, targets) are sized by the other arguments
                assert (op, t.name) in covered, f"{op}.{t.name}: no dim of it has a wrong-size case"


@pytest.mark.parametrize("op, tensor, dim", _cases(free=True), ids=lambda x: str(x))
def test_a_free_dim_takes_any_size(op, tensor, dim):
    """The rule that exempts a dim holds: one more along it is a valid call."""
    args = _valid(op)
    args[tensor] = _grow(args[tensor], dim)
    out = _call(op, args)
    outs = out if isinstance(out, (tuple, list)) else [out]
    assert all(torch.isfinite(o.double()).all() for o in outs if o.is_floating_point()), op


@pytest.mark.parametrize("op, tensor, dim", _cases(), ids=lambda x: str(x))
def test_wrong_size_is_refused(op, tensor, dim):
    args = _valid(op)
    args[tensor] = _grow(args[tensor], dim)
    names = "|".join(re.escape(t.name) for t in SPECS[op].tensors)
    with pytest.raises(RuntimeError, match=rf"({names})\b|must"):
        _call(op, args)
