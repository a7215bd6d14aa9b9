"""Outputs indexed by the streamed axis (written per element in a final pass over the row, from the row's final
states): rms_norm_fp8_quant (RMS norm + per-token FP8 quantisation) and row_softmax, ops made only of their YAML
specs, on the CPU through torch.ops.redfuser. References (float64): tests/spec_references.py.

Judging: q within one e4m3 unit of the e4m3 rounding of the float64 reference's y / scale; scale within float32
rounding of the float64 scale (relative 5e-6, and ACCEPTANCE's rule against the same math in the inputs' dtype);
softmax by ACCEPTANCE's rule max|out - ref| <= 2 * max|plain - ref| + 1e-5."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spec_references import E4M3_MIN_SCALE
from spec_references import rms_norm_fp8_quant as rq_reference
from spec_references import softmax as softmax_reference

import redfuser_ops  # loads the library; its typed wrapper is tested too

ROOT = Path(__file__).resolve().parent.parent
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROWS = [(1, 1), (17, 113), (113, 1023), (4, 4096), (2, 7168), (3, 8192)]  # Llama / DeepSeek hidden sizes too


def e4m3_unit(v: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3fn values at |v| (3 mantissa bits; subnormals below 2^-6 have spacing 2^-9)."""
    a = v.abs().clamp(min=2.0**-6)
    return torch.exp2(torch.floor(torch.log2(a)) - 3)


def rows_of(T, N, dtype, gen, spread=3.0):
    """(T, N) activations as a strided view (every other column of a wider tensor), rows of different scales."""
    x = torch.randn(T, 2 * N, generator=gen) * spread * torch.rand(T, 1, generator=gen).add(0.05)
    return x.to(dtype)[:, ::2]


def weight_of(N, dtype, gen):
    return (1 + 0.5 * torch.randn(2 * N, generator=gen)).to(dtype)[::2]  # strided too


def judge_quant(q, scale, x, w, eps):
    """q within one e4m3 unit of the reference quantisation; scale within float32 rounding."""
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert q.shape == x.shape and scale.shape == x.shape[:1]
    ref_v, ref_s = rq_reference(x, w, eps)
    ref_q = ref_v.to(torch.float8_e4m3fn).double()
    got = q.double()
    unit = e4m3_unit(torch.maximum(got.abs(), ref_q.abs()))
    assert ((got - ref_q).abs() <= unit).all(), ((got - ref_q).abs() / unit).max().item()
    rel = ((scale.double() - ref_s).abs() / ref_s).max().item()
    assert rel <= 5e-6, rel  # measured <= 7e-7 up to N = 8192 (float32 sums, sqrt and divisions)
    # ACCEPTANCE's rule against the same math in the inputs' dtype (the plain implementation a user would write)
    _, plain_s = rq_reference(x, w, eps, dtype=x.dtype)
    err, plain_err = (scale.double() - ref_s).abs().max().item(), (plain_s.double() - ref_s).abs().max().item()
    assert err <= 2 * plain_err + 1e-5 * ref_s.max().item(), (err, plain_err)
    return (got == ref_q).double().mean().item()


@pytest.mark.parametrize("T, N", ROWS)
def test_rms_norm_fp8_quant_matches_reference(T, N):
    gen = torch.Generator().manual_seed(T * 31 + N)
    for dtype in DTYPES:
        x, w = rows_of(T, N, dtype, gen), weight_of(N, dtype, gen)
        for eps in (1e-6, 1e-2):
            q, scale = torch.ops.redfuser.rms_norm_fp8_quant(x, w, eps)
            exact = judge_quant(q, scale, x, w, eps)
            assert exact >= 0.99, exact  # all but a few rounding ties land on the reference's e4m3 value


def test_rms_norm_fp8_quant_defaults_and_wrapper():
    gen = torch.Generator().manual_seed(5)
    x, w = rows_of(6, 64, torch.bfloat16, gen), weight_of(64, torch.bfloat16, gen)
    q, scale = torch.ops.redfuser.rms_norm_fp8_quant(x, w)  # eps = 1e-6
    judge_quant(q, scale, x, w, 1e-6)
    q2, scale2 = redfuser_ops.rms_norm_fp8_quant(x, w, eps=1e-6)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale, scale2)


def test_rms_norm_fp8_quant_zero_rows_are_exact():
    """An all-zero row: y = 0, scale = 1 / (448 * 512) (vLLM's floor), q exactly 0; other rows unaffected."""
    gen = torch.Generator().manual_seed(3)
    x = rows_of(5, 300, torch.float32, gen).contiguous()
    x[1] = 0
    x[3] = -0.0
    w = weight_of(300, torch.float32, gen)
    q, scale = torch.ops.redfuser.rms_norm_fp8_quant(x, w, 1e-6)
    floor = torch.tensor(E4M3_MIN_SCALE, dtype=torch.float32)
    for r in (1, 3):
        assert scale[r] == floor and (q[r].float() == 0).all()
    judge_quant(q[[0, 2, 4]], scale[[0, 2, 4]], x[[0, 2, 4]], w, 1e-6)
    # a weight of zeros also gives the floor scale and zeros
    q, scale = torch.ops.redfuser.rms_norm_fp8_quant(x, torch.zeros_like(w), 1e-6)
    assert (scale == floor).all() and (q.float() == 0).all()


def test_rms_norm_fp8_quant_saturates_at_448():
    """The row's largest |y| maps to +-448 exactly (e4m3's largest finite value), never to NaN."""
    x = torch.tensor([[1.0, -3.0, 2.0, 0.5], [4.0, 4.0, -4.0, 4.0]])
    q, scale = torch.ops.redfuser.rms_norm_fp8_quant(x, torch.ones(4), 1e-6)
    assert q[0, 1].float() == -448 and (q[1].float().abs() == 448).all()
    judge_quant(q, scale, x, torch.ones(4), 1e-6)


def test_rms_norm_fp8_quant_non_finite_rows():
    """Documented: a row holding +-inf or NaN gives a NaN scale and NaN q (e4m3 NaN) for the whole row, as the
    float64 reference does (inf * rsqrt(inf) is NaN); other rows are unaffected."""
    gen = torch.Generator().manual_seed(9)
    x = rows_of(4, 50, torch.float32, gen).contiguous()
    x[0, 7] = float("inf")
    x[1, 0] = float("-inf")
    x[2, 49] = float("nan")
    w = weight_of(50, torch.float32, gen)
    q, scale = torch.ops.redfuser.rms_norm_fp8_quant(x, w, 1e-6)
    _, ref_s = rq_reference(x, w, 1e-6)
    for r in range(3):
        assert torch.isnan(ref_s[r]) and torch.isnan(scale[r]) and torch.isnan(q[r].float()).all()
    judge_quant(q[3:], scale[3:], x[3:], w, 1e-6)


def test_rms_norm_fp8_quant_row_whose_sum_of_squares_overflows():
    """All math in float32: a row of finite values whose sum of squares overflows float32 (1e20**2) has rsqrt = 0,
    y = 0, the floor scale and q = 0, as the float32 reference gives; the online form kept the correction of the
    abs-max at ss_old = ss_new = inf as inf / inf = NaN until the engine made it the identity there."""
    gen = torch.Generator().manual_seed(11)
    x = rows_of(3, 40, torch.float32, gen).contiguous()
    x[0, 3] = 1e20
    x[1, :] = 3e19  # every square overflows
    w = weight_of(40, torch.float32, gen)
    q, scale = torch.ops.redfuser.rms_norm_fp8_quant(x, w, 1e-6)
    ref_q, ref_s = rq_reference(x, w, 1e-6, dtype=torch.float32)
    for r in range(2):
        assert ref_s[r] == 1 / (448 * 512) and (ref_q[r] == 0).all()
        assert scale[r] == ref_s[r] and (q[r].float() == 0).all(), (scale[r], q[r])
    judge_quant(q[2:], scale[2:], x[2:], w, 1e-6)


def test_rms_norm_fp8_quant_checks():
    x, w = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="eps must be positive"):
        torch.ops.redfuser.rms_norm_fp8_quant(x, w, 0.0)
    with pytest.raises(RuntimeError, match="eps must be positive"):
        torch.ops.redfuser.rms_norm_fp8_quant(x, w, -1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.redfuser.rms_norm_fp8_quant(x, torch.randn(9), 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.redfuser.rms_norm_fp8_quant(x, w.half(), 1e-6)  # weight takes x's dtype
    q, scale = torch.ops.redfuser.rms_norm_fp8_quant(torch.randn(0, 8), w, 1e-6)
    assert q.shape == (0, 8) and scale.shape == (0,)


@pytest.mark.parametrize("T, E", [(1, 1), (17, 113), (113, 1023), (4, 32000)])
def test_row_softmax_matches_reference(T, E):
    gen = torch.Generator().manual_seed(T + E)
    for dtype in DTYPES:
        x = rows_of(T, E, dtype, gen, spread=4.0)
        out = torch.ops.redfuser.row_softmax(x)
        assert out.shape == x.shape and out.dtype == dtype
        ref = softmax_reference(x)
        plain = torch.softmax(x, dim=-1)  # torch in the inputs' dtype
        err, plain_err = (out.double() - ref).abs().max().item(), (plain.double() - ref).abs().max().item()
        assert err <= 2 * plain_err + 1e-5, (dtype, err, plain_err)


def test_row_softmax_kept_terms_and_recomputed_elements():
    """The CPU kernel keeps each element's exp(y - m_chunk) and scales it by its chunk's exp(m_chunk - m) / l; it
    recomputes the elements instead for a row longer than it keeps (2**18) and where a chunk's factor is not finite
    (a leading chunk of -inf: m_chunk is taken as 0 there, and exp(0 - m) overflows for m = -100). Both paths, and
    rows whose maximum grows chunk after chunk (512 elements a chunk), against the float64 reference."""
    gen = torch.Generator().manual_seed(5)
    ramp = torch.linspace(-60.0, 0.0, 4 * 512).repeat(2, 1) + torch.rand(2, 4 * 512, generator=gen)
    leading = torch.full((2, 3 * 512), -100.0) + torch.rand(2, 3 * 512, generator=gen)
    leading[:, :512] = float("-inf")
    leading[1, 700] = -95.0
    long_row = torch.randn(2, 2**18 + 3, generator=gen) * 4
    for x in (ramp, leading, long_row):
        for dtype in DTYPES:
            xd = x.to(dtype)
            out = torch.ops.redfuser.row_softmax(xd)
            ref = softmax_reference(xd)
            plain_err = (torch.softmax(xd, dim=-1).double() - ref).abs().max().item()
            assert (out.double() - ref).abs().max().item() <= 2 * plain_err + 1e-5, (x.shape, dtype)
            assert (out[:, :512] == 0).all() if x is leading else True


def test_row_softmax_infinities():
    """-inf entries get probability 0; a row of -inf gives zeros (torch.softmax gives NaN there)."""
    x = torch.tensor([[float("-inf")] * 4, [0.0, float("-inf"), 1.0, float("-inf")], [1000.0, -800.0, 0.0, 1000.0]])
    out = torch.ops.redfuser.row_softmax(x)
    assert (out[0] == 0).all()
    assert torch.allclose(out[1:].double(), softmax_reference(x[1:]), atol=1e-7)
    assert out[1, 1] == 0 and out[1, 3] == 0


def _samples():
    gen = torch.Generator().manual_seed(11)
    x, w = rows_of(5, 37, torch.float32, gen), weight_of(37, torch.float32, gen)
    return [(torch.ops.redfuser.rms_norm_fp8_quant.default, (x, w, 1e-5)),
            (torch.ops.redfuser.rms_norm_fp8_quant.default, (x.bfloat16(), w.bfloat16())),
            (torch.ops.redfuser.row_softmax.default, (x,)),
            (torch.ops.redfuser.row_softmax.default, (x.half(),))]


@pytest.mark.parametrize("sample", range(4))
def test_opcheck(sample):
    op, args = _samples()[sample]
    torch.library.opcheck(op, args)


def test_torch_compile_fullgraph():
    gen = torch.Generator().manual_seed(6)
    x, w = rows_of(8, 256, torch.float32, gen), weight_of(256, torch.float32, gen)

    def block(x, w):
        q, scale = torch.ops.redfuser.rms_norm_fp8_quant(x * 2, w, 1e-5)
        deq = q.float() * scale[:, None]
        return q, deq, torch.ops.redfuser.row_softmax(x + 1).square()

    got, want = torch.compile(block, fullgraph=True)(x, w), block(x, w)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))  # the same kernel on the same input
    assert torch.allclose(got[1], want[1], rtol=1e-6) and torch.allclose(got[2], want[2], rtol=1e-6)


# --------------------------------------------------------------------------------------------- spec errors
SPEC = (ROOT / "specs" / "rms_norm_fp8_quant.yaml").read_text()


def check(tmp_path: Path, text: str) -> tuple[int, str]:
    spec = tmp_path / "op.yaml"
    spec.write_text(text)
    r = subprocess.run([sys.executable, "-m", "generator", "check", str(spec)], check=False, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.parametrize("old, new, message", [
    # a per-row output that reads an element value: the streamed index is not named
    ('value: "s"}', 'value: "s * xf"}', "reads index 'j', which its index ['t'] does not name (name 'j'"),
    # an output dimension that does not match its index's extent
    ("    shape: [T, N]\n", "    shape: [T, T]\n", "the dimension T is indexed by 'j', which runs over N"),
    # without `eps > 0` the correction of the abs-max can overflow (eps = 0 and an all-zero prefix)
    ('  - {expr: "eps > 0", message: "eps must be positive"}\n', "", "overflows to inf"),
    # CUDA families no template has variants for (stream_row: sm80/sm90a/sm100a): the reasons are listed
    ("    families: [sm80, sm90a, sm100a]\n", "    families: [sm89]\n", "no CUDA kernel template accepts this cascade"),
])
def test_bad_per_element_specs_give_clear_errors(tmp_path, old, new, message):
    assert old in SPEC
    rc, out = check(tmp_path, SPEC.replace(old, new))
    assert rc == 1 and message in out and "Traceback" not in out, out


def test_sign_from_a_check_written_either_way(tmp_path):
    """`0 < eps` inside an `and` gives the proofs eps > 0 as `eps > 0` does; `eps >= 0` does not suffice (at eps = 0
    an all-zero prefix makes the abs-max's correction 0/0)."""
    rc, out = check(tmp_path, SPEC.replace('expr: "eps > 0"', 'expr: "N >= 1 and 0 < eps"'))
    assert rc == 0 and out.startswith("ok "), out
    rc, out = check(tmp_path, SPEC.replace('expr: "eps > 0"', 'expr: "eps >= 0"'))
    assert rc == 1 and "reduction 'a' is not fusible" in out and "Traceback" not in out, out


def test_transposed_per_element_output_is_accepted(tmp_path):
    """Any order of the output's indices: q indexed [j, t] (shape [N, T])."""
    # without the cuda section: stream_row writes per-element outputs indexed [row, e] only (refused with the reason)
    text = SPEC.split("  cuda:")[0]
    text = text.replace("    shape: [T, N]\n", "    shape: [N, T]\n").replace("index: [t, j]", "index: [j, t]")
    rc, out = check(tmp_path, text)
    assert rc == 0 and out.startswith("ok "), out


# --------------------------------------------------------------------------------------------- bench cases
@pytest.mark.parametrize("op", ["rms_norm_fp8_quant", "row_softmax"])
def test_bench_cases_run_and_judge(op):
    """The tiny CPU bench cases: the op and torch eager pass their checks, a perturbed result does not; the CUDA
    cases (stream_row kernels) are the same op on the GPU."""
    from bench import cases
    from bench.run import Runner

    make = cases.OPS[op]
    assert {c.op for c in make("cuda", "quick")} == {op}
    runner = Runner("cpu", budget_s=60, quick=True, size="tiny", cache_bytes=1 << 20, mem_cap=1 << 26,
                    log=lambda s: None)
    case = make("cpu", "tiny")[0]
    res = {r["impl"]: r for r in runner.run_case(case, {"copy_GBps": 10.0}, {"eager"})}
    assert set(res) == {"redfuser", "eager"}
    for r in res.values():
        assert r["status"] == "ok" and r["correct"]["ok"], r
    case = make("cpu", "tiny")[0]
    inputs = case.make_inputs(torch.Generator().manual_seed(0), "cpu")
    good = case.impls[0].fn(*inputs)
    assert case.check("redfuser", good, inputs)["ok"]
    if isinstance(good, tuple):  # q moved by 100 (several e4m3 units) in one place, or the scale off by 1e-5
        q = good[0].clone()
        v = q[0, 0].float()
        q[0, 0] = (v - 100 if v > 0 else v + 100).to(torch.float8_e4m3fn)
        assert not case.check("bad", (q, good[1]), inputs)["ok"]
        assert not case.check("bad", (good[0], good[1] * (1 + 1e-5)), inputs)["ok"]
    else:
        assert not case.check("bad", good * 1.01 + 1e-4, inputs)["ok"]
