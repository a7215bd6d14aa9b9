"""The stream_row template (generator/codegen/templates/stream_row.py) and its bridge, on the CPU.

The math comes from the engine (specs/logsumexp.yaml, specs/softmax_cross_entropy.yaml through
stream_row_bridge.stream_math). The template's ``cpu_sim`` emission of the same schedule (the 256 threads of a CTA
made explicit, shuffles as reads of another thread's registers) is lowered for TileLang's ``"c"`` target, compiled
and run against the float64 references (tests/spec_references.py) by the ACCEPTANCE rule: rows with tails, rows
longer than a chunk, -inf / NaN rows, ignore_index, empty rows, strided rows (row stride > length, odd strides that
take the element-by-element path), fp32/fp16/bf16.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from spec_references import logsumexp as lse_reference
from spec_references import softmax_cross_entropy as ce_reference
from tl_c_sim import compile_c_program

from generator.codegen.bridge import BridgeError
from generator.codegen.templates import stream_row as sr
from generator.codegen.templates.stream_row_bridge import stream_math, stream_plan
from generator.spec import load_spec
from generator.symbolic import derive

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def engine(name: str):
    path = ROOT / "specs" / f"{name}.yaml"
    spec = load_spec(path if path.exists() else ROOT / "tests" / "specs" / f"{name}.yaml")
    return spec, derive(spec)


@functools.cache
def build_sim(name: str, dtype: str, threads: int = 256):
    """Emit the engine's math of spec ``name`` as the cpu_sim program, lower it (TileLang "c"), compile, load."""
    spec, op = engine(name)
    math, roles = stream_math(spec, op)
    v = sr.StreamVariant(dtype, threads=threads)
    symbol = f"sim_{name}_{dtype}_{threads}"
    lib, _ = compile_c_program(sr.emit_stream_row_program(math, v, symbol, backend="cpu_sim"), symbol)
    merge = None  # per-element outputs or a selection: one CTA per row, no merge program
    if not math.whole_row:
        merge, _ = compile_c_program(sr.emit_stream_row_merge(math, v, symbol + "_merge", backend="cpu_sim"),
                                     symbol + "_merge")
    return lib, merge, math, roles


def _device_rows(x: torch.Tensor, dtype: str, ld: int, misalign: bool) -> tuple[np.ndarray, np.ndarray]:
    """(storage the kernel reads, rows of ld elements; the values it sees as float64)."""
    T_, L = x.shape
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    xd = x.to(tdt)
    seen = xd.double()
    raw = (xd.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else xd.numpy())
    n = max(T_ * ld, 1) + 8
    store = np.full(n, 0, dtype=raw.dtype)
    off = 1 if misalign else (-(store.ctypes.data // raw.itemsize) % (16 // raw.itemsize))
    buf = store[off:off + max(T_ * ld, 1)]
    if misalign:
        assert buf.ctypes.data % 16 != 0
    for t in range(T_):
        buf[t * ld:t * ld + L] = raw[t]
    return buf, seen


def run(name: str, x: torch.Tensor, dtype: str, index=None, iparams=(), fparams=(), ld=None, misalign=False,
        threads: int = 256, sms: int | None = None):
    """The emitted program(s) on rows x; ``sms``: split rows as impl_cuda does on a GPU with that many SMs (None:
    one segment per row)."""
    lib, merge, math, _ = build_sim(name, dtype, threads)
    T_, L = x.shape
    ld = ld or L
    buf, seen = _device_rows(x, dtype, ld, misalign)
    chunk = sr.StreamVariant(dtype, threads=threads).chunk
    ns, cps = sr.split_plan(T_, L, sms, chunk) if sms else (1, max(1, L // chunk))
    idx = [np.ascontiguousarray(np.asarray(i, dtype=np.int64)) for i in (index or [])]
    outs = [np.full(T_, -777.0, dtype=np.float32) for _ in math.outputs]  # poisoned
    ws = np.full((len(math.states), T_, ns), np.nan, dtype=np.float32)
    P = ctypes.c_void_p
    tail = [ctypes.c_int32(L)]
    params = [ctypes.c_int64(v) for v in iparams] + [ctypes.c_float(v) for v in fparams]
    heads = [P(i.ctypes.data) for i in idx] + [P(o.ctypes.data) for o in outs] + [P(ws.ctypes.data)]
    args = [P(buf.ctypes.data)] + heads + tail + [ctypes.c_int32(cps)] + params
    assert lib.call(*args, ctypes.c_int32(T_), ctypes.c_int32(ld), ctypes.c_int32(ns)) == 0
    if ns > 1:
        assert np.all(outs[0] == -777.0)  # the split kernel leaves the outputs to the merge
        assert merge.call(*heads, *tail, *params, ctypes.c_int32(T_), ctypes.c_int32(ns)) == 0
    run.last_split = ns
    return outs, seen


def judge(out, ref, plain):
    """ACCEPTANCE: error to the float64 reference at most twice the plain float32 computation's, + 1e-5."""
    out, ref, plain = (np.asarray(v, dtype=np.float64) for v in (out, ref, plain))
    same_nonfinite = (~np.isfinite(ref)) & (out == ref) | np.isnan(ref) & np.isnan(out)
    assert np.array_equal(np.isnan(out), np.isnan(ref)), (out, ref)
    fin = ~same_nonfinite
    assert np.all(np.isfinite(out[fin])), (out, ref)
    err = np.abs(out[fin] - ref[fin]).max(initial=0.0)
    plain_err = np.abs(plain[fin] - ref[fin]).max(initial=0.0)
    assert err <= 2 * plain_err + 1e-5, (err, plain_err)


def logits(T_, L, seed):
    gen = torch.Generator().manual_seed(seed)
    return 4 * torch.randn(T_, L, generator=gen)


DTYPES = ["float32", "float16", "bfloat16"]
# tails (1, 113, 4095 < one chunk; 4097, 10000 = chunks + a tail), exactly one and two chunks, a vocabulary row
LENGTHS = [1, 7, 113, 4095, 4096, 4097, 10000, 8192, 32000]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", LENGTHS)
def test_logsumexp_sim_matches_reference(dtype, L):
    x = logits(3, L, L)
    (out,), seen = run("logsumexp", x, dtype)
    judge(out, lse_reference(seen).numpy(), lse_reference(seen.float(), dtype=torch.float32).numpy())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logsumexp_sim_infinities_nan_and_empty_rows(dtype):
    L = 5000
    x = logits(6, L, 1)
    x[0] = float("-inf")  # every element -inf: -inf
    x[1, ::3] = float("-inf")  # some
    x[2, 4500] = float("nan")  # NaN in the tail chunk: NaN
    x[3, 17] = float("nan")  # NaN in a full chunk
    x[4, :4096] = float("-inf")  # the first chunk all -inf: the guard, then a finite tail
    (out,), seen = run("logsumexp", x, dtype)
    ref = lse_reference(seen).numpy()
    assert out[0] == -np.inf and np.isnan(out[2]) and np.isnan(out[3])
    judge(out, ref, lse_reference(seen.float(), dtype=torch.float32).numpy())
    (empty,), _ = run("logsumexp", torch.zeros(2, 0), dtype)  # L = 0: the neutral states' output
    assert np.all(empty == -np.inf)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("ld_extra, misalign", [(0, False), (8, False), (3, False), (0, True)])
def test_logsumexp_sim_strided_and_misaligned_rows(dtype, ld_extra, misalign):
    """A row stride larger than the row (vector path when it keeps 16-byte alignment, else element by element),
    and a base pointer off a 16-byte boundary (element path)."""
    x = logits(4, 9000, 5)
    (out,), seen = run("logsumexp", x, dtype, ld=9000 + ld_extra, misalign=misalign)
    judge(out, lse_reference(seen).numpy(), lse_reference(seen.float(), dtype=torch.float32).numpy())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [1, 113, 4097, 32000])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_cross_entropy_sim_matches_reference(dtype, L, eps):
    T_ = 5
    x = logits(T_, L, L + 3)
    gen = torch.Generator().manual_seed(L)
    target = torch.randint(0, L, (T_,), generator=gen)
    target[0] = L - 1  # the last element (in the tail chunk)
    target[1] = 0
    if T_ > 3:
        target[3] = -100  # ignored: 0
    (out,), seen = run("softmax_cross_entropy", x, dtype, index=[target.numpy()], iparams=[-100], fparams=[eps])
    ref = ce_reference(seen, target, eps, -100).numpy()
    plain = ce_reference(seen.float(), target, eps, -100, dtype=torch.float32).numpy()
    assert out[3] == 0.0
    judge(out, ref, plain)


def test_cross_entropy_sim_ignore_index_large_and_nonfinite_rows():
    """An int64 ignore_index beyond int32, targets equal to it, a NaN row (NaN unless ignored), a -inf row."""
    L = 6000
    x = logits(5, L, 9)
    x[1, 100] = float("nan")
    x[2, 100] = float("nan")
    x[4, 5999] = float("inf")  # +inf at the target: lse - x = inf - inf = NaN in float64 too
    ignore = 1 << 40
    target = torch.tensor([3, 4, ignore, ignore, 5999])
    (out,), seen = run("softmax_cross_entropy", x, "float32", index=[target.numpy()], iparams=[ignore],
                       fparams=[0.1])
    ref = ce_reference(seen, target, 0.1, ignore).numpy()
    assert np.isnan(out[1]) and out[2] == 0.0 and out[3] == 0.0
    judge(out, ref, ce_reference(seen.float(), target, 0.1, ignore, dtype=torch.float32).numpy())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("L", [16384, 50001, 131072])
def test_split_rows_merge_form(dtype, L):
    """Few long rows: segments of a row in separate CTAs, their states merged by the merge program (the engine's
    merge form), for logsumexp and cross-entropy (the target in any segment, or in the tail)."""
    x = logits(3, L, L + 1)
    x[2, : L // 2] = float("-inf")  # the first segments of a row hold only -inf: neutral states merged
    (out,), seen = run("logsumexp", x, dtype, sms=132)
    assert run.last_split > 1
    judge(out, lse_reference(seen).numpy(), lse_reference(seen.float(), dtype=torch.float32).numpy())
    target = torch.tensor([5, L - 1, L // 2 + 3])
    (out,), seen = run("softmax_cross_entropy", x, dtype, index=[target.numpy()], iparams=[-100], fparams=[0.1],
                       sms=132)
    assert run.last_split > 1
    ref = ce_reference(seen, target, 0.1, -100).numpy()
    judge(out, ref, ce_reference(seen.float(), target, 0.1, -100, dtype=torch.float32).numpy())


def _entropy_reference(x: torch.Tensor) -> np.ndarray:
    """float64: -sum p log p of softmax(row), -inf elements counting for nothing; nan for a row of only -inf."""
    x = x.double()
    m = x.max(dim=1, keepdim=True).values
    p = torch.softmax(x, dim=1)
    terms = torch.where(torch.isneginf(x), torch.zeros_like(x), p * (x - m - torch.logsumexp(x - m, 1, True)))
    out = -terms.sum(dim=1)
    return torch.where(torch.isneginf(m[:, 0]), torch.full_like(out, float("nan")), out).numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("L", [1, 4097, 50001])
def test_where_predicate_tutorial_entropy(dtype, L):
    """specs/README.md's tutorial op (tests/specs/row_entropy.yaml): a `where=` reduction, -inf elements (masked
    logits) counting for nothing, a row of only -inf giving the spec's `empty: nan`; split rows too."""
    x = logits(4, L, L + 11)
    x[1, : L // 2] = float("-inf")
    x[2] = float("-inf")
    for sms in (None, 132):
        (out,), seen = run("row_entropy", x, dtype, sms=sms)
        ref = _entropy_reference(seen)
        assert np.isnan(out[2]) and np.isnan(ref[2])
        plain = _entropy_reference(seen.float())  # the same formula; the rule's slack comes from + 1e-5
        judge(out, ref, plain)
        assert np.abs(out[[0, 1, 3]] - ref[[0, 1, 3]]).max() < 1e-3 * max(1.0, np.abs(ref[[0, 1, 3]]).max())


@pytest.mark.parametrize("L", [1, 4097])
def test_lets_reading_lets_tempered_entropy(L):
    """tests/specs/tempered_entropy.yaml: z = y / temperature is an element value only through the let y, and
    w = exp(z - m) through z: each must be computed per element (a let taken as a row value would be one number for
    the whole row); -inf elements count for nothing, split rows too."""
    x = logits(3, L, L + 5)
    x[1, : L // 2] = float("-inf")
    for temp in (0.5, 3.0):
        for sms in (None, 132):
            (out,), seen = run("tempered_entropy", x, "float32", fparams=[temp], sms=sms)
            judge(out, _entropy_reference(seen / temp), _entropy_reference(seen.float() / temp))


def test_split_plan():
    assert sr.split_plan(4096, 128256, 132, 4096) == (1, 31)  # many rows: a CTA per row
    assert sr.split_plan(16, 128256, 132, 4096) == (11, 3)  # 16 rows of 31 chunks: 11 segments of <= 3 chunks
    assert sr.split_plan(1, 5000, 132, 4096) == (1, 1)  # fewer than 4 full chunks: no split
    for rows, length in [(1, 1 << 20), (7, 40000), (100, 262144), (3, 16384)]:
        ns, cps = sr.split_plan(rows, length, 132, 4096)
        n_full = length // 4096
        assert (ns - 1) * cps < n_full <= ns * cps and (ns == 1 or cps >= 2)  # no empty segment


def test_split_plan_cpp_equals_python(tmp_path):
    """impl_cuda's copy of the split plan (SPLIT_CPP) gives the same (n_split, cps) as the one the tests simulate."""
    import random
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed (it builds the library too)"
    rng = random.Random(3)
    cases = [(rng.choice([1, 2, 3, 16, 100, 263, 264, 5000]), rng.choice([0, 1, 4095, 4096, 16384, 50001, 128256,
                                                                          1 << 20]),
              rng.choice([78, 108, 132, 148]), rng.choice([2048, 4096])) for _ in range(300)]
    src = tmp_path / "t.cpp"
    src.write_text("#include <algorithm>\n#include <cstdint>\n#include <cstdio>\n" + sr.SPLIT_CPP + "\nint main() {\n"
                   "  int64_t ns, cps;\n" + "".join(
                       f"  stream_row_split_plan({', '.join(map(str, c))}, ns, cps); "
                       "std::printf(\"%lld %lld\\n\", (long long)ns, (long long)cps);\n" for c in cases) + "}\n")
    subprocess.run([cxx, "-O1", str(src), "-o", str(tmp_path / "t")], check=True)
    got = subprocess.run([str(tmp_path / "t")], capture_output=True, text=True, check=True).stdout.split("\n")
    want = [sr.split_plan(*c) for c in cases]
    assert [tuple(map(int, line.split())) for line in got if line] == want
    assert any(w[0] > 1 for w in want) and any(w[0] == 1 for w in want)


def test_sim_with_fewer_threads_same_results():
    """The schedule does not depend on the CTA size: 64 threads (2 warps) give the reference too."""
    x = logits(3, 3000, 2)
    (out,), seen = run("logsumexp", x, "float32", threads=64)
    judge(out, lse_reference(seen).numpy(), lse_reference(seen.float(), dtype=torch.float32).numpy())


# ------------------------------------------------------------------------------------------- the bridge
def test_bridge_binds_by_role():
    spec, op = engine("softmax_cross_entropy")
    math, roles = stream_math(spec, op)
    assert roles["x"] == "logits" and roles["index"] == ("target",) and roles["iparams"] == ("ignore_index",)
    assert roles["fparams"] == ("label_smoothing",) and len(math.states) == 4 and math.n_index == 1
    # the merge form of the rescaled sum reads the max's segment and merged values
    assert "s0_seg" in math.merge[1] and "s0_safe" in math.merge[1]
    # one kernel per (family, dtype), and a merge program per family
    plan = stream_plan(spec, op, ["sm80", "sm90a", "sm100a"])
    assert len(plan.jobs) == 12 and {j.family for j in plan.jobs} == {"sm80", "sm90a", "sm100a"}


def _refused(name: str, mutate) -> str:
    text = (ROOT / "specs" / f"{name}.yaml").read_text()
    tmp = Path(tempfile.mkdtemp(prefix="stream_row_spec_")) / f"{name}.yaml"
    atexit.register(shutil.rmtree, tmp.parent, True)
    tmp.write_text(mutate(text))
    spec = load_spec(tmp)
    with pytest.raises(BridgeError) as exc:
        stream_plan(spec, derive(spec), ["sm90a"])
    return str(exc.value)


@pytest.mark.parametrize("name, mutate, reason", [
    # per-element outputs are written row-major only (index [t, e]); a transposed one is refused
    ("logsumexp", lambda t: t.replace('out: {shape: [T], dtype: float32, index: [t], value: "m if m == inf else m + log(l)"}',
                                      'out: {shape: [E, T], dtype: float32, index: [e, t], value: "exp(y - m) / l", empty: 0}'),
     "per-element results indexed (t, e)"),
    # a read of a second row tensor
    ("logsumexp", lambda t: t.replace("  x: {shape: [T, E], dtype: [float32, float16, bfloat16]}",
                                      "  x: {shape: [T, E], dtype: [float32, float16, bfloat16]}\n"
                                      "  w: {shape: [E], dtype: [float32]}")
     .replace('y: "float32(x[t, e])"', 'y: "float32(x[t, e]) * w[e]"'), "the row tensor's dtype"),
    # a float per-row tensor
    ("softmax_cross_entropy", lambda t: t.replace('dtype: [int64, int32], values: "[0, V)"', "dtype: [float32]"),
     "integer index tensor"),
    # an output of another dtype
    ("logsumexp", lambda t: t.replace("out: {shape: [T], dtype: float32", "out: {shape: [T], dtype: float16"),
     "stream_row writes float32"),
])
def test_bridge_refusals_say_why(name, mutate, reason):
    assert reason in _refused(name, mutate)


def test_bridge_refuses_specialised_and_multi_row_cascades():
    for name, why in (("moe_route", "specialised"), ("fused_attention", "specialised")):
        spec, op = engine(name)
        with pytest.raises(BridgeError, match=why):
            stream_plan(spec, op, ["sm90a"])
    spec, op = engine("logsumexp")
    with pytest.raises(BridgeError, match="no variants for"):
        stream_plan(spec, op, ["sm89"])


def test_variant_checks():
    with pytest.raises(ValueError, match="multiple of 32"):
        sr.StreamVariant("float32", threads=100).check()
    with pytest.raises(ValueError, match="per_thread"):
        replace(sr.StreamVariant("bfloat16"), per_thread=12).check()
