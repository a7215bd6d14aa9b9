"""Static SASS check of the INSTALLED library: `python -m bench.sass [--update] [--lib PATH]`.

Reads the CUDA code in redfuser_ops' `_C.so` with cuobjdump (`--dump-resource-usage`, `--dump-sass`), one
record per (variant, SASS arch, kernel function): registers, static shared memory, local memory, stack, and the
count of a few telling opcodes. It then

- checks every variant of the families in bench/sass_expect.CHECKED_FAMILIES against the rule its name matches
  (matrix instructions, TMA loads, no local-memory traffic);
- compares the per-family tables with the committed bench/results/sass/<family>.md and .json
  (`--update` rewrites them), so that a change of the generated machine code shows up in review.

Without --update it prints the violations and table differences and exits 1 if there are any.
tests/test_sass.py runs the same code. cuobjdump comes from PATH, $CUDA_HOME/bin, /usr/local/cuda/bin or the pip
package nvidia-cuda-cuobjdump (site-packages/nvidia/cu13/bin).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import ROOT
from .sass_expect import (
    CHECKED_FAMILIES,
    FAMILY_ARCHS,
    FORBID_ALWAYS,
    NO_LOCAL_MEMORY,
    family_of,
    rule_for,
)

TABLE_DIR = ROOT / "bench" / "results" / "sass"
# opcodes counted in the table (the part of the mnemonic before the first '.')
COUNTED = ("HGMMA", "QGMMA", "HMMA", "QMMA", "UTMALDG", "UTMASTG", "LDGSTS", "SHFL", "BAR", "LDL", "STL")
SASS_ARCHS = {a for archs in FAMILY_ARCHS.values() for a in archs}


class ToolMissing(RuntimeError):
    pass


def find_tool(name: str) -> str:
    """PATH, $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin, site-packages/nvidia/*/bin."""
    path = shutil.which(name)
    if path:
        return path
    candidates = [Path(os.environ[e]) / "bin" / name for e in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(e)]
    candidates.append(Path("/usr/local/cuda/bin") / name)
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(Path(base).glob(f"*/bin/{name}"))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise ToolMissing(f"{name} not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, site-packages/nvidia/*/bin); "
                      "install it with `pip install nvidia-cuda-cuobjdump` or use a CUDA toolkit")


# ----------------------------------------------------------------------------------------------------------
# The installed package
# ----------------------------------------------------------------------------------------------------------

_PROBE = r"""
import json, sys
import redfuser_ops
from redfuser_ops import _loader
info = redfuser_ops.info()
json.dump({"package": redfuser_ops.__file__, "library": str(_loader.library_path()),
           "families": info["families"], "cuda": info["cuda"],
           "variants": [dict(v, op=op) for op, d in info["ops"].items() for v in d["variants"]]}, sys.stdout)
"""


def installed_library(python: str | None = None) -> dict[str, Any]:
    """Facts about the installed redfuser_ops, read in a subprocess started in an empty folder without
    PYTHONPATH so that the source tree is never imported."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["PYTHONNOUSERSITE"] = "1"
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run([python or sys.executable, "-c", _PROBE], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=600, check=False)
    if r.returncode != 0:
        raise RuntimeError("cannot import the installed redfuser_ops (install the wheel first, e.g. `pip install .`):\n"
                           + r.stderr[-3000:])
    data = json.loads(r.stdout)
    pkg = Path(data["package"]).resolve()
    if ROOT in pkg.parents and "site-packages" not in pkg.parts:
        raise RuntimeError(f"imported redfuser_ops from the source tree ({pkg}), not from an installed package")
    return data


def has_cuda_code(lib: Path) -> bool:
    """Whether the library holds a CUDA fat binary (section .nv_fatbin), read with readelf."""
    readelf = find_tool("readelf")
    out = subprocess.run([readelf, "-S", "-W", str(lib)], capture_output=True, text=True, check=True).stdout
    return ".nv_fatbin" in out or "__nv_relfatbin" in out


# ----------------------------------------------------------------------------------------------------------
# cuobjdump output
# ----------------------------------------------------------------------------------------------------------

@dataclass
class Kernel:
    variant: str
    family: str
    arch: str
    function: str
    reg: int = 0
    shared: int = 0
    local: int = 0
    stack: int = 0
    instrs: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    def key(self) -> tuple[str, str, str]:
        return (self.variant, self.arch, self.function)


_ARCH = re.compile(r"^arch = (sm_\w+)")
_IDENT = re.compile(r"^identifier = (.+)$")
_RES_FN = re.compile(r"^\s*Function (\S+):\s*$")
_RES = re.compile(r"(REG|STACK|SHARED|LOCAL):(\d+)")
_SASS_FN = re.compile(r"^\s*Function : (\S+)\s*$")
_INSTR = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def _variant_of(identifier: str) -> str:
    name = Path(identifier.strip()).name
    return re.sub(r"\.(cu|cubin|ptx)$", "", name)


def _arch_name(arch: str, variant: str) -> str:
    """cuobjdump may call an sm_90a cubin sm_90; this build never makes plain sm_90/sm_100 code."""
    if arch in ("sm_90", "sm_100") and variant.endswith("a"):
        return arch + "a"
    return arch


def _blocks(text: str):
    """Yields (arch, identifier, lines) per 'Fatbin elf code' block."""
    arch = ident = None
    lines: list[str] = []
    started = False
    for line in text.splitlines():
        if line.startswith(("Fatbin elf code", "Fatbin ptx code")):
            if started:
                yield arch, ident, lines
            arch = ident = None
            lines = []
            started = line.startswith("Fatbin elf code")
            continue
        if not started:
            continue
        m = _ARCH.match(line)
        if m and arch is None:
            arch = m.group(1)
            continue
        m = _IDENT.match(line)
        if m and ident is None:
            ident = m.group(1)
            continue
        lines.append(line)
    if started:
        yield arch, ident, lines


def _variant_blocks(text: str):
    """(variant, arch name, lines) of each cuobjdump block that names both its arch and its variant."""
    for arch, ident, lines in _blocks(text):
        if arch is not None and ident is not None:
            variant = _variant_of(ident)
            yield variant, _arch_name(arch, variant), lines


def parse_resource_usage(text: str, kernels: dict[tuple[str, str, str], Kernel] | None = None
                         ) -> dict[tuple[str, str, str], Kernel]:
    """Kernels (with their resources) from `cuobjdump --dump-resource-usage` output."""
    kernels = {} if kernels is None else kernels
    for variant, arch, lines in _variant_blocks(text):
        fn = None
        for line in lines:
            m = _RES_FN.match(line)
            if m:
                fn = m.group(1)
                continue
            if fn and "REG:" in line:
                vals = {k: int(v) for k, v in _RES.findall(line)}
                k = Kernel(variant, family_of(variant), arch, fn, reg=vals.get("REG", 0), shared=vals.get("SHARED", 0),
                           local=vals.get("LOCAL", 0), stack=vals.get("STACK", 0))
                kernels[k.key()] = k
                fn = None
    return kernels


def parse_sass(text: str, kernels: dict[tuple[str, str, str], Kernel] | None = None
               ) -> dict[tuple[str, str, str], Kernel]:
    """Adds instruction counts from `cuobjdump --dump-sass` output (kernels missing so far are created)."""
    kernels = {} if kernels is None else kernels
    for variant, arch, lines in _variant_blocks(text):
        current: Kernel | None = None
        for line in lines:
            m = _SASS_FN.match(line)
            if m:
                key = (variant, arch, m.group(1))
                current = kernels.get(key)
                if current is None:
                    current = kernels[key] = Kernel(variant, family_of(variant), arch, m.group(1))
                continue
            if current is None:
                continue
            m = _INSTR.match(line)
            if m:
                op = m.group(1)
                current.instrs += 1
                if op in COUNTED:
                    current.counts[op] = current.counts.get(op, 0) + 1
    return kernels


def inspect_library(lib: Path, cuobjdump: str | None = None) -> list[Kernel]:
    """One Kernel per (variant, arch, function) in the library's CUDA code."""
    tool = cuobjdump or find_tool("cuobjdump")
    res = subprocess.run([tool, "--dump-resource-usage", str(lib)], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        if "does not contain" in res.stderr + res.stdout:
            return []
        raise RuntimeError(f"cuobjdump --dump-resource-usage failed: {res.stderr.strip()[:2000]}")
    kernels = parse_resource_usage(res.stdout)
    sass = subprocess.run([tool, "--dump-sass", str(lib)], capture_output=True, text=True, check=False)
    if sass.returncode != 0:
        raise RuntimeError(f"cuobjdump --dump-sass failed: {sass.stderr.strip()[:2000]}")
    parse_sass(sass.stdout, kernels)
    return sorted(kernels.values(), key=lambda k: k.key())


# ----------------------------------------------------------------------------------------------------------
# Checks and tables
# ----------------------------------------------------------------------------------------------------------

def violations(kernels: list[Kernel], variants: list[dict] | None = None) -> list[str]:
    """What breaks the rules of bench/sass_expect.py. `variants` (info()'s CUDA variants) adds: every variant
    of a checked family has code."""
    problems = []
    by_variant: dict[str, list[Kernel]] = defaultdict(list)
    for k in kernels:
        by_variant[k.variant].append(k)
    for variant, ks in sorted(by_variant.items()):
        family = family_of(variant)
        if family not in CHECKED_FAMILIES:
            continue
        rule = rule_for(variant)
        if rule is None:
            problems.append(f"{variant}: no rule in bench/sass_expect.py matches this variant name; add one")
            continue
        total: dict[str, int] = defaultdict(int)
        for k in ks:
            for op, n in k.counts.items():
                total[op] += n
        for op in rule.require:
            if total.get(op, 0) == 0:
                problems.append(f"{variant}: no {op} in its SASS ({rule.kind}: {rule.why})")
        for op in rule.forbid + FORBID_ALWAYS.get(family, ()):
            if total.get(op, 0):
                problems.append(f"{variant}: {total[op]} x {op} in its SASS (forbidden for {rule.kind} kernels"
                                f"{' and for every ' + family + ' kernel' if op in FORBID_ALWAYS.get(family, ()) else ''})")
        if family in NO_LOCAL_MEMORY:
            for k in ks:
                if k.local or k.stack:
                    problems.append(f"{variant}: kernel {k.function} ({k.arch}) uses {k.local} B of local memory, "
                                    f"stack {k.stack} B")
    if variants is not None:
        have = set(by_variant)
        for v in variants:
            if v.get("device") == "cuda" and v.get("family") in CHECKED_FAMILIES and v["name"] not in have:
                problems.append(f"{v['name']}: registered as a CUDA variant but no SASS found for it")
    return problems


def tables(kernels: list[Kernel]) -> dict[str, tuple[str, str]]:
    """family -> (markdown, json text)."""
    fams: dict[str, list[Kernel]] = defaultdict(list)
    for k in kernels:
        fams[k.family].append(k)
    out = {}
    for fam, ks in sorted(fams.items()):
        ks = sorted(ks, key=lambda k: k.key())
        cols = [c for c in COUNTED if any(k.counts.get(c) for k in ks)] or ["HGMMA"]
        for must in ("LDL", "STL"):
            if must not in cols:
                cols.append(must)
        lines = [
            f"# SASS resources and instructions: {fam}",
            "",
            ("Generated by `python -m bench.sass --update` from the installed library; tests/test_sass.py fails when "
            "the library's code differs from this table. One row per kernel function and SASS arch. REG: registers "
            "per thread; SHARED: static shared memory per block in bytes (dynamic shared memory is set by the "
            "launcher and is not part of the cubin); LOCAL: local memory per thread in bytes; STACK: stack frame; "
            "then the count of selected opcodes (HGMMA/QGMMA: warpgroup MMA, HMMA/QMMA: warp MMA, UTMALDG/UTMASTG: "
            "TMA, LDGSTS: cp.async, LDL/STL: local memory traffic) and the total instruction count. Expectations "
            "per kind of kernel: bench/sass_expect.py."),
            "",
            "| variant | kernel | arch | kind | REG | SHARED | LOCAL | STACK | " + " | ".join(cols) + " | instrs |",
            "|---|---|---|---|---:|---:|---:|---:|" + "---:|" * len(cols) + "---:|",
        ]
        for k in ks:
            rule = rule_for(k.variant)
            kind = rule.kind if rule else "–"
            lines.append(f"| {k.variant} | {k.function} | {k.arch} | {kind} | {k.reg} | {k.shared} | {k.local} | "
                         f"{k.stack} | " + " | ".join(str(k.counts.get(c, 0)) for c in cols) + f" | {k.instrs} |")
        lines.append("")
        js = json.dumps({"family": fam, "counted_opcodes": list(COUNTED),
                         "kernels": [asdict(k) for k in ks]}, indent=1, sort_keys=True) + "\n"
        out[fam] = ("\n".join(lines), js)
    return out


def compare_tables(current: dict[str, tuple[str, str]], table_dir: Path = TABLE_DIR, subset: bool = False,
                   unlisted: list[str] | None = None) -> list[str]:
    """Differences between the library's tables and the committed ones, as readable text (empty: same).

    The committed tables hold the kernels of CI's subset build (.ci/run). ``subset=False`` (the default, used by
    `--update` checks and tools) requires the tables to equal the library's. A caller that passes a list as
    ``unlisted`` compares kernel by kernel instead: every kernel of the library that has a committed row must equal
    it, and the kernels without a row are appended to ``unlisted`` (a full build holds more variants than CI's);
    with ``subset=True`` too, a kernel without a row is a difference."""
    diffs = []
    for fam, (md, js) in current.items():
        md_path, js_path = table_dir / f"{fam}.md", table_dir / f"{fam}.json"
        if not md_path.is_file() or not js_path.is_file():
            diffs.append(f"{md_path.relative_to(ROOT) if ROOT in md_path.parents else md_path}: missing "
                         f"(the library has {fam} code); write it with `python -m bench.sass --update`")
            continue
        if subset or unlisted is not None:
            diffs += _compare_subset(fam, json.loads(js), json.loads(js_path.read_text()),
                                     None if subset else unlisted)
            continue
        old_md, old_js = md_path.read_text(), js_path.read_text()
        if old_md != md or old_js != js:
            d = "".join(difflib.unified_diff(old_md.splitlines(True), md.splitlines(True),
                                             f"committed {md_path.name}", "installed library", n=0))
            if not d:
                d = f"(the .md tables agree; {js_path.name} differs)\n"
            diffs.append(f"{md_path.name} differs from the installed library "
                         f"(review, then `python -m bench.sass --update`):\n{d[:20000]}")
    return diffs


def _compare_subset(fam: str, mine: dict, committed: dict, unlisted: list[str] | None = None) -> list[str]:
    """Kernel by kernel: each kernel of the library equals the committed row of the same function and arch; one
    without a row is a difference, or goes to ``unlisted`` when a list is given."""
    rows = {(k["function"], k["arch"]): k for k in committed["kernels"]}
    diffs = []
    for k in mine["kernels"]:
        old = rows.get((k["function"], k["arch"]))
        if old is None:
            if unlisted is not None:
                unlisted.append(f"{k['function']} ({k['arch']})")
            else:
                diffs.append(f"{fam}: {k['function']} ({k['arch']}) is not in the committed table "
                             f"(review, then `python -m bench.sass --update` on CI's subset build)")
        elif old != k:
            changed = {f: (old.get(f), k.get(f)) for f in sorted(set(old) | set(k)) if old.get(f) != k.get(f)}
            diffs.append(f"{fam}: {k['function']} ({k['arch']}) differs from the committed row: {changed}")
    if not mine["kernels"]:
        diffs.append(f"{fam}: the build holds no kernel of this family")
    return diffs


def write_tables(current: dict[str, tuple[str, str]], table_dir: Path = TABLE_DIR) -> list[Path]:
    table_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for fam, (md, js) in current.items():
        for path, text in ((table_dir / f"{fam}.md", md), (table_dir / f"{fam}.json", js)):
            path.write_text(text)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sass", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--update", action="store_true", help="rewrite bench/results/sass/<family>.md/.json")
    p.add_argument("--lib", type=Path, default=None, help="inspect this .so instead of the installed package's")
    p.add_argument("--tables", type=Path, default=TABLE_DIR, help="folder of the committed tables")
    args = p.parse_args(argv)
    variants = None
    if args.lib:
        lib = args.lib
    else:
        data = installed_library()
        lib = Path(data["library"])
        variants = data["variants"]
        if not data["families"]:
            cuda = has_cuda_code(lib)
            print(f"{lib}: a CPU-only build (no arch families)" + ("; but it HOLDS CUDA code" if cuda else ""))
            return 1 if cuda else 0
    kernels = inspect_library(lib)
    print(f"{lib}: {len({k.variant for k in kernels})} CUDA variants, {len(kernels)} kernels "
          f"({', '.join(sorted({k.arch for k in kernels}))})")
    probs = violations(kernels, variants)
    for pr in probs:
        print("VIOLATION:", pr)
    current = tables(kernels)
    if args.update:
        for path in write_tables(current, args.tables):
            print("wrote", path)
        return 1 if probs else 0
    diffs = compare_tables(current, args.tables)
    for d in diffs:
        print(d)
    if not probs and not diffs:
        print("SASS: all rules met; tables match")
    return 1 if probs or diffs else 0


if __name__ == "__main__":
    sys.exit(main())
