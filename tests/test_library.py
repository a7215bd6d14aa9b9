"""The INSTALLED library: what it links to, what CUDA code it holds, what it reports.

Runs against the redfuser_ops installed in site-packages (imported in a subprocess started in
an empty directory without PYTHONPATH, so the source tree is never picked up). Nothing here
skips: a missing package, tool or arch is a failure.

Tools: binutils (readelf, nm) and, for a build with CUDA families, cuobjdump. cuobjdump is not
part of the CUDA toolkit's compiler packages; CI installs it with
``pip install nvidia-cuda-cuobjdump`` (it lands in site-packages/nvidia/cu13/bin) or uses the
one of a full CUDA toolkit (``$CUDA_HOME/bin``). These tests never install anything.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import sass
from generator.families import TABLE

REPO = Path(__file__).resolve().parents[1]

# Archs each family's objects must hold: SASS (cuobjdump --list-elf) and PTX (--list-ptx), as the one table of
# families (generator/families.py) declares them.
FAMILY_SASS = {f.name: list(f.sass) for f in TABLE}
FAMILY_PTX = {f.name: ["sm_" + f.ptx.split("_")[1]] if f.ptx else [] for f in TABLE}

# The only shared libraries _C.so may depend on. No CUDA library (cudart is linked statically
# and hidden), no Python, nothing from torch but libtorch_cpu (present in CPU and CUDA torch).
ALLOWED_NEEDED = {
    "libtorch_cpu.so",
    "libstdc++.so.6",
    "libgcc_s.so.1",
    "libm.so.6",
    "libmvec.so.1",  # vectorised expf & co. of the -ffast-math CPU kernels
    "libc.so.6",
    "libdl.so.2",
    "libpthread.so.0",
    "librt.so.1",
    "ld-linux-x86-64.so.2",
}
FORBIDDEN_NEEDED = re.compile(r"libcudart|libcuda\.so|libtorch_cuda|libc10_cuda|libnvrtc|libcublas|libpython|libtorch_python")

_PROBE = r"""
import json, sys
import torch
import redfuser_ops
from redfuser_ops import _loader
info = redfuser_ops.info()
kernels = {}
for op, d in info["ops"].items():
    name = "redfuser::" + op
    kernels[op] = {k: torch._C._dispatch_has_kernel_for_dispatch_key(name, k) for k in ("CPU", "CUDA")}
json.dump({"package": redfuser_ops.__file__, "version": redfuser_ops.__version__,
           "library": str(_loader.library_path()), "info": info, "kernels": kernels,
           "torch": torch.__version__, "all": redfuser_ops.__all__}, sys.stdout)
"""


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run_python(code_or_args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *code_or_args], check=False, cwd=cwd, env=_clean_env(),
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> dict:
    cwd = tmp_path_factory.mktemp("outside_source_tree")
    r = _run_python(["-c", _PROBE], cwd)
    if r.returncode != 0:
        pytest.fail(
            "cannot import the installed redfuser_ops (install the wheel first, e.g. "
            f"`pip install .` or `pip install dist/*.whl`):\n{r.stderr[-4000:]}"
        )
    data = json.loads(r.stdout)
    pkg = Path(data["package"]).resolve()
    assert REPO not in pkg.parents or "site-packages" in pkg.parts, (
        f"imported redfuser_ops from the source tree ({pkg}), not from an installed package"
    )
    return data


@pytest.fixture(scope="session")
def library(installed) -> Path:
    lib = Path(installed["library"])
    assert lib.is_file(), lib
    assert lib.name == "_C.so"
    return lib


def _tool(name: str, hint: str) -> str:
    try:
        return sass.find_tool(name)
    except sass.ToolMissing as e:
        pytest.fail(f"{e}. {hint}")


def _readelf_dynamic(lib: Path) -> str:
    readelf = _tool("readelf", "Install binutils (apt-get install binutils).")
    return subprocess.run([readelf, "-d", str(lib)], capture_output=True, text=True, check=True).stdout


def test_the_package_names_the_generator_keeps_from_ops(installed):
    """An op is re-exported next to the package's own functions: the generator refuses an op of one of their names
    (pyapi.PACKAGE_NAMES), so that list must be the package's."""
    from generator.codegen.pyapi import PACKAGE_NAMES

    names = installed["all"]
    assert len(names) == len(set(names)), names
    assert set(names) - set(installed["info"]["ops"]) == PACKAGE_NAMES


def test_needed_has_no_cuda_library(library):
    dyn = _readelf_dynamic(library)
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)
    assert needed, f"readelf found no NEEDED entries in {library}:\n{dyn}"
    bad = [n for n in needed if FORBIDDEN_NEEDED.search(n)]
    assert not bad, f"{library.name} depends on {bad}; it must load on CPU-only torch"
    unexpected = sorted(set(needed) - ALLOWED_NEEDED)
    assert not unexpected, f"{library.name} depends on unexpected libraries {unexpected} (NEEDED: {needed})"
    assert "libtorch_cpu.so" in needed


def test_no_rpath_into_the_build_machine(library):
    dyn = _readelf_dynamic(library)
    assert "(RPATH)" not in dyn and "(RUNPATH)" not in dyn, dyn


def test_exports_nothing_cuda(library):
    """The static cudart must stay hidden, else CUDA torch's libcudart interposes it."""
    nm = _tool("nm", "Install binutils (apt-get install binutils).")
    out = subprocess.run([nm, "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True).stdout
    symbols = [line.split()[-1] for line in out.splitlines() if line.strip()]
    cuda = [s for s in symbols if re.match(r"(__)?cuda|cu[A-Z]|__nv|_Z.*cuda", s)]
    assert not cuda, f"{library.name} exports CUDA runtime symbols: {cuda[:10]}"
    strong = sorted(line.split()[-1] for line in out.splitlines() if len(line.split()) == 3 and line.split()[1] == "T")
    assert strong == ["redfuser_build_info_json"], f"unexpected exported functions: {strong[:20]}"


def test_build_info(installed):
    info = installed["info"]
    for key in ("version", "torch_target", "torch_built_with", "cuda", "families", "archs", "ops",
                "library", "torch", "cuda_available", "devices"):
        assert key in info, key
    assert info["torch_target"] == "2.10.0"
    assert info["version"] == installed["version"]
    assert all(f in FAMILY_SASS for f in info["families"]), info["families"]
    assert (info["cuda"] is None) == (not info["families"])
    assert info["ops"], "the library registers no op"
    for op, d in info["ops"].items():
        assert d["variants"], f"{op} has no variant"
        devices = {v["device"] for v in d["variants"]}
        assert installed["kernels"][op]["CPU"] == ("cpu" in devices), (op, installed["kernels"][op])
        assert installed["kernels"][op]["CUDA"] == ("cuda" in devices), (op, installed["kernels"][op])
        for v in d["variants"]:
            if v["device"] == "cuda":
                assert v["family"] in info["families"], v


def test_cuda_code_for_every_family(installed, library):
    families = installed["info"]["families"]
    if not families:
        readelf = _tool("readelf", "Install binutils (apt-get install binutils).")
        sections = subprocess.run([readelf, "-S", "-W", str(library)], capture_output=True, text=True, check=True).stdout
        assert ".nv_fatbin" not in sections, "a CPU-only build (no families) holds CUDA code"
        return
    cuobjdump = _tool("cuobjdump", "CI installs it with `pip install nvidia-cuda-cuobjdump`.")
    elf = subprocess.run([cuobjdump, "--list-elf", str(library)], capture_output=True, text=True, check=True).stdout
    ptx = subprocess.run([cuobjdump, "--list-ptx", str(library)], capture_output=True, text=True, check=True).stdout
    sass_archs = set(re.findall(r"\.(sm_\d+a?)\.cubin", elf))
    # Some cuobjdump versions name an sm_90a cubin "...sm_90.cubin"; this build never compiles
    # plain sm_90/sm_100, so read those names as the arch-specific targets.
    sass_archs = {a + "a" if a in ("sm_90", "sm_100") else a for a in sass_archs}
    ptx_archs = set(re.findall(r"\.(sm_\d+a?)\.ptx", ptx))
    for fam in families:
        for arch in FAMILY_SASS[fam]:
            assert arch in sass_archs, f"family {fam}: no {arch} SASS in {library.name} (have {sorted(sass_archs)})"
        for arch in FAMILY_PTX[fam]:
            assert arch in ptx_archs, f"family {fam}: no compute_{arch[3:]} PTX in {library.name} (have {sorted(ptx_archs)})"
    wanted = {a for f in families for a in FAMILY_SASS[f]}
    extra = sass_archs - wanted
    assert not extra, f"{library.name} holds SASS for archs no family asked for: {sorted(extra)}"


def test_every_cuda_variant_has_its_cubins(installed, library):
    """One translation unit per variant, named after it: <variant>.cu -> <variant>.<arch>.cubin."""
    variants = [v for d in installed["info"]["ops"].values() for v in d["variants"] if v["device"] == "cuda"]
    if not variants:
        assert not installed["info"]["families"], "built for CUDA families, but no CUDA variant is registered"
        return
    cuobjdump = _tool("cuobjdump", "CI installs it with `pip install nvidia-cuda-cuobjdump`.")
    elf = subprocess.run([cuobjdump, "--list-elf", str(library)], capture_output=True, text=True, check=True).stdout
    cubins = set(re.findall(r"ELF file\s+\d+:\s+(\S+)", elf))
    cubins |= {re.sub(r"\.(sm_90|sm_100)\.cubin$", r".\1a.cubin", c) for c in cubins}
    missing = [f"{v['name']}.{arch}.cubin" for v in variants for arch in FAMILY_SASS[v["family"]]
               if f"{v['name']}.{arch}.cubin" not in cubins]
    assert not missing, f"{len(missing)} cubins missing, e.g. {missing[:5]}"


def test_python_m_redfuser_ops(installed, tmp_path):
    r = _run_python(["-m", "redfuser_ops"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"redfuser-ops {installed['version']}" in r.stdout
    for op in installed["info"]["ops"]:
        assert f"torch.ops.redfuser.{op}" in r.stdout
    r = _run_python(["-m", "redfuser_ops", "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ops"].keys() == installed["info"]["ops"].keys()


_FAMILY_RULE = r"""
import json, sys
import torch
import redfuser_ops  # noqa: F401
out = {}
for fams in ["sm80;sm90a;sm100a", "sm80", "sm90a", "sm100a", "sm90a;sm100a", "sm80;sm89;sm90a", "sm89"]:
    for major, minor in [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0)]:
        try:
            r = torch.ops.redfuser._select_family("someop", major, minor, fams)
        except RuntimeError as e:
            r = "error: " + str(e).splitlines()[0]
        out[f"{fams}@{major}.{minor}"] = r
json.dump(out, sys.stdout)
"""


def test_arch_family_selection(installed, tmp_path):
    r = _run_python(["-c", _FAMILY_RULE], tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["sm80;sm90a;sm100a@8.0"] == "sm80"
    assert got["sm80;sm90a;sm100a@8.6"] == "sm80"
    assert got["sm80;sm90a;sm100a@8.9"] == "sm80"
    assert got["sm80;sm90a;sm100a@9.0"] == "sm90a"
    assert got["sm80;sm90a;sm100a@10.0"] == "sm100a"
    assert got["sm80@9.0"] == "sm80"  # compute_80 PTX, JIT-compiled by the driver
    assert got["sm80@10.0"] == "sm80"
    assert got["sm80;sm90a;sm100a@7.5"] == (
        "error: redfuser::someop: this wheel was built for sm_80, sm_86, sm_89, sm_90a, sm_100a; this GPU is sm_75"
    )
    assert got["sm90a@8.0"] == "error: redfuser::someop: this wheel was built for sm_90a; this GPU is sm_80"
    assert got["sm90a;sm100a@9.0"] == "sm90a"
    assert got["sm90a;sm100a@12.0"].startswith("error: redfuser::someop: this wheel was built for sm_90a, sm_100a;")
    # a capability without SASS in the wheel runs the sm80 family's compute_80 PTX (issue 13)
    assert got["sm80;sm90a;sm100a@10.3"] == "sm80"
    # sm89 (fp8 tensor cores) runs on exactly 8.9; other 8.x keep sm80
    assert got["sm80;sm89;sm90a@8.9"] == "sm89"
    assert got["sm80;sm89;sm90a@8.6"] == "sm80"
    assert got["sm80;sm89;sm90a@9.0"] == "sm90a"
    assert got["sm89@8.0"] == "error: redfuser::someop: this wheel was built for sm_89; this GPU is sm_80"
