"""The one table of arch families (generator/families.py) and the library's use of it.

The runtime's choice of family for a device (C++, from the generated header) must be the table's rule as the
generator states it in Python, for every capability and every set of built families.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import redfuser_ops
from generator.codegen.cuda_lower import family_gencode_flags
from generator.families import (
    FAMILIES,
    TABLE,
    family,
    family_for_capability,
    sass_runs_on,
)

CAPABILITIES = [(7, 0), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (9, 5), (10, 0), (10, 3), (11, 0), (12, 0),
                (12, 1)]
SUBSETS = [s for n in range(1, len(FAMILIES) + 1) for s in itertools.combinations(FAMILIES, n)]


@pytest.mark.parametrize("cap", CAPABILITIES)
def test_runtime_choice_is_the_tables_rule(cap):
    for fams in SUBSETS:
        want = family_for_capability(cap, fams)
        if want is None:
            with pytest.raises(RuntimeError, match=rf"this GPU is sm_{cap[0]}{cap[1]}"):
                torch.ops.redfuser._select_family("op", cap[0], cap[1], ";".join(fams))
        else:
            assert torch.ops.redfuser._select_family("op", cap[0], cap[1], ";".join(fams)) == want, (cap, fams)


@pytest.mark.parametrize("cap, fams, want", [
    ((8, 9), FAMILIES, "sm89"),                 # fp8 tensor cores: the family lowered for 8.9 itself
    ((8, 9), ("sm80", "sm90a"), "sm80"),        # sm80's own sm_89 SASS
    ((8, 6), FAMILIES, "sm80"),
    ((8, 7), FAMILIES, "sm80"),                 # sm_80 SASS runs on every 8.x
    ((9, 0), FAMILIES, "sm90a"),
    ((9, 0), ("sm80", "sm100a"), "sm80"),       # compute_80 PTX, JIT-compiled
    ((10, 0), FAMILIES, "sm100a"),
    ((12, 0), FAMILIES, "sm80"),                # consumer Blackwell: PTX
    ((12, 0), ("sm90a", "sm100a"), None),       # arch-specific SASS runs only on its own arch
    ((7, 5), FAMILIES, None),
])
def test_rule_examples(cap, fams, want):
    assert family_for_capability(cap, fams) == want


def test_sass_compatibility():
    assert sass_runs_on("sm_80", (8, 6)) and sass_runs_on("sm_86", (8, 9)) and not sass_runs_on("sm_86", (8, 0))
    assert sass_runs_on("sm_90a", (9, 0)) and not sass_runs_on("sm_90a", (9, 5)) and not sass_runs_on("sm_80", (9, 0))


def test_gencode_lists_come_from_the_table():
    for f in TABLE:
        pairs = [x.removeprefix("-gencode=arch=").split(",code=") for x in family_gencode_flags(f.name)]
        assert pairs == [[v, r] for v, r in f.gencode] + ([[f.ptx, f.ptx]] if f.ptx else [])
        assert all(v == "compute_" + r.removeprefix("sm_") for v, r in f.gencode)
    with pytest.raises(ValueError, match="unknown arch family 'sm75'"):
        family("sm75")


def test_library_reports_the_tables_archs():
    info = redfuser_ops.info()
    assert info["archs"] == [", ".join(family(f).sass) for f in info["families"]]
