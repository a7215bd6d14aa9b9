"""Derived forms -> CUDA variants through the kernel templates, and the C++ that launches them.

A *bridge* per template (generator/codegen/templates/<template>_bridge.py, registered in ``TEMPLATES`` as its
(plan, body) pair) reads the engine's analysis of an op, checks that the cascade has the shape the template
schedules (and says precisely why not otherwise), and renders the engine's formulas into the template's math
interface; nothing op-specific is typed here. Per variant the template emits a TileLang
program, which is lowered (in parallel processes, cached by the program's digest) to a .cu with a renamed
launcher. The bridge also writes the body of the op's `impl_cuda`: variant selection, argument checks the
kernel relies on, workspaces, and the launch calls, generated from each launcher's parameter list by name.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from .. import __version__
from ..spec import OpSpec
from ..symbolic.forms import OpAnalysis
from .bridge import BridgeError, Job, Plan, launch_call, py_to_cpp
from .files import write_if_changed
from .glue import CudaGlue
from .templates import paged_attention_bridge, quant_gemm_bridge, stream_row_bridge
from .templates.resident_row_bridge import row_body, row_plan, row_program
from .templates.stream_attention_bridge import (
    attention_body,
    attention_math,
    attention_plan,
)

# the names bridges used from this module before they moved next to their templates
_call, _py_to_cpp = launch_call, py_to_cpp


# --------------------------------------------------------------------------------------------- lowering
def _program_digest(job: Job) -> str:
    return hashlib.sha256((job.program + job.family + job.symbol + __version__).encode()).hexdigest()[:16]


def _lower_one(args: tuple[str, str, str, str, str]) -> tuple[str, str, list[tuple], int | None]:
    """Worker: import the program, lower it; returns (symbol, .cu source, params, smem)."""
    symbol, family, program_path, digest, header = args
    from .cuda_lower import lower_to_cuda

    spec = importlib.util.spec_from_file_location(f"redfuser_prog_{symbol}", program_path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    pass_configs = getattr(mod, "PASS_CONFIGS", None) or None
    hdr = dict(ast.literal_eval(header))
    hdr["program-digest"] = digest
    low = lower_to_cuda(mod.make_prim_func(), family, symbol, generator_version=__version__,
                        pass_configs=pass_configs, header=hdr)
    params = [(p.name, p.kind, p.dtype, p.host_c_type) for p in low.params]
    return symbol, low.source, params, low.dynamic_smem_bytes


def _cached(cu: Path, digest: str) -> bool:
    if not cu.exists():
        return False
    head = cu.read_text()[:4000]
    return f"program-digest: {digest}" in head and (cu.with_suffix(".params")).exists()


def lower_all(jobs: list[Job], out_dir: Path, workers: int, log: Callable[[str], None]) -> dict[str, dict]:
    """Lower every job (cached by program digest); returns symbol -> {path, params, family}."""
    out: dict[str, dict] = {}
    todo = []
    for job in jobs:
        fam_dir = out_dir / job.family
        prog = fam_dir / f"{job.symbol}.py"
        cu = fam_dir / f"{job.symbol}.cu"
        write_if_changed(prog, job.program)
        digest = _program_digest(job)
        out[job.symbol] = {"path": cu, "family": job.family}
        if _cached(cu, digest):
            out[job.symbol]["params"] = ast.literal_eval(cu.with_suffix(".params").read_text())
            continue
        todo.append((job.symbol, job.family, str(prog), digest, repr(job.header)))
    log(f"  {len(jobs) - len(todo)} variant(s) unchanged, {len(todo)} to lower with TileLang")
    if todo:
        n = max(1, min(workers or (os.cpu_count() or 1), len(todo)))
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        done = 0
        with ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
            for symbol, source, params, _smem in pool.map(_lower_one, todo):
                done += 1
                cu = out[symbol]["path"]
                write_if_changed(cu, source)
                write_if_changed(cu.with_suffix(".params"), repr(params))
                out[symbol]["params"] = params
                log(f"  lowered {done}/{len(todo)}: {symbol}")
    return out


def declarations(lowered: dict[str, dict]) -> list[str]:
    lines = []
    for symbol, info in sorted(lowered.items()):
        args = ", ".join(f"{c} {n}" for n, _k, _d, c in info["params"])
        lines += [
            f'extern "C" int {symbol}_init(void);',
            f'extern "C" int {symbol}_call({args});',
            f'extern "C" const char* {symbol}_get_last_error(void);',
        ]
    return lines


def _variant_object(symbol: str, op: str, family: str) -> str:
    return (f"static redfuser::CudaVariant kV_{symbol}{{\"{op}\", \"{symbol}\", \"{family}\", "
            f"&{symbol}_init, &{symbol}_get_last_error}};")


# --------------------------------------------------------------------------------------------- entry point
TEMPLATES = {"stream_attention": (attention_plan, attention_body), "resident_row": (row_plan, row_body),
             "paged_attention": (paged_attention_bridge.paged_plan, paged_attention_bridge.paged_body),
             "quant_gemm": (quant_gemm_bridge.quant_plan, quant_gemm_bridge.quant_body),
             "stream_row": (stream_row_bridge.stream_plan, stream_row_bridge.stream_body)}


def choose_template(spec: OpSpec, op: OpAnalysis, families: list[str]) -> tuple[str | None, Plan | None, dict]:
    """The template of a spec's CUDA variants and its plan: the one its `template:` names, or else the first in
    ``TEMPLATES`` whose bridge accepts the cascade. Also returns why each template tried refused (name -> reason)."""
    cv = spec.variants.cuda
    names = [cv.template] if cv.template else list(TEMPLATES)
    refused: dict[str, str] = {}
    for name in names:
        if name not in TEMPLATES:
            refused[name] = "no template of this name in this generator yet"
            continue
        try:
            return name, TEMPLATES[name][0](spec, op, families), refused
        except ValueError as exc:  # BridgeError, or a formula a template cannot print
            refused[name] = str(exc)
    return None, None, refused


def template_report(spec: OpSpec, op: OpAnalysis) -> list[str]:
    """What `explain` prints about a spec's CUDA variants: the template they use and why each other refused."""
    cv = spec.variants.cuda
    if cv is None:
        return ["cuda: no variants.cuda section: CPU only"]
    name, _, refused = choose_template(spec, op, list(cv.families))
    verdicts = dict(refused)
    for other in TEMPLATES:  # the verdict of every template, also those after the chosen one
        if other not in verdicts and other != name:
            verdicts[other] = choose_template(replace(spec, variants=replace(
                spec.variants, cuda=replace(cv, template=other))), op, list(cv.families))[2].get(other, "accepts")
    how = "named by the spec" if cv.template else "the first template that accepts the cascade"
    out = [f"cuda: template {name} ({how})" if name else "cuda: no template accepts the cascade: CPU only"]
    out += [f"  {t}: {'refused: ' + why if why != 'accepts' else 'accepts too'}" for t, why in verdicts.items()]
    return out


def cuda_plan(spec: OpSpec, op: OpAnalysis, families: list[str], log: Callable[[str], None]):
    """The op's CUDA variants (a Plan and its body maker), or None when it gets no CUDA kernel."""
    cv = spec.variants.cuda
    fams = [f for f in families if f in cv.families]
    if not fams:
        log(f"{spec.name}: none of the requested families {families} is supported ({cv.families}): CPU only")
        return None
    if not cv.dtypes:
        log(f"{spec.name}: no CUDA dtype selected: CPU only")
        return None
    name, plan, refused = choose_template(spec, op, fams)
    if name is None:
        why = "; ".join(f"{t}: {r}" for t, r in refused.items())
        if cv.template and cv.template not in TEMPLATES:
            log(f"{spec.name}: no kernel template '{cv.template}' in this generator yet: CPU only")
            return None
        raise BridgeError(f"{spec.file}: no CUDA kernel template accepts {spec.name} ({why}); remove its "
                          f"variants.cuda section to build it for the CPU only")
    log(f"{spec.name}: {len(plan.jobs)} CUDA variant(s) from template {name}"
        + ("" if cv.template else " (chosen: the first template that accepts the cascade)"))
    return plan, TEMPLATES[name][1]


def cuda_glue(spec: OpSpec, planned, lowered: dict[str, dict]) -> tuple[CudaGlue, dict[str, list[Path]]]:
    """The op's launch code and .cu files, once `lower_all` has lowered (at least) its plan's jobs."""
    plan, make_body = planned
    mine = {j.symbol: lowered[j.symbol] for j in plan.jobs}
    body = make_body(spec, plan, mine)
    decl = declarations(mine) + [""] + [_variant_object(s, spec.name, i["family"]) for s, i in sorted(mine.items())]
    decl += getattr(plan, "support", [])
    files: dict[str, list[Path]] = {}
    for sym, info in sorted(mine.items()):
        files.setdefault(info["family"], []).append(info["path"])
    glue = CudaGlue(declarations=decl, body=body, variants=[(s, i["family"]) for s, i in sorted(mine.items())])
    return glue, files


def cuda_for_op(spec: OpSpec, op: OpAnalysis, families: list[str], out_dir: Path, jobs: int,
                log: Callable[[str], None]) -> tuple[CudaGlue | None, dict[str, list[Path]]]:
    """One op alone: plan, lower, glue (`emit` plans every op first and lowers all variants in one pool)."""
    planned = cuda_plan(spec, op, families, log)
    if planned is None:
        return None, {}
    return cuda_glue(spec, planned, lower_all(planned[0].jobs, Path(out_dir), jobs, log))


__all__ = ["TEMPLATES", "BridgeError", "Job", "Plan", "attention_math", "choose_template", "cuda_for_op", "cuda_glue",
           "cuda_plan", "lower_all", "row_program", "template_report"]
