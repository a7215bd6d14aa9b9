"""`python -m generator emit`: every spec -> derived forms -> sources for the build (see files.py).

Per op: `<op>_cpu.h` / `<op>_cpu.cpp` (the CPU kernels, compiled with the kernel flags), `<op>_ops.cpp` (schema,
checks, outputs, CPU/CUDA registration), `_generated_<op>.py` (fake + typed wrapper) and, for each arch family
the spec's CUDA template supports, one `.cu` per variant. Files are rewritten only when their content changes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .. import __version__
from ..errors import FusionError, SpecError
from ..spec import load_spec
from ..symbolic import derive
from .cpu import cpu_header, cpu_source
from .files import KNOWN_FAMILIES, render_sources_cmake, write_if_changed
from .glue import glue_source
from .pyapi import python_module

OPS_SRC = Path(__file__).resolve().parent.parent.parent / "ops_src"


def log(msg: str) -> None:
    print(f"[redfuser generator] {msg}", flush=True)


def emit(out: Path, families: list[str], specs: list[Path], jobs: int = 0) -> int:
    t0 = time.time()
    for f in families:
        if f not in KNOWN_FAMILIES:
            print(f"error: unknown arch family '{f}' (known: {', '.join(KNOWN_FAMILIES)})", file=sys.stderr)
            return 2
    out = Path(out).resolve()
    cpu_dir, py_dir = out / "cpu", out / "python"
    cpu_sources: list[Path] = []
    kernel_sources: list[Path] = []
    python_files: list[Path] = []
    cuda_sources: dict[str, list[Path]] = {f: [] for f in families}
    written = 0
    for path in specs:
        try:
            spec = load_spec(path)
            log(f"{spec.name}: deriving forms ({path.name})")
            op = derive(spec)
        except (SpecError, FusionError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        cuda = None
        if families and spec.variants.cuda is not None:
            from .bridge import BridgeError
            from .cuda import cuda_for_op  # imports tilelang: only when CUDA is built

            try:
                cuda, files = cuda_for_op(spec, op, families, out / "cuda", jobs, log)
            except BridgeError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            for fam, paths in files.items():
                cuda_sources[fam] += paths
        header = f"{spec.name}_cpu.h"
        try:
            files_text = _op_files(spec, op, cuda, header, cpu_dir, py_dir)
        except EmitError as exc:
            print(f"error: {spec.file}: {exc}", file=sys.stderr)
            return 1
        for p, text in files_text.items():
            written += write_if_changed(p, text)
        cpu_sources += [cpu_dir / f"{spec.name}_cpu.cpp", cpu_dir / f"{spec.name}_ops.cpp"]
        kernel_sources.append(cpu_dir / f"{spec.name}_cpu.cpp")
        python_files.append(py_dir / f"_generated_{spec.name}.py")
        log(f"{spec.name}: {len(op.cases)} specialisation(s); CPU kernels and glue generated")
    text = render_sources_cmake(
        generator_version=__version__,
        families=families,
        cpu_sources=[str(p) for p in cpu_sources],
        cpu_kernel_sources=[str(p) for p in kernel_sources],
        cuda_sources={f: [str(p) for p in v] for f, v in cuda_sources.items()},
        python_files=[str(p) for p in python_files],
        include_dirs=[str(cpu_dir), str(OPS_SRC)],
    )
    written += write_if_changed(out / "sources.cmake", text)
    n_cuda = sum(len(v) for v in cuda_sources.values())
    log(f"done in {time.time() - t0:.1f} s: {len(specs)} op(s), {n_cuda} CUDA file(s), {written} file(s) changed")
    return 0


def _op_files(spec, op, cuda, header: str, cpu_dir: Path, py_dir: Path) -> dict[Path, str]:
    return {
        cpu_dir / header: _stage("CPU kernels", lambda: cpu_header(op)),
        cpu_dir / f"{spec.name}_cpu.cpp": _stamp(_stage("CPU kernels", lambda: cpu_source(op, header)), spec.file),
        cpu_dir / f"{spec.name}_ops.cpp": _stage("op glue", lambda: glue_source(spec, op, header, cuda, __version__)),
        py_dir / f"_generated_{spec.name}.py": _stage("Python API", lambda: python_module(spec, op, __version__)),
    }


class EmitError(Exception):
    """A spec the engine accepts but an emitter cannot turn into code (says which emitter and why)."""


def _stage(what: str, make):
    """Run one emitter; whatever it cannot handle becomes an EmitError naming the emitter, never a traceback."""
    try:
        return make()
    except Exception as exc:  # an emitter's limitation, whatever its type: report it against the spec
        why = f"no support for {exc.args[0]!r}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise EmitError(f"the {what} generator cannot handle this spec: {why}") from exc


def emitter_problems(op) -> list[str]:
    """What `python -m generator check` reports after the engine: every emitter the build runs on this spec (CPU
    kernels, op glue, Python API, and the CUDA template choice), each failure as one line."""
    spec = op.spec
    stages = [("CPU kernels", lambda: cpu_header(op) + cpu_source(op, f"{spec.name}_cpu.h")),
              ("op glue", lambda: glue_source(spec, op, f"{spec.name}_cpu.h", None, __version__)),
              ("Python API", lambda: python_module(spec, op, __version__))]
    problems = []
    for what, make in stages:
        try:
            _stage(what, make)
        except EmitError as exc:
            problems.append(str(exc))
    cv = spec.variants.cuda
    if cv is not None:
        from .cuda import TEMPLATES, choose_template

        try:
            name, _, refused = _stage("CUDA", lambda: choose_template(spec, op, list(cv.families)))
        except EmitError as exc:
            return [*problems, str(exc)]
        if name is None and (not cv.template or cv.template in TEMPLATES):
            why = "; ".join(f"{t}: {r}" for t, r in refused.items())
            problems.append(f"no CUDA kernel template accepts this cascade ({why}); remove variants.cuda to build "
                            f"it for the CPU only")
    return problems


def _stamp(text: str, spec_file: str) -> str:
    return f"// Generated by redfuser-ops generator {__version__} from {spec_file}; do not edit.\n{text}"
