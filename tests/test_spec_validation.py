"""Every way generator/spec.py refuses a malformed spec: one edit of specs/moe_route.yaml (the spec that uses most
of the format: an optional tensor, str choices, defaults, checks, a CUDA section with static values) per case, and
the error must name the file, the line of the edit and the key, with the reason. A refusal that went missing would
let the spec through to the engine or the build, which fail later and far from the mistake (a fixed size of 0, an
argument without a default after one with a default: a torch schema that does not parse at load time)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from generator.errors import SpecError
from generator.spec import parse_spec

ROOT = Path(__file__).resolve().parent.parent
BASE = (ROOT / "specs" / "moe_route.yaml").read_text()

LOGITS = "  logits: {shape: [T, E], dtype: [float32, float16, bfloat16]}\n"
TOPK = '  topk: {type: int, doc: "experts selected per token"}\n'
SCORING = "  scoring: {type: str, default: softmax, choices: [softmax, sigmoid]}\n"
RENORM = "  renormalize: {type: bool, default: false,"
BIAS = "  bias: {shape: [E], dtype: [float32], optional: true,"
NGROUP = "  n_group: {type: int, default: 1,"
TOPK_GROUP = "  topk_group: {type: int, default: 1,"
CHECK = '  - {expr: "topk >= 1", message: "topk must be at least 1"}\n'
IDS = '  ids: {shape: [T, topk], dtype: int32, index: [t, r], value: "sel.index[r]"}\n'
INDICES = "  indices: {t: T, e: E, g: n_group, r: topk}\n"
GIDS = '  gids: {shape: [E], dtype: [int32], values: "[0, E)"}\n'  # an index tensor, added where a case needs one

# (what is replaced, by what, the key the error names, words of the reason[, where the error points when that is not
# the edited line: the last line of this text])
CASES = [
    ("op: moe_route\n", "op: moe-route\n", "op", "op must be a valid name"),
    (TOPK, TOPK.replace("{type: int,", "{type: int,,"), "args.topk", "invalid YAML"),
    (TOPK, TOPK + TOPK, "args.topk", "duplicate key"),
    (TOPK, TOPK.replace("type: int,", "type: int, size: 3,"), "args.topk.size", "unknown key (allowed: "),
    (BIAS, "  bias: {shape: [E], optional: true,", "args.bias", "missing key 'dtype'"),
    (TOPK, TOPK.replace("topk:", "top-k:"), "args.top-k", "'top-k' is not a valid name"),
    (TOPK, TOPK + "  lambda: {type: int, default: 0}\n", "args.lambda", "'lambda' is a reserved word"),
    ("op: moe_route\n", "op: class\n", "op", "'class' is a reserved word"),
    (BIAS, BIAS.replace("shape: [E]", "shape: E"), "args.bias.shape", "a shape is a list of axis names"),
    (BIAS, BIAS.replace("shape: [E]", "shape: [1.5]"), "args.bias.shape", "bad dimension 1.5"),
    (BIAS, BIAS.replace("shape: [E]", "shape: [0]"), "args.bias.shape", "a fixed size must be positive, got 0"),
    (BIAS, BIAS.replace("shape: [E]", "shape: [F]"), "args.bias.shape", "unknown axis 'F'"),
    (TOPK, TOPK + "  E: {type: int, default: 1}\n", "args.E", "an argument may not share its name with an axis"),
    (BIAS, BIAS.replace("dtype: [float32]", "dtype: weights"), "args.bias.dtype",
     "'weights' is not an earlier tensor argument"),
    (BIAS, BIAS.replace("dtype: [float32]", "dtype: [float33]"), "args.bias.dtype", "expected a list of dtypes"),
    (BIAS, BIAS.replace("dtype: [float32]", "dtype: []"), "args.bias.dtype", "expected a list of dtypes"),
    (BIAS, BIAS.replace("optional: true", "optional: 1"), "args.bias.optional", "expected true or false"),
    (BIAS, BIAS.replace("optional: true", 'optional: true, values: "[0, E)"'), "args.bias.values",
     "only integer tensors take values"),
    (TOPK, TOPK + GIDS.replace("[0, E)", "0, E"), "args.gids.values", "values must read '[lo, hi)' or '[lo, hi]'"),
    (TOPK, TOPK + GIDS.replace("[0, E)", "[0, E +)"), "args.gids.values", "cannot parse the bound 'E +'"),
    (TOPK, TOPK + GIDS.replace("[0, E)", "[0, F)"), "args.gids.values", "the bound 'F' of [0, F) reads F"),
    (TOPK, TOPK.replace("type: int", "type: integer"), "args.topk.type", "unknown type 'integer'"),
    (NGROUP, NGROUP + " choices: [a],", "args.n_group.choices", "only str arguments take choices"),
    (SCORING, "  scoring: {type: str, default: softmax}\n", "args.scoring", "a str argument must list its choices"),
    (RENORM, RENORM.replace("default: false", "default: 3"), "args.renormalize.default",
     "default 3 does not fit type 'bool'"),
    (SCORING, SCORING.replace("default: softmax", "default: tanh"), "args.scoring.default",
     "default 'tanh' does not fit type 'str'"),
    (NGROUP, NGROUP.replace("default: 1", "default: 1.5"), "args.n_group.default",
     "default 1.5 does not fit type 'int'"),
    (NGROUP, NGROUP.replace("default: 1", "default: null"), "args.n_group.default",
     "only optional ('?') arguments may default to null"),
    (NGROUP, NGROUP + ' when_null: "1",', "args.n_group.when_null", "only optional ('?') arguments take when_null"),
    (TOPK_GROUP, "  topk_group: {type: int,", "args.topk_group",
     "an argument without a default may not follow one with a default"),
    (CHECK, '  - {expr: "topk >= 1"}\n', "checks[0]", "missing key 'message'"),
    (CHECK, '  - {expr: "  ", message: "x"}\n', "checks[0].expr", "expected an expression (a non-empty string)"),
    (IDS, IDS.replace("index: [t, r]", "index: [t]"), "outputs.ids.index", "1 indices for a 2-d output"),
    (IDS, IDS.replace("index: [t, r]", "index: t"), "outputs.ids.index", "expected a list of names or sizes"),
    (IDS, IDS.replace("dtype: int32", "dtype: int33"), "outputs.ids.dtype", "unknown dtype 'int33'"),
    (IDS, IDS.replace("shape: [T, topk]", "shape: [T, G]"), "outputs.ids.shape", "unknown axis 'G'"),
    (IDS, IDS.replace("ids:", "logits:"), "outputs.logits", "an output may not share its name with an argument"),
    (IDS, IDS.replace("ids:", "T:"), "outputs.T", "an output may not share its name with an axis"),
    ("  rows: [t]\n", "  rows: [u]\n", "cascade.rows", "row index 'u' is not declared under indices"),
    ("  over: e\n", "  over: t\n", "cascade.over", "the reduction index cannot also be a row index"),
    ("  passes: 3\n", "  passes: 0\n", "cascade.passes", "passes is a positive integer"),
    ("  passes: 3\n", "  passes: true\n", "cascade.passes", "passes is a positive integer"),
    ("    m: max(x)\n", "    x: max(x)\n", "cascade", "'x' names both a let and a reduction"),
    (INDICES, INDICES.replace("r: topk}", "r: topk, bias: E}"), "cascade",
     "indices ['bias'] clash with axis or argument names"),
    # the edit is to logits; the error names the variant that asks for more than the first argument allows
    (LOGITS, LOGITS.replace(", bfloat16]", "]"), "variants.cpu.dtype",
     "dtype bfloat16 is not allowed by the first argument", "  cpu:\n    dtype:"),
    ("    families: [sm80, sm90a, sm100a]\n", "    families: [sm80, sm70]\n", "variants.cuda.families",
     "unknown arch family 'sm70'"),
    ("    static: {E_cap: [64, 128, 256, 512]}\n", "    static: {E_cap: []}\n", "variants.cuda.static.E_cap",
     "expected a non-empty list of values"),
]


def _line_at(text: str, pos: int) -> int:
    """The 1-based line of `text` that holds character `pos`."""
    return text.count("\n", 0, pos) + 1


def _first_changed_line(text: str) -> int:
    """The 1-based line of the first line of `text` that differs from the base spec's."""
    for n, (a, b) in enumerate(zip(text.splitlines(), BASE.splitlines()), start=1):
        if a != b:
            return n
    return len(BASE.splitlines()) + 1


@pytest.mark.parametrize("old, new, key, reason, at", [c if len(c) == 5 else (*c, None) for c in CASES],
                         ids=[c[3][:40] for c in CASES])
def test_a_malformed_spec_is_refused_where_the_mistake_is(old, new, key, reason, at):
    assert BASE.count(old) == 1, old
    text = BASE.replace(old, new)
    with pytest.raises(SpecError) as exc:
        parse_spec(text, "broken.yaml")
    msg = str(exc.value)
    assert reason in msg, msg
    m = re.match(r"broken\.yaml:(\d+): (\S+): ", msg)
    assert m, msg
    assert m.group(2) == key, msg
    line, edit = int(m.group(1)), _first_changed_line(text)
    if at is not None:
        edit = _line_at(text, text.index(at)) + at.count("\n")
    if key.split(".")[0] in ("cascade", "variants") and key.count(".") < 2:  # the block's own line, above the edit
        assert 0 < line <= edit, msg
    else:  # one-line entries: the line of the edit itself
        assert line == edit, msg


def test_an_empty_spec_and_one_without_tensors_are_refused():
    with pytest.raises(SpecError, match="the spec is empty"):
        parse_spec("", "broken.yaml")
    no_tensor = BASE.replace(LOGITS, "").replace(BIAS, "  bias: {type: float, default: 0.0,")
    with pytest.raises(SpecError, match="an op needs at least one tensor argument"):
        parse_spec(no_tensor, "broken.yaml")


def test_the_base_spec_parses():
    assert parse_spec(BASE, "moe_route.yaml").name == "moe_route"


# --------------------------------------------------------------------------------------------- names in the C++ glue
def _problems(text: str) -> list[str]:
    from generator.codegen.emit import emitter_problems
    from generator.symbolic import analyze

    return emitter_problems(analyze(parse_spec(text, "broken.yaml")))


@pytest.mark.parametrize("old, new, key, reason", [
    (BIAS, BIAS.replace("bias:", "auto:"), "args.auto", "'auto' is a C++ keyword or type"),
    (NGROUP, NGROUP.replace("n_group:", "int64_t:"), "args.int64_t", "'int64_t' is a C++ keyword or type"),
    (BIAS, BIAS.replace("bias:", "A:"), "args.A", "'A' is a name the generated C++ glue uses"),
    (NGROUP, NGROUP.replace("n_group:", "kind:"), "args.kind", "'kind' is a name the generated C++ glue uses"),
    (IDS, IDS.replace("ids:", "delete:"), "outputs.delete", "'delete' is a C++ keyword or type"),
    (SCORING, SCORING.replace("scoring:", "op:"), "args.op", "'op' is a name the generated Python module uses"),
    (IDS, IDS.replace("ids:", "allowed:"), "outputs.allowed", "'allowed' is a name the generated Python module uses"),
])
def test_a_name_the_generated_cpp_cannot_take_is_refused_at_its_line(old, new, key, reason):
    """The glue names every argument and output by its spec name (a parameter of prepare and impl_*, a member of
    Call), and so does the Python module's fake implementation (a local name): `python -m generator check` refuses
    the names that would not compile there or that those use for their own, at the name's line."""
    text = BASE.replace(old, new)
    # the name's other uses renamed too, so that only the glue's check can refuse it
    plain = re.search(r"^  (\w+):", old).group(1)
    renamed = re.search(r"^  (\w+):", new).group(1)
    text = re.sub(rf"\b{plain}\b", renamed, text)
    problems = _problems(text)
    assert len(problems) == 1, problems
    line = _line_at(text, re.search(rf"^  {renamed}:", text, re.MULTILINE).start())
    assert problems[0].startswith(f"broken.yaml:{line}: {key}: "), problems
    assert reason in problems[0], problems


@pytest.mark.parametrize("name, reason", [
    ("auto", "'auto' is a C++ keyword or type: the generated C++ puts the op in a namespace of its name"),
    ("info", "an op may not be named 'info': redfuser_ops has a function of that name"),
    ("_warm_up", "an op may not be named '_warm_up'"),
])
def test_an_op_name_the_generated_code_cannot_take_is_refused(name, reason):
    text = BASE.replace("op: moe_route\n", f"op: {name}\n")
    problems = _problems(text)
    line = _first_changed_line(text)
    assert len(problems) == 1 and problems[0].startswith(f"broken.yaml:{line}: op: "), problems
    assert reason in problems[0], problems


def _glue_identifiers(src: str) -> set[str]:
    """The identifiers that the bodies of prepare and impl_cpu name unqualified (not after '.', '->' or '::')."""
    src = re.sub(r'"(?:\\.|[^"\\])*"', '""', src)
    src = re.sub(r"//[^\n]*", "", src)
    out: set[str] = set()
    for fn in ("prepare", "impl_cpu"):
        m = re.search(rf"\b{fn}\([^)]*\)\s*{{", src)
        assert m, fn
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            i += 1
        body = src[m.start():i]
        out |= {w.group(1) for w in re.finditer(r"(?<![\w.:>])([A-Za-z_]\w*)", body)}
    return out


ALL_SPECS = sorted((ROOT / "specs").glob("*.yaml")) + sorted((ROOT / "tests" / "specs").glob("*.yaml"))


@pytest.mark.parametrize("path", ALL_SPECS, ids=lambda p: p.stem)
def test_the_glue_names_nothing_but_the_specs_names_and_its_reserved_ones(path):
    """What keeps glue.GLUE_NAMES true: every identifier the CPU glue of every spec names unqualified in the functions
    that take the op's arguments is one of the spec's own names, a C++ keyword or type, one of GLUE_NAMES, or a loop
    variable of a block that reads none of the spec's names (s, d)."""
    from generator.codegen.cpp import CPP_RESERVED
    from generator.codegen.glue import GLUE_NAMES, glue_source
    from generator.symbolic import analyze

    op = analyze(parse_spec(path.read_text(), path.name))
    own = {a.name for a in op.spec.args} | {o.name for o in op.spec.outputs}
    src = glue_source(op.spec, op, f"{op.spec.name}_cpu.h", None, "test")
    other = _glue_identifiers(src) - own - CPP_RESERVED - GLUE_NAMES - {"s", "d"}
    assert not other, f"{path.name}: the glue names {sorted(other)}: add them to glue.GLUE_NAMES"
