"""`python -m generator emit`: every spec -> derived forms -> sources for the build (see files.py).

Per op: `<op>_cpu.h` / `<op>_cpu.cpp` (the CPU kernels, compiled with the kernel flags), `<op>_ops.cpp` (schema,
checks, outputs, CPU/CUDA registration), `_generated_<op>.py` (fake + typed wrapper) and, for each arch family
the spec's CUDA template supports, one `.cu` per variant. Files are rewritten only when their content changes.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

from .. import __version__
from ..errors import FusionError, SpecError
from ..families import render_header
from ..spec import load_spec
from ..symbolic import derive
from .cpu import cpu_header, cpu_source
from .files import KNOWN_FAMILIES, render_sources_cmake, write_if_changed
from .glue import glue_source
from .pyapi import python_module

OPS_SRC = Path(__file__).resolve().parent.parent.parent / "ops_src"


def log(msg: str) -> None:
    print(f"[redfuser generator] {msg}", flush=True)


def emit(out: Path, families: list[str], specs: list[Path], jobs: int = 0,
         ops: list[str] | None = None, dtypes: list[str] | None = None, static: list[str] | None = None) -> int:
    """Generate everything; `ops`/`dtypes` (None = all) restrict the CUDA variants (a development subset).

    Every op's CUDA variants are planned first and lowered together in one process pool, so that no
    worker waits for the last variant of one op before the next op's start (and TileLang is imported once
    per worker, not once per op and worker).
    """
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
    try:
        loaded = [load_spec(path) for path in specs]
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    problem = _check_subset(loaded, ops, dtypes, static)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    derived = []
    for spec in loaded:
        try:
            log(f"{spec.name}: deriving forms ({Path(spec.file).name})")
            derived.append((spec, derive(spec)))
        except (SpecError, FusionError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    planned = {}
    if families:
        from .bridge import BridgeError
        from .cuda import (  # imports tilelang: only when CUDA is built
            cuda_glue,
            cuda_plan,
            lower_all,
        )

        for spec, op in derived:
            cv = spec.variants.cuda
            if cv is None or (ops and spec.name not in ops):
                continue
            if dtypes:
                cv = replace(cv, dtypes=tuple(d for d in cv.dtypes if d in dtypes))
            if static:
                cv = replace(cv, static=_static_subset(cv.static, _static_wanted(static)))
            spec = replace(spec, variants=replace(spec.variants, cuda=cv))
            try:
                p = cuda_plan(spec, op, families, log)
            except BridgeError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            if p is not None:
                planned[spec.name] = (spec, p)
        all_jobs = [j for _, p in planned.values() for j in p[0].jobs]
        lowered = lower_all(all_jobs, out / "cuda", jobs, log) if all_jobs else {}
    for spec, op in derived:
        cuda = None
        if spec.name in planned:
            cuda_spec, p = planned[spec.name]
            cuda, files = cuda_glue(cuda_spec, p, lowered)
            for fam, paths in files.items():
                cuda_sources[fam] += paths
        header = f"{spec.name}_cpu.h"
        try:
            files_text = _op_files(spec, op, cuda, header, cpu_dir, py_dir)
        except EmitError as exc:
            print(f"error: {spec.file}: {exc}", file=sys.stderr)
            return 1
        for p_, text in files_text.items():
            written += write_if_changed(p_, text)
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
    written += write_if_changed(cpu_dir / "redfuser_families.h", render_header())
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
    except SpecError as exc:  # a mistake in the spec that only this emitter can see: reported at its place
        raise EmitError(str(exc)) from exc
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


def _static_wanted(static: list[str]) -> dict[str, set[str]]:
    """'KEY=VALUE' entries -> key -> the wanted values, as text (a key may repeat)."""
    wanted: dict[str, set[str]] = {}
    for entry in static:
        key, _, value = entry.partition("=")
        wanted.setdefault(key.strip(), set()).add(value.strip().lower())
    return wanted


def _static_subset(static: tuple, wanted: dict[str, set[str]]) -> tuple:
    """A spec's static values restricted to the wanted ones where the spec has that key (others unchanged)."""
    return tuple((k, tuple(v for v in vals if str(v).lower() in wanted[k]) if k in wanted else vals)
                 for k, vals in static)


def _check_subset(specs: list, ops: list[str] | None, dtypes: list[str] | None,
                  static: list[str] | None = None) -> str | None:
    """A typo in a subset setting must not silently build nothing."""
    with_cuda = {spec.name: spec.variants.cuda for spec in specs if spec.variants.cuda is not None}
    unknown = sorted(set(ops or ()) - set(with_cuda))
    if unknown:
        return f"CUDA ops {unknown} do not exist (ops with a CUDA section: {', '.join(sorted(with_cuda))})"
    known = {d for cv in with_cuda.values() for d in cv.dtypes}
    unknown = sorted(set(dtypes or ()) - known)
    if unknown:
        return f"CUDA dtypes {unknown} are not built by any op (known: {', '.join(sorted(known))})"
    if static:
        bad = [e for e in static if "=" not in e or not e.partition("=")[0].strip()]
        if bad:
            return f"CUDA static subset entries {bad} are not KEY=VALUE"
        for key, values in _static_wanted(static).items():
            have = {str(v).lower() for cv in with_cuda.values() for k, vals in cv.static if k == key for v in vals}
            if not have:
                return f"CUDA static key {key!r} is not a static key of any op"
            for spec in specs:
                cv = spec.variants.cuda
                if cv is not None and (not ops or spec.name in ops) and not all(
                        _static_subset(cv.static, {key: values})[i][1] for i in range(len(cv.static))):
                    return (f"CUDA static subset {key}={sorted(values)} leaves {spec.name} no variant "
                            f"(its values: {sorted(have)})")
    return None


def _stamp(text: str, spec_file: str) -> str:
    return f"// Generated by redfuser-ops generator {__version__} from {spec_file}; do not edit.\n{text}"
