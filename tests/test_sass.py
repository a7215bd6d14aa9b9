"""Static SASS check of the INSTALLED library (bench/sass.py does the work; docs/benchmarks.md explains it).

For every CUDA variant of the checked families (sm_90a): the instructions its kind of kernel must use
(bench/sass_expect.py: HGMMA/QGMMA where there is a GEMM, UTMALDG where tiles come by TMA) and no local-memory
traffic (LDL/STL, LOCAL = 0); and the per-family tables of registers, shared and local memory and opcode counts
must equal the committed bench/results/sass/<family>.md/.json, so that a change of the machine code shows up in
review (`python -m bench.sass --update` rewrites them).

A CPU-only build has nothing to inspect: then the test FAILS unless REDFUSER_CPU_ONLY_BUILD=1 says that the
build is meant to be CPU-only, and in that case it checks that the library holds no CUDA code. No silent skip.
Tools: cuobjdump (pip install nvidia-cuda-cuobjdump, or a CUDA toolkit) and readelf (binutils).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from bench import sass
from bench.sass_expect import CHECKED_FAMILIES, FAMILY_ARCHS

CPU_ONLY = os.environ.get("REDFUSER_CPU_ONLY_BUILD", "") == "1"
# a declared subset build (.ci/run: bf16, D=128, E_cap=512: every template for every family): each of its kernels
# must have its row in the committed tables (which are written from that build) and equal it
SUBSET = os.environ.get("REDFUSER_SUBSET_BUILD", "") == "1"


@pytest.fixture(scope="module")
def installed() -> dict:
    try:
        return sass.installed_library()
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def kernels(installed) -> list[sass.Kernel]:
    if not installed["families"]:
        pytest.fail(_cpu_only_message(installed) if not CPU_ONLY else
                    "internal: CPU-only build reached the SASS fixture")
    try:
        return sass.inspect_library(Path(installed["library"]))
    except sass.ToolMissing as e:
        pytest.fail(str(e))


def _cpu_only_message(installed: dict) -> str:
    return (f"the installed library {installed['library']} has no CUDA code (a CPU-only build: no arch families), "
            "so there is no SASS to check. Build with CUDA families (the default REDFUSER_ARCHS), or, if this "
            "build is meant to be CPU-only, say so with REDFUSER_CPU_ONLY_BUILD=1.")


def test_build_kind_is_declared(installed):
    """A CPU-only build must be declared; a declared CPU-only build must hold no CUDA code."""
    lib = Path(installed["library"])
    if CPU_ONLY:
        assert not installed["families"], (
            f"REDFUSER_CPU_ONLY_BUILD=1 but the library was built for {installed['families']}")
        assert not [v for v in installed["variants"] if v["device"] == "cuda"], "CUDA variants in a CPU-only build"
        try:
            assert not sass.has_cuda_code(lib), f"{lib} is declared CPU-only but holds a CUDA fat binary"
        except sass.ToolMissing as e:
            pytest.fail(str(e))
    else:
        assert installed["families"], _cpu_only_message(installed)


@pytest.mark.skipif(CPU_ONLY, reason="REDFUSER_CPU_ONLY_BUILD=1: test_build_kind_is_declared checked that the "
                                     "library holds no CUDA code")
class TestCudaCode:
    def test_every_variant_has_code(self, installed, kernels):
        have = {k.variant for k in kernels}
        missing = [v["name"] for v in installed["variants"] if v["device"] == "cuda" and v["name"] not in have]
        assert not missing, f"{len(missing)} CUDA variants without SASS, e.g. {missing[:5]}"
        for fam in installed["families"]:
            archs = {k.arch for k in kernels if k.family == fam}
            assert archs == set(FAMILY_ARCHS[fam]), (fam, sorted(archs))

    def test_checked_families_meet_their_rules(self, installed, kernels):
        checked = [f for f in installed["families"] if f in CHECKED_FAMILIES]
        if not checked:
            pytest.fail(f"the library holds {installed['families']} but none of the checked families "
                        f"{CHECKED_FAMILIES}: build sm90a too (REDFUSER_ARCHS) so that the Hopper code is checked")
        problems = sass.violations(kernels, installed["variants"])
        assert not problems, "\n".join(problems)

    def test_tables_match_the_library(self, kernels):
        # The committed tables are those of CI's subset build: there every kernel must have its row; a full build
        # (README) holds more variants, whose rules test_checked_families_meet_their_rules checks, and each of its
        # kernels that has a row must still equal it.
        unlisted: list[str] = []
        diffs = sass.compare_tables(sass.tables(kernels), subset=SUBSET, unlisted=None if SUBSET else unlisted)
        assert not diffs, "\n".join(diffs)
        if unlisted:
            warnings.warn(f"{len(unlisted)} kernels of this full build have no row in the committed tables "
                          f"(CI's subset), e.g. {unlisted[:3]}")
