"""Where the INSTALLED library can load, and how the build behaves without a CUDA compiler.

- glibc / libstdc++: the versions _C.so's dynamic symbols need (readelf -V). Above glibc 2.28 (manylinux_2_28,
  torch's own baseline) or above the GLIBCXX/CXXABI that the installed torch's libraries need, the library
  cannot load everywhere torch does (RHEL 8, Ubuntu 20.04, Debian 11).
- torch's stable ABI: `torch-abi-audit --check torch` on the installed library; any unstable torch symbol fails,
  and the oldest torch the symbols need must be the one the wheel claims (pyproject: torch>=2.10).
- configure without nvcc: CMake with every nvcc hidden gives the CPU library and one line saying how to get the
  CUDA kernels ("auto", the default); explicit families are a clear error.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_library import REPO, _tool, installed, library  # noqa: F401 (fixtures)

GLIBC_MAX = (2, 28)
TORCH_CLAIMED = "2.10.0"  # pyproject.toml: dependencies = ["torch>=2.10"]


def _needed_versions(lib: Path) -> dict[str, set[str]]:
    """{needed file: {version names}} from the .gnu.version_r section."""
    readelf = _tool("readelf", "Install binutils (apt-get install binutils).")
    out = subprocess.run([readelf, "-V", "-W", str(lib)], capture_output=True, text=True, check=True).stdout
    needs: dict[str, set[str]] = {}
    current = None
    section = out.split("Version needs section", 1)
    for line in (section[1] if len(section) > 1 else "").splitlines():
        m = re.search(r"File: (\S+)", line)
        if m:
            current = needs.setdefault(m.group(1), set())
            continue
        m = re.search(r"Name: (\S+)", line)
        if m and current is not None:
            current.add(m.group(1))
    return needs


def _max_version(versions: set[str], prefix: str) -> tuple[int, ...]:
    found = [tuple(int(x) for x in v[len(prefix):].split(".")) for v in versions
             if re.fullmatch(re.escape(prefix) + r"[0-9.]+", v)]
    return max(found, default=())


def _symbols_with(lib: Path, version: str) -> list[str]:
    readelf = _tool("readelf", "Install binutils (apt-get install binutils).")
    out = subprocess.run([readelf, "--dyn-syms", "-W", str(lib)], capture_output=True, text=True, check=True).stdout
    return sorted({m.group(1) for m in re.finditer(r"\s(\S+)@" + re.escape(version) + r"\b", out)})


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


@pytest.fixture(scope="session")
def torch_libs(installed) -> list[Path]:  # noqa: F811
    r = subprocess.run([sys.executable, "-c", "import os, torch; print(os.path.dirname(torch.__file__))"],
                       capture_output=True, text=True, check=True, cwd="/")
    lib_dir = Path(r.stdout.strip()) / "lib"
    libs = [lib_dir / n for n in ("libtorch_cpu.so", "libc10.so")]
    assert all(p.is_file() for p in libs), libs
    return libs


def test_glibc_at_most_2_28(library):  # noqa: F811
    needs = _needed_versions(library)
    assert needs, f"readelf -V found no version needs in {library}"
    glibc = set().union(*(v for f, v in needs.items() if f.startswith(("libc.", "libm.", "libdl.", "libpthread.",
                                                                      "librt.", "libmvec.", "ld-linux"))))
    newest = _max_version(glibc, "GLIBC_")
    assert newest, f"no GLIBC_ version needed at all? {needs}"
    too_new = sorted((v for v in glibc if v.startswith("GLIBC_") and _max_version({v}, "GLIBC_") > GLIBC_MAX),
                     key=lambda v: _max_version({v}, "GLIBC_"))
    detail = {v: _symbols_with(library, v)[:8] for v in too_new}
    assert not too_new, (f"{library.name} needs glibc {_fmt(newest)} > {_fmt(GLIBC_MAX)} (manylinux_2_28): {detail}; "
                         "build with REDFUSER_GLIBC=2.28 (needs the ziglang package)")


def test_libstdcxx_not_newer_than_torchs(library, torch_libs):  # noqa: F811
    ours = set().union(*_needed_versions(library).values())
    theirs = set().union(*(set().union(*_needed_versions(p).values()) for p in torch_libs))
    for prefix in ("GLIBCXX_", "CXXABI_"):
        mine, torch_max = _max_version(ours, prefix), _max_version(theirs, prefix)
        assert torch_max, f"torch's libraries need no {prefix} version?"
        too_new = sorted(v for v in ours if v.startswith(prefix) and _max_version({v}, prefix) > torch_max)
        detail = {v: _symbols_with(library, v)[:8] for v in too_new}
        assert not too_new, (f"{library.name} needs {prefix}{_fmt(mine)}, torch's own libraries only "
                             f"{prefix}{_fmt(torch_max)}: {detail} (define them in ops_src/toolchain_compat.cpp)")


def test_torch_abi_audit_stable(library):  # noqa: F811
    r = subprocess.run([sys.executable, "-m", "torch_abi_audit.cli", "--check", "torch", "--json", str(library)],
                       check=False, capture_output=True, text=True, timeout=300)
    if r.returncode == 2 or (r.returncode != 0 and not r.stdout.strip()):
        pytest.fail(f"torch-abi-audit did not run (pip install torch-abi-audit, tests/requirements.txt): "
                    f"rc {r.returncode}\n{r.stderr[-2000:]}")
    report = json.loads(r.stdout)
    libs = report["bundled_libs"] + report.get("extensions", [])
    ours = [x for x in libs if Path(x["path"]).resolve() == library.resolve()]
    assert len(ours) == 1, f"torch-abi-audit did not inspect {library}: {[x['path'] for x in libs]}"
    t = ours[0]["torch"]
    assert ours[0]["error"] is None, ours[0]["error"]
    assert t["uses_torch"] and t["stable_shim_count"] > 0, t
    assert t["unstable_symbols"] == [], f"unstable torch symbols: {t['unstable_symbols'][:20]}"
    assert t["stable"] is True and r.returncode == 0, (r.returncode, t)
    assert t["min_torch_version"] == TORCH_CLAIMED, (
        f"the library's symbols need torch {t['min_torch_version']} "
        f"({t['version_defining_symbols'][:5]}), the wheel claims torch>={TORCH_CLAIMED}")


# ------------------------------------------------------------------------------------ configure without nvcc
def _env_without_nvcc() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDACXX", "CUDA_PATH", "CUDAToolkit_ROOT", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and not os.access(os.path.join(p, "nvcc"), os.X_OK))
    env["CUDA_HOME"] = "/nonexistent-cuda-home"  # CMakeLists.txt's last place to look for nvcc
    return env


def _configure(tmp_path: Path, archs: str | None) -> subprocess.CompletedProcess:
    env = _env_without_nvcc()
    cmake = shutil.which("cmake", path=env["PATH"])
    if cmake is None:
        pytest.fail("cmake not found (pip install cmake ninja: tests/requirements.txt)")
    assert shutil.which("nvcc", path=env["PATH"]) is None
    args = [cmake, "-S", str(REPO), "-B", str(tmp_path / "build"), f"-DPython_EXECUTABLE={sys.executable}",
            "-DREDFUSER_GLIBC="]
    if shutil.which("ninja", path=env["PATH"]):
        args += ["-G", "Ninja"]
    if archs is not None:
        args.append(f"-DREDFUSER_ARCHS={archs}")
    return subprocess.run(args, check=False, capture_output=True, text=True, env=env, timeout=900)


def test_configure_without_nvcc_builds_the_cpu_library(tmp_path):
    r = _configure(tmp_path, None)  # the default: REDFUSER_ARCHS=auto
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    hint = [line for line in out.splitlines() if "no CUDA compiler" in line]
    assert len(hint) == 1 and "CUDA kernels" in hint[0] and "nvcc" in hint[0], hint
    sources = (tmp_path / "build" / "gen" / "sources.cmake").read_text()
    assert re.search(r'set\(REDFUSER_GEN_FAMILIES ""\)', sources), sources[:500]
    assert "REDFUSER_GEN_CUDA_SOURCES_" not in sources


def test_configure_explicit_families_without_nvcc_is_an_error(tmp_path):
    r = _configure(tmp_path, "sm80")
    out = " ".join((r.stdout + r.stderr).split())  # CMake wraps error messages
    assert r.returncode != 0, out[-4000:]
    assert "REDFUSER_ARCHS=sm80 asks for CUDA kernels, but no CUDA compiler (nvcc) was found" in out, out[-4000:]
    assert not (tmp_path / "build" / "gen" / "sources.cmake").exists(), "the generator ran anyway"


# ------------------------------------------------------------------------------- development subsets
class _Lowering(Exception):
    def __init__(self, jobs):
        super().__init__(f"{len(jobs)} jobs")
        self.jobs = jobs


def _planned_jobs(monkeypatch, tmp_path, **subset) -> list:
    """The CUDA variants `emit` hands to TileLang (stopped there: lowering needs minutes)."""
    from generator.codegen import cuda
    from generator.codegen.emit import emit
    from generator.spec import spec_files

    def stop(jobs, *a, **k):
        raise _Lowering(jobs)

    monkeypatch.setattr(cuda, "lower_all", stop)
    with pytest.raises(_Lowering) as e:
        emit(tmp_path / "gen", subset.pop("families"), spec_files(REPO / "specs"), **subset)
    return e.value.jobs


FAMILIES = ["sm80", "sm90a", "sm100a"]


@pytest.fixture(scope="module")
def full_plan(tmp_path_factory) -> list:
    with pytest.MonkeyPatch.context() as mp:
        return _planned_jobs(mp, tmp_path_factory.mktemp("full"), families=FAMILIES)


def test_subset_one_op_one_dtype_one_family(monkeypatch, tmp_path, full_plan):
    full = full_plan
    sub = _planned_jobs(monkeypatch, tmp_path, families=["sm90a"], ops=["moe_route"], dtypes=["bfloat16"])
    assert sub and len(sub) < len(full)
    assert {j.family for j in sub} == {"sm90a"}
    assert all(j.symbol.startswith("moe_route__") and "bf16" in j.symbol for j in sub), [j.symbol for j in sub]
    # exactly the full build's variants of that op, dtype and family: nothing renamed, nothing dropped
    want = {j.symbol for j in full if j.family == "sm90a" and j.symbol.startswith("moe_route__") and "bf16" in j.symbol}
    assert {j.symbol for j in sub} == want
    # one pool for every op: the full plan reaches lower_all once, with several ops' variants
    assert len({j.symbol.split("__")[0] for j in full}) >= 2


def test_subset_dtype_keeps_every_template_and_family(monkeypatch, tmp_path, full_plan):
    """The CI-sized build (REDFUSER_CUDA_DTYPES=bfloat16): every template still compiled for every family."""
    full = full_plan
    sub = _planned_jobs(monkeypatch, tmp_path, families=FAMILIES, dtypes=["bfloat16"])
    by_op = lambda jobs: {(j.symbol.split("__")[0], j.family) for j in jobs}
    assert by_op(sub) == by_op(full)
    assert len(sub) < len(full)


@pytest.mark.parametrize("subset, message", [({"ops": ["moe_rout"]}, "CUDA ops ['moe_rout'] do not exist"),
                                             ({"dtypes": ["bf16"]}, "CUDA dtypes ['bf16'] are not built")])
def test_subset_typo_is_an_error(tmp_path, capsys, subset, message):
    from generator.codegen.emit import emit
    from generator.spec import spec_files

    assert emit(tmp_path / "gen", ["sm80"], spec_files(REPO / "specs"), **subset) == 2
    assert message in capsys.readouterr().err
