"""The bridges from the engine's forms to the kernel templates (generator/codegen/templates/*_bridge.py), checked on the CPU.

- fused_attention: the AttentionMath rendered from the engine's forms runs through the template's own numpy
  simulation of the emitted schedule (tiles, masks, guards, split-KV merge) against the float64 reference;
- moe_route: the step program derived from the spec is the one the resident_row template's CPU simulation runs
  in tests/test_resident_row_template.py (program "moe_route_engine"); here its structure is checked;
- the split heuristic's C++ (generated into the launcher) agrees with the template's Python;
- a cascade of another shape is refused by a bridge with a reason.
"""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from generator.codegen.bridge import BridgeError
from generator.codegen.templates import resident_row as rr
from generator.codegen.templates import stream_attention as sa
from generator.codegen.templates.resident_row_bridge import row_program
from generator.codegen.templates.stream_attention_bridge import attention_math
from generator.spec import load_spec, parse_spec
from generator.symbolic import derive

ROOT = Path(__file__).resolve().parent.parent


def _attention_reference(q, k, v, causal, scale):
    """float64 attention (bottom-right causal; rows that see no key: out 0, lse -inf), numpy only."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    _, Sq, H, _ = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    kr, vr = np.repeat(k, H // Hk, axis=2), np.repeat(v, H // Hk, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    if causal:
        s = np.where(np.arange(Sk)[None, :] <= np.arange(Sq)[:, None] + Sk - Sq, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    l_ = p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", np.where(l_ > 0, p / np.where(l_ > 0, l_, 1), 0), vr)
    with np.errstate(divide="ignore"):
        return o, (m + np.log(l_))[..., 0]


@pytest.fixture(scope="module")
def attention():
    op = derive(load_spec(ROOT / "specs" / "fused_attention.yaml"))
    return {causal: attention_math(a)[:2] for a in op.cases for causal in [dict(a.ir.specialization)["causal"]]}


def test_attention_math_is_the_engines(attention):
    math, band = attention[True]
    assert band is not None and band.lo is None and band.name == "causal"
    names = [s.name for s in math.states]
    assert names == ["m", "l"]
    l_state = math.states[1]
    # the correction and P come out of the engine: exp(m_old - m_safe), guarded for an empty prefix
    assert "T.exp((m_old - m_safe))" in l_state.correction and "m_old == -T.infinity" in l_state.correction
    assert l_state.term == math.weight == "T.exp((s - m_safe))"
    assert math.acc_correction == l_state.correction
    assert math.out.startswith("T.if_then_else((l == T.float32(0.0))")
    assert math.merge.acc_term.startswith("(o_seg * ")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sq, Sk, H, Hk", [(37, 5, 4, 2), (70, 300, 2, 1), (1, 1, 2, 2), (128, 129, 3, 3)])
@pytest.mark.parametrize("splits", [1, 3])
def test_engine_math_through_the_template_schedule(attention, causal, Sq, Sk, H, Hk, splits):
    math, _ = attention[causal]
    rng = np.random.default_rng(Sq * 31 + Sk)
    q = rng.standard_normal((2, Sq, H, 64)).astype(np.float32)
    k = rng.standard_normal((2, Sk, Hk, 64)).astype(np.float32)
    v = rng.standard_normal((2, Sk, Hk, 64)).astype(np.float32)
    q[0, 0] *= -300.0  # a row whose scores are all far below zero: the first correction must not overflow
    o, lse = sa.simulate(math, q, k, v, causal, {"fparam0": 0.125}, num_splits=splits)
    ro, rl = _attention_reference(q, k, v, causal, 0.125)
    assert np.isfinite(o).all()
    assert np.abs(o - ro).max() < 2e-5
    finite = np.isfinite(rl)
    assert np.array_equal(np.isfinite(lse), finite) and np.array_equal(lse[~finite], rl[~finite])
    assert np.abs(lse[finite] - rl[finite]).max() < 1e-3


def test_every_attention_variant_emits(attention):
    for causal, (math, _) in attention.items():
        for fam in sa.FAMILIES:
            for dt in sa.DTYPES:
                for d in sa.HEAD_DIMS:
                    for split in (False, True):
                        cfg = sa.default_config(fam, dt, d, causal, split)
                        compile(sa.emit_attention_program(math, cfg), cfg.variant_name(), "exec")
                        if split:
                            compile(sa.emit_combine_program(math, cfg), cfg.combine_variant_name(), "exec")


def test_moe_route_program_structure():
    spec = load_spec(ROOT / "specs" / "moe_route.yaml")
    prog = row_program(spec, derive(spec))
    rr.check_program(prog)
    flat = []

    def walk(steps):
        for s in steps:
            if isinstance(s, rr.If):
                flat.append(("If", s.cond))
                walk(s.then)
                walk(s.orelse)
            else:
                flat.append((type(s).__name__, getattr(s, "name", getattr(s, "ids", getattr(s, "output", "")))))

    walk(prog.steps)
    kinds = [k for k, _ in flat]
    # one top-k over the experts shared by every mode; group reductions and selection for n_group > 1
    assert kinds.count("TopK") == 1 and ("If", "n_group > 1") in flat
    assert ("If", "scoring == 1") in flat and ("If", "has_bias == 0") in flat and ("If", "renormalize == 0") in flat
    assert [p.name for p in prog.params] == ["scoring", "renormalize", "has_bias", "n_group", "topk_group",
                                             "routed_scaling_factor"]


def test_bridge_refuses_other_shapes():
    text = (ROOT / "tests" / "specs" / "softmax_topk_renorm.yaml").read_text()
    op = derive(parse_spec(text, "softmax_topk_renorm.yaml"))
    with pytest.raises(BridgeError, match="stream_attention runs one streaming pass"):
        attention_math(op.cases[0])
    op = derive(load_spec(ROOT / "tests" / "specs" / "logsumexp.yaml"))
    with pytest.raises(BridgeError, match="needs exactly one weighted sum carried over a free index"):
        attention_math(op.cases[0])


def test_split_heuristic_cpp_matches_python(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed (it builds the library too)"
    rng = random.Random(0)
    cases = [(rng.choice([1, 2, 4, 16]), rng.choice([1, 8, 32, 64]), rng.choice([1, 2, 7, 128, 1000, 8192]),
              rng.choice([1, 64, 512, 4096, 65536, 131072]), rng.choice([64, 128]), rng.choice([32, 64, 128]),
              rng.choice([78, 108, 132])) for _ in range(400)]
    src = tmp_path / "t.cpp"
    src.write_text("#include <cstdint>\n#include <cstdio>\n" + sa.NUM_SPLITS_CPP + "int main() {\n" + "".join(
        f"  std::printf(\"%d\\n\", choose_num_splits({', '.join(map(str, c))}));\n" for c in cases) + "}\n")
    subprocess.run([cxx, "-O1", str(src), "-o", str(tmp_path / "t")], check=True)
    got = subprocess.run([str(tmp_path / "t")], capture_output=True, text=True, check=True).stdout.split()
    want = [sa.choose_num_splits(*c) for c in cases]
    assert [int(x) for x in got] == want
    assert any(w > 1 for w in want) and any(w == 1 for w in want)


# ---- masks read as bands of keys per query row (specs/sliding_window_attention.yaml)
@pytest.fixture(scope="module")
def window_attention():
    op = derive(load_spec(ROOT / "specs" / "sliding_window_attention.yaml"))
    return attention_math(op.cases[0])


def test_sliding_window_band_is_read_from_the_mask(window_attention):
    _, band, roles = window_attention
    # j <= i + Sk - Sq and j > i + Sk - Sq - window: two affine bounds, the window an int kernel argument
    assert band.hi == "r - seqlen_q + seqlen_k + 1" and band.lo == "r - seqlen_q + seqlen_k - iparam0 + 1"
    assert band.params == ("iparam0",) and roles.int_params == ("window",)
    assert roles.float_params == ("softcap", "softmax_scale")
    assert dict(roles.empty) == {"out": 0.0, "lse": -np.inf}


@pytest.mark.parametrize("Sq, Sk, window", [(37, 5, 3), (70, 300, 1), (70, 300, 100), (128, 129, 64), (1, 1, 1),
                                            (200, 200, 1000), (9, 150, 17)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("block_m, block_n", [(64, 64), (16, 32)])
def test_sliding_window_through_the_template_schedule(window_attention, Sq, Sk, window, splits, block_m, block_n):
    torch = pytest.importorskip("torch")
    from spec_references import sliding_window_attention as reference

    math, band, _ = window_attention
    rng = np.random.default_rng(Sq * 7 + Sk + window)
    q = rng.standard_normal((2, Sq, 4, 64)).astype(np.float32)
    k = rng.standard_normal((2, Sk, 2, 64)).astype(np.float32)
    v = rng.standard_normal((2, Sk, 2, 64)).astype(np.float32)
    q *= 3.0  # scores beyond the cap: tanh saturates
    params = {"fparam0": 5.0, "fparam1": 0.125, "iparam0": window}
    o, lse = sa.simulate(math, q, k, v, band, params, block_m=block_m, block_n=block_n, num_splits=splits)
    ro, rl = reference(*(torch.from_numpy(x) for x in (q, k, v)), window, softcap=5.0, softmax_scale=0.125)
    ro, rl = ro.numpy(), rl.numpy()
    assert np.isfinite(o).all()
    assert np.abs(o - ro).max() < 2e-5
    finite = np.isfinite(rl)
    assert np.array_equal(np.isfinite(lse), finite) and np.array_equal(lse[~finite], rl[~finite])
    assert np.abs(lse[finite] - rl[finite]).max() < 1e-3


MASK_SPEC = """
op: banded
axes: {B: b, S: s, H: h, D: d}
args:
  q: {shape: [B, S, H, D], dtype: [float32]}
  k: {shape: [B, S, H, D], dtype: [float32]}
  v: {shape: [B, S, H, D], dtype: [float32]}
  lens: {shape: [B], dtype: [int32], values: "[0, S]"}
  w: {type: int, default: 4}
outputs:
  out: {shape: [B, S, H, D], dtype: q, index: [b, i, h, d], value: "o / l", empty: 0}
  lse: {shape: [B, H, S], dtype: float32, index: [b, h, i], value: "m + log(l)"}
cascade:
  indices: {b: B, i: S, h: H, j: S, c: D, d: D}
  rows: [b, i, h]
  over: j
  let:
    s: "sum(q[b, i, h, c] * k[b, j, h, c], c)"
  mask: "MASK"
  reduce:
    m: max(s)
    l: sum(exp(s - m))
    o: sum(exp(s - m) * v[b, j, h, d])
"""


@pytest.mark.parametrize("mask, band, why", [
    ("j >= i - w and j <= i + w", ("r - iparam0", "r + iparam0 + 1"), None),  # a symmetric band
    ("2 * j <= i", None, "is not key"),
    ("j < lens[b]", (None, "blen0"), None),  # per-sequence lengths: one int32 per batch
    ("j < lens[i]", None, "per-sequence values L\\[batch\\]"),
    ("j < lens[b] + lens[b] * j", None, "is not key"),
    ("j <= i or j > i + 8", None, "is not a bound on the key index"),
    ("j <= i and j < i + 3", None, "2 upper bounds"),
    ("j <= i + b", None, "reads"),
])
def test_masks_as_bands_or_refusals(mask, band, why):
    op = derive(parse_spec(MASK_SPEC.replace("MASK", mask), "banded.yaml"))
    if why is not None:
        with pytest.raises(BridgeError, match=why):
            attention_math(op.cases[0])
        return
    _, got, _ = attention_math(op.cases[0])
    assert (got.lo, got.hi) == band


# ---- per-sequence lengths read in the mask (tests/specs/padded_attention.yaml)
@pytest.fixture(scope="module")
def padded_attention():
    op = derive(load_spec(ROOT / "tests" / "specs" / "padded_attention.yaml"))
    return {dict(a.ir.specialization)["causal"]: attention_math(a) for a in op.cases}


def _padded_reference(q, k, v, lens, causal, scale):
    """float64: sequence b sees keys j < lens[b] (causal: j <= i + lens[b] - Sq); a length beyond Sk reads no padding past Sk."""
    B, Sq, H, _ = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    out = np.zeros(q.shape)
    lse = np.full((B, H, Sq), -np.inf)
    for b in range(B):
        for h in range(H):
            g = h // (H // Hk)
            s = scale * q[b, :, h].astype(np.float64) @ k[b, :, g].astype(np.float64).T
            j, i = np.arange(Sk)[None, :], np.arange(Sq)[:, None]
            seen = (j <= i + int(lens[b]) - Sq) if causal else (j < int(lens[b]))
            s = np.where(seen, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            ok = np.isfinite(m[:, 0])
            p = np.where(seen, np.exp(s - np.where(ok[:, None], m, 0)), 0.0)
            l_ = p.sum(axis=1)
            out[b, ok, h] = (p[ok] @ v[b, :, g].astype(np.float64)) / l_[ok, None]
            lse[b, h, ok] = m[ok, 0] + np.log(l_[ok])
    return out, lse


def test_per_sequence_length_band(padded_attention):
    _, band, roles = padded_attention[False]
    assert (band.lo, band.hi, band.tensors) == (None, "blen0", ("blen0",)) and roles.len_tensors == ("kv_lens",)
    _, band, _ = padded_attention[True]
    assert band.hi == "r - seqlen_q + blen0 + 1" and band.name == "causal"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sq, Sk", [(1, 130), (37, 70), (70, 37)])
@pytest.mark.parametrize("splits", [1, 3])
def test_per_sequence_lengths_through_the_template_schedule(padded_attention, causal, Sq, Sk, splits):
    math, band, _ = padded_attention[causal]
    rng = np.random.default_rng(Sq * 31 + Sk + splits)
    # lengths: empty, one key, a tail, exactly Sk, and beyond Sk (the mask as written; no key past Sk is read)
    lens = np.array([0, 1, Sk // 2 + 3, Sk, Sk + 50], np.int32)
    B = len(lens)
    q = rng.standard_normal((B, Sq, 4, 64)).astype(np.float32)
    k = rng.standard_normal((B, Sk, 2, 64)).astype(np.float32)
    v = rng.standard_normal((B, Sk, 2, 64)).astype(np.float32)
    o, lse = sa.simulate(math, q, k, v, band, {"fparam0": 0.125, "blen0": lens}, block_m=16, block_n=32,
                         num_splits=splits)
    ro, rl = _padded_reference(q, k, v, lens, causal, 0.125)
    assert np.isfinite(o).all() and np.abs(o - ro).max() < 2e-5
    finite = np.isfinite(rl)
    assert np.array_equal(np.isfinite(lse), finite) and np.array_equal(lse[~finite], rl[~finite])
    assert np.abs(lse[finite] - rl[finite]).max() < 1e-4


def test_per_sequence_lengths_reach_the_kernel_and_its_launch(padded_attention):
    from generator.codegen.cuda import cuda_plan
    from generator.codegen.templates.stream_attention_bridge import attention_body

    spec = load_spec(ROOT / "tests" / "specs" / "padded_attention.yaml")
    plan = cuda_plan(spec, derive(spec), ["sm80", "sm90a"], lambda *_: None)[0]
    fwd = [j for j in plan.jobs if "splitkv" not in j.symbol and "combine" not in j.symbol]
    assert len(fwd) == 4  # (sm80, sm90a) x (masked, causal)
    for job in fwd:  # the per-batch value is read once per CTA, from the buffer the launcher passes
        assert "blen0 = Blen0[bz]" in job.program and "Blen0" in job.program.split("def ", 2)[2].split("):")[0]
    params = [("Q", "pointer", "", ""), ("Blen0", "pointer", "", ""), ("stream", "stream", "", "")]
    body = "\n".join(attention_body(spec, plan, {j.symbol: {"params": params} for j in plan.jobs}))
    assert "torch::stable::copy_(blen0, kv_lens);" in body and "redfuser::batch_ptr(blen0, b_launch0)" in body


# ---- template choice: a spec's cuda section may omit `template:`
def test_generator_picks_the_first_template_that_accepts():
    from generator.codegen.cuda import choose_template, template_report

    spec = load_spec(ROOT / "specs" / "sliding_window_attention.yaml")
    assert spec.variants.cuda.template == ""
    op = derive(spec)
    name, plan, refused = choose_template(spec, op, ["sm90a"])
    assert name == "stream_attention" and refused == {} and plan.jobs
    text = (ROOT / "specs" / "moe_route.yaml").read_text().replace("    template: resident_row\n", "")
    moe = parse_spec(text, "moe_route.yaml")
    name, plan, refused = choose_template(moe, derive(moe), ["sm80"])
    assert name == "resident_row" and "stream_attention runs one streaming pass" in refused["stream_attention"]
    assert template_report(moe, derive(moe))[0] == "cuda: template resident_row (the first template that accepts the cascade)"
    text = (ROOT / "tests" / "specs" / "logsumexp.yaml").read_text()
    lse = parse_spec(text + "variants:\n  cuda: {families: [sm80], dtype: [float32]}\n", "logsumexp.yaml")
    name, plan, refused = choose_template(lse, derive(lse), ["sm80"])
    # per-row results of a long row: the stream_row template (logsumexp reads x[t, e] in place, no let)
    assert name == "stream_row" and plan.jobs and "(rows, k) outputs; out has shape (T)" in refused["resident_row"]
    assert "weighted sum carried over a free index" in refused["stream_attention"]
    mla = load_spec(ROOT / "specs" / "mla_decode.yaml")
    name, plan, refused = choose_template(mla, derive(mla), ["sm90a"])
    assert name == "paged_attention" and refused == {} and plan.jobs


def test_schedule_block_is_gone():
    from generator.errors import SpecError

    text = (ROOT / "tests" / "specs" / "logsumexp.yaml").read_text() + "schedule: {sm80: {block_m: 64}}\n"
    with pytest.raises(SpecError, match="'schedule:' is gone"):
        parse_spec(text, "logsumexp.yaml")


def test_tanh_reaches_both_templates():
    """The spec language's tanh prints as T.tanh and both templates accept it (a tanh-scored router)."""
    text = (ROOT / "specs" / "moe_route.yaml").read_text().replace("else sigmoid(x)", "else tanh(x)")
    spec = parse_spec(text, "moe_route.yaml")
    prog = row_program(spec, derive(spec))
    v = rr.RowVariant(dtype="float32", e_cap=64, family="sm80")
    assert "T.tanh(" in rr.emit_resident_row_program(prog, v, "K")
