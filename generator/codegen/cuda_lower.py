"""Lower one TileLang program to one self-contained, linkable CUDA translation unit.

Op-agnostic: this module knows TileLang, nvcc and the arch families, nothing about any op.

`lower_to_cuda(prim_func, family, symbol)` returns a `LoweredKernel` whose ``source`` holds

* the device kernel(s), renamed through ``global_symbol`` (TileLang names them ``<symbol>_kernel``),
* TileLang's host launcher (built by ``TLWrapper``), renamed to ``extern "C"``
  ``<symbol>_init()``, ``<symbol>_call(...)`` and ``<symbol>_get_last_error()``,
* defines that rename the non-inline helpers of ``tl_templates/cuda/debug.h`` per file, so that
  many generated files link into one shared library.

Launcher conventions (what the generated host code must follow):

* ``int <symbol>_init(void)`` sets the dynamic shared-memory limit of the kernel(s). It must run
  once per (variant, device) with that device current, before the first call. 0 = success.
* ``int <symbol>_call(<params>, <dynamic dims>, cudaStream_t stream)``: ``params`` are the
  prim_func's parameters in order (a buffer becomes its data pointer, a scalar is passed by
  value), then every dynamic dimension (``int32``) in order of first appearance in the buffer
  shapes (then strides), then the stream. 0 = success, else ``<symbol>_get_last_error()`` says
  why. It validates nothing (dtype, device, contiguity, alignment, int32 range are the caller's)
  and launches with a zero grid if a dynamic dim is 0, which CUDA rejects: skip empty launches.
* ``const char* <symbol>_get_last_error(void)``: the message of the last failure in this file.

`LoweredKernel.host_declarations()` gives the matching ``extern "C"`` declarations for host C++
code that does not include CUDA headers (pointers and the stream as ``void*``).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..families import FAMILIES
from ..families import family as _family

__all__ = [
    "FAMILIES",
    "KernelInfo",
    "LauncherParam",
    "LoweredKernel",
    "family_gencode_flags",
    "family_sass_archs",
    "family_target_arch",
    "lower_to_cuda",
    "nvcc_flags",
    "tilelang_include_dirs",
]


# Non-inline host+device helpers of tl_templates/cuda/debug.h. They are strong symbols in every
# object that includes debug.h, so two generated files collide at link time unless renamed.
_DEBUG_H_SYMBOLS = ("debug_print_msg", "debug_print_buffer_value")

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

# TileLang's C types in the launcher signature -> fixed-width host types (scalars only).
_SCALAR_C_TYPES = {
    "float32": "float",
    "float64": "double",
    "int64": "int64_t",
    "uint64": "uint64_t",
    "int32": "int32_t",
    "uint32": "uint32_t",
    "int16": "int16_t",
    "uint16": "uint16_t",
    "int8": "int8_t",
    "uint8": "uint8_t",
    "bool": "int8_t",
}


def family_target_arch(family: str) -> str:
    """The arch TileLang lowers for (``sm_80``, ``sm_90a``, ``sm_100a``): generator/families.py."""
    return _family(family).lower_arch


def family_sass_archs(family: str) -> list[str]:
    """Real archs whose SASS the family's objects hold (as cuobjdump names them, sm_90a -> sm_90a)."""
    return list(_family(family).sass)


def family_gencode_flags(family: str) -> list[str]:
    """The nvcc ``-gencode`` list for one family, from generator/families.py."""
    fam = _family(family)
    flags = [f"-gencode=arch={virt},code={real}" for virt, real in fam.gencode]
    if fam.ptx is not None:
        flags.append(f"-gencode=arch={fam.ptx},code={fam.ptx}")
    return flags


def tilelang_include_dirs() -> list[str]:
    """Include directories a TileLang ``.cu`` needs: tl_templates (``tilelang/src``) and CUTLASS.

    CCCL (``<cuda>/include/cccl``) is added by nvcc itself (nvcc.profile); host-only C++ files
    that include CCCL headers need it from the build system instead.
    """
    return list(_tilelang_include_dirs())


@functools.cache
def _tilelang_include_dirs() -> tuple[str, ...]:
    from tilelang import env as tl_env

    dirs = [tl_env.TILELANG_TEMPLATE_PATH, tl_env.CUTLASS_INCLUDE_DIR]
    for d in dirs:
        if not os.path.isdir(d):
            raise RuntimeError(f"tilelang's include directory {d} does not exist")
    return tuple(os.path.normpath(d) for d in dirs)


def nvcc_flags(*, fast_math: bool = True) -> list[str]:
    """nvcc flags every generated TileLang ``.cu`` needs (not the ``-gencode`` list).

    * ``-std=c++20``: tl_templates use C++20 lambdas with template parameters.
    * ``-D__NV_NO_VECTOR_DEPRECATION_DIAG``: CUDA 13 deprecates the vector types TileLang uses.
    * ``--use_fast_math`` (default on): what TileLang's fast-math pass config asks of nvcc.
    * ``-w`` and ``--diag_suppress=177``: TileLang/CUTLASS headers are noisy; TileLang's own
      build passes the same.
    * ``-lineinfo``: source lines for profilers; no run-time cost.
    * ``-I`` for `tilelang_include_dirs`.
    """
    flags = [
        "-std=c++20",
        "-D__NV_NO_VECTOR_DEPRECATION_DIAG",
        "-w",
        "-Xcudafe=--diag_suppress=177",
        "-lineinfo",
    ]
    if fast_math:
        flags.append("--use_fast_math")
    flags += [f"-I{d}" for d in tilelang_include_dirs()]
    return flags


@dataclass(frozen=True)
class LauncherParam:
    """One parameter of ``<symbol>_call``, in order."""

    name: str
    kind: str  # "pointer" | "scalar" | "dim" | "stream"
    dtype: str  # TileLang dtype ("float16", "int32", ...); "" for the stream
    c_type: str  # type in the launcher's own definition (TileLang's C type)
    shape: tuple[str, ...] = ()  # pointer params: buffer shape, ints or dynamic dim names

    @property
    def host_c_type(self) -> str:
        """Type to declare it with in host C++ that does not include CUDA headers."""
        if self.kind in ("pointer", "stream"):
            return "void*"
        return _SCALAR_C_TYPES[self.dtype]


@dataclass(frozen=True)
class KernelInfo:
    """One device kernel launched by the launcher."""

    name: str
    dynamic_smem_bytes: int | None
    block: tuple[str, str, str]
    grid: tuple[str, str, str]


@dataclass(frozen=True)
class LoweredKernel:
    symbol: str
    family: str
    target_arch: str
    source: str
    params: tuple[LauncherParam, ...]  # every argument of <symbol>_call, stream last
    dynamic_dims: tuple[str, ...]
    dynamic_smem_bytes: int | None  # max over kernels; None when no kernel uses dynamic smem
    kernels: tuple[KernelInfo, ...]
    tilelang_version: str
    generator_version: str
    # per-file nvcc options the pass configs ask for (ptxas register usage level, TileLang's
    # device compile flags); give them to render_sources_cmake(cuda_file_options=...)
    nvcc_options: tuple[str, ...] = ()

    @property
    def init_name(self) -> str:
        return f"{self.symbol}_init"

    @property
    def call_name(self) -> str:
        return f"{self.symbol}_call"

    @property
    def get_last_error_name(self) -> str:
        return f"{self.symbol}_get_last_error"

    @property
    def tensor_params(self) -> tuple[LauncherParam, ...]:
        return tuple(p for p in self.params if p.kind == "pointer")

    def host_declarations(self) -> str:
        """``extern "C"`` declarations of the three launcher functions for host C++ code."""
        args = ", ".join(f"{p.host_c_type} {p.name}" for p in self.params)
        return (
            f'extern "C" int {self.init_name}(void);\n'
            f'extern "C" int {self.call_name}({args});\n'
            f'extern "C" const char* {self.get_last_error_name}(void);\n'
        )


def _expr_str(e: Any) -> str:
    from tilelang import tvm

    if isinstance(e, tvm.tirx.IntImm):
        return str(int(e.value))
    if isinstance(e, tvm.tirx.Var):
        return str(e.name)
    return str(e)


def _launcher_params(prim_func: Any) -> tuple[list[LauncherParam], list[str]]:
    """Parameters of TileLang's launcher, derived from the prim_func the way TLWrapper does."""
    from tilelang import tvm

    params: list[LauncherParam] = []
    for p in prim_func.params:
        if p in prim_func.buffer_map:
            buf = prim_func.buffer_map[p]
            params.append(LauncherParam(
                name=str(buf.data.name),
                kind="pointer",
                dtype=str(buf.dtype),
                c_type="",
                shape=tuple(_expr_str(d) for d in buf.shape),
            ))
        elif isinstance(p, tvm.tirx.Var):
            params.append(LauncherParam(name=str(p.name), kind="scalar", dtype=str(p.dtype), c_type=""))
        else:  # pragma: no cover - TileLang rejects this earlier
            raise ValueError(f"parameter {p} is neither a buffer nor a scalar")
    names = {q.name for q in params}
    dims: list[str] = []
    seen: dict[str, str] = {}
    for attr in ("shape", "strides"):
        for p in prim_func.params:
            if p not in prim_func.buffer_map:
                continue
            for d in getattr(prim_func.buffer_map[p], attr):
                if isinstance(d, tvm.tirx.Var):
                    nm, dt = str(d.name), str(d.dtype)
                    if nm in seen:
                        if seen[nm] != dt:
                            raise ValueError(f"dynamic dim {nm} has two dtypes: {seen[nm]} and {dt}")
                        continue
                    seen[nm] = dt
                    if nm not in names:
                        dims.append(nm)
    for nm in dims:
        if seen[nm] != "int32":
            raise ValueError(f"dynamic dim {nm} is {seen[nm]}; TileLang 0.1.15 lowers int32 dims only")
        params.append(LauncherParam(name=nm, kind="dim", dtype="int32", c_type=""))
    return params, dims


_CALL_DEF = re.compile(r'extern "C" TL_EXPORT int call\(([^)]*)\) \{')


def _split_signature(sig: str) -> list[tuple[str, str]]:
    """``'half_t* __restrict__ x, float a, cudaStream_t stream=cudaStreamDefault'`` -> [(type, name)]."""
    out = []
    for part in sig.split(","):
        part = part.strip().split("=")[0].strip()
        m = re.match(r"(.*?)([A-Za-z_][A-Za-z0-9_]*)\Z", part)
        if not m:
            raise ValueError(f"cannot parse launcher parameter {part!r}")
        out.append((m.group(1).strip(), m.group(2)))
    return out


def _replace_once(text: str, old: str, new: str, what: str) -> str:
    n = text.count(old)
    if n != 1:
        raise RuntimeError(
            f"TileLang's launcher changed: expected exactly one {what} ({old!r}), found {n}. "
            "generator/codegen/cuda_lower.py must be adapted to this TileLang version."
        )
    return text.replace(old, new)


def _nvcc_options(configs: Mapping[str, Any]) -> tuple[str, ...]:
    """nvcc options implied by TileLang pass configs (what TileLang's own build would pass)."""
    opts: list[str] = []
    level = configs.get("tl.ptxas_register_usage_level")
    if level is not None:
        opts.append(f"--ptxas-options=--register-usage-level={int(level)}")
    extra = configs.get("tl.device_compile_flags")
    if extra:
        items = extra.split() if isinstance(extra, str) else [str(x) for x in extra]
        opts += items
    return tuple(opts)


def _header(symbol: str, family: str, generator_version: str, tl_version: str,
            extra: Mapping[str, str] | None) -> str:
    gencode = " ".join(family_gencode_flags(family))
    lines = [
        f"// Generated by redfuser-ops generator {generator_version}. Do not edit.",
        f"// symbol: {symbol}",
        f"// family: {family} (lowered for {family_target_arch(family)}; nvcc {gencode})",
        f"// tilelang: {tl_version}",
    ]
    for k in sorted(extra or {}):
        v = str(extra[k]).replace("\n", " ")
        lines.append(f"// {k}: {v}")
    return "\n".join(lines) + "\n"


def lower_to_cuda(
    prim_func: Any,
    family: str,
    symbol: str,
    *,
    generator_version: str = "dev",
    pass_configs: Mapping[str, Any] | None = None,
    header: Mapping[str, str] | None = None,
) -> LoweredKernel:
    """Lower ``prim_func`` for ``family`` into one ``.cu`` whose exported names start with ``symbol``.

    ``symbol`` must be a C identifier unique in the library (the variant name). ``header`` adds
    ``// key: value`` lines to the header comment (spec file, variant parameters...).
    Deterministic: the same program, family, symbol and options give a byte-identical source.
    """
    import tilelang
    from tilelang import tvm
    from tilelang.jit.adapter.wrapper import TLWrapper

    _family(family)  # ValueError for an unknown family
    if not _IDENT.match(symbol):
        raise ValueError(f"symbol {symbol!r} is not a C identifier")
    arch = family_target_arch(family)
    target = {"kind": "cuda", "arch": arch}
    configs = dict(pass_configs or {})

    func = prim_func.with_attr("global_symbol", symbol)
    with tvm.transform.PassContext(opt_level=3, config=configs), tvm.target.Target(target):
        artifact = tilelang.lower(func, target=target)
        wrapper = TLWrapper(tvm.target.Target(target))
        wrapper.assign_optimized_module(tvm.IRModule({symbol: func}))
        wrapper.assign_pass_configs(configs)
        wrapper.assign_host_module(artifact.host_mod)
        wrapper.assign_device_module(artifact.device_mod)
        wrapped = wrapper.wrap(artifact.kernel_source)

    # --- the launcher's own signature is the ground truth; check our derivation against it
    m = _CALL_DEF.search(wrapped)
    if m is None:
        raise RuntimeError("TileLang's launcher changed: no `extern \"C\" TL_EXPORT int call(...)` found")
    sig = _split_signature(m.group(1))
    derived, dims = _launcher_params(func)
    if len(sig) != len(derived) + 1 or sig[-1][1] != "stream":
        raise RuntimeError(
            f"{symbol}: launcher signature {[n for _, n in sig]} does not match the program's "
            f"parameters {[p.name for p in derived]} + stream"
        )
    params: list[LauncherParam] = []
    for (ctype, name), p in zip(sig[:-1], derived):
        if name != p.name:
            raise RuntimeError(f"{symbol}: launcher parameter {name!r} where {p.name!r} was expected")
        is_ptr = "*" in ctype
        if is_ptr != (p.kind == "pointer"):
            raise RuntimeError(f"{symbol}: launcher parameter {name!r} has type {ctype!r}")
        if p.kind != "pointer" and p.dtype not in _SCALAR_C_TYPES:
            raise ValueError(f"{symbol}: scalar parameter {name!r} has unsupported dtype {p.dtype}")
        params.append(LauncherParam(p.name, p.kind, p.dtype, ctype, p.shape))
    params.append(LauncherParam("stream", "stream", "", sig[-1][0]))

    # --- kernels and their dynamic shared memory
    kernels = []
    for gv, f in sorted(artifact.device_mod.functions.items(), key=lambda kv: kv[0].name_hint):
        attrs = f.attrs
        smem = int(attrs["dyn_shared_memory_buf"]) if "dyn_shared_memory_buf" in attrs else None
        block = ["1", "1", "1"]
        grid = ["1", "1", "1"]
        if "thread_extent" in attrs:
            for tag, ext in attrs["thread_extent"].items():
                tag = str(tag)
                if "threadIdx" in tag:
                    block["xyz".index(tag[-1])] = _expr_str(ext)
                elif "blockIdx" in tag:
                    grid["xyz".index(tag[-1])] = _expr_str(ext)
        kernels.append(KernelInfo(gv.name_hint, smem, tuple(block), tuple(grid)))
    smems = [k.dynamic_smem_bytes for k in kernels if k.dynamic_smem_bytes is not None]

    # --- rename the launcher and the debug.h helpers
    src = wrapped
    src = _replace_once(src, 'extern "C" TL_EXPORT const char* get_last_error() {',
                        f'extern "C" TL_EXPORT const char* {symbol}_get_last_error() {{', "get_last_error()")
    src = _replace_once(src, 'extern "C" TL_EXPORT int init() {',
                        f'extern "C" TL_EXPORT int {symbol}_init() {{', "init()")
    src = _replace_once(src, 'extern "C" TL_EXPORT int call(',
                        f'extern "C" TL_EXPORT int {symbol}_call(', "call(")
    # TileLang's launcher marks every launch with programmatic stream serialization (PDL), but the kernels
    # never wait on the previous grid (no griddepcontrol.wait): a kernel could start reading its inputs
    # before the kernel that writes them has finished. Launch with ordinary stream ordering instead.
    n_pdl = src.count("config.numAttrs = 1;")
    src = src.replace("config.numAttrs = 1;", "config.numAttrs = 0;  // redfuser: no PDL (kernels do not wait)")
    if "programmaticStreamSerializationAllowed = 1" in src and n_pdl == 0 and "numAttrs = 0" not in src:
        raise RuntimeError(f"{symbol}: TileLang's launcher sets PDL in an unknown way; refusing to emit it")
    renames = "".join(f"#define {s} {symbol}__{s}\n" for s in _DEBUG_H_SYMBOLS)
    tl_version = str(getattr(tilelang, "__version__", "unknown"))
    decl = ", ".join(f"{p.c_type} {p.name}" for p in params)
    text = (
        _header(symbol, family, generator_version, tl_version, header)
        + f"// launcher: extern \"C\" int {symbol}_call({decl})\n"
        + "// debug.h defines non-inline helpers: give them per-file names (one .so holds many files)\n"
        + renames
        + "\n"
        + src.rstrip("\n")
        + "\n"
    )
    return LoweredKernel(
        symbol=symbol,
        family=family,
        target_arch=arch,
        source=text,
        params=tuple(params),
        dynamic_dims=tuple(dims),
        dynamic_smem_bytes=max(smems) if smems else None,
        kernels=tuple(kernels),
        tilelang_version=tl_version,
        generator_version=generator_version,
        nvcc_options=_nvcc_options(configs),
    )
