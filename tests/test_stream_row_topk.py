"""The stream_row template's top-k selection (specs/vocab_topk.yaml), on the CPU: the cpu_sim emission of the
CUDA schedule (per-thread sorted lists of 64-bit keys filled while the row streams, then k rounds of a block-wide
maximum over the lists' heads) lowered for TileLang's "c" target and run against the float64 reference
(tests/spec_references.py vocab_topk). Ids must equal the reference exactly (the order of the row's own values, ties
to the lower index, NaN after every number); probabilities by ACCEPTANCE.md's rule."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from spec_references import vocab_topk as topk_reference
from test_stream_row_template import ROOT, _device_rows, build_sim, engine

from generator.codegen.bridge import BridgeError
from generator.codegen.templates import stream_row as sr
from generator.codegen.templates.stream_row_bridge import stream_math, stream_plan


def run_topk(x: torch.Tensor, dtype: str, k: int, ld=None, misalign=False, threads: int = 256):
    """The emitted program on rows x, k entries per row: (probs, ids), each poisoned beforehand."""
    lib, _merge, math, _ = build_sim("vocab_topk", dtype, threads)
    T_, L = x.shape
    ld = ld or L
    buf, seen = _device_rows(x, dtype, ld, misalign)
    chunk = sr.StreamVariant(dtype, threads=threads).chunk
    probs = np.full((T_, k), -777.0, dtype=np.float32)
    ids = np.full((T_, k), -777, dtype=np.int64)
    ws = np.full((len(math.states), T_, 1), np.nan, dtype=np.float32)
    P = ctypes.c_void_p
    args = [P(buf.ctypes.data), P(ws.ctypes.data), P(probs.ctypes.data), P(ids.ctypes.data), ctypes.c_int32(L),
            ctypes.c_int32(max(1, L // chunk)), ctypes.c_int64(k)]
    assert lib.call(*args, ctypes.c_int32(T_), ctypes.c_int32(ld), ctypes.c_int32(1), ctypes.c_int32(k)) == 0
    return probs, ids, seen


def check(x: torch.Tensor, dtype: str, k: int, **kw) -> tuple[np.ndarray, np.ndarray]:
    probs, ids, seen = run_topk(x, dtype, k, **kw)
    kk = min(k, x.shape[1])
    ref_p, ref_i = topk_reference(seen, kk)
    plain_p, _ = topk_reference(seen, kk, dtype=torch.float32)
    assert np.array_equal(ids[:, :kk], ref_i.numpy()), (ids, ref_i)
    out, ref, plain = probs[:, :kk].astype(np.float64), ref_p.numpy(), plain_p.double().numpy()
    assert np.array_equal(np.isnan(out), np.isnan(ref)), (out, ref)
    fin = ~np.isnan(ref)
    err = np.abs(out[fin] - ref[fin]).max(initial=0.0)
    assert err <= 2 * np.abs(plain[fin] - ref[fin]).max(initial=0.0) + 1e-5, err
    return probs, ids


def logits(T_, L, seed):
    gen = torch.Generator().manual_seed(seed)
    return 4 * torch.randn(T_, L, generator=gen)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("L, k", [(1, 1), (113, 5), (4095, 64), (4097, 50), (10000, 1), (50001, 64)])
def test_topk_sim_matches_reference(dtype, L, k):
    check(logits(3, L, L + k), dtype, k)


def test_topk_sim_ties_go_to_the_lower_index():
    """Integer logits: hundreds of equal keys per value, across threads, chunks and the tail; -0.0 ties +0.0."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(-3, 4, (4, 9000), generator=gen).float()
    x[1] = 0.0
    x[1, 1::2] = -0.0
    x[2, 8999] = 7.0  # the best one in the tail
    x[3, :] = 1.0
    for k in (1, 17, 64):
        check(x, "float32", k)
    check(x, "bfloat16", 64)


def test_topk_sim_nonfinite_rows():
    """NaN keys rank after every number (and -inf); +inf first; a row of -inf keeps index order (probs NaN)."""
    x = logits(5, 5000, 9)
    x[0, [3, 4000, 4999]] = float("nan")
    x[1] = float("-inf")
    x[2, :4990] = float("-inf")  # fewer finite elements than k: -inf keys next, by index
    x[3, [10, 20]] = float("inf")
    x[4] = float("nan")
    for dtype in ("float32", "bfloat16"):
        probs, ids = check(x, dtype, 64)
        assert np.isnan(probs[[0, 1, 3, 4]]).all()
        assert list(ids[1, :5]) == [0, 1, 2, 3, 4] and list(ids[0, -3:]) != [3, 4000, 4999]
    _, ids, _ = run_topk(x[:1], "float32", 64)  # 4997 numbers: the NaNs never make the top 64
    assert not {3, 4000, 4999} & set(ids[0].tolist())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_topk_sim_one_thread_holds_every_entry(dtype):
    """The row's 64 best elements all belong to one thread (its elements of 5 chunks, in decreasing order): that
    thread's list must keep k entries, each arriving as its new k-th best."""
    v = sr.StreamVariant(dtype)
    tid, L = 5, 5 * v.chunk + 100
    pos = [c * v.chunk + (k // v.vec) * v.threads * v.vec + tid * v.vec + k % v.vec
           for c in range(5) for k in range(v.per_thread)]
    x = logits(2, L, 8).clamp(-4, 4)
    x[:, pos] = 100.0 - 0.5 * torch.arange(len(pos), dtype=torch.float32)
    _, ids = check(x, dtype, 64)
    assert ids[0].tolist() == pos[:64]


def test_topk_sim_more_entries_than_elements():
    """k > L (the spec refuses it; the kernel is still defined): the entries past the row are empty, id -1 and
    probability exp(-inf - m) / l = 0."""
    x = logits(2, 7, 1)
    probs, ids, _ = run_topk(x, "float32", 12)
    ref_p, ref_i = topk_reference(x, 7)
    assert np.array_equal(ids[:, :7], ref_i.numpy()) and (ids[:, 7:] == -1).all()
    assert np.allclose(probs[:, :7], ref_p.numpy(), rtol=1e-5) and (probs[:, 7:] == 0).all()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("ld_extra, misalign", [(8, False), (3, False), (0, True)])
def test_topk_sim_strided_and_misaligned_rows(dtype, ld_extra, misalign):
    L = 9001
    check(logits(3, L, 3), dtype, 33, ld=L + ld_extra, misalign=misalign)


def test_topk_sim_with_fewer_threads_same_results():
    """2 warps instead of 8: the same entries (the schedule does not depend on the CTA size)."""
    x = logits(3, 7000, 4)
    a = check(x, "float32", 40, threads=64)
    b = check(x, "float32", 40)
    assert np.array_equal(a[1], b[1])


def test_topk_bridge_binds_entries_by_role():
    spec, op = engine("vocab_topk")
    math, roles = stream_math(spec, op)
    assert math.select == sr.Selection("x") and len(math.states) == 2
    assert [dt for _, dt in math.k_outputs] == ["float32", "int64"] and math.k_outputs[1][0] == "kix"
    assert roles["k_outputs"] == ("probs", "ids") and roles["outputs"] == () and math.whole_row
    plan = stream_plan(spec, op, ["sm80", "sm90a", "sm100a"])
    assert len(plan.jobs) == 9  # one kernel per (family, dtype); a selection is never split: no merge program
    with pytest.raises(ValueError, match="one CTA per row"):
        sr.emit_stream_row_merge(math, sr.StreamVariant("float32"), "m")


def test_topk_bridge_refusals(tmp_path):
    from generator.spec import load_spec
    from generator.symbolic import derive

    text = (ROOT / "specs" / "vocab_topk.yaml").read_text()
    two = text.replace("    top: topk(y, k)", "    top: topk(y, k)\n    low: topk(-y, k)").replace(
        '  ids: {shape: [T, k], dtype: int64, index: [t, r], value: "top.index[r]"}',
        '  ids: {shape: [T, k], dtype: int64, index: [t, r], value: "top.index[r]"}\n'
        '  low_ids: {shape: [T, k], dtype: int64, index: [t, r], value: "low.index[r]"}')
    half = text.replace("ids: {shape: [T, k], dtype: int64", "ids: {shape: [T, k], dtype: float16")
    for body, why in ((two, "one top-k per row"), (half, "entries of a selection are stored as")):
        p = tmp_path / "vocab_topk.yaml"
        p.write_text(body)
        spec = load_spec(p)
        with pytest.raises(BridgeError, match=why):
            stream_plan(spec, derive(spec), ["sm90a"])
