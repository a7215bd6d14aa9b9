"""Shared by the template tests: a TileLang program emitted for the ``"c"`` target (a template's cpu_sim
backend), lowered, compiled with the host C++ compiler and loaded (``lib.call(...)`` runs the kernel)."""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import shutil
import subprocess
import tempfile

import pytest


def cxx() -> str | None:
    for c in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_c_program(text: str, symbol: str):
    """(library, module) of one emitted program; skips without TileLang or a C++ compiler."""
    tilelang = pytest.importorskip("tilelang")
    from tilelang import tvm
    from tilelang.jit.adapter.wrapper import TLWrapper

    compiler = cxx()
    if compiler is None:
        pytest.skip("no C++ compiler")
    d = tempfile.mkdtemp(prefix="tl_c_sim_")
    atexit.register(shutil.rmtree, d, True)
    py = os.path.join(d, f"{symbol}.py")
    with open(py, "w") as f:
        f.write(text)
    mod = load_module(py, symbol)
    func = mod.make_prim_func()
    target = {"kind": "c"}
    with tvm.target.Target(target):
        art = tilelang.lower(func, target=target)
        w = TLWrapper(tvm.target.Target(target))
        w.assign_optimized_module(tvm.IRModule({symbol: func}))
        w.assign_pass_configs({})
        w.assign_host_module(art.host_mod)
        w.assign_device_module(art.device_mod)
        code = w.wrap(art.kernel_source)
    cpp, so = os.path.join(d, f"{symbol}.cpp"), os.path.join(d, f"{symbol}.so")
    with open(cpp, "w") as f:
        f.write(code)
    inc = os.path.join(os.path.dirname(tilelang.__file__), "src")
    # no fast-math: the simulation must keep NaN/inf semantics
    subprocess.run([compiler, "-O1", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{inc}", cpp, "-o", so], check=True)
    lib = ctypes.CDLL(so)
    lib.call.restype = ctypes.c_int32
    return lib, mod
