"""The tables that tell a user what each spec builds follow the specs themselves: specs/README.md lists every spec
in specs/ once, with its CPU dtypes and, for a CUDA variant, the template the generator takes for it (named by the
spec or chosen), its arch families and its dtypes; README.md's status table does the same for the four ops it
lists and names every other spec's op below it. (specs/README.md had fp8_quant_gemm's CUDA column at "not yet"
long after its quant_gemm variants landed.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from generator.codegen.cuda import choose_template
from generator.spec import load_spec
from generator.symbolic import derive

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def table_rows(text: str, heading: str) -> dict[str, list[str]]:
    """The rows of the first table after a markdown heading, keyed by their first cell's first `code` span (or the
    cell itself), each as its cells."""
    at = text.index(heading + "\n")
    rows: dict[str, list[str]] = {}
    seen_table = False
    for line in text[at:].splitlines()[1:]:
        if not line.startswith("|"):
            if seen_table or line.startswith("#"):
                break
            continue
        seen_table = True
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set(cells[0]) <= {"-", ":"} or cells[0] in {"spec", "op"}:
            continue
        m = re.search(r"`([^`]+)`", cells[0])
        rows[m.group(1) if m else cells[0]] = cells
    return rows


def names(cell: str, words) -> list[str]:
    """Those of ``words`` that the cell does not name as a whole word."""
    return [w for w in words if not re.search(rf"(?<![\w]){re.escape(w)}(?![\w])", cell)]


SPECS_README = (ROOT / "specs" / "README.md").read_text()
SPEC_ROWS = {**table_rows(SPECS_README, "## Ops made only of their YAML"),
             **table_rows(SPECS_README, "## The shipped specs")}


def test_table_rows_reads_the_table_under_its_heading():
    text = "# t\n## A\nintro\n| spec | CPU |\n|---|---|\n| `a.yaml` (x) | fp32 |\n| `b.yaml` | bf16 |\n\n| `c.yaml` | x |\n"
    assert table_rows(text, "## A") == {"a.yaml": ["`a.yaml` (x)", "fp32"], "b.yaml": ["`b.yaml`", "bf16"]}
    assert names("sm80/sm90a (fp8 WGMMA)", ["sm80", "sm90a", "sm90", "sm100a"]) == ["sm90", "sm100a"]


def test_specs_readme_lists_every_spec_once():
    listed = sorted(SPEC_ROWS)
    assert listed == sorted(p.name for p in SPECS)
    for p in SPECS:
        assert sum(line.startswith(f"| `{p.name}`") for line in SPECS_README.splitlines()) == 1, p.name


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_specs_readme_states_what_each_spec_builds(path: Path):
    spec = load_spec(path)
    cells = SPEC_ROWS[path.name]
    cpu, cuda = cells[1], cells[2]
    assert not names(cpu, [SHORT[d] for d in spec.variants.cpu_dtypes]), (path.name, cpu)
    cv = spec.variants.cuda
    if cv is None:
        assert "CPU only" in cuda, (path.name, cuda)
        return
    template, _, refused = choose_template(spec, derive(spec), list(cv.families))
    assert template is not None, refused
    assert "not yet" not in cuda.lower(), (path.name, cuda)
    assert not names(cuda, [template, *cv.families, *(SHORT[d] for d in cv.dtypes)]), (path.name, cuda)


def test_readme_status_table_follows_the_specs():
    readme = (ROOT / "README.md").read_text()
    status = table_rows(readme, "## Status")
    ops = {s.name: s for s in map(load_spec, SPECS)}
    assert set(status) <= set(ops)
    for op, cells in status.items():
        spec = ops[op]
        assert not names(cells[1], [SHORT[d] for d in spec.variants.cpu_dtypes]), (op, cells[1])
        if spec.variants.cuda is not None:
            assert not names(cells[2], list(spec.variants.cuda.families)), (op, cells[2])
    after = readme[readme.index("## Status"):readme.index("## The ops")]
    others = sorted(set(ops) - set(status))
    assert not names(after, others), others
