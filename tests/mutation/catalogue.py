"""The mutation catalogue: small semantic bugs planted one at a time in a clean copy of the tree.

Each mutant is an exact search/replace pair (the search text must occur exactly once in its file), a line saying
what real bug it stands for, and the test selection (pytest arguments, run from the copy's root) that must fail
on it. A selection names tests that check values (outputs against a reference, the oracle, a simulation or the
emitted program run on the CPU), never generated text. Mutants of the C++ runtime, the CPU emitter, the glue and
the package's own Python (redfuser_ops/, which the tests import from the install) need the CPU-only library rebuilt
and installed (``needs_build``); mutants of the engine, the CUDA templates and bridges are caught by tests that
import ``generator`` from the source tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# files whose change reaches the CPU-only library (the generated C++ kernels and glue, the runtime)
# (and the package's own Python, redfuser_ops/, which the tests import from the install: a mutant there is installed)
BUILD_INPUTS = ("ops_src/", "generator/codegen/cpu.py", "generator/codegen/cpu_tiles.py", "generator/codegen/cpu_params.py",
                "generator/codegen/cpp.py", "generator/codegen/glue.py", "generator/codegen/pyapi.py",
                "generator/codegen/emit.py", "redfuser_ops/")


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    search: str
    replace: str
    bug: str
    tests: tuple[str, ...]
    cheap: bool = False  # no build and a selection of a few seconds: eligible for the CI sample
    env: dict = field(default_factory=dict)

    @property
    def needs_build(self) -> bool:
        return self.path.startswith(BUILD_INPUTS)

    @property
    def area(self) -> str:
        if self.path.startswith("generator/symbolic/") or self.path == "generator/spec.py":  # the spec is its input
            return "engine"
        if self.path.startswith("generator/codegen/templates/") or self.path == "generator/codegen/bridge.py":
            return "cuda"
        if self.path.startswith("ops_src/") or self.path == "generator/codegen/glue.py":
            return "runtime"
        if self.path.startswith("redfuser_ops/"):
            return "package"
        return "emitter"


M = Mutant
SOUND = "tests/test_engine_soundness.py"
# the value tests of the row ops and attention, without opcheck/torch.compile (slow, and they check no values)
# (one -k expression for all: pytest keeps the last -k it is given)
NOSLOW = ("-k", "not opcheck and not compile")
ROWS = ("tests/test_row_ops.py", *NOSLOW)
ATTN = ("tests/test_fused_attention.py", *NOSLOW)
# the CUDA side's value tests: a template's schedule (its simulation, or its emitted program run on the CPU) against
# the reference; not the tests that read the emitted text, lower it or check the plans
SA_VALUES = "schedule_matches_reference or see_no_key or very_negative or guarding_the_old or low_precision"
PA_VALUES = "through_the_paged_schedule or slices or first_key or clamped or with_le"
QG_VALUES = "acceptance or saturate or exact"
BR_VALUES = "through_the_template_schedule"
RR_VALUES = "cpu_sim"
# the engine's value tests in test_engine.py (forms against the oracle on adversarial rows), not explain/errors
EN_VALUES = tuple(f"tests/test_engine.py::test_{n}" for n in (
    "online_and_merge_forms_match_the_unfused_cascade", "attention_fully_masked_rows_give_zero_and_minus_inf",
    "mla_empty_sequence_gives_zero_and_minus_inf", "logsumexp_and_softmax_of_minus_inf_rows",
    "very_negative_rows_do_not_overflow_the_correction", "all_zero_rows_quantize_to_exact_zero"))

MUTANTS: list[Mutant] = [
    # ------------------------------------------------------------------------------------------------ engine
    M("forms-guard-never-refuses", "generator/symbolic/forms.py",
      "        ir = self.ir\n        dep = ir.reduction(d)\n        point = gp.point\n",
      "        return None\n        ir = self.ir\n        dep = ir.reduction(d)\n        point = gp.point\n",
      "issue 17 (a): the guard-soundness proof accepts every guard, also where a non-empty prefix reaches the "
      "degenerate point and its elements contribute (the guard then drops them)",
      (SOUND,), cheap=True),
    M("algebra-absmax-no-zero-candidate", "generator/symbolic/algebra.py",
      "    out.append(sp.Integer(0))  # e.g. the abs-max of an all-zero row\n", "",
      "issue 17 (b): 0 is not a degenerate candidate, so an abs-max state's correction x/a is not guarded at a = 0 "
      "(an all-zero prefix gives 0/0)",
      (SOUND,), cheap=True),
    # (algebra-no-infinite-candidates, dropping +-inf as guard candidates, became equivalent when the correction
    # of a state that stays at +-inf was made the identity: the mutant below plants that bug instead)
    M("forms-stuck-infinite-identity-dropped", "generator/symbolic/forms.py",
      '               for d in deps):\n            degenerate.append(',
      '               for d in ()):\n            degenerate.append(',
      "the correction out of a state that stays at +-inf is the regular one: inf / inf or exp(inf - inf) is nan "
      "where the plain math is finite (rms_norm on a row whose sum of squares overflows, a max of an overflowed sum)",
      (SOUND,), cheap=True),
    M("forms-max-neutral-not-kept", "generator/symbolic/forms.py",
      '            degenerate.append(sp.Eq(self.syms[f.name]["old"], MONOIDS[f.op].neutral))\n',
      "            pass\n",
      "a max/min that has counted nothing yet is corrected like any other state: a factor that underflowed to 0 "
      "(exp(-1000 - 0)) makes -inf * 0 = nan where the plain result is a number",
      (SOUND,), cheap=True),
    M("forms-degenerate-correction-not-identity", "generator/symbolic/forms.py",
      "        if not degenerate:\n            return regular\n", "        return regular\n",
      "the correction out of a degenerate old state is the regular one, not the identity: exp(-inf - m) * 0 "
      "style nan/overflow after an all-masked prefix",
      (SOUND, *EN_VALUES), ),
    M("forms-nan-state-check-dropped", "generator/symbolic/forms.py",
      "                if at is not None:\n", "                if False:\n",
      "a state whose body can be nan (log of a negative, 0/0) is accepted as an online dependency: its nan "
      "reaches the correction of a sum that counted nothing",
      (SOUND,), cheap=True),
    M("forms-overflowing-correction-accepted", "generator/symbolic/forms.py",
      "                bad = correction_overflows(dd.correction, moves, self.rng) if moves else None\n",
      "                bad = None\n",
      "a multiplicative correction that overflows to inf as the states move (exp(m_old - m_new) for a growing "
      "correction) is accepted: 0 * inf = nan",
      (SOUND,), cheap=True),
    M("forms-where-implication-ignored", "generator/symbolic/forms.py",
      "        if not _implies(r.where, dep.where):\n", "        if False:\n",
      "the guard proof ignores that r counts elements its dependency does not (different where=), so the dependency "
      "can sit at its degenerate point on a prefix that is not empty for r",
      (SOUND,), cheap=True),
    M("algebra-max-distributes-over-any-factor", "generator/symbolic/algebra.py",
      "        if sp.simplify(lhs - rhs) != 0:\n", "        if False:\n",
      "max/min distributes over a factor of any sign: a rescale by a negative factor (a negative temperature) keeps "
      "the old maximum instead of swapping to the minimum",
      (SOUND, *EN_VALUES), ),
    M("forms-mask-value-neutral-for-one-form", "generator/symbolic/forms.py",
      "                ok = all(_neutral_at(f, atom, cand) for f in streamed)\n",
      "                ok = any(_neutral_at(f, atom, cand) for f in streamed)\n",
      "a mask value neutral for one streamed reduction but not for all: masked elements feed the others a term "
      "(e.g. a sum of x at x = -inf)",
      (SOUND, *EN_VALUES), ),
    M("forms-empty-output-unguarded", "generator/symbolic/forms.py",
      "            if math.isnan(v) or divides_by_zero:\n", "            if False:\n",
      "an output that is undefined on an empty row (o / l with l = 0) is emitted without its `empty:` value: rows "
      "that see no key return nan",
      (SOUND, *EN_VALUES), ),
    M("ir-let-indices-dropped", "generator/symbolic/ir.py",
      "                out |= set(self.lets[sym.name].indices)\n", "                pass\n",
      "an expression that reads a let is taken as free of the let's indices: a let that is an element value only "
      "through another let (z = y / temperature in tests/specs/tempered_entropy.yaml) looks row-constant, so the "
      "kernels compute it once per row",
      ("tests/test_stream_row_template.py::test_lets_reading_lets_tempered_entropy",), cheap=True),
    M("oracle-judge-ignores-infinities", "generator/symbolic/oracle.py",
      "        if np.any(inf & (g != r)):\n", "        if False:\n",
      "the engine's self-check takes any value where the plain math is an infinity: a form giving +inf for a "
      "logsumexp of a row of -inf (or nan, or a finite number) passes the check",
      ("tests/test_engine.py::test_the_self_checks_judge_holds_every_defined_value", SOUND, *EN_VALUES), cheap=True),
    M("families-exact-arch-runs-on-later-minors", "generator/families.py",
      "        return cap == (major, minor)\n", "        return cap[0] == major and cap[1] >= minor\n",
      "an arch-specific SASS (sm_90a, sm_100a) is taken to run on later minors of its major: a 10.3 GPU (B300) "
      "loads sm_100a's tcgen05 code, which only 10.0 runs, instead of the sm80 family's PTX",
      ("tests/test_families.py",), cheap=True),
    M("transformers-dsv3-scaling-dropped", "redfuser_ops/integrations/transformers.py",
      "                              self.num_group, self.topk_group, self.routed_scaling_factor)\n",
      "                              self.num_group, self.topk_group, 1.0)\n",
      "the DeepSeek-V3 router hook leaves out routed_scaling_factor (2.5 in the real model): every expert output of "
      "the patched model is 2.5x too small",
      ("tests/test_integrations_transformers.py", "-k", "deepseek"), ),
    M("reference-group-score-best-one", "redfuser_ops/reference.py",
      "        gtop = selection_order(grouped)[..., : min(2, size)]\n",
      "        gtop = selection_order(grouped)[..., : min(1, size)]\n",
      "the float64 reference of moe_route scores a group by its best biased score where DeepSeek-V3 sums its two "
      "best: the reference every op test and the bench judge the grouped router by would agree with a kernel "
      "that has the same bug",
      ("tests/test_moe_route.py", *NOSLOW), ),
    M("reference-mla-causal-off-by-one", "redfuser_ops/reference.py",
      "            s = s.masked_fill(j >= n - (Sq - 1 - t), float(\"-inf\"))\n",
      "            s = s.masked_fill(j > n - (Sq - 1 - t), float(\"-inf\"))\n",
      "the mla_decode reference lets each query token of a causal step see one key past its own position",
      ("tests/test_mla_decode.py", *NOSLOW), ),
    M("tl-print-sigmoid-sign", "generator/codegen/tl_print.py",
      '            return f"(T.float32(1.0) / (T.float32(1.0) + T.exp(-({self.p(e.args[0])}))))"\n',
      '            return f"(T.float32(1.0) / (T.float32(1.0) + T.exp({self.p(e.args[0])})))"\n',
      "the TileLang printer writes sigmoid(x) as 1 / (1 + exp(x)), sigmoid(-x): every CUDA kernel of a sigmoid "
      "router (DeepSeek-V3) scores and selects its experts reversed",
      ("tests/test_resident_row_template.py", "-k", RR_VALUES), ),
    # ------------------------------------------------------------------------------------------------ CPU emitter
    M("stream-attention-tail-mask-le", "generator/codegen/templates/stream_attention.py",
      'masked = f"T.if_then_else(kt * {BN} + j < {limit}, {score}, {mask_value})"',
      'masked = f"T.if_then_else(kt * {BN} + j <= {limit}, {score}, {mask_value})"',
      "issue 17 (f): stream_attention's emitted tail mask lets the first key past the sequence end (or the causal "
      "bound) through",
      ("tests/test_emitted_programs.py", "-k", "fused_attention_programs or sliding_window_attention_programs"), ),
    M("stream-attention-causal-band-off-by-one", "generator/codegen/templates/stream_attention.py",
      'CAUSAL = KeyBand("causal", hi="r + 1 + seqlen_k - seqlen_q")',
      'CAUSAL = KeyBand("causal", hi="r + seqlen_k - seqlen_q")',
      "the bottom-right causal bound excludes the diagonal key (query r cannot see key r + Sk - Sq)",
      ("tests/test_stream_attention_template.py", "-k", SA_VALUES), ),
    M("merge-terms-without-correction", "generator/codegen/bridge.py",
      '        e = seg * f.correction if f.kind == "*" else seg + f.correction\n',
      '        e = seg if f.kind == "*" else seg + f.correction\n',
      "the split-KV / split-K merge adds the segments' states without rescaling them to the merged maximum",
      ("tests/test_stream_attention_template.py", "tests/test_paged_attention.py", "tests/test_quant_gemm_template.py",
       "-k", f"{SA_VALUES} or {PA_VALUES} or {QG_VALUES}"), ),
    M("paged-bridge-le-limit-off-by-one", "generator/codegen/templates/paged_attention_bridge.py",
      "        limit = mask.rhs + 1\n", "        limit = mask.rhs\n",
      "a mask written `j <= limit - 1` is read as `j < limit - 1`: the last key of every sequence is dropped",
      ("tests/test_paged_attention.py", "-k", "with_le"), ),
    M("quant-gemm-saturates-at-fnuz-max", "generator/codegen/templates/quant_gemm.py",
      'QUANT_DTYPES = {"float8_e4m3fn": 448.0}', 'QUANT_DTYPES = {"float8_e4m3fn": 240.0}',
      "the quantised values saturate at 240 (the max of e4m3fnuz, AMD's variant) instead of e4m3fn's 448: the "
      "largest elements of every row are clipped",
      ("tests/test_quant_gemm_template.py", "-k", QG_VALUES), ),
    M("resident-row-sum-keeps-last-value", "generator/codegen/templates/resident_row.py",
      '        return f"({acc} + {val})"', '        return f"{val}"',
      "the resident-row kernel's sum reduction assigns instead of accumulating (acc = v for acc += v): the softmax "
      "denominator and the renormalisation sums hold one lane's value",
      ("tests/test_resident_row_template.py", "-k", RR_VALUES), ),
    M("resident-row-nan-orders-as-inf", "generator/codegen/templates/resident_row.py",
      'T.if_then_else(T.isnan({kf}), T.uint32(4286578688), T.reinterpret({kf}, \\"uint32\\"))',
      'T.if_then_else(T.isnan({kf}), T.uint32(2139095040), T.reinterpret({kf}, \\"uint32\\"))',
      "the CUDA top-k orders a NaN key as +inf (selected first) instead of -inf",
      ("tests/test_resident_row_template.py", "-k", RR_VALUES), ),
    M("paged-attention-v-rows-past-length-kept", "generator/codegen/templates/paged_attention.py",
      'f"        if kt * {BN} + r >= kv_len:\\n"', 'f"        if kt * {BN} + r > kv_len:\\n"',
      "the paged kernel zeroes V rows past the sequence end from one row too late: the first garbage row of the last "
      "page (NaN in a recycled page) meets P = 0 and makes the output NaN (caught by running the emitted program)",
      ("tests/test_emitted_programs.py", "-k", "mla_decode_programs"), ),
    M("stream-row-tail-le", "generator/codegen/templates/stream_row.py",
      '                    term = f"T.if_then_else(i_e < L, {term}, {_neutral(s.op)})"',
      '                    term = f"T.if_then_else(i_e <= L, {term}, {_neutral(s.op)})"',
      "the long-row kernel's tail chunk lets the element one past the row's end into the states (the next row's "
      "first element, or zero fill)",
      ("tests/test_stream_row_template.py", "-k", "sim_matches_reference"), ),
    M("stream-row-topk-ties-to-higher-index", "generator/codegen/templates/stream_row.py",
      '"T.cast(T.uint32(4294967295) - T.cast(i_e, \\"uint32\\"), \\"uint64\\")")',
      '"T.cast(T.cast(i_e, \\"uint32\\"), \\"uint64\\")")',
      "the long-row top-k's 64-bit key holds the element index itself below the order word: of equal keys the "
      "higher index wins (the CPU and the spec keep the lower)",
      ("tests/test_stream_row_topk.py", "-k", "ties"), ),
    M("stream-row-topk-threshold-too-high", "generator/codegen/templates/stream_row.py",
      '                    self.src(f"{thr} = T.if_then_else(i_kk == {q + 1}, {tk(q)}, {thr})")',
      '                    self.src(f"{thr} = T.if_then_else(i_kk == {q + 2}, {tk(q)}, {thr})")',
      "a thread's insertion threshold is its (k-1)-th entry instead of its k-th: an element that would be the "
      "thread's k-th best is refused, and a row whose k-th entry comes from a thread that holds k of them loses it",
      ("tests/test_stream_row_topk.py", "-k", "one_thread"), ),
    M("stream-row-final-reads-first-segment", "generator/codegen/templates/stream_row.py",
      '                self.src(f"WS[{i}, i_row, 0] = {self.t(f\'s{i}\')}")\n',
      '                self.src("T.evaluate(0)")\n',
      "the merge program of split rows with per-element outputs does not keep the row's final states: the final "
      "program writes every element from the first segment's states",
      ("tests/test_stream_row_elementwise.py", "-k", "split_rows"), ),
    M("stream-row-bridge-where-dropped", "generator/codegen/templates/stream_row_bridge.py",
      "            term = sp.Piecewise((term, expand(f.where)), (MONOIDS[f.op].neutral, True))\n",
      "            pass\n",
      "a `where=` reduction is streamed unconditionally: elements the predicate excludes (a -inf logit in an "
      "entropy) feed the state (0 * -inf = nan)",
      ("tests/test_stream_row_template.py", "-k", "where_predicate"), ),
    M("stream-bridge-window-lower-bound", "generator/codegen/templates/stream_attention_bridge.py",
      "        else:\n            lo.append(bound + 1)\n", "        else:\n            lo.append(bound)\n",
      "a strict lower bound on the key (j > i - window) is read as j >= i - window: a sliding window sees one key "
      "too many",
      ("tests/test_cuda_bridges.py", "tests/test_stream_attention_template.py", "-k", f"{BR_VALUES} or {SA_VALUES}"), ),
    M("quant-bridge-accumulator-not-rescaled", "generator/codegen/templates/quant_gemm_bridge.py",
      '    acc_corr = tl(acc.correction) if acc.kind == "*" else "T.float32(1)"\n',
      '    acc_corr = "T.float32(1)"\n',
      "the GEMM accumulator is not rescaled when the running abs-max grows: chunks quantised with an old scale are "
      "summed as if with the new one",
      ("tests/test_quant_gemm_template.py", "-k", QG_VALUES), ),
    M("resident-bridge-group-score-is-max", "generator/codegen/templates/resident_row_bridge.py",
      "            if k == 1:\n", "            if k <= 2:\n",
      "a group is scored by its best expert instead of the sum of its top two (DeepSeek-V3's grouped routing with "
      "a correction bias)",
      ("tests/test_resident_row_template.py", "-k", RR_VALUES), ),
    # ------------------------------------------------------------------------------------------------ rebuilding
    # (in the order the runner builds them: few generated files first, the headers every kernel includes last)
    M("cpp-e4m3-noop", "generator/codegen/cpp.py",
      'ROUNDING = {cast_e4m3: "rf::round_e4m3", ', "ROUNDING = {",
      "issue 17 (c): the e4m3 cast prints as its argument: fp8_quant_gemm's activations are never quantised",
      ("tests/test_dtype_exact.py", "-k", "fp8"), ),
    M("glue-size-checks-skipped-for-values", "generator/codegen/glue.py",
      "            if not checks:\n                continue\n            if t.optional:\n                L.append(f\"  if (A.has_{t.name}) {{\")\n                L += [\"    \" + x for x in checks]",
      "            if not checks or t.values:\n                continue\n            if t.optional:\n                L.append(f\"  if (A.has_{t.name}) {{\")\n                L += [\"    \" + x for x in checks]",
      "issue 17 (e): the run-time size checks are skipped for tensors with a `values:` domain (block_table, "
      "cache_seqlens, labels): a short one is read past its end",
      ("tests/test_wrong_sizes.py",), ),
    M("glue-value-domains-unchecked-on-cpu", "generator/codegen/glue.py",
      '        *([f"  check_value_domains(c.A, {\', \'.join(doms)});"] if doms else []),\n',
      "",
      "the CPU entry does not check index tensors against their `values:` domain: a block_table entry past the "
      "cache reads out of bounds",
      ("tests/test_hardening.py",), ),
    M("runtime-check-size-accepts-larger", "ops_src/runtime.cpp",
      "  if (got == expected) return;\n", "  if (got >= expected) return;\n",
      "a size check that accepts a larger dimension than the spec's (a tensor of another batch or head count is "
      "silently read in part)",
      ("tests/test_wrong_sizes.py",), ),
    M("cpu-math-nan-keys-first", "ops_src/cpu_math.h",
      "  if (na != nb) return nb;  // a non-NaN key beats a NaN key\n", "  if (na != nb) return na;\n",
      "issue 17 (d): NaN keys rank before every other key in the CPU selections (top-k routing picks NaN experts)",
      ("tests/test_dtype_exact.py", "-k", "nan_rows"), ),
    M("runtime-bf16-store-truncates", "ops_src/runtime.h",
      "  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;  // ties to even; overflow -> inf\n",
      "  const uint32_t rounded = u >> 16;\n",
      "bf16 stores truncate instead of rounding to nearest even",
      ("tests/test_dtype_exact.py", "-k", "half_output"), ),
    M("cpu-math-sigmoid-sign", "ops_src/cpu_math.h",
      "inline float sigmoid(float x) { return 1.0f / (1.0f + redfuser::cpu::exp(-x)); }",
      "inline float sigmoid(float x) { return 1.0f / (1.0f + redfuser::cpu::exp(x)); }",
      "the CPU sigmoid has the sign of its exponent flipped (sigmoid(-x)): sigmoid routing picks the smallest logits",
      ("tests/test_moe_route.py", *NOSLOW), ),
    M("cpu-math-exp-ln2-split-sign", "ops_src/cpu_math.h",
      "  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 split: hi + lo parts\n",
      "  const float r = (x - n * 0.693359375f) - n * 2.12194440e-4f;\n",
      "the low part of ln 2 in exp's range reduction has the wrong sign (relative error ~4e-4 per unit of n)",
      (*ROWS, *ATTN), ),
    M("cpu-math-e4m3-subnormal-scale", "ops_src/cpu_math.h",
      "static_cast<float>(static_cast<int32_t>(em)) * 0.001953125f);  // em * 2^-9\n",
      "static_cast<float>(static_cast<int32_t>(em)) * 0.0009765625f);\n",
      "e4m3 subnormals decode at half their value (wrong exponent of the subnormal range)",
      ("tests/test_dtype_exact.py", "-k", "fp8"), ),
    M("cpu-chunk-tail-dropped", "generator/codegen/cpu.py",
      'self.block(f"for (int64_t c0 = 0; c0 < ex_{self.ir.over}; c0 += {self.chunk})")',
      'self.block(f"for (int64_t c0 = 0; c0 + {self.chunk} <= ex_{self.ir.over}; c0 += {self.chunk})")',
      "the chunk loop of the row kernels stops at the last full chunk: a row whose length is not a multiple of the "
      "chunk loses its tail",
      ROWS, ),
    M("cpu-lane-remainder-dropped", "generator/codegen/cpu.py",
      'self.block("for (int64_t jj = jl; jj < cn; ++jj)")', 'self.block("for (int64_t jj = cn; jj < cn; ++jj)")',
      "the vectorised reduction forgets the scalar remainder after its LANES-wide loop",
      ROWS, ),
    M("cpu-point-sum-misses-last-element", "generator/codegen/cpu.py",
      'self.emit(f"if (ix_{over} >= 0 && ix_{over} < ex_{over}) st_{name} = st_{name} + {self.pr.flt(value)};")',
      'self.emit(f"if (ix_{over} >= 0 && ix_{over} + 1 < ex_{over}) st_{name} = st_{name} + {self.pr.flt(value)};")',
      "a one-hot sum read at its index (a cross-entropy's target logit) takes the last element of the row for out of "
      "bounds: a token whose target is the last class loses its logit",
      ROWS, ),
    M("cpu-online-rescale-dropped", "generator/codegen/cpu.py",
      '                self.emit(f"st_{f.name} = st_{f.name} {op} {cname};")',
      '                self.emit(f"(void){cname};")',
      "the online correction of a scalar state is computed but not applied (a softmax denominator not rescaled "
      "when the running max moves between chunks)",
      ROWS, ),
    M("cpu-state-init-zero", "generator/codegen/cpu.py",
      '            self.emit(f"float st_{f.name} = {neutral};")', '            self.emit(f"float st_{f.name} = 0.0f;")',
      "a row state starts at 0 instead of its neutral element: a running max of an all-negative row stays 0 "
      "(and exp(x - 0) underflows on rows of very negative logits)",
      ("tests/test_value_extremes.py", *ROWS), ),
    M("tiles-score-gemm-drops-last-row-of-run", "generator/codegen/cpu_tiles.py",
      'k.emit(f"rf::gemm_tile_panels(r1 - r0, {ch}, ex_{c}, b{buf} + r0 * ex_{c}',
      'k.emit(f"rf::gemm_tile_panels(r1 - r0 - 1, {ch}, ex_{c}, b{buf} + r0 * ex_{c}',
      "the score GEMM of a run of rows that share a packed tile computes one row too few (an exclusive end read as "
      "inclusive): the last row of each run keeps stale scores",
      (*ATTN, "tests/test_mla_decode.py"), ),
    M("tiles-nt-pack-stride-is-chunk-length", "generator/codegen/cpu_tiles.py",
      'k.emit(f"float* dst = {g.pack} + (ix_{n} - n0) * {ch};")',
      'k.emit(f"float* dst = {g.pack} + (ix_{n} - n0) * cn;")',
      "a weight row's stretch is packed at the stride of the chunk's length, not the buffer's: the NT GEMM tile "
      "reads rows of the last, shorter chunk of a row at the wrong offsets (K not a multiple of the chunk)",
      ("tests/test_fp8_quant_gemm.py", *NOSLOW), ),
    M("cpu-math-gemm-nt-lane-dropped", "ops_src/cpu_math.h",
      "      const vf4 r = lane_sums4(c[i][0], c[i][1], c[i][2], c[i][3]);\n",
      "      const vf4 r = lane_sums4(c[i][0], c[i][1], c[i][2], c[i][2]);\n",
      "the NT tile's four-column reduction reads the third column's accumulators for the fourth: every fourth "
      "output column of the fp8 GEMM is a copy of the one before it (every x86 level)",
      ("tests/test_fp8_quant_gemm.py", *NOSLOW), ),
    M("cpu-math-gemm-one-running-sum", "ops_src/cpu_math.h",
      "constexpr int64_t GEMM_KC = 128;\n", "constexpr int64_t GEMM_KC = int64_t(1) << 40;\n",
      "the float tile GEMM sums all of k in one running sum per output: fp32 attention's scores over D 256 and its "
      "weighted sum over a chunk's 256 keys get up to 5x the error of torch's attention (values right to ~1e-4)",
      ("tests/test_fused_attention.py", "-k", "large_scores"), ),
    M("cpu-math-gemm-later-k-blocks-overwrite", "ops_src/cpu_math.h",
      "                                                  accumulate || k0 > 0);\n",
      "                                                  accumulate);\n",
      "each block of 128 values of k overwrites C instead of adding to it: a product over more than 128 of k "
      "keeps its last block's part only (attention's scores at D 256, the weighted sum of a long chunk)",
      ("tests/test_cpu_math_exhaustive.py", "-k", "tile_gemms"), ),
    M("tiles-fold-pack-panels-overlap", "generator/codegen/cpu_tiles.py",
      'k.emit(f"bad |= rf::pack_row_panels(&{row}, nt, dst, {ch} * 32) ? 1u : 0u;")',
      'k.emit(f"bad |= rf::pack_row_panels(&{row}, nt, dst, ({ch} - 1) * 32) ? 1u : 0u;")',
      "the fold's packed tile (V of attention) puts its 32-column panels one element row short of apart: each "
      "panel's last row overlaps the next panel's first, so p.v reads wrong values for d past 32",
      ATTN, ),
    M("cpu-math-row-panels-tail-slot", "ops_src/cpu_math.h",
      "    dst[x0 / 32 * pstride + x0 % 32] = v;\n", "    dst[x0 % 32] = v;\n",
      "a packed element row's columns past its last whole panel go to the first panel: V of a head dimension "
      "that is not a multiple of 32 (80, say) overwrites columns 0-15 of p.v's tile with columns 64-79",
      ("tests/test_cpu_math_exhaustive.py", "-k", "tile_gemms"), ),
    M("cpu-math-row-panels-flag-dropped", "ops_src/cpu_math.h",
      "      dp[u] = v;\n      bad |= is_finite_bits(v) ? 0u : 1u;\n", "      dp[u] = v;\n",
      "an inf or NaN in a whole panel of a packed element row goes unreported: the fold runs the tile GEMM, whose "
      "weight-0 products of masked elements give NaN (0 x inf), where it should fold counted elements only",
      ("tests/test_cpu_math_exhaustive.py", "-k", "tile_gemms"), ),
    M("cpu-math-panels-pack-stride", "ops_src/cpu_math.h",
      "    pack_transposed(R - r0 < 32 ? R - r0 : 32, C, rows + r0, dst + r0 / 32 * pstride, 32);\n",
      "    pack_transposed(R - r0 < 32 ? R - r0 : 32, C, rows + r0, dst + r0 / 32 * (pstride - 32), 32);\n",
      "the panel pack writes each 32-element panel one row of the tile short of its place: the score tile's "
      "panels overlap (q.k wrong past the first 32 keys of a chunk), and the fp8 weight tile's likewise",
      ("tests/test_cpu_math_exhaustive.py", "-k", "tile_gemms"), ),
    M("tiles-short-run-nt-gemm-drops-last-row", "generator/codegen/cpu_tiles.py",
      'k.emit(f"rf::gemm_tile_nt(r1 - r0, {ch}, ex_{c}, b{buf} + r0 * ex_{c}',
      'k.emit(f"rf::gemm_tile_nt(r1 - r0 - 1, {ch}, ex_{c}, b{buf} + r0 * ex_{c}',
      "the score GEMM of a short run of rows (decode heads, the NT tile on the operand's rows) computes one row "
      "too few: the last head of each run keeps stale scores",
      ("tests/test_mla_decode.py", "tests/test_fused_attention.py", *NOSLOW), ),
    M("tiles-hidden-row-keeps-stale-weights", "generator/codegen/cpu_tiles.py",
      'k.emit(f"std::fill({g.wbuf}, {g.wbuf} + {ch}, 0.0f);")', 'k.emit(f"(void){g.wbuf};")',
      "a row that the mask hides from a chunk skips its update but keeps the previous chunk's fold weights: the "
      "run's GEMM tile adds that chunk's values again (causal rows of a tile on the diagonal)",
      ATTN, ),
    M("cpu-math-transpose-mask", "ops_src/cpu_math.h",
      "  const vi8 lo4{0, 1, 2, 3, 8, 9, 10, 11}, hi4{4, 5, 6, 7, 12, 13, 14, 15};\n",
      "  const vi8 lo4{0, 1, 2, 3, 8, 9, 10, 11}, hi4{4, 5, 6, 7, 12, 13, 14, 14};\n",
      "the transposing pack of the score GEMM's operand takes a wrong lane in its last shuffle: one key channel of "
      "every 8 x 8 block is the wrong key's",
      ("tests/test_cpu_math_exhaustive.py", "-k", "x86"), ),
    # the bf16 pair tiles run only on a CPU with AVX512_BF16: elsewhere these four survive (the float tiles run)
    M("cpu-math-bf16-pairs-odd-tail-dropped", "ops_src/cpu_math.h",
      "      _mm512_mask_storeu_epi16(d + k, __mmask32((1ull << r) - 1u), v);\n",
      "      _mm512_mask_storeu_epi16(d + k, __mmask32((1ull << (r / 2 * 2)) - 1u), v);\n",
      "the bf16 pairs of a fold's weights leave the last pair unwritten where a chunk has an odd number of elements: "
      "the last key of a tail is weighted by a stale value (AVX512_BF16 CPUs)",
      ATTN, ),
    M("cpu-math-bf16-pairs-halves-swapped", "ops_src/cpu_math.h",
      "      _mm512_storeu_si512(d + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + k + 16), _mm512_loadu_ps(s + k)));\n",
      "      _mm512_storeu_si512(d + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + k), _mm512_loadu_ps(s + k + 16)));\n",
      "the vector rounding to bf16 pairs puts each 32 floats' second 16 first: a fold's weights and a query row's "
      "pairs are multiplied with the wrong keys' values and channels (AVX512_BF16 CPUs)",
      ATTN, ),
    M("tiles-raw-query-pairs-half-row", "generator/codegen/cpu_tiles.py",
      'f"ex_{cn} * sizeof({k.types[name]}));")',
      'f"ex_{cn} / 2 * sizeof({k.types[name]}));")',
      "a long run's bf16 query rows are taken as pair words for only their first half of channels: the rest of "
      "each row's pairs are stale (AVX512_BF16 CPUs)",
      ATTN, ),
    M("tiles-pair-run-tile-threshold", "generator/codegen/cpu_tiles.py",
      'k.block(f"if ({_pair_run(g)})")',
      'k.block(f"if ({g.pack}_bf && r1 - r0 > {NT_RUN})")',
      "runs of 8 to 32 rows on bf16 pairs (decode heads of a GQA group, MLA's 16 heads) take the float tile, whose "
      "row buffer their pairs' fill skipped: their scores come from stale query rows (AVX512_BF16 CPUs)",
      ("tests/test_mla_decode.py", "tests/test_fused_attention.py", *NOSLOW), ),
    M("tiles-pair-scores-first-run-rows", "generator/codegen/cpu_tiles.py",
      'f"rf::gemm_tile_bf16(r1 - r0, {ch}, ex_{c} / 2, {g.pack}a + r0 * (ex_{c} / 2), ex_{c} / 2, "',
      'f"rf::gemm_tile_bf16(r1 - r0, {ch}, ex_{c} / 2, {g.pack}a, ex_{c} / 2, "',
      "the pair tile of the scores reads the row factor's pairs from the block's first row on for every run: a "
      "block with several runs (GQA groups, several heads) scores the later runs with the first run's queries "
      "(AVX512_BF16 CPUs)",
      ATTN, ),
    M("cpu-math-bf16-pairs-inf-unreported", "ops_src/cpu_math.h",
      "      bad |= ((lo & 0x7F80u) == 0x7F80u) | ((hi & 0x7F80u) == 0x7F80u);\n",
      "      bad |= ((lo & 0x7F80u) == 0x7F80u);\n",
      "the interleaving pack of a fold's bf16 tile misses an inf/NaN in the second element of a pair: the tile is "
      "multiplied with weight 0 for the rows that do not count that key, and 0 x inf puts NaN in their outputs "
      "(AVX512_BF16 CPUs)",
      ATTN, ),
    M("tiles-nt-pairs-source-stride", "generator/codegen/cpu_tiles.py",
      'f"  rf::pairs_from_floats(nt, cn, {g.pack}, {ch}, {g.pack}w_v.data(), {half});",',
      'f"  rf::pairs_from_floats(nt, cn, {g.pack}, {half}, {g.pack}w_v.data(), {half});",',
      "the NT fold's pair tile reads the decoded weight rows at half their stride: the fp8 GEMM of a long run of "
      "rows multiplies the wrong weights (AVX512_BF16 CPUs)",
      ("tests/test_fp8_quant_gemm.py", *NOSLOW), ),
    M("cpu-tile-memo-flags-ignored", "ops_src/cpu_math.h",
      "    hit = t[ntag_] != 0.0 && std::equal(tag, tag + ntag_, t) && std::equal(flags, flags + nflags_, f);\n",
      "    hit = t[ntag_] != 0.0 && std::equal(tag, tag + ntag_, t);\n",
      "the packed-tile memo matches a tile by its key and chunk but not by which elements were read: a block whose "
      "rows see more of a chunk than the block that packed it (causal rows, Sq < Sk) takes zeros for those keys",
      ATTN, ),
    M("tiles-memo-hit-forgets-inf", "generator/codegen/cpu_tiles.py",
      'k.emit(f"  bad = {g.pack}_memo.word(slot);")', 'k.emit("  bad = 0;")',
      "a fold tile taken from the memo forgets that its pack found an inf/NaN: the GEMM tile multiplies it by the "
      "weight 0 of rows that do not count that key (0 x inf: NaN in their outputs)",
      ATTN, ),
    M("cpu-lanes-total-upper-half-dropped", "ops_src/cpu_math.h",
      "    return lane_sum(v);\n",
      "    vf8 lo;\n    std::memcpy(&lo, &v, sizeof(lo));\n    return lane_sum(lo);\n",
      "the total of a vectorised fold's 16 lanes adds only the first 8: half of every chunk's partial sums are lost",
      ROWS, ),
    M("cpu-shared-weights-wrong-element", "generator/codegen/cpu.py",
      "out[f.name] = self.wsums[reuse[f.name]]", 'out[f.name] = f"{reuse[f.name]}[0]"',
      "the softmax denominator, taken from the weights of the GEMM fold, takes the chunk's first weight for the "
      "chunk's sum",
      ATTN, ),
    M("cpu-exp-sum-under-not-zeroed", "ops_src/cpu_math.h",
      "    const __m512 y = _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), _mm512_scalef_ps(p, t));\n",
      "    const __m512 y = _mm512_scalef_ps(p, t);\n",
      "the AVX-512 exp of a chunk keeps the value it computed at x = -87 for the lanes below ln(FLT_MIN): exp(-inf) "
      "of a masked element is 1.6e-38 instead of 0",
      ("tests/test_cpu_math_exhaustive.py", "-k", "chunk_helpers"), ),
    M("cpu-exp-sum-tail-skipped", "ops_src/cpu_math.h",
      "    acc = _mm512_add_ps(acc, y);\n  }\n  float tail = 0.0f;\n  for (; j < n; ++j) {\n",
      "    acc = _mm512_add_ps(acc, y);\n  }\n  float tail = 0.0f;\n  for (j = n; j < n; ++j) {\n",
      "the AVX-512 exp of a chunk stops at its last whole 16-element step: the chunk's last n % 16 weights stay "
      "exponents and are not in the sum",
      ("tests/test_cpu_math_exhaustive.py", "-k", "chunk_helpers"), ),
    M("cpu-max-of-nan-dropped", "ops_src/cpu_math.h",
      "  return nan ? std::numeric_limits<float>::quiet_NaN() : r;\n", "  return r;\n",
      "the AVX-512 max of a chunk forgets the NaN it saw (vmaxps drops a NaN in its first operand): a row with a NaN "
      "score gets a finite running max",
      ("tests/test_cpu_math_exhaustive.py", "-k", "chunk_helpers"), ),
    M("cpu-tc-store-last-column-dropped", "ops_src/cpu_math.h",
      "      const int64_t ne = nv - g < 8 ? nv - g : 8;\n",
      "      const int64_t ne = nv - g < 8 ? nv - g - 1 : 8;\n",
      "the transposed store of an 8-row register block (gemm_tile_panels_tc) drops the last column of a partial "
      "group: an fp8 GEMM over more than 32 tokens, not a multiple of 8 per panel, leaves a token's sums out",
      ("tests/test_cpu_math_exhaustive.py", "-k", "tile_gemms"), ),
    M("cpu-tc-narrow-block-past-16", "ops_src/cpu_math.h",
      "  if (N <= 16)\n    gemm_rows<vf16, 1, 16, true>",
      "  if (N <= 17)\n    gemm_rows<vf16, 1, 16, true>",
      "the AVX-512 transposed tile takes its 16-column block for 17 columns too: the 17th column (a run's 17th "
      "row of an fp8 GEMM) gets the sums of lanes the block never computed",
      ("tests/test_cpu_math_exhaustive.py", "-k", "tile_gemms"), ),
    M("e4m3-to-floats-nan-bytes-finite", "ops_src/cpu_math.h",
      "  if (m != 0) e4m3_nan_bytes(src, k, dst);  // the NaN bytes' floats (fp16 widening made them finite)\n",
      "  if (false) e4m3_nan_bytes(src, k, dst);  // the NaN bytes' floats (fp16 widening made them finite)\n",
      "the AVX-512 decode of a weight tile leaves NaN bytes at the fp16 path's finite 480 (still flagging the tile): "
      "the float fallback then folds a NaN weight as 480",
      ("tests/test_cpu_math_exhaustive.py", "-k", "tile_gemms"), ),
    M("tiles-tc-weight-rows-at-chunk-length", "generator/codegen/cpu_tiles.py",
      'k.emit(f"for (int64_t q = r0; q < r1; ++q) {g.wbuf}_rows[q - r0] = b{g.wbuf} + q * {ch};")',
      'k.emit(f"for (int64_t q = r0; q < r1; ++q) {g.wbuf}_rows[q - r0] = b{g.wbuf} + q * cn;")',
      "a long run's weights are packed for the transposed tile at the stride of the chunk's length, not the "
      "buffer's: the fp8 GEMM over more than 32 tokens reads the wrong quantised activations in the last, shorter "
      "chunk of K",
      ("tests/test_fp8_quant_gemm.py", *NOSLOW), ),
    M("cpu-kept-terms-finite-check-dropped", "generator/codegen/cpu.py",
      'self.emit("tc_ok = tc_ok && rf::is_finite_bits(tcr[tc]);")', 'self.emit("(void)tcr[tc];")',
      "a per-element output is served from the kept terms even where a chunk's ratio is not finite (a leading "
      "chunk of -inf, m = -100: 0 x inf)",
      ("tests/test_per_element_outputs.py", "-k", "softmax"), ),
    M("cpu-kept-terms-row-in-output-misplaced", "generator/codegen/cpu.py",
      'tc_out ? reinterpret_cast<float*>(&o_{o.name}[{row}])', 'tc_out ? reinterpret_cast<float*>(&o_{o.name}[0])',
      "a float32 softmax keeps every row's terms in the output's first row instead of its own: each row is scaled "
      "from the right terms, but the first row ends as the last row's unscaled terms",
      ("tests/test_per_element_outputs.py", "-k", "softmax"), ),
    M("e4m3-row-dots-nan-bytes-missed", "ops_src/cpu_math.h",
      "      m |= _mm256_cmpeq_epi8_mask(_mm256_and_si256(b, m7f), m7f);\n",
      "      (void)m7f;\n",
      "the AVX-512 decode-and-dot rows of a one-token fp8 GEMM no longer report NaN bytes: through fp16 a NaN weight "
      "reads as 480 and its output column comes out finite",
      ("tests/test_fp8_quant_gemm.py", "-k", "nan_weight"), ),
    M("cpu-exp-float-scale-overflows", "ops_src/cpu_math.h",
      "  float y = bits_float(float_bits(p) + (ni << 23));\n",
      "  float y = p * bits_float((ni + 127) << 23);\n",
      "exp scales by a float 2^n, which is +inf at n = 128: exp(x) for x in (88.38, 88.72] comes out inf where it is "
      "a finite float",
      ("tests/test_cpu_math_exhaustive.py", "-k", "exp"), ),
    M("cpu-exp-top-select-excludes-top", "ops_src/cpu_math.h",
      "  return x <= hi ? y : x + std::numeric_limits<float>::infinity();  // past the top: +inf; NaN: NaN\n",
      "  return x < hi ? y : x + std::numeric_limits<float>::infinity();\n",
      "exp's last select takes the largest float with a finite exp (88.72) for one past it: exp(88.72) comes out +inf",
      ("tests/test_cpu_math_exhaustive.py", "-k", "exp"), ),
    M("cpu-exp-integer-n-off-by-one", "ops_src/cpu_math.h",
      "  const uint32_t ni = float_bits(n + 12582912.0f) - 0x4B400000u;  // n as an integer, through 1.5 * 2^23\n",
      "  const uint32_t ni = float_bits(n + 12582912.0f) - 0x4B3FFFFFu;\n",
      "exp reads n back from the bits of n + 1.5 * 2^23 with a bias one short: every result is twice the exp",
      ("tests/test_cpu_math_exhaustive.py", "-k", "exp"), ),
    M("cpu-math-first-rows-stops-after-one-row", "ops_src/cpu_math.h",
      "      missing = static_cast<int8_t>(missing | v);\n",
      "      missing = static_cast<int8_t>(missing & v);\n",
      "first_rows stops after the run's first row: the elements that row does not see (a causal chunk on the "
      "diagonal) are packed as the zero row for every row of the run",
      ("tests/test_fused_attention.py", *NOSLOW), ),
    M("tiles-row-let-kept-across-heads", "generator/codegen/cpu_tiles.py",
      '        moved = "".join(f" || ix_{n} != rix_{n}[rb - 1]" for n in plan.order if n in let.indices)\n',
      '        moved = ""\n',
      "a block's row lets are computed for its first row only: where a block spans several heads, the later ones "
      "read the first head's GQA group of K and V",
      ATTN, ),
    M("tiles-row-count-carry-skips-zero", "generator/codegen/cpu_tiles.py",
      '            carry += f"if (++cx_{n} == ex_{n}) {{ cx_{n} = 0; "\n',
      '            carry += f"if (++cx_{n} == ex_{n}) {{ cx_{n} = 1; "\n',
      "counting the rows of a block up, an index that wraps restarts at 1: the block's rows after a head's last "
      "query row skip the next head's first one and run one past the end",
      ATTN, ),
    M("tiles-run-range-is-rows-intersection", "generator/codegen/cpu_tiles.py",
      '               "vis_hi = std::max(vis_hi, rvis_hi[q]); }")\n',
      '               "vis_hi = std::min(vis_hi, rvis_hi[q]); }")\n',
      "a run walks the chunks up to the smallest of its rows' upper ends, not the largest: under a causal mask the "
      "later query rows of a run lose the keys past the first row's diagonal",
      ATTN, ),
    M("tiles-mask-lower-bound-taken-as-upper", "generator/codegen/cpu_tiles.py",
      "        else:\n            los.append(f\"{bound} + 1\")\n",
      "        else:\n            his.append(f\"{bound} + 1\")\n",
      "a mask conjunct j > x bounds a row's range from above instead of below: a sliding window's rows walk only "
      "the chunk of the window's first key",
      ("tests/test_sliding_window_attention.py", *NOSLOW), ),
    M("tiles-whole-chunk-ignores-range-end", "generator/codegen/cpu_tiles.py",
      '                k.block("if (c0 >= rvis_lo[rb] && c0 + cn <= rvis_hi[rb])")\n',
      '                k.block("if (c0 >= rvis_lo[rb])")\n',
      "a chunk counts as all visible once it starts inside the row's range: under a causal mask the chunk on the "
      "diagonal shows every row the keys past it",
      ATTN, ),
    M("cpu-late-lets-ok-without-mask-inverted", "generator/codegen/cpu.py",
      '        self.emit("const bool ok = true;" if ir.mask in (sp.true, True) else "const bool ok = el_ok[jj];")\n',
      '        self.emit("const bool ok = true;" if ir.mask not in (sp.true, True) else "const bool ok = el_ok[jj];")\n',
      "the scores after the contraction take every element as visible where there is a mask (and read the flags "
      "where there is none): causal attention's masked scores are computed and counted",
      ATTN, ),
    M("cpu-counted-by-value-inverted", "generator/codegen/cpu.py",
      '        return " && ".join(self.off_mask_values()) or "true"\n',
      '        return " && ".join(c[1:] for c in self.off_mask_values()) or "true"\n',
      "the fold's weights count the elements at their mask value instead of the others: every weight of a row "
      "is 0 (or exp(-inf - m))",
      ATTN, ),
    M("e4m3-row-dots-huge-x-scaled", "ops_src/cpu_math.h",
      "      huge = huge || std::fabs(x[k0 + k]) > 6.6e35f;\n",
      "      (void)huge;\n",
      "the decode-and-dot rows take x times 256 even past 2^119: a finite sum of huge activations and small weights "
      "comes out inf",
      ("tests/test_cpu_math_exhaustive.py", "-k", "x86"), ),
    M("cpu-math-lane-sums-avx2-mask", "ops_src/cpu_math.h",
      "  const vi8 lo{0, 1, 8, 9, 4, 5, 12, 13}, hi{2, 3, 10, 11, 6, 7, 14, 15};\n",
      "  const vi8 lo{0, 1, 8, 9, 4, 5, 12, 13}, hi{2, 3, 10, 11, 6, 7, 14, 14};\n",
      "a wrong lane in the AVX2 level's four-way lane reduction: only a CPU of that level runs it in the ops, so the "
      "ops' tests on an AVX-512 machine pass; the per-level tile GEMM test catches it on any machine with AVX2",
      ("tests/test_cpu_math_exhaustive.py", "-k", "x86"), ),
    M("cpu-sel-candidates-ties-to-last", "ops_src/cpu_math.h",
      "  const auto code = [](int64_t j) { return 255 - j; };  // a position's code, its own inverse\n",
      "  const auto code = [](int64_t j) { return j; };  // a position's code, its own inverse\n",
      "a chunk's candidates for a top-k take, among equal keys, the last element instead of the first: with more "
      "equal keys than places left, the selection keeps a higher expert id than the lower-id rule",
      ("tests/test_cpu_math_exhaustive.py", "-k", "selection"), ),
    M("cpu-sel-candidates-scan-drops-tail", "ops_src/cpu_math.h",
      "  const int nr = n >= N ? N : static_cast<int>((n + 15) & ~int64_t{15});\n",
      "  const int nr = n >= N ? N : static_cast<int>(n & ~int64_t{15});\n",
      "a chunk's candidate scans stop at the used elements rounded down to 16, not up: the last elements of a short "
      "row (a router of fewer experts than the chunk, a row's last chunk) are never offered to its top-k",
      ("tests/test_cpu_math_exhaustive.py", "-k", "selection"), ),
    M("cpu-sel-candidates-first-bound-too-low", "ops_src/cpu_math.h",
      "  int64_t last = int64_t(1) << 39;  // above every key: w[j] < 2^31\n",
      "  int64_t last = int64_t(1) << 31;  // above every key: w[j] < 2^31\n",
      "the candidate scans start below the largest 64-bit keys (the int key not scaled by the position's 256): the "
      "keys of large positive scores wrap to the top of the unsigned gaps and are never found, so a top-k takes "
      "smaller scores",
      ("tests/test_cpu_math_exhaustive.py", "-k", "selection"), ),
    M("cpu-sel-okey-signed-zero", "ops_src/cpu_math.h",
      "  const int32_t k = fkey_bits(a == 0u ? 0u : b);\n",
      "  const int32_t k = fkey_bits(b);\n",
      "the candidates' int keys order -0.0 below +0.0 (they compare equal as floats): a -0.0 key of a lower index "
      "loses its place to a +0.0 one",
      ("tests/test_cpu_math_exhaustive.py", "-k", "selection"), ),
    M("tiles-sel-offers-bar-from-first-entry", "generator/codegen/cpu.py",
      '"bar_{f.name}[ix_{pinned[0]}] = oo[K_{f.name} - 1] ? rf::sel_okey(kk[K_{f.name} - 1]) : "',
      '"bar_{f.name}[ix_{pinned[0]}] = oo[K_{f.name} - 1] ? rf::sel_okey(kk[0]) : "',
      "a per-group selection's bar follows its best entry instead of its last: elements that would displace the "
      "second of a group's two best keys (DeepSeek-V3's group score) are never offered",
      ("tests/test_moe_route.py", *NOSLOW), ),
    M("cpu-all-members-test-inverted", "generator/codegen/cpu.py",
      'return f"(all_{sel} || {member})" if sel in self.skipped_sels() else member',
      'return f"(!all_{sel} || {member})" if sel in self.skipped_sels() else member',
      "the short-cut of a membership table that is all ones is inverted: with groups (n_group > topk_group) every "
      "expert counts as in a kept group, so the top-k ignores the group limit",
      ("tests/test_moe_route.py", *NOSLOW), ),
    M("tiles-run-shares-flags-without-mask", "generator/codegen/cpu_tiles.py",
      "    exprs = [sp.sympify(ir.mask)] + [x.expr for x in written]\n",
      "    exprs = [x.expr for x in written]\n",
      "the rows of a run share the first row's mask flags without the mask being checked for row indices: the "
      "query rows of one head in causal attention all see the first row's keys",
      (*ATTN[:1], "-k", "causal and not opcheck and not compile"), ),
    M("cpu-kept-exp-sum-term-not-exponent", "generator/codegen/cpu.py",
      'self.emit(f"tcrow[(tc_n ? c0 : 0) + jj] = {self.pr.flt(f.term.args[0])};  // the exponent, exp in place below")',
      'self.emit(f"tcrow[(tc_n ? c0 : 0) + jj] = {self.pr.flt(f.term)};  // the exponent, exp in place below")',
      "the kept terms' buffer gets the term exp(y - m) instead of its exponent before rf::exp_sum: every softmax "
      "probability comes out of exp applied twice",
      ("tests/test_per_element_outputs.py",), ),
    M("cpu-sel-mark-positions", "ops_src/cpu_math.h",
      "    if (ok[r] && idx[r] >= 0 && idx[r] < n) mem[idx[r]] = 1;\n",
      "    if (ok[r] && idx[r] >= 0 && idx[r] < n) mem[r] = 1;\n",
      "the membership table of the kept groups marks entry positions instead of group ids: grouped routing picks "
      "experts of the first groups whatever their scores",
      ("tests/test_moe_route.py", *NOSLOW), ),
    M("tiles-cols-task-count", "generator/codegen/cpu_tiles.py",
      "redfuser::parallel_rows(nblk * ncol, 1,",
      "redfuser::parallel_rows(nblk, 1,",
      "a block kernel that shares a row's columns out across tasks launches one task per block: the columns of "
      "every part but the first are never written (one token of a quantised GEMM on two threads)",
      ("tests/test_fp8_quant_gemm.py", "-k", "threads"), ),
    M("tiles-cols-output-range", "generator/codegen/cpu.py",
      '            lo, hi = self.bounds(n)\n            self.block(f"for (int64_t ix_{n} = {lo}; ix_{n} < {hi}; ++ix_{n})")',
      '            lo, hi = "0", f"ex_{n}"\n            self.block(f"for (int64_t ix_{n} = {lo}; ix_{n} < {hi}; ++ix_{n})")',
      "each task of a column-split row stores every column of the output, the others' from states it never "
      "folded: columns race to values without the weights",
      ("tests/test_fp8_quant_gemm.py", "tests/test_mla_decode.py", "-k", "threads"), ),
    M("expr-is-none-reads-as-is-not-none", "generator/symbolic/expr.py",
      "            return present if isinstance(op, ast.IsNot) else not present\n", "            return present\n",
      "a spec's `x is None` means `x is not None`: an op written with `bias[e] if bias is None ...` the other way "
      "round (no shipped spec writes `is None`) reads the bias where it is absent and drops it where given",
      ("tests/test_spec_expressions.py",), cheap=True),
    M("expr-or-parsed-as-and", "generator/symbolic/expr.py",
      "        return sp.And(*out) if is_and else sp.Or(*out)\n", "        return sp.And(*out)\n",
      "`a or b` of two conditions on values becomes `a and b`: a mask or where= written with `or` hides the "
      "elements that meet only one side (fp8_quant_gemm's check `NS == N or NS == 1` refuses every call)",
      ("tests/test_spec_expressions.py",), cheap=True),
    M("expr-where-branches-swapped", "generator/symbolic/expr.py",
      "            return sp.Piecewise((args[1], args[0]), (args[2], True))\n",
      "            return sp.Piecewise((args[2], args[0]), (args[1], True))\n",
      "where(c, a, b) gives b where c holds: the cross-entropy's target logit sum(where(e == target, x, 0)) "
      "becomes the sum of every other logit",
      ("tests/test_spec_expressions.py",), cheap=True),
    M("spec-fixed-size-zero-accepted", "generator/spec.py",
      "            if dim < 1:\n", "            if dim < 0:\n",
      "a spec's fixed dimension of 0 is taken: every call of the op must then pass an empty tensor there, and the "
      "glue and kernels are built around an axis that cannot hold an element",
      ("tests/test_spec_validation.py",), cheap=True),
    M("spec-required-after-default", "generator/spec.py",
      "        if seen_default and not has:\n", "        if False:\n",
      "an argument without a default after one with a default is taken: the op's torch schema and Python API "
      "(defaults last) cannot be written, and the failure comes at load time, not from the spec",
      ("tests/test_spec_validation.py",), cheap=True),
    M("spec-python-keywords-as-names", "generator/spec.py",
      'RESERVED = frozenset(keyword.kwlist) | {"inf", "nan"}\n',
      'RESERVED = frozenset(["True", "False", "None", "and", "or", "not", "if", "else", "is", "in", "inf", "nan"])\n',
      "a name that is a Python keyword (an argument `lambda`) passes the spec check, and the generated Python API "
      "does not compile: the installed package fails to import",
      ("tests/test_spec_validation.py",), cheap=True),
    M("spec-values-on-float-tensors", "generator/spec.py",
      '    if any(d not in ("int32", "int64") for d in dtypes):\n', "    if False:\n",
      "a value domain on a float tensor is taken and then ignored by the glue: the spec promises a check that no "
      "call makes",
      ("tests/test_spec_validation.py",), cheap=True),
    M("order-negative-coefficient", "generator/symbolic/order.py",
      "            return c if (coef.is_positive and coef.is_finite) else None\n",
      "            return c if coef.is_finite else None\n",
      "the order rule takes a constant times an increasing term as increasing whatever the constant's sign: a key "
      "-x (or -2 exp(x)) would be selected on x, the order reversed",
      ("tests/test_engine.py", "-k", "increasing_in"), cheap=True),
    M("cpu-by-value-payload-is-the-value", "generator/codegen/cpu.py",
      '                value = f"(byv_{f.name} ? {self.pr.flt(p.term)} : key)"\n',
      '                value = "key"\n',
      "a selection made on the logit stores its entry's logit as the score payload it carries (the key was the "
      "score before): a softmax router's weights are logits",
      ("tests/test_moe_route.py", *NOSLOW), ),
    M("cpu-skip-pass-when-groups-cut", "generator/codegen/cpu.py",
      "all_{f.name} = ex_{over[f.name]} <= K_{f.name};",
      "all_{f.name} = ex_{over[f.name]} <= 2 * K_{f.name};",
      "a row skips the per-group pass and keeps every group while n_group is up to twice topk_group: DeepSeek-V3's "
      "8 groups, 4 kept, route to experts of the cut groups",
      ("tests/test_moe_route.py", *NOSLOW), ),
    M("cpu-group-best-bar-stale", "generator/codegen/cpu.py",
      '            self.emit(f"bar_{f.name}[s] = b ? o : bar_{f.name}[s];")\n',
      '            self.emit(f"bar_{f.name}[s] = bar_{f.name}[s];")\n',
      "the one-entry-per-group path never raises a group's bar: every later element replaces the group's best, so "
      "a group's score is its last expert's, and grouped routing keeps the wrong groups",
      ("tests/test_moe_route.py", *NOSLOW), ),
    # the element-by-element fold of the row kernels: only ops of tests/specs reach it (a sum with `where=`, or
    # whose state another form reads), judged by the library built from them (tests/test_user_specs.py)
    M("cpu-chunk-sum-overwrites-state", "generator/codegen/cpu.py",
      '            self.emit(f"st_{name} = st_{name} + {v};")',
      '            self.emit(f"st_{name} = {v};")',
      "a sum folded chunk by chunk into a local accumulator replaces its state with the last chunk's sum: an "
      "entropy's sum of p log p over a row longer than a chunk keeps only its last chunk",
      ("tests/test_user_specs.py",), ),
    M("cpu-fold-where-ignored", "generator/codegen/cpu.py",
      '        guard = "" if where in (sp.true, True) else f"if ({self.pr(where)}) "\n        target = getattr(',
      '        guard = ""\n        target = getattr(',
      "a reduction's `where=` is not applied in the element-by-element fold: elements it excludes (a -inf logit "
      "in an entropy's sum of w * z) are folded in, and the row's entropy is NaN",
      ("tests/test_user_specs.py",), ),
    # the row kernel's blocked contraction and fold (a score that is no product of a row and a streamed factor:
    # tests/specs/rbf_attention.yaml's squared distance)
    M("cpu-blocked-fold-drops-fourth-key", "generator/codegen/cpu.py",
      "for w, v in zip(ws, vs))};\")",
      "for w, v in zip(ws[:-1], vs[:-1]))};\")",
      "the fold over free indices that takes four elements at a time adds three of them: every fourth key's value "
      "is missing from the attention output (its weight still in the denominator)",
      ("tests/test_user_specs.py",), ),
    M("cpu-blocked-contraction-tail-dropped", "generator/codegen/cpu.py",
      'self.scalar_contraction(buf, c, scalar_body, "cn", start="jb")',
      'self.scalar_contraction(buf, c, scalar_body, "jb", start="jb")',
      "the contraction computed four elements at a time skips the chunk's last elements (its length not a multiple "
      "of four): their scores are stale values of the buffer",
      ("tests/test_user_specs.py",), ),
    M("glue-optional-same-dtype-checks-itself", "generator/codegen/glue.py",
      '                L += ["    " + b.replace("{T}", f"(*{t.name})") for b in body]\n',
      '                L += ["    " + b.replace("{T}", f"(*{t.name})").replace(f", {t.same_as});", f", (*{t.name}));")\n'
      '                      for b in body]\n',
      "an optional tensor whose dtype follows another argument (dtype: x) is compared with itself, as when its "
      "checks ran in a lambda whose parameter was named x: a weight of another dtype is read as x's type",
      ("tests/test_user_specs.py",), ),
]
