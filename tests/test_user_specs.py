"""A new op from its YAML spec alone, on the CPU: a library built from tests/specs/*.yaml alone (ops no shipped spec
is: lets that read lets, a cast inside the cascade, per-sequence lengths in the mask, selections that carry
payloads, `where=` sums, a squared-distance score that takes the row kernel's blocked paths, an optional tensor
whose dtype follows another argument's) whose kernels are called through torch.ops.redfuser and judged against the engine's plain float64 math of
each spec, its casts rounding as their dtypes do (tests/_user_specs_worker.py, in its own process: the library's
ops register under the namespace of the installed one). The build is CPU-only, its kernels at -O0 (the release
build's semantics, fast-math without finite-math; about 30 s on 2 cores), from a copy of this checkout's generator
and runtime sources, so that a change to the CPU emitter is judged here on ops the shipped specs do not exercise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SPECS = sorted((REPO / "tests" / "specs").glob("*.yaml"))
KERNEL_FLAGS = "-O0;-ffast-math;-fno-finite-math-only"
DRAWS = 24  # per case and dtype: each length of the reduced axis (_user_specs_worker.LONG) four times
SEEDS = (1, 2)


def _tool(name: str) -> str | None:
    """The interpreter's own (pip's cmake and ninja in a venv not on PATH), else PATH's."""
    own = Path(sys.executable).parent / name
    return str(own) if own.exists() else shutil.which(name)


@pytest.fixture(scope="module")
def user_library(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("user_specs")
    src = root / "src"
    for d in ("generator", "ops_src"):
        shutil.copytree(REPO / d, src / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "CMakeLists.txt", src)
    (src / "specs").mkdir()
    for p in SPECS:
        shutil.copy(p, src / "specs")
    cmake, ninja = _tool("cmake"), _tool("ninja")
    if cmake is None:
        pytest.fail("cmake not found (pip install cmake ninja: tests/requirements.txt)")
    build = root / "build"
    configure = [cmake, "-S", str(src), "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}",
                 "-DREDFUSER_ARCHS=", "-DREDFUSER_GLIBC=", f"-DREDFUSER_CPU_KERNEL_FLAGS={KERNEL_FLAGS}"]
    if ninja:
        configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for step in (configure, [cmake, "--build", str(build), "-j", str(os.cpu_count() or 2)]):
        r = subprocess.run(step, check=False, capture_output=True, text=True, env=env, timeout=1200)
        assert r.returncode == 0, f"{' '.join(step[:3])}: exit {r.returncode}\n{(r.stdout + r.stderr)[-4000:]}"
    lib = build / "_C.so"
    assert lib.exists(), f"the build made no {lib}"
    return lib


@pytest.fixture(scope="module")
def report(user_library) -> dict[int, dict]:
    out = {}
    for seed in SEEDS:
        r = subprocess.run([sys.executable, str(REPO / "tests" / "_user_specs_worker.py"), str(user_library),
                            str(REPO / "tests" / "specs"), str(seed), str(DRAWS)],
                           check=False, capture_output=True, text=True, timeout=900, cwd=REPO)
        assert r.returncode == 0, f"the worker failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-4000:]}"
        out[seed] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn"])
def test_rounding_casts_round_as_torch(dtype):
    """The reference's casts (Evaluator(round_casts=True)): torch's conversion from float32, e4m3 saturating."""
    import numpy as np
    import torch

    from generator.symbolic.evaluate import round_cast

    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(20000) * s for s in (1e-6, 1e-3, 1.0, 30.0, 500.0, 1e5)] +
                       [[0.0, -0.0, np.inf, -np.inf, np.nan, 448.0, 449.0, 464.0, 480.0, 2.0**-9, 2.0**-10,
                         1.5 * 2.0**-9, 2.5 * 2.0**-9, 65504.0, 65520.0, 1e6, 3.0e38]])
    t = torch.from_numpy(x).float()
    if dtype == "float8_e4m3fn":
        t = t.clamp(-448.0, 448.0)
    want = t.to(getattr(torch, dtype)).double().numpy()
    got = round_cast(dtype, x)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    assert same.all(), list(zip(x[~same][:5], got[~same][:5], want[~same][:5]))


def test_every_spec_is_an_op_of_the_library(report):
    for seed, ops in report.items():
        assert sorted(ops) == sorted(p.stem for p in SPECS), seed


@pytest.mark.parametrize("name", [p.stem for p in SPECS])
def test_cpu_kernel_matches_the_plain_math(report, name):
    for seed, ops in report.items():
        res = ops[name]
        assert res["calls"] >= DRAWS, res  # every case and dtype ran
        assert res["n_failures"] == 0, f"seed {seed}: {res['n_failures']} of {res['calls']} calls failed: " + \
            "\n".join(res["failures"])
