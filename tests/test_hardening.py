"""Issue 13's findings, one test each: every input that crashed the process, read outside a tensor or passed a spec
check unchecked gets a clear error naming the argument (CPU build); the CUDA glue's rules are pinned through the
code that can run without a GPU (the family rule, the generated launch source).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import redfuser_ops
from generator.codegen.glue import divisors, ordered_checks, value_domains
from generator.spec import load_spec
from redfuser_ops import reference

SPECS = Path(__file__).resolve().parent.parent / "specs"


def _mla_inputs(B=2, Sq=1, Hq=2, NB=4, MB=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, Hq, 576, generator=gen)
    kv = torch.randn(NB, 64, 1, 576, generator=gen)
    table = torch.arange(B * MB, dtype=torch.int32).reshape(B, MB) % NB
    lens = torch.full((B,), 64 * MB, dtype=torch.int32)
    return q, kv, table, lens


# --------------------------------------------------------------------------------------------- CPU findings
def test_empty_kv_heads_is_an_error_not_sigfpe():
    # k, v of shape (B, Sk, 0, D): H % Hk divided by zero before anything checked Hk >= 1
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 3, 0, 8)
    with pytest.raises(RuntimeError, match=r"fused_attention: Hk must be at least 1 .*\(Hk = 0\)"):
        redfuser_ops.fused_attention(q, k, k)


def test_empty_head_dim_is_an_error():
    # the spec says D >= 1; the engine's positive axes folded it to true, so D = 0 returned an empty result
    q, k = torch.randn(1, 2, 4, 0), torch.randn(1, 3, 2, 0)
    with pytest.raises(RuntimeError, match=r"the head dimension must not be empty \(D = 0\)"):
        redfuser_ops.fused_attention(q, k, k)


@pytest.mark.parametrize("entry", [10**6, -1, 4, -(2**31)])
def test_block_table_entry_outside_the_cache(entry):
    # 10**6 was a SIGSEGV, -1 read before the cache and returned NaN
    q, kv, table, lens = _mla_inputs()
    table[1, 1] = entry
    with pytest.raises(RuntimeError, match=rf"block_table\[1, 1\] = {entry} is outside its domain \[0, NB\) = \[0, 4\)"):
        redfuser_ops.mla_decode(q, kv, table, lens)


def test_unused_block_table_entries_may_hold_anything():
    q, kv, table, lens = _mla_inputs()
    table[1, 1] = 10**6  # block 1 of sequence 1 is not used with a length of 64
    lens[1] = 64
    for causal in (False, True):
        out, lse = redfuser_ops.mla_decode(q, kv, table, lens, causal=causal)
        r_out, r_lse = reference.mla_decode(q, kv, table, lens, causal=causal)
        assert (out.double() - r_out).abs().max().item() < 1e-4
        assert (lse.double() - r_lse).abs().max().item() < 1e-4


@pytest.mark.parametrize("length", [129, -1, 2**31 - 1])
def test_cache_seqlens_outside_its_domain(length):
    q, kv, table, lens = _mla_inputs()
    lens[0] = length
    with pytest.raises(RuntimeError, match=rf"cache_seqlens\[0\] = {length} is outside its domain "
                                           r"\[0, 64 \* MB\] = \[0, 128\]"):
        redfuser_ops.mla_decode(q, kv, table, lens)


def test_cache_seqlens_checked_without_blocks():
    # no table column at all: every length but 0 is out of its domain, although no key is read
    q, kv, _, _ = _mla_inputs()
    table = torch.zeros(2, 0, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"cache_seqlens\[1\] = 5 is outside"):
        redfuser_ops.mla_decode(q, kv, table, torch.tensor([0, 5], dtype=torch.int32))


def test_wrongly_sized_index_tensors():
    q, kv, table, lens = _mla_inputs()
    with pytest.raises(RuntimeError, match=r"block_table.size\(0\) must equal q.size\(0\)"):
        redfuser_ops.mla_decode(q, kv, table[:1], lens)
    with pytest.raises(RuntimeError, match=r"cache_seqlens.size\(0\) must equal q.size\(0\)"):
        redfuser_ops.mla_decode(q, kv, table, lens[:1])


def test_strided_index_tensors_are_checked_through_their_strides():
    q, kv, table, lens = _mla_inputs()
    wide = torch.full((2, 4), 10**6, dtype=torch.int32)
    wide[:, ::2] = table  # the odd columns are outside the cache, but not part of the view
    out, _ = redfuser_ops.mla_decode(q, kv, wide[:, ::2], lens)
    ref, _ = reference.mla_decode(q, kv, table, lens)
    assert (out.double() - ref).abs().max().item() < 1e-4
    wide[1, 2] = 7
    with pytest.raises(RuntimeError, match=r"block_table\[1, 1\] = 7"):
        redfuser_ops.mla_decode(q, kv, wide[:, ::2], lens)


def test_check_inputs_setting():
    before = redfuser_ops.check_inputs()
    try:
        assert redfuser_ops.set_check_inputs(True) == before
        assert redfuser_ops.check_inputs() is True
        assert redfuser_ops.set_check_inputs(False) is True
        assert redfuser_ops.check_inputs() is False
    finally:
        redfuser_ops.set_check_inputs(before)


def test_fake_checks_in_the_same_order():
    # the fake (torch.compile) must not divide by Hk either
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(1, 2, 4, 8), torch.empty(1, 3, 0, 8)
        with pytest.raises(RuntimeError, match="Hk must be at least 1"):
            torch.ops.redfuser.fused_attention(q, k, k)
        with pytest.raises(RuntimeError, match="head dimension must not be empty"):
            torch.ops.redfuser.fused_attention(torch.empty(1, 2, 4, 0), torch.empty(1, 3, 2, 0),
                                               torch.empty(1, 3, 2, 0))


# --------------------------------------------------------------------------------------------- generator rules
def test_checks_are_ordered_so_that_no_divisor_is_unchecked():
    for path in sorted(SPECS.glob("*.yaml")):
        spec = load_spec(path)
        proved = set()
        for chk in ordered_checks(spec):
            for d in divisors(chk.expr):
                assert d in proved, f"{path.name}: {chk.expr} divides by {d} before a check proves it >= 1"
            if chk.expr.is_Relational and chk.expr.rhs == 1 and chk.expr.rel_op == ">=":
                proved.add(chk.expr.lhs)
        # nothing is folded away: D >= 1 stays a check although D is an axis
    names = [str(c.expr) for c in ordered_checks(load_spec(SPECS / "fused_attention.yaml"))]
    assert names.index("Hk >= 1") < names.index("Eq(Mod(H, Hk), 0)") and "D >= 1" in names


def test_value_domains_are_read_from_the_spec():
    doms = {d.tensor: d for d in value_domains(load_spec(SPECS / "mla_decode.yaml"))}
    assert set(doms) == {"block_table", "cache_seqlens"}
    assert (str(doms["block_table"].hi), doms["block_table"].hi_closed) == ("NB", False)
    assert (str(doms["cache_seqlens"].hi), doms["cache_seqlens"].hi_closed) == ("64*MB", True)


# --------------------------------------------------------------------------------------------- CUDA glue rules
@pytest.mark.parametrize("cap, families, want", [
    ((12, 0), "sm80;sm90a;sm100a", "sm80"),   # consumer Blackwell: compute_80 PTX
    ((10, 3), "sm80;sm90a;sm100a", "sm80"),
    ((11, 0), "sm80;sm100a", "sm80"),
    ((9, 0), "sm80;sm90a", "sm90a"),
    ((10, 0), "sm80;sm100a", "sm100a"),
    ((8, 9), "sm80", "sm80"),
])
def test_ptx_fallback_for_capabilities_without_sass(cap, families, want):
    assert torch.ops.redfuser._select_family("op", cap[0], cap[1], families) == want


@pytest.mark.parametrize("cap, families", [((12, 0), "sm90a;sm100a"), ((7, 5), "sm80;sm90a"), ((8, 0), "sm90a")])
def test_error_only_where_nothing_fits(cap, families):
    with pytest.raises(RuntimeError, match=rf"this GPU is sm_{cap[0]}{cap[1]}"):
        torch.ops.redfuser._select_family("op", cap[0], cap[1], families)


# --------------------------------------------------------------------------------------------- generated CUDA glue
def _fake_params(program: str) -> list[tuple]:
    """A launcher's parameters as the lowering reports them, read from the TileLang program's signature."""
    import re

    found = re.search(r"T\.dynamic\(['\"]([^'\"]+)['\"]\)", program)
    ints = found.group(1).split(", ") if found else []
    start = program.index("@T.prim_func")
    sig = program[start:program.index("):", start)]
    params = [(n, "pointer", "", "void*") for n in re.findall(r"(\w+?)(?:_ptr)?: T\.(?:ptr|(?:Strided)?Tensor)", sig)]
    params += [(n, "scalar", "", "int32_t" if t == "int32" else "float")
               for n, t in re.findall(r"(\w+): T\.(int32|float32),", sig)]
    params += [(n, "scalar", "", "int32_t") for n in ints if (n, "pointer", "", "void*") not in params]
    return params + [("stream", "stream", "", "void*")]


def _cuda_glue(op: str):
    from generator.codegen import cuda
    from generator.codegen.glue import CudaGlue, glue_source
    from generator.symbolic.forms import analyze

    spec = load_spec(SPECS / f"{op}.yaml")
    an = analyze(spec)
    make_plan, make_body = cuda.TEMPLATES[spec.variants.cuda.template]
    plan = make_plan(spec, an, ["sm80", "sm90a"])
    lowered = {j.symbol: {"params": _fake_params(j.program), "family": j.family} for j in plan.jobs}
    decl = cuda.declarations(lowered) + [cuda._variant_object(s, op, i["family"]) for s, i in sorted(lowered.items())]
    decl += getattr(plan, "support", [])
    glue = CudaGlue(decl, make_body(spec, plan, lowered), [(s, i["family"]) for s, i in lowered.items()])
    return glue_source(spec, an, f"{op}_cpu.h", glue, "test")


@pytest.mark.parametrize("op", ["fused_attention", "moe_route"])
def test_generated_cuda_glue_compiles_with_batch_tiling(op, tmp_path):
    """The launch code: pointers offset per batch (or row) chunk on the host in 64-bit arithmetic, the chunk from
    redfuser::batch_chunk (int32 offsets, grid limit), stride-0 inputs copied; it must compile as C++."""
    import shutil
    import subprocess
    import sys

    src = _cuda_glue(op)
    if op == "fused_attention":
        assert "redfuser::batch_chunk(kOp, A.sz_B," in src and "redfuser::batch_ptr(qq, b_launch0)" in src
        assert "t.stride(d) <= 0" in src  # expanded inputs are copied, never given to TMA
        assert "const int64_t n_launch_b = std::min(bchunk, A.sz_B - b_launch0);" in src
    else:
        assert "redfuser::batch_chunk(kOp, A.sz_T," in src and "redfuser::batch_ptr(logits_c, r_launch0)" in src
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    gen = tmp_path / "gen"
    subprocess.run([sys.executable, "-m", "generator", "emit", "--out", str(gen), "--archs=", str(SPECS / f"{op}.yaml")],
                   check=True, capture_output=True, cwd=SPECS.parent)
    (tmp_path / "glue.cpp").write_text(src)
    inc = Path(torch.__file__).parent / "include"
    r = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-DTORCH_STABLE_ONLY",
                        "-DTORCH_TARGET_VERSION=0x020A000000000000", f"-I{inc}", f"-I{SPECS.parent / 'ops_src'}",
                        f"-I{gen / 'cpu'}", str(tmp_path / "glue.cpp")], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-4000:]


def test_batch_chunk_rule():
    """The launch tiling of the CUDA glue (runtime.cpp), through its test op: a launch covers batches whose int32
    offsets and grid fit; base pointers are offset on the host."""
    chunk = torch.ops.redfuser._batch_chunk
    # the case: B = 2 with a batch stride of 2**32 and a small batch: one batch per launch, not a
    # truncated stride (int32(2**32) = 0 read batch 0 twice); exactly 2**31 is valid too
    assert chunk("op", 2, f"q:{2**32}:{2**20}") == 1
    assert chunk("op", 4, f"q:{2**31}:{2**20}") == 1
    assert chunk("op", 4, f"q:{2**29}:{2**29}") == 4  # 4 * 2**29 - 1 = 2**31 - 1: still fits
    assert chunk("op", 5, f"q:{2**29}:{2**29}") == 4
    # the grid's batch dimension: at most 65535 per launch
    assert chunk("op", 100000, "q:8:8") == 65535
    assert chunk("op", 100000, "q:8:8", 2**31 - 1) == 100000
    assert chunk("op", 0, "q:8:8") == 1
    assert chunk("op", 3, f"q:{2**30}:{2**31}") == 1  # offsets up to 2**31 - 1: one batch per launch
    # one batch larger than int32 offsets can reach: a clear error naming the tensor (the 1M x 32 x 128)
    with pytest.raises(RuntimeError, match=r"op: k: one batch spans 4294967296 elements; .*int32"):
        chunk("op", 2, f"q:8:8;k:{2**32}:{2**32}")


@pytest.mark.parametrize("family", ["sm90a", "sm100a", "sm80"])
def test_every_thread_fences_before_the_tma_store(family):
    """The threads that write O_shared with generic stores each issue fence.proxy.async before the barrier that
    precedes the TMA store (lowered for sm90a: `tl::fence_proxy_async(); tl::__sync_thread_partial(..);
    if (elect) { tl::tma_store(..) }`); sm80 has no TMA store and no fence."""
    from generator.codegen import cuda
    from generator.symbolic.forms import analyze

    spec = load_spec(SPECS / "fused_attention.yaml")
    plan = cuda.TEMPLATES["stream_attention"][0](spec, analyze(spec), [family])
    job = next(j for j in plan.jobs if "splitkv" not in j.symbol and "combine" not in j.symbol)
    lines = [x.strip() for x in job.program.splitlines()]
    store = lines.index("T.copy(acc_o, O_shared)")
    if family == "sm80":
        assert "T.fence_proxy_async()" not in lines
        return
    assert lines[store + 1] == "T.fence_proxy_async()"
    assert lines[store + 2].startswith("T.copy(O_shared, O[")


def test_warm_up_entry_point():
    """redfuser_ops.warm_up(device) initialises every kernel a device runs before a CUDA-graph capture; a build
    without CUDA kernels has none to initialise."""
    info = redfuser_ops.info()
    if info["families"]:
        pytest.skip("needs a GPU on a CUDA build (tests/gpu)")
    assert redfuser_ops.warm_up(0) == 0


def test_only_index_and_length_uses_are_checked():
    """softmax_cross_entropy documents target in [0, V) but compares it (ignore_index tokens hold -100): a value that
    is never used as an index or a length is not checked; mla_decode's table (an index) and lengths (the mask) are."""
    from generator.codegen.glue import glue_source
    from generator.symbolic.forms import analyze

    for op, checked in (("softmax_cross_entropy", False), ("mla_decode", True)):
        spec = load_spec(SPECS / f"{op}.yaml")
        src = glue_source(spec, analyze(spec), f"{op}_cpu.h", None, "test")
        assert ("domain_error(" in src) is checked, op
