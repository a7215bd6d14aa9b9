"""python -m generator explain|check|emit ...

explain SPEC...     print each reduction's classification and the derived fused, online and merge forms
check [DIR|SPEC...] analyse every spec (default: specs/), self-check its forms numerically and run the code
                    generators on it (CPU kernels, glue, Python API, CUDA template choice); exit 1 on failure
emit --out DIR      generate the sources of every spec for the build (see generator/codegen)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .codegen.emit import emitter_problems
from .errors import FusionError, SpecError
from .explain import explain
from .families import FAMILIES, TABLE
from .spec import load_spec, spec_files
from .symbolic.forms import analyze
from .symbolic.oracle import self_check

ROOT = Path(__file__).resolve().parent.parent


def _paths(items: list[str]) -> list[Path]:
    if not items:
        return spec_files(ROOT / "specs")
    out: list[Path] = []
    for item in items:
        p = Path(item)
        out += spec_files(p) if p.is_dir() else [p]
    return out


def cmd_explain(args: argparse.Namespace) -> int:
    status = 0
    for path in _paths(args.specs):
        try:
            op = analyze(load_spec(path))
            sys.stdout.write(explain(op))
            from .codegen.cuda import (
                template_report,  # the bridges' verdicts (no TileLang needed)
            )

            sys.stdout.write("\n".join(template_report(op.spec, op)) + "\n\n")
        except (SpecError, FusionError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 1
    return status


def cmd_check(args: argparse.Namespace) -> int:
    status = 0
    for path in _paths(args.specs):
        try:
            op = analyze(load_spec(path))
        except (SpecError, FusionError) as exc:
            print(f"FAIL {path}: {exc}")
            status = 1
            continue
        problems = emitter_problems(op)  # what the build's code generators make of the spec
        for case in op.cases:
            problems += [f"[{case.ir.label}] {p}" for p in self_check(case, seed=args.seed, trials=args.trials)]
        if problems:
            status = 1
            print(f"FAIL {path}:")
            for p in problems:
                print(f"  {p}")
        else:
            passes = max(len(c.passes) for c in op.cases)
            print(f"ok   {path}: {op.spec.name}, {len(op.cases)} specialisation(s), up to {passes} pass(es)")
    return status


def cmd_emit(args: argparse.Namespace) -> int:
    from .codegen.emit import (
        emit,  # build-time code generation; imports tilelang lazily
    )

    return emit(out=Path(args.out), families=[f for f in args.archs.replace(",", ";").split(";") if f],
                specs=_paths(args.specs), jobs=args.jobs, ops=_names(args.ops), dtypes=_names(args.dtypes),
                static=_names(args.static))


def cmd_families(args: argparse.Namespace) -> int:
    """The known arch families, ';'-separated (CMake reads this), or the table with --table."""
    if args.table:
        for f in TABLE:
            ptx = f" + {f.ptx} PTX" if f.ptx else ""
            print(f"{f.name:7s} lowered for {f.lower_arch}; SASS {', '.join(f.sass)}{ptx}: {f.why}")
    else:
        print(";".join(FAMILIES))
    return 0


def _names(text: str) -> list[str] | None:
    names = [n for n in text.replace(",", ";").split(";") if n]
    return names or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m generator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("explain", help="print the derivation of specs")
    p.add_argument("specs", nargs="*")
    p.set_defaults(fn=cmd_explain)
    p = sub.add_parser("check", help="analyse and numerically self-check specs")
    p.add_argument("specs", nargs="*")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trials", type=int, default=2)
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("emit", help="generate sources for the build")
    p.add_argument("--out", required=True)
    p.add_argument("--archs", default=";".join(FAMILIES), help="arch families, ';'-separated ('' = CPU only)")
    p.add_argument("--jobs", type=int, default=0, help="parallel lowering processes (0 = number of CPUs)")
    p.add_argument("--ops", default="", help="only these ops get CUDA kernels (';'-separated; '' = all)")
    p.add_argument("--dtypes", default="", help="only CUDA variants of these dtypes (';'-separated; '' = all)")
    p.add_argument("--static", default="", help="only CUDA variants with these static values, KEY=VALUE entries "
                   "(';'-separated, a key may repeat; e.g. 'D=128;E_cap=512'; '' = all)")
    p.add_argument("specs", nargs="*")
    p.set_defaults(fn=cmd_emit)
    p = sub.add_parser("families", help="the known CUDA arch families (generator/families.py)")
    p.add_argument("--table", action="store_true", help="one line per family: archs, PTX and why")
    p.set_defaults(fn=cmd_families)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
