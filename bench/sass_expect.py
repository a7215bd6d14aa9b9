"""What the machine code of each kind of kernel must show: the table tests/test_sass.py checks the INSTALLED
library against (docs/benchmarks.md explains it).

A variant is matched by its name (fnmatch patterns, first match wins, so the specific patterns come first).
Every CUDA variant of a family listed in CHECKED_FAMILIES must match a rule; a new kind of kernel needs a
row here before the test passes.

Columns of a rule:
- require: SASS opcodes (the part before the first '.') that must occur at least once in the variant's code,
  e.g. HGMMA (Hopper warpgroup MMA, fp16/bf16), QGMMA (the same for fp8), UTMALDG (a TMA tile load).
- forbid: opcodes that must not occur.
Whatever the rule, FORBID_ALWAYS[family] applies too: LDL/STL are loads/stores of thread-local memory, i.e.
register spills (or arrays the compiler could not keep in registers), and the per-kernel LOCAL size must be 0.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from generator.families import TABLE

# arch families and the SASS archs each holds (generator/families.py, the one table)
FAMILY_ARCHS = {f.name: f.sass for f in TABLE}

# families whose variants are checked against RULES (the others only get a resource table)
CHECKED_FAMILIES = ("sm90a", "sm89")

# opcodes forbidden in every variant of a family, and whether LOCAL (bytes of local memory) must be 0
FORBID_ALWAYS = {"sm90a": ("LDL", "STL"), "sm89": ("LDL", "STL")}
NO_LOCAL_MEMORY = ("sm90a", "sm89")


@dataclass(frozen=True)
class Rule:
    pattern: str
    kind: str
    require: tuple[str, ...] = ()
    forbid: tuple[str, ...] = ()
    why: str = ""


RULES: tuple[Rule, ...] = (
    # the merge kernels of split-KV: read partial (o, lse) rows, no GEMM, no tiles by TMA
    Rule("fused_attention_combine__*__sm90a", "merge", why="merge of split-KV partial states: plain loads, no GEMM"),
    Rule("mla_decode_combine__*__sm90a", "merge", why="merge of split-KV partial states: plain loads, no GEMM"),
    Rule("sliding_window_attention_combine__*__sm90a", "merge",
         why="merge of split-KV partial states: plain loads, no GEMM"),
    # attention forward, with or without split-KV: QK^T and PV on warpgroup MMA, Q/K/V tiles by TMA
    Rule("fused_attention__*__sm90a", "attention", require=("HGMMA", "UTMALDG"),
         why="QK^T and PV on WGMMA; Q, K, V tiles by TMA"),
    Rule("sliding_window_attention__*__sm90a", "attention", require=("HGMMA", "UTMALDG"),
         why="banded mask + tanh soft-capping (specs/sliding_window_attention.yaml): WGMMA, tiles by TMA"),
    Rule("mla_decode__*__sm90a", "attention", require=("HGMMA", "UTMALDG"), forbid=("HMMA",),
         why="paged latent attention: WGMMA (64 packed head rows, never the mma.sync fallback), KV pages by TMA"),
    # fp8 GEMM with online per-token quantisation: fp8 warpgroup MMA, X and w tiles by TMA (the single-segment
    # and the split-K kernels); the merge of split-K partials reads rows, no GEMM
    Rule("fp8_quant_gemm_merge__*__sm90a", "merge", forbid=("QGMMA", "HGMMA"),
         why="merge of split-K partial (abs-max, accumulator) rows: plain loads, no GEMM"),
    Rule("fp8_quant_gemm__*__sm90a", "fp8 gemm", require=("QGMMA", "UTMALDG"),
         why="e4m3 x e4m3 on fp8 WGMMA; tiles by TMA"),
    # sm_89 (Ada): fp8 mma.sync; an HMMA here would mean the fp8 GEMM fell back to 16-bit MMA
    Rule("fp8_quant_gemm_merge__*__sm89", "merge", forbid=("QMMA", "HMMA"),
         why="merge of split-K partial rows: no GEMM"),
    Rule("fp8_quant_gemm__*__sm89", "fp8 gemm", require=("QMMA",), forbid=("HMMA",),
         why="e4m3 x e4m3 on fp8 mma.sync (QMMA.16832)"),
    # long rows streamed by one CTA each (stream_row): vector loads, warp shuffles + shared memory for the merge;
    # no matrix work, no TMA (specs/logsumexp.yaml, specs/softmax_cross_entropy.yaml)
    Rule("logsumexp_merge__*__sm90a", "merge", forbid=("HGMMA", "QGMMA", "UTMALDG"),
         why="merge of split rows' segment states: a thread per row, plain loads"),
    Rule("softmax_cross_entropy_merge__*__sm90a", "merge", forbid=("HGMMA", "QGMMA", "UTMALDG"),
         why="merge of split rows' segment states: a thread per row, plain loads"),
    Rule("logsumexp__*__sm90a", "stream row", require=("SHFL",), forbid=("HGMMA", "QGMMA", "UTMALDG"),
         why="one CTA per row: online states in registers, merged by warp shuffles and shared memory"),
    Rule("softmax_cross_entropy__*__sm90a", "stream row", require=("SHFL",), forbid=("HGMMA", "QGMMA", "UTMALDG"),
         why="one CTA per row: online states in registers, merged by warp shuffles and shared memory"),
    # stream_row with per-element outputs: the same streaming pass, then the final states broadcast through shared
    # memory (a second barrier) and a second pass over the row storing each element; split rows: the merge program
    # keeps the final states, the final program (a CTA per segment) stores the segment's elements
    Rule("rms_norm_fp8_quant_merge__*__sm90a", "merge", forbid=("HGMMA", "QGMMA", "UTMALDG"),
         why="merge of split rows' segment states (and the row's final states kept): a thread per row, plain loads"),
    Rule("row_softmax_merge__*__sm90a", "merge", forbid=("HGMMA", "QGMMA", "UTMALDG"),
         why="merge of split rows' segment states (and the row's final states kept): a thread per row, plain loads"),
    Rule("rms_norm_fp8_quant_final__*__sm90a", "final pass", forbid=("HGMMA", "QGMMA", "UTMALDG", "SHFL"),
         why="a CTA per segment of a split row: the merged states from the workspace, q written per element"),
    Rule("row_softmax_final__*__sm90a", "final pass", forbid=("HGMMA", "QGMMA", "UTMALDG", "SHFL"),
         why="a CTA per segment of a split row: the merged states from the workspace, probabilities per element"),
    Rule("rms_norm_fp8_quant__*__sm90a", "stream row + final pass", require=("SHFL", "BAR"),
         forbid=("HGMMA", "QGMMA", "UTMALDG"),
         why="one CTA per row: sum of squares and abs-max online, then q written per element as e4m3"),
    Rule("row_softmax__*__sm90a", "stream row + final pass", require=("SHFL", "BAR"),
         forbid=("HGMMA", "QGMMA", "UTMALDG"),
         why="one CTA per row: max and rescaled sum online, then each probability written in x's dtype"),
    # stream_row with a selection: the streaming pass also fills each thread's sorted list of top-k keys
    # (registers: no local memory), then k rounds of a block-wide maximum (64-bit shuffles, a barrier per round)
    Rule("vocab_topk__*__sm90a", "stream row + top-k rounds", require=("SHFL", "BAR"),
         forbid=("HGMMA", "QGMMA", "UTMALDG"),
         why="one CTA per row: max and rescaled sum online, per-thread top-k lists in registers, k merge rounds"),
    # the router: one warp per row in registers, warp shuffles; no GEMM, no TMA
    Rule("moe_route__*__sm90a", "router", forbid=("HGMMA", "QGMMA"),
         why="a row per warp in registers; no matrix work"),
)


def rule_for(variant: str) -> Rule | None:
    for rule in RULES:
        if fnmatch.fnmatchcase(variant, rule.pattern):
            return rule
    return None


def family_of(variant: str) -> str:
    """Variant names end in __<family> (generator convention)."""
    return variant.rsplit("__", 1)[-1]
