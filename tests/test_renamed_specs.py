"""A copy of a spec with every axis, argument and output renamed is the same op: the engine gives the same results,
and the generator the same CPU kernels and glue, the same TileLang programs and the same impl_cuda launch code, up
to the names. The copies are tests/specs/renamed/*.yaml; MAPPINGS says which name became which."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest

from generator.codegen.cpu import cpu_source
from generator.codegen.cuda import TEMPLATES, choose_template
from generator.codegen.glue import glue_source
from generator.spec import load_spec
from generator.symbolic import derive
from generator.symbolic.evaluate import Problem, evaluate_online, random_problem
from generator.symbolic.oracle import evaluate_plain

ROOT = Path(__file__).resolve().parent.parent
MAPPINGS = {
    "fused_attention": {"fused_attention": "attn_renamed", "B": "nb", "Sq": "nq", "Sk": "nkv", "H": "Hq",
                        "Hk": "Hkv", "D": "hd", "q": "qx", "k": "kx", "v": "vx", "causal": "is_causal",
                        "softmax_scale": "qk_scale", "out": "o_out", "lse": "lse_out"},
    "moe_route": {"moe_route": "router_renamed", "T": "ntok", "E": "nexp", "logits": "scores_in", "topk": "top_n",
                  "scoring": "score_fn", "renormalize": "renorm", "bias": "ebias", "n_group": "ngroups",
                  "topk_group": "keep_groups", "routed_scaling_factor": "wscale", "weights": "w_out",
                  "ids": "id_out"},
    "softmax_cross_entropy": {"softmax_cross_entropy": "ce_renamed", "T": "ntok", "V": "ncls", "logits": "scores",
                              "target": "labels", "label_smoothing": "smooth", "ignore_index": "skip_label",
                              "loss": "nll"},
}


def _normalise(text: str, mapping: dict[str, str]) -> str:
    """The renamed spec's names back to the original's, where they stand as names (`_` separates)."""
    back = {new: old for old, new in mapping.items()}
    pat = re.compile(r"(?<![A-Za-z0-9])(" + "|".join(sorted(map(re.escape, back), key=len, reverse=True)) +
                     r")(?![A-Za-z0-9])")
    return pat.sub(lambda m: back[m.group(1)], text)


@pytest.fixture(scope="module", params=sorted(MAPPINGS))
def pair(request):
    name = request.param
    orig = load_spec(ROOT / "specs" / f"{name}.yaml")
    renamed = load_spec(ROOT / "tests" / "specs" / "renamed" / f"{name}.yaml")
    return name, (orig, derive(orig)), (renamed, derive(renamed)), MAPPINGS[name]


def test_every_axis_and_argument_is_renamed(pair):
    _, (orig, _), (renamed, _), mapping = pair
    names = {a.name for a in orig.axes} | {a.name for a in orig.args} | {o.name for o in orig.outputs}
    assert names <= set(mapping) and not names & ({a.name for a in renamed.args} | {a.name for a in renamed.axes})


def test_same_results(pair):
    _, (_, op_a), (_, op_b), mapping = pair
    assert len(op_a.cases) == len(op_b.cases)
    rng = random.Random(5)
    for a, b in zip(op_a.cases, op_b.cases):
        assert [(mapping.get(k, k), v) for k, v in a.ir.specialization] == list(b.ir.specialization)
        for _ in range(3):
            p = random_problem(a.ir, rng, max_size=7)
            q = Problem({mapping[k]: v for k, v in p.sizes.items()}, {mapping[k]: v for k, v in p.scalars.items()},
                        {mapping[k]: v for k, v in p.tensors.items()})
            # the plain math (the oracle) and the engine's online form (the same random chunks for both)
            for ra, rb in ((evaluate_plain(a.ir, p), evaluate_plain(b.ir, q)),
                           (evaluate_online(a, p, random.Random(1)), evaluate_online(b, q, random.Random(1)))):
                assert {mapping[k] for k in ra} == set(rb)
                for k, val in ra.items():
                    np.testing.assert_array_equal(val, rb[mapping[k]])


def test_same_cpu_kernels_and_glue(pair):
    name, (sa_, op_a), (sb, op_b), mapping = pair
    a = cpu_source(op_a, f"{name}_cpu.h") + glue_source(sa_, op_a, f"{name}_cpu.h", None, "v")
    b = cpu_source(op_b, f"{mapping[name]}_cpu.h") + glue_source(sb, op_b, f"{mapping[name]}_cpu.h", None, "v")
    b = _normalise(b, mapping).replace(sb.file, sa_.file)
    assert a.split("\n") == b.split("\n")


def _cuda(spec, op):
    name, plan, _ = choose_template(spec, op, list(spec.variants.cuda.families))  # named, or the first accepting
    body_fn = TEMPLATES[name][1]
    # launchers as if lowered: every parameter a template's program declares, bound by name
    lowered = {j.symbol: {"params": _launcher_params(j.program), "family": j.family} for j in plan.jobs}
    return {j.symbol: j.program for j in plan.jobs}, body_fn(spec, plan, lowered)


def _launcher_params(program: str) -> list[tuple]:
    """The kernel arguments of a TileLang program text (tensors, scalars, dynamic sizes), then the stream."""
    out = []
    for m in re.finditer(r"^\s+(\w+?)(?:_ptr)?: T\.(\w+),$", program, re.MULTILINE):
        kind = "pointer" if m.group(2) == "ptr" else "scalar"
        out.append((m.group(1), kind, m.group(2), "void*" if kind == "pointer" else "int32_t"))
    for m in re.finditer(r"^\s+(\w+): T\.(?:Strided)?Tensor", program, re.MULTILINE):
        out.append((m.group(1), "pointer", "", "void*"))
    m = re.search(r"^\s+([\w, ]+) = T\.dynamic\(", program, re.MULTILINE)
    if m:
        out += [(n.strip(), "dim", "int32", "int32_t") for n in m.group(1).split(",")]
    return out + [("stream", "stream", "", "cudaStream_t")]


def test_same_cuda_programs_and_launch_code(pair):
    _, (sa_, op_a), (sb, op_b), mapping = pair
    progs_a, body_a = _cuda(sa_, op_a)
    progs_b, body_b = _cuda(sb, op_b)
    norm_b = {_normalise(k, mapping): _normalise(v, mapping).replace(sb.file, sa_.file) for k, v in progs_b.items()}
    assert sorted(progs_a) == sorted(norm_b) and len(progs_a) > 0
    for sym, text in progs_a.items():
        # a resident_row program's header carries the digest of its step program, which holds the names
        a_, b_ = (re.sub(r"\(digest [0-9a-f]+\)", "(digest)", x).split("\n") for x in (text, norm_b[sym]))
        assert a_ == b_, sym
    assert body_a == [_normalise(x, mapping) for x in body_b]
