"""The CPU kernels' float8_e4m3fn rounding against torch's conversion on every float32 input (2^32 of them).

tests/cpu_math_exhaustive.cpp is compiled here with the flags of the CPU kernel objects (CMakeLists.txt:
REDFUSER_CPU_KERNEL_FLAGS) and run; it takes about half a minute. It catches what sampled inputs miss: the sign of
-0 and of negative values that round to 0 (the frexp/signbit version lost it under -ffast-math), ties at each
binade, the subnormal range and the saturation edge at 448/464.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from cpu_features import cpu_flag

ROOT = Path(__file__).resolve().parents[1]


def _kernel_flags() -> list[str]:
    text = (ROOT / "CMakeLists.txt").read_text()
    m = re.search(r'set\(REDFUSER_CPU_KERNEL_FLAGS "([^"]+)"', text)
    assert m, "REDFUSER_CPU_KERNEL_FLAGS not found in CMakeLists.txt"
    return m.group(1).split(";")


def _build_and_run(tmp_path: Path, source: str, extra: list[str], timeout: int) -> str:
    """Compile tests/<source> against ops_src with the kernels' flags (+ extra), run it, return its output."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    include = Path(torch.__file__).parent / "include"
    exe = tmp_path / Path(source).stem
    cmd = [cxx, "-std=c++17", *_kernel_flags(), *extra, f"-I{ROOT / 'ops_src'}", f"-I{include}",
           str(ROOT / "tests" / source), "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], check=False, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_e4m3_rounding_matches_torch_on_every_float(tmp_path):
    out = _build_and_run(tmp_path, "cpu_math_exhaustive.cpp", ["-march=native"], 600)
    assert "e4m3 mismatches: 0 of 2^32" in out


def test_tile_gemms_at_every_x86_level(tmp_path):
    """tests/cpu_gemm_levels.cpp: gemm_tile, gemm_tile_nt, gemm_tile_tc (stored transposed), e4m3_row_dots,
    e4m3_to_floats, first_rows and pack_row_panels at each x86-64 level the CPU runs (each level has its own vector width and lane
    reduction; the op tests reach only the machine's own), against float64 (first_rows against a search per
    element, e4m3_to_floats bit for bit against the scalar decode). Compiled with the kernels' flags and no -march,
    as the kernels are: the base level is then really SSE2 code."""
    out = _build_and_run(tmp_path, "cpu_gemm_levels.cpp", ["-w"], 300)
    assert "gemm_tile_nt_base mismatches: 0" in out, out
    assert "e4m3_row_dots_base mismatches: 0" in out, out
    assert "pack_transposed_base bf16 mismatches: 0" in out, out
    assert "panels mismatches: 0" in out, out
    assert "first_rows_base mismatches: 0" in out, out
    assert "pack_row_panels_base float mismatches: 0" in out and "pack_row_panels_base bf16 mismatches: 0" in out, out
    assert "gemm_tile_tc_base mismatches: 0" in out and "e4m3_to_floats_base mismatches: 0" in out, out
    if cpu_flag("avx512_bf16"):  # the pair tiles, whether or not the kernels pick them here: checked, not skipped
        assert "bf16 pairs mismatches: 0" in out, out


def test_selection_shortcuts_at_every_x86_level(tmp_path):
    """tests/cpu_selection.cpp: the chunk candidates (sel_candidates), the per-set offers with their bars
    (sel_offers) and the membership tables (sel_mark/sel_member) leave every selection exactly as offering each
    element in turn does, on keys with ties, NaN, infinities and signed zeros, at each x86-64 level."""
    out = _build_and_run(tmp_path, "cpu_selection.cpp", ["-w"], 300)
    assert "base selection mismatches: 0" in out, out
    assert "mismatches: 0" in out and not re.search(r"mismatches: [1-9]", out), out


def test_exp_at_every_x86_level(tmp_path):
    """tests/cpu_exp_levels.cpp: the kernels' float exp, vectorised at each x86-64 level the CPU runs, against float64
    on one float in 31 of its whole finite range (both ends: exp of 88.72, the largest float with a finite result,
    was +inf until the scale went into the exponent field) and on the special values."""
    out = _build_and_run(tmp_path, "cpu_exp_levels.cpp", ["-w"], 300)
    assert "exp_base mismatches: 0" in out, out
    assert not re.search(r"mismatches: [1-9]", out), out


def test_chunk_helpers_at_every_x86_level(tmp_path):
    """tests/cpu_chunk_helpers.cpp: rf::exp_sum (a GEMM fold's exp weights in place and their sum) against float64
    exp on one float in 31 of its range and the special values at every lane position, its sum on lengths around
    the 16-lane steps, and rf::max_of (a max fold over an element let's buffer) against a scalar NaN-propagating
    fold on rows with NaN (either sign), infinities and all -inf, at each x86-64 level the CPU runs."""
    out = _build_and_run(tmp_path, "cpu_chunk_helpers.cpp", ["-w"], 300)
    assert "exp_sum_base mismatches: 0" in out and "max_of_base mismatches: 0" in out, out
    assert not re.search(r"mismatches: [1-9]", out), out
