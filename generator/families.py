"""The one table of CUDA arch families: what each is lowered for, compiled to and runs on.

Everything else reads this table: spec validation (`cuda: families:`), the emitter and its `sources.cmake`
(`-gencode` lists), TileLang's target per family, CMake's list of known families (`python -m generator
families`), the runtime's choice of family for a device (a generated header, `redfuser_families.h`), and the
tests that check which SASS and PTX the library holds.

A family is one TileLang lowering (one source per variant), compiled by nvcc into SASS for one or more real
archs and optionally kept as PTX for the driver to JIT on newer GPUs. Choosing a family for a device of compute
capability (major, minor): among the built families whose SASS runs there, the one lowered for the highest arch;
else, among those with PTX at or below the capability, the one lowered for the highest arch; else none.
SASS of `sm_XY` runs on every X.Z with Z >= Y; SASS of an arch-specific target (`sm_90a`) only on exactly X.Y.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAMILIES", "TABLE", "Family", "family", "family_for_capability", "render_header", "sass_runs_on"]


@dataclass(frozen=True)
class Family:
    name: str
    lower_arch: str  # the arch TileLang lowers for ("sm_90a")
    sass: tuple[str, ...]  # real archs compiled to SASS, each with its own virtual arch ("sm_86" <- compute_86)
    ptx: str | None  # virtual arch kept as PTX ("compute_80"), or None
    why: str

    @property
    def gencode(self) -> tuple[tuple[str, str], ...]:
        """(virtual, real) pairs for nvcc's -gencode: each SASS compiled from its own virtual arch, so that
        __CUDA_ARCH__-guarded paths of that arch are taken."""
        return tuple(("compute_" + real[3:], real) for real in self.sass)

    @property
    def lower_capability(self) -> tuple[int, int]:
        return _capability(self.lower_arch)


TABLE: tuple[Family, ...] = (
    Family("sm80", "sm_80", ("sm_80", "sm_86", "sm_89"), "compute_80",
           "Ampere/Ada: one sm_80 source; SASS for 8.0, 8.6, 8.9 and compute_80 PTX for every newer GPU"),
    Family("sm89", "sm_89", ("sm_89",), None,
           "Ada (8.9) lowered for itself: TileLang emits fp8 mma.sync (QMMA) only when it lowers for sm_89"),
    Family("sm90a", "sm_90a", ("sm_90a",), None,
           "Hopper (9.0): TMA, WGMMA and setmaxnreg compile only for the arch-specific target"),
    Family("sm100a", "sm_100a", ("sm_100a",), None,
           "Blackwell datacenter (10.0): TileLang 0.1.15 lowers TMA + mma.sync here, not tcgen05"),
)

FAMILIES: tuple[str, ...] = tuple(f.name for f in TABLE)
_BY_NAME = {f.name: f for f in TABLE}


def family(name: str) -> Family:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown arch family {name!r}; known: {', '.join(FAMILIES)}") from None


def _capability(arch: str) -> tuple[int, int]:
    """'sm_90a' / 'compute_80' -> (9, 0) / (8, 0)."""
    digits = arch.split("_", 1)[1].rstrip("af")
    return int(digits[:-1]), int(digits[-1])


def sass_runs_on(real_arch: str, cap: tuple[int, int]) -> bool:
    major, minor = _capability(real_arch)
    if real_arch.endswith(("a", "f")):
        return cap == (major, minor)
    return cap[0] == major and cap[1] >= minor


def family_for_capability(cap: tuple[int, int], available) -> str | None:
    """The family among `available` that a device of capability `cap` runs (module docstring), or None."""
    built = [f for f in TABLE if f.name in set(available)]
    native = [f for f in built if any(sass_runs_on(a, cap) for a in f.sass)]
    if native:
        return max(native, key=lambda f: f.lower_capability).name
    jit = [f for f in built if f.ptx is not None and _capability(f.ptx) <= cap]
    return max(jit, key=lambda f: f.lower_capability).name if jit else None


def render_header() -> str:
    """C++ header with the table, for ops_src/runtime.cpp (family choice and messages)."""
    rows = []
    for f in TABLE:
        sass = ", ".join(f"{{{m}, {n}, {str(a.endswith(('a', 'f'))).lower()}}}"
                         for a in f.sass for m, n in [_capability(a)])
        ptx = 10 * _capability(f.ptx)[0] + _capability(f.ptx)[1] if f.ptx else 0
        lm, ln = f.lower_capability
        rows.append(f'  {{"{f.name}", "{", ".join(f.sass)}", {10 * lm + ln}, {ptx}, {len(f.sass)}, {{{sass}}}}},\n')
    return (
        "// Generated from generator/families.py (the one table of arch families). Do not edit.\n"
        "#pragma once\n\n"
        "namespace redfuser::families {\n\n"
        "struct Sass { int major, minor; bool exact; };  // SASS of sm_XY runs on X.Z, Z >= Y; exact: only X.Y\n"
        "struct Row {\n"
        "  const char* name;\n"
        "  const char* archs;  // for messages\n"
        "  int lowered_for;    // 10 * major + minor of the arch TileLang lowers for\n"
        "  int ptx;            // 10 * major + minor of the PTX kept, 0 = none\n"
        "  int n_sass;\n"
        "  Sass sass[4];\n"
        "};\n\n"
        f"inline constexpr Row kTable[] = {{\n{''.join(rows)}}};\n\n"
        "}  // namespace redfuser::families\n"
    )
