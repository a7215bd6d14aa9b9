"""The paged_attention template and its bridge (mla_decode on CUDA), checked on the CPU.

The template's numpy simulation of its own schedule (row blocks of packed heads, tiles gathered through the
block table, clamped indices, the row limit from the IR's mask, V rows past the length zeroed, the engine's
online update, split-KV segments and the engine's merge form) runs the math the bridge derives from
specs/mla_decode.yaml against the float64 reference (redfuser_ops.reference.mla_decode).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from generator.codegen.cuda import BridgeError
from generator.codegen.templates import paged_attention as pa
from generator.codegen.templates import paged_attention_bridge as pb
from generator.spec import load_spec, parse_spec
from generator.symbolic import derive
from redfuser_ops import reference

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "mla_decode.yaml"
PAGE, DK, DV = 64, 576, 512


@pytest.fixture(scope="module")
def kernel():
    """(math, roles) of the one kernel for both specialisations (causal is a run-time mask flag)."""
    return pb.kernel_math(derive(load_spec(SPEC)))[:2]


def _case(rng, lens, Sq, Hq, n_extra_blocks=3):
    """q, a cache whose pages are shuffled, a table with garbage past each length, NaN in unused cache rows."""
    B = len(lens)
    need = [-(-n // PAGE) for n in lens]
    MB = max(max(need), 1) + 1
    NB = sum(need) + n_extra_blocks
    perm = rng.permutation(NB)
    bt = rng.integers(-(2**31), 2**31 - 1, size=(B, MB), dtype=np.int64).astype(np.int32)  # garbage
    kv = rng.standard_normal((NB, PAGE, 1, DK)).astype(np.float32)
    used = 0
    for b, n in enumerate(lens):
        bt[b, : need[b]] = perm[used : used + need[b]]
        used += need[b]
        if n % PAGE:  # rows past the length in the last page: garbage that must never reach the output
            kv[bt[b, need[b] - 1], n % PAGE :] = np.nan
    for p in perm[used:]:  # pages no sequence uses
        kv[p] = np.nan
    q = rng.standard_normal((B, Sq, Hq, DK)).astype(np.float32)
    return q, kv, bt, np.asarray(lens, np.int32)


def _run(kernel, causal, q, kv, bt, lens, family="sm90a", splits=1, **tiles):
    math, roles = kernel
    B, Sq, Hq, _ = q.shape
    cfg = pa.replace(pa.default_config(family, "bfloat16", DV, split_kv=splits > 1), **tiles)
    scale = DK**-0.5
    o, lse = pa.simulate(math, roles, cfg, q.reshape(B, Sq * Hq, DK), kv[:, :, 0], bt, lens,
                         {"softmax_scale": scale}, heads=Hq, num_splits=splits, mask_flag=int(causal))
    return o.reshape(B, Sq, Hq, DV), lse.reshape(B, Hq, Sq)


def _check(kernel, causal, q, kv, bt, lens, **kw):
    o, lse = _run(kernel, causal, q, kv, bt, lens, **kw)
    ro, rl = reference.mla_decode(torch.from_numpy(q), torch.from_numpy(kv), torch.from_numpy(bt),
                                  torch.from_numpy(lens), DV, None, causal)
    ro, rl = ro.numpy(), rl.numpy()
    assert np.isfinite(o).all()
    assert np.abs(o - ro).max() < 1e-4  # float32 sums over up to 4097 keys
    fin = np.isfinite(rl)
    assert (np.isfinite(lse) == fin).all() and (lse[~fin] == rl[~fin]).all()
    assert (np.abs(lse[fin] - rl[fin]) <= 1e-4 + 1e-6 * np.abs(rl[fin])).all()  # float32 of |lse| up to 1e3
    return o, lse


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Hq, Sq", [(1, 1), (16, 1), (8, 2), (16, 4), (128, 3)])
def test_engine_math_through_the_paged_schedule(kernel, Hq, Sq, causal, splits):
    """Hq 1/16/128 and Sq 1..4 (Hq x Sq up to 384 packed rows: six 64-row slices), every length of the issue in
    one batch, causal and not, one segment and three."""
    rng = np.random.default_rng(Hq * 10 + Sq)
    q, kv, bt, ln = _case(rng, [0, 1, 63, 64, 65, 4097], Sq, Hq)
    q[-1, 0, 0] *= -300.0  # scores far below zero: the first correction must not overflow
    o, lse = _check(kernel, causal, q, kv, bt, ln, splits=splits)
    assert (o[0] == 0).all() and np.isneginf(lse[0]).all()  # length 0: out 0, lse -inf


@pytest.mark.parametrize("causal", [False, True])
def test_sm80_slices_and_half_pages(kernel, causal):
    """sm80 runs 16-row slices of the packed heads; tiles of half a page (block_n 32) gather the right rows."""
    rng = np.random.default_rng(7)
    q, kv, bt, ln = _case(rng, [3, 64, 97, 200], 3, 16)
    _check(kernel, causal, q, kv, bt, ln, family="sm80", splits=1)
    _check(kernel, causal, q, kv, bt, ln, family="sm80", splits=2)
    _check(kernel, causal, q, kv, bt, ln, family="sm80", splits=2, block_n=32)


def test_causal_rows_before_the_first_key(kernel):
    """Causal with Sq > length: the first queries see no key (out 0, lse -inf), the later ones do."""
    rng = np.random.default_rng(3)
    q, kv, bt, ln = _case(rng, [2, 5], 4, 8)
    o, lse = _check(kernel, True, q, kv, bt, ln, splits=2)
    assert (o[0, :2] == 0).all() and np.isneginf(lse[0, :, :2]).all() and np.isfinite(lse[0, :, 2:]).all()


@pytest.mark.parametrize("family", ["sm90a", "sm100a"])
def test_tma_families_share_the_schedule(kernel, family):
    """sm100a runs the TMA schedule of sm90a (64 packed rows, whole-page tiles, two in flight); its simulation
    matches the reference with split-KV over a batch of mixed lengths."""
    cfg = pa.default_config(family, "float16", DV, True)
    assert (cfg.block_m, cfg.block_n, cfg.num_stages, cfg.producer_regs) == (64, PAGE, 2, 40)
    rng = np.random.default_rng(5)
    q, kv, bt, ln = _case(rng, [0, 64, 130, 700], 2, 16)
    _check(kernel, True, q, kv, bt, ln, family=family, splits=2)


def test_out_of_range_pages_are_clamped_not_read(kernel):
    """An in-use table entry outside [0, NB) reads the clamped page (inside the cache), nothing else."""
    rng = np.random.default_rng(11)
    q, kv, bt, ln = _case(rng, [130, 64], 1, 4, n_extra_blocks=0)
    kv = np.nan_to_num(kv)
    NB = kv.shape[0]
    bad = bt.copy()
    bad[0, 1], bad[1, 0] = NB + 5, -7
    clamped = bt.copy()
    clamped[0, 1], clamped[1, 0] = NB - 1, 0
    o, lse = _run(kernel, False, q, kv, bad, ln)
    ro, rl = reference.mla_decode(torch.from_numpy(q), torch.from_numpy(kv), torch.from_numpy(clamped),
                                  torch.from_numpy(ln), DV, None, False)
    assert np.abs(o - ro.numpy()).max() < 1e-4 and np.abs(lse - rl.numpy()).max() < 1e-4


def test_renamed_spec_gives_the_same_kernel(kernel, tmp_path):
    """The bridge binds by role: renaming the op, axes, arguments and indices changes nothing but names."""
    text = SPEC.read_text()
    renames = {"mla_decode": "latent_decode", "B": "N", "Sq": "T", "Hq": "G", "NB": "P", "MB": "W",
               "q": "query", "kv_cache": "pool", "block_table": "pages", "cache_seqlens": "lengths",
               "head_dim_v": "dv", "b": "n", "t": "u", "h": "g", "j": "k", "c": "e", "d": "f", "page": "blk", "s": "sc"}
    body = text.split("\nvariants:")[0]
    for old, new in renames.items():
        body = re.sub(rf"(?<![\w.#]){old}(?![\w])", new, body)
    rest = "\nvariants:" + text.split("\nvariants:")[1].replace("head_dim_v:", "dv:")
    path = tmp_path / "latent_decode.yaml"
    path.write_text(body + rest)
    spec = parse_spec(path.read_text(), str(path))
    assert {t.name for t in spec.tensors} == {"query", "pool", "pages", "lengths"}
    math, roles, r, flag = pb.kernel_math(derive(spec))
    assert flag == "causal" and str(r["lens"]) == "lengths[n]"
    for fam in ("sm80", "sm90a", "sm100a"):
        for split in (False, True):
            cfg = pa.default_config(fam, "float16", DV, split)
            assert pa.emit_paged_program(math, roles, cfg, "k") == pa.emit_paged_program(*kernel, cfg, "k")
            assert pa.emit_combine_program(math, cfg, "k") == pa.emit_combine_program(kernel[0], cfg, "k")


@pytest.fixture(scope="module")
def plan():
    """The CUDA plan of specs/mla_decode.yaml for the families it lists."""
    spec = load_spec(SPEC)
    families = spec.variants.cuda.families
    assert set(families) == {"sm80", "sm90a", "sm100a"}  # the three families
    return spec, pb.paged_plan(spec, derive(spec), list(families))


def test_every_variant_emits_valid_python(plan):
    _, plan = plan
    # per family and dtype: the single-segment kernel, the split kernel, the combine (causal is a run-time flag)
    assert len(plan.jobs) == 3 * 2 * 3 and {j.family for j in plan.jobs} == {"sm80", "sm90a", "sm100a"}
    for job in plan.jobs:
        compile(job.program, job.symbol, "exec")
        assert f"def {job.symbol}(" in job.program


def test_masked_v_rows_and_page_clamps_in_the_program(kernel):
    cfg = pa.default_config("sm90a", "bfloat16", DV, True)
    text = pa.emit_paged_program(*kernel, cfg, "k")
    assert "page = T.min(T.max(BT[by, T.min(kt, max_blocks - 1)], 0), n_blocks - 1)" in text
    assert "KV_shared[r, c] = T.cast(0, dtype)" in text
    assert ("lim[i] = T.min(T.if_then_else(mask_flag != 0, kv_len - n_a + T.truncdiv(r0 + i, heads) + 1, kv_len), "
            "kv_len)") in text
    # V is the cached tile itself: one load of the 512 channels serves both GEMMs
    assert text.count("T.copy(KV[page") == 2 and "T.gemm(P_shared, KV_shared, acc_o" in text


def _launcher_params(program: str) -> list[tuple]:
    """A lowered kernel's launcher parameters as TileLang's wrapper orders them: tensors, float params, ints."""
    tensors = re.findall(r"^\s+(\w+): T\.Tensor\(", program, re.MULTILINE)
    consts = dict(re.findall(r"^(PARAMS|CALL_INT_ARGS) = (\(.*?\))", program, re.MULTILINE))
    floats, ints = (ast.literal_eval(consts[k]) for k in ("PARAMS", "CALL_INT_ARGS"))
    return ([(t, "pointer", "", "void*") for t in tensors] + [(f, "scalar", "float32", "float") for f in floats]
            + [(i, "dim", "int32", "int32_t") for i in ints] + [("stream", "stream", "", "void*")])


def test_launch_plan_reads_no_device_memory(plan):
    """CUDA-graph capture: the glue chooses the split count from host-known sizes (batch, packed rows, the
    table's capacity, the SM count) and never copies device data to the host, for every family."""
    spec, plan = plan
    lowered = {j.symbol: {"params": _launcher_params(j.program)} for j in plan.jobs}
    body = "\n".join(pb.paged_body(spec, plan, lowered))
    calls = re.findall(r"const int ns = choose_num_splits\((.*)\);", body)
    assert len(calls) == len(plan.entries) == 3 * 2
    for args in calls:
        names = set(re.findall(r"[A-Za-z_][\w.]*", args))
        assert names <= {"A.sz_B", "A.sz_MB", "rows", "sms"}, names
    assert "const int64_t rows = A.sz_Sq * A.sz_Hq;" in body
    for host_read in ("item(", "cpu", "Memcpy", "ynchronize", "DeviceType::CPU", "values_of", "to_host"):
        assert host_read not in body, host_read
    for fam in ("sm80", "sm90a", "sm100a"):  # each family launches its own three kernels
        assert f'fam == "{fam}"' in body and f"kV_mla_decode_combine__bf16_v512__{fam}" in body


def test_bridge_refuses_an_unpaged_cascade():
    op = derive(load_spec(ROOT / "specs" / "fused_attention.yaml"))
    with pytest.raises(BridgeError, match="page"):
        pb.paged_math(op.cases[0])


def test_split_plan_uses_host_sizes_only():
    # small batch, long table: split; a full grid: no split; a short table: no split
    assert pa.choose_num_splits(1, 16, 32768, 64, 64, 132, 256, 64) > 1
    assert pa.choose_num_splits(128, 128, 32768, 64, 64, 132, 256, 64) == 1
    assert pa.choose_num_splits(1, 16, 256, 64, 64, 132, 256, 64) == 1


def test_shared_memory_fits_each_family(kernel):
    _, roles = kernel
    for fam in ("sm90a", "sm100a"):
        assert pa.shared_bytes(pa.default_config(fam, "bfloat16", DV), roles) <= 227 * 1024
    assert pa.shared_bytes(pa.default_config("sm80", "bfloat16", DV), roles) <= 99 * 1024


@pytest.mark.parametrize("causal", [False, True])
def test_a_mask_written_with_le_gives_the_same_values(causal):
    """The bridge reads `j <= limit - 1` as `j < limit`: the spec's mask rewritten that way gives the same results."""
    text = SPEC.read_text()
    le = text.replace('mask: "j < cache_seqlens[b] - (Sq - 1 - t) if causal else j < cache_seqlens[b]"',
                      'mask: "j <= cache_seqlens[b] - (Sq - 1 - t) - 1 if causal else j <= cache_seqlens[b] - 1"')
    assert le != text
    kernel = pb.kernel_math(derive(parse_spec(le, "mla_decode_le.yaml")))[:2]
    q, kv, bt, ln = _case(np.random.default_rng(5), [1, 63, 65, 130], 3, 4)
    _check(kernel, causal, q, kv, bt, ln, splits=2)
