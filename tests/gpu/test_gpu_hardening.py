"""Issue 13 on a GPU (marker `gpu`; never run by the sessions that wrote it, which had no GPU): the launch tiling
over batches (more than 65535 batches, a batch stride of 2**31 elements), expanded inputs, and a CUDA-graph
capture after redfuser_ops.warm_up() in a fresh process (no eager call before the capture).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import redfuser_ops
from redfuser_ops import reference as ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _judge(q, k, v, causal=False):
    out, lse = torch.ops.redfuser.fused_attention(q, k, v, causal, None)
    r_out, r_lse = ref.fused_attention(q, k, v, causal, None, dtype=torch.float32)
    p_out, _ = ref.fused_attention(q, k, v, causal, None, dtype=q.dtype)
    plain = (p_out.float() - r_out).abs().max().item()
    assert (out.float() - r_out).abs().max().item() <= 2 * plain + 1e-5
    assert (lse - r_lse).abs().max().item() <= 1e-3


def test_more_batches_than_a_grid_dimension():
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(70000, 1, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(70000, 3, 1, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    _judge(q, k, torch.randn_like(k))


def test_batch_stride_of_2_pow_31_elements():
    # the second batch starts 2**31 elements after the first: an int32 stride would read batch 0 twice
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs 24 GiB")
    buf = torch.zeros(2**31 + 16 * 4 * 64, device="cuda", dtype=torch.float16)
    q = buf.as_strided((2, 16, 4, 64), (2**31, 256, 64, 1))
    q.copy_(torch.randn(2, 16, 4, 64, device="cuda", dtype=torch.float16))
    k = torch.randn(2, 32, 4, 64, device="cuda", dtype=torch.float16)
    _judge(q, k, torch.randn_like(k), causal=True)
    del buf


def test_expanded_inputs():
    k1 = torch.randn(1, 40, 2, 128, device="cuda", dtype=torch.float16)
    q = torch.randn(3, 17, 4, 128, device="cuda", dtype=torch.float16)
    _judge(q, k1.expand(3, 40, 2, 128), k1.expand(3, 40, 2, 128))


def test_capture_after_warm_up_in_a_fresh_process(tmp_path):
    code = textwrap.dedent("""
        import torch, redfuser_ops
        n = redfuser_ops.warm_up(0)
        assert n > 0, n
        q = torch.randn(2, 33, 4, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 70, 2, 128, device="cuda", dtype=torch.bfloat16)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out, lse = torch.ops.redfuser.fused_attention(q, k, k, True, None)
        g.replay()
        torch.cuda.synchronize()
        e_out, e_lse = torch.ops.redfuser.fused_attention(q, k, k, True, None)
        assert torch.equal(out, e_out) and torch.equal(lse, e_lse)
        print("ok", n)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_check_inputs_on_cuda_reads_index_values():
    info = redfuser_ops.info()["ops"]["mla_decode"]
    if not any(v["device"] == "cuda" for v in info["variants"]):
        pytest.skip("mla_decode has no CUDA kernel in this build")
    q = torch.randn(2, 1, 2, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(4, 64, 1, 576, device="cuda", dtype=torch.bfloat16)
    table = torch.tensor([[0, 1], [2, 10**6]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([100, 128], dtype=torch.int32, device="cuda")
    before = redfuser_ops.set_check_inputs(True)
    try:
        with pytest.raises(RuntimeError, match=r"block_table\[1, 1\] = 1000000 is outside its domain"):
            redfuser_ops.mla_decode(q, kv, table, lens)
    finally:
        redfuser_ops.set_check_inputs(before)
    # unchecked: no read outside the cache (compute-sanitizer in bench/gpu_run.sh), a finite result
    out, _ = redfuser_ops.mla_decode(q, kv, table, lens)
    torch.cuda.synchronize()
    assert torch.isfinite(out[0]).all()
