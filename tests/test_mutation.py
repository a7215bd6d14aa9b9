"""The mutation catalogue in CI (tests/mutation): every mutant still applies to the tree (exactly once, so the
catalogue cannot rot as the code changes) and names tests that exist; and a small random sample of the cheap
mutants (no rebuild, a few seconds of tests each) is planted in a copy of the tree and killed. The sample's seed
is printed; replay with MUTATION_SEED=<seed>. The whole catalogue: `python -m tests.mutation` (README).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from tests.mutation.catalogue import MUTANTS
from tests.mutation.run import ROOT, patch_count, run_one, sync_package, tree_files

SEED = int(os.environ.get("MUTATION_SEED", str(int(time.time()) % 100_000)))
NAMED = {  # the six that issue 17 found surviving, plus the two it names besides
    "forms-guard-never-refuses", "algebra-absmax-no-zero-candidate", "cpp-e4m3-noop", "cpu-math-nan-keys-first",
    "glue-size-checks-skipped-for-values", "stream-attention-tail-mask-le", "runtime-bf16-store-truncates",
}


def test_catalogue_is_large_unique_and_covers_every_area():
    names = [m.name for m in MUTANTS]
    assert len(names) >= 32 and len(set(names)) == len(names)
    assert NAMED <= set(names)
    assert {m.area for m in MUTANTS} == {"engine", "emitter", "runtime", "cuda", "package"}
    templates = {p.name for p in (ROOT / "generator/codegen/templates").glob("*.py") if p.name != "__init__.py"}
    hit = {Path(m.path).name for m in MUTANTS}
    assert templates <= hit, f"CUDA templates/bridges without a mutant: {sorted(templates - hit)}"


@pytest.mark.parametrize("m", MUTANTS, ids=lambda m: m.name)
def test_mutant_applies_and_names_existing_tests(m):
    assert patch_count(m) == 1, f"{m.name}: the search text must occur exactly once in {m.path}"
    assert m.search != m.replace and m.bug and m.tests
    for arg in m.tests:
        if arg.startswith("tests/"):
            assert (ROOT / arg.split("::")[0]).is_file(), arg


def test_a_sample_of_cheap_mutants_is_killed(tmp_path):
    cheap = [m for m in MUTANTS if m.cheap]
    assert len(cheap) >= 3 and not any(m.needs_build for m in cheap)
    sample = random.Random(SEED).sample(cheap, 2)
    print(f"MUTATION_SEED={SEED}: {', '.join(m.name for m in sample)}")
    files = tree_files()
    (tmp_path / "src").mkdir()
    for m in sample:
        r = run_one(m, tmp_path, files, timeout=120)
        assert r.status == "killed", (m.name, r.status, r.detail, (tmp_path / "logs" / f"{m.name}.test.log").read_text())


def test_a_package_mutant_reaches_the_installed_package(tmp_path):
    """A mutant of redfuser_ops/*.py is rebuilt by `cmake --install`, which installs only the library and the
    generated files: sync_package copies the copy's Python files over the installed ones (and the clean ones back)."""
    src, site = tmp_path / "src", tmp_path / "site"
    (src / "redfuser_ops" / "sub").mkdir(parents=True)
    (site / "redfuser_ops").mkdir(parents=True)
    (src / "redfuser_ops" / "a.py").write_text("x = 2\n")
    (src / "redfuser_ops" / "sub" / "b.py").write_text("y = 1\n")
    (site / "redfuser_ops" / "a.py").write_text("x = 1\n")
    (site / "redfuser_ops" / "_generated_op.py").write_text("z = 0\n")
    written = sync_package(src, site)
    assert sorted(p.relative_to(site).as_posix() for p in written) == ["redfuser_ops/a.py", "redfuser_ops/sub/b.py"]
    assert (site / "redfuser_ops" / "a.py").read_text() == "x = 2\n"
    assert (site / "redfuser_ops" / "sub" / "b.py").read_text() == "y = 1\n"
    assert (site / "redfuser_ops" / "_generated_op.py").read_text() == "z = 0\n"
    assert sync_package(src, site) == []
