"""A bad spec ends in a clear error from `python -m generator check` (which runs the engine and every code generator
the build runs), never in a Python traceback from inside the generator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CE = (ROOT / "tests" / "specs" / "cross_entropy.yaml").read_text()
# per-token float weights: no CUDA template takes them (resident_row: 1-D outputs; stream_row: float per-row reads)
CE_WEIGHTED = (CE.replace('  labels: {shape: [T], dtype: [int32], values: "[0, V)"}\n',
                          '  labels: {shape: [T], dtype: [int32], values: "[0, V)"}\n  weight: {shape: [T], dtype: [float32]}\n')
               .replace('value: "m + log(l) - xt"', 'value: "(m + log(l) - xt) * weight[t]"'))


def check(tmp_path: Path, text: str) -> tuple[int, str]:
    spec = tmp_path / "op.yaml"
    spec.write_text(text)
    r = subprocess.run([sys.executable, "-m", "generator", "check", str(spec)], check=False, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.parametrize("text, message", [
    (CE.replace('dtype: [int32], values: "[0, V)"', "dtype: [bool]"), "no support for 'bool'"),
    # a value domain is for integer tensors (tests/test_spec_validation.py has the other mistakes in one)
    (CE.replace("dtype: [int32], values", "dtype: [bool], values"), "only integer tensors take values"),
    (CE + "variants:\n  cuda: {template: stream_attention, families: [sm80], dtype: [float32]}\n",
     "no CUDA kernel template accepts this cascade (stream_attention: "),
    (CE_WEIGHTED + "variants:\n  cuda: {families: [sm80], dtype: [float32]}\n", "resident_row writes (rows, k) outputs"),
    (CE_WEIGHTED + "variants:\n  cuda: {families: [sm80], dtype: [float32]}\n",
     "stream_row: per-row tensor weight must be an integer index tensor"),
    (CE + "schedule: {sm80: {block_m: 64}}\n", "'schedule:' is gone"),
    (CE.replace("xt: sum(where(e == labels[t], x, 0))", "xt: sum(sin(x * m))"), "is not fusible"),
])
def test_bad_spec_gives_a_clear_error(tmp_path, text, message):
    rc, out = check(tmp_path, text)
    assert rc == 1 and message in out and "Traceback" not in out, out


@pytest.mark.parametrize("dtype", ["int32", "int64", "int64, int32"])
def test_index_tensors_of_every_torch_index_dtype(tmp_path, dtype):
    rc, out = check(tmp_path, CE.replace("dtype: [int32], values", f"dtype: [{dtype}], values"))
    assert rc == 0 and out.startswith("ok "), out


def test_build_stops_with_the_reasons_when_no_template_accepts(tmp_path):
    """The build's generator (`emit`) ends a spec whose cuda section no template accepts with the reasons."""
    spec = tmp_path / "op.yaml"
    spec.write_text(CE_WEIGHTED + "variants:\n  cuda: {families: [sm80], dtype: [float32]}\n")
    r = subprocess.run([sys.executable, "-m", "generator", "emit", "--out", str(tmp_path / "gen"), "--archs", "sm80",
                        str(spec)], check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "no CUDA kernel template accepts cross_entropy" in out, out
    assert "resident_row writes (rows, k) outputs" in out and "Traceback" not in out
    assert "stream_row: per-row tensor weight must be an integer index tensor" in out
