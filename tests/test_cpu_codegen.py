"""The CPU emitter's loop structure: what is computed once per call, per chunk and per element.

Correctness of the generated kernels is judged by the op tests through torch.ops; these tests pin the two
structural rules that keep per-element work out of the row loop, so that a change which silently puts an integer
division back into every element of every pass shows up here.
"""

from __future__ import annotations

import re
from pathlib import Path

from generator.codegen.cpu import cpu_source
from generator.codegen.cpu_tiles import NT_RUN, PAIR_RUN, SCHUNK, SCHUNK_OPEN
from generator.spec import load_spec, parse_spec
from generator.symbolic import derive

ROOT = Path(__file__).resolve().parents[1]


def _row_loop_bodies(src: str) -> list[str]:
    """The text of each kernel from its row loop (or its loop over blocks of rows) on."""
    return [part.split("for (int64_t row = row_begin;", 1)[1] for part in src.split("static void rows_case")[1:]]


def _block_loop_bodies(src: str) -> list[str]:
    return [re.split(r"for \(int64_t (?:blk|task) = blk_begin;", part, maxsplit=1)[1]
            for part in src.split("static void blocks_case")[1:]]


def test_moe_route_group_of_expert_is_tabled_once_per_call():
    src = cpu_source(derive(load_spec(ROOT / "specs" / "moe_route.yaml")), "moe_route_cpu.h")
    assert "tab_group[ix_e] = rf::idiv(ix_e, rf::idiv(sz_E, p_n_group));" in src
    for body in _row_loop_bodies(src):
        assert "rf::idiv(ix_e" not in body  # no integer division per element inside the row loop
        assert "el_group[jj] = tab_group[ix_e];" in body


def test_selection_keys_computed_in_a_branch_free_loop():
    src = cpu_source(derive(load_spec(ROOT / "specs" / "moe_route.yaml")), "moe_route_cpu.h")
    case1 = _row_loop_bodies(src)[1]  # softmax with a bias: the key is an expression of the element
    assert re.search(r"elk_sel\[jj\] = \(\(rf::exp\(.*\) \+ rf::ld\(t_bias\[", case1)
    assert "const float key = elk_sel[jj];" in case1
    assert "byv_sel" not in case1  # bias[e] + score is not increasing in x: selected on the key


def test_rows_of_a_run_share_the_first_rows_flags_where_only_keys_are_read():
    """MLA decode: the mask (j < cache_seqlens[b]) and the page (block_table[b, j / 64]) read only b, the run's key,
    and the element, so a later head of the run copies the first head's flags and lets instead of computing them
    again. Causal attention's mask reads the query position: every row computes its own; a kernel without a mask
    and without early lets has nothing to share."""
    mla = _block_loop_bodies(cpu_source(derive(load_spec(ROOT / "specs" / "mla_decode.yaml")), "mla_decode_cpu.h"))
    assert len(mla) == 2  # non-causal, causal (its mask reads t: the query rows of a sequence differ)
    assert "a later row of the run" not in mla[1] and "ix_t" in mla[1].split("const bool ok = ", 1)[1].split(";")[0]
    for body in mla[:1]:
        shared = ("if (rb > r0) {\n"
                  "            std::memcpy(el_ok, bel_ok + r0 * 128, static_cast<size_t>(cn) * sizeof(*el_ok));\n"
                  "            std::memcpy(el_page, bel_page + r0 * 128, static_cast<size_t>(cn) * sizeof(*el_page));\n")
        assert shared in body
        rest = body.split(shared, 1)[1]
        assert rest.index("row_sees[rb] = row_sees[r0];\n            continue;") < rest.index("el_page[jj] = rf::ld(")
    for spec in ("fused_attention", "sliding_window_attention", "fp8_quant_gemm"):
        src = cpu_source(derive(load_spec(ROOT / "specs" / f"{spec}.yaml")), "x_cpu.h")
        assert "static void blocks_case" in src
        assert "a later row of the run" not in src, spec


def test_softmax_router_selects_on_the_logit():
    """Softmax without a bias (the key exp(x - m) / z, strictly increasing in x): where m is finite and 1 / z finite
    and positive, the row's chunk keys are the logits themselves and the score is computed only for an entry that
    enters the selection; elsewhere (a row of NaN or inf) the keys as before."""
    src = cpu_source(derive(load_spec(ROOT / "specs" / "moe_route.yaml")), "moe_route_cpu.h")
    case0 = _row_loop_bodies(src)[0]
    assert ("const bool byv_sel = rf::is_finite_bits((-1.0f * st_m_safe)) && rf::is_finite_bits((1.0f / st_z)) && "
            "((1.0f / st_z)) > 0.0f;") in case0
    assert "if (byv_sel) for (int64_t jj = 0; jj < cn; ++jj) elk_sel[jj] = el_x[jj];" in case0
    assert re.search(r"else for \(int64_t jj = 0; jj < cn; \+\+jj\) \{\n.*\n.*\n\s*elk_sel\[jj\] = \(rf::exp\(", case0)
    assert "pp[pos] = (byv_sel ? (rf::exp((el_x[jj] + (-1.0f * st_m_safe))) / (st_z)) : key);" in case0


def test_group_pass_is_skipped_when_every_group_is_kept():
    """The router's per-group pass feeds only the group selection, read only as a membership table: with at most
    topk_group groups (n_group = 1) every group is kept whatever its score, so a row marks them all and skips the
    pass. Every moe_route kernel has the branch; nothing else in the shipped specs qualifies. The membership reads
    test all_gsel first, so such a row loads no table byte per element."""
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        src = cpu_source(derive(load_spec(path)), "x_cpu.h")
        bodies = _row_loop_bodies(src)
        if path.stem != "moe_route":
            assert "std::memset(mem_" not in src, path.stem
            continue
        for body in bodies:
            head = ("const bool all_gsel = ex_g <= K_gsel;  // its table all ones\n    if (all_gsel) {\n"
                    "      std::memset(mem_gsel, 1, static_cast<size_t>(ex_g));\n    } else {")
            assert head in body
            rest = body.split(head, 1)[1]
            assert rest.index("rf::sel_mark(mem_gsel") < rest.index("// ---- pass")  # the pass in the else branch
            assert "(all_gsel || rf::sel_member(mem_gsel, ex_g, el_group[jj]))" in rest


def test_selections_insert_only_candidates():
    """Every moe_route kernel offers its per-row top-k only the chunk's candidates (rf::sel_candidates), its
    per-group selection only the elements above their group's bar (rf::sel_offers, the bar kept by each insertion),
    and reads group membership from a table marked once per row (rf::sel_member), not by testing every entry."""
    src = cpu_source(derive(load_spec(ROOT / "specs" / "moe_route.yaml")), "moe_route_cpu.h")
    bodies = _row_loop_bodies(src)
    assert len(bodies) == 8
    for body in bodies:
        assert re.search(r"rf::sel_candidates<256>\(elk_sel, elo_sel\d+, cn, st_sel_key \+ 0, st_sel_ok \+ 0, K_sel,", body)
        assert re.search(r"rf::sel_offers<16>\(elk_gtop \+ j0, el_ok \+ j0, els_gtop\d+ \+ j0, bar_gtop,", body)
        assert "bar_gtop[ix_g] = oo[K_gtop - 1] ? rf::sel_okey(kk[K_gtop - 1])" in body
        assert "rf::sel_mark(mem_gsel, ex_g, st_gsel_idx, st_gsel_ok, K_gsel);" in body
        assert re.search(r"elo_sel\d+\[jj\] = el_ok\[jj\] & \(\(all_gsel \|\| rf::sel_member\(mem_gsel, ex_g, "
                         r"el_group\[jj\]\)\)\);", body)
        assert "sel_has" not in body


def test_one_entry_per_group_is_kept_without_branches():
    """A per-group selection of one entry (the group's best score, without a bias) keeps each group's best so far
    with conditional moves on its int key (elements come in index order, so an equal key loses), not through
    sel_offers and the insertion, whose early-out branch mispredicted on a new maximum (13-19 % of a grouped
    router's time). With a bias (two entries per group) only the general path runs."""
    src = cpu_source(derive(load_spec(ROOT / "specs" / "moe_route.yaml")), "moe_route_cpu.h")
    for n, body in enumerate(_row_loop_bodies(src)):
        fast = "if (K_gtop == 1) for (int64_t jj = 0; jj < cn; ++jj) {"
        assert fast in body  # K_gtop is 2 with a bias: the branch is not taken there
        part = body.split(fast, 1)[1].split("} else {", 1)[0]
        assert "const bool b = o > bar_gtop[s];" in part and "bar_gtop[s] = b ? o : bar_gtop[s];" in part
        assert "st_gtop_idx[s] = b ? c0 + jj : st_gtop_idx[s];" in part and part.count("if (") == 1  # s < 0 only


def test_selection_payloads_are_cleared_with_the_keys():
    """Every row starts its selections empty, payloads included: an entry that a row leaves unfilled (a `where=`
    that admits fewer than k elements) carries payload 0, as the CUDA kernels write, never the previous row's."""
    for spec, sel, payload in (("specs/moe_route.yaml", "sel", "score"), ("tests/specs/sigmoid_topk_bias.yaml", "top", "score")):
        src = cpu_source(derive(load_spec(ROOT / spec)), "x_cpu.h")
        bodies = _row_loop_bodies(src)
        assert bodies
        for body in bodies:
            clear = body.index(f"rf::sel_clear(st_{sel}_key, st_{sel}_idx, st_{sel}_ok,")
            fill = body.index(f"std::fill(st_{sel}_pl_{payload}, st_{sel}_pl_{payload} + ")
            assert fill > clear and body[fill:].split(";")[0].endswith(f"K_{sel}, 0.0f)")
            assert body.index("for (int64_t c0 = 0;", clear) > fill  # before the pass's chunks


def _masked_spec_source() -> str:
    """causal_attention with two integer element lets: jb (a division) enters the score, jm (a modulo) the mask."""
    text = (ROOT / "tests" / "specs" / "causal_attention.yaml").read_text()
    text = text.replace('    s: "sum(q[b, i, c] * k[b, j, c], c) / sqrt(D)"',
                        '    jb: "j // 2"\n    jm: "j % 3"\n    s: "sum(q[b, i, c] * k[b, j, c], c) / sqrt(D) + jb"')
    text = text.replace('mask: "j <= i and j < lens[b]"', 'mask: "j <= i and j < lens[b] and jm >= 0"')
    assert "jb" in text and "jm >= 0" in text
    return cpu_source(derive(parse_spec(text, "masked_div.yaml")), "masked_div_cpu.h")


def test_division_under_a_mask_is_not_tabled():
    src = _masked_spec_source()
    row = _block_loop_bodies(src)[0]
    assert "tab_jb" not in src  # a division is evaluated only where the mask holds...
    assert re.search(r"if \(ok\) \{[^}]*el_jb\[jj\] = rf::idiv\(ix_j, int64_t\(2\)\);", row)
    assert "tab_jm[ix_j] = rf::imod(ix_j, int64_t(3));" in src  # ...unless the mask reads it: then for every element


def test_lets_read_by_the_mask_are_computed_before_it():
    row = _block_loop_bodies(_masked_spec_source())[0]
    assert row.index("el_jm[jj] = tab_jm[ix_j];") < row.index("const bool ok = ")
    assert row.index("const bool ok = ") < row.index("el_jb[jj] = rf::idiv(")


def test_attention_contraction_and_weighted_sum_are_gemm_tiles():
    src = cpu_source(derive(load_spec(ROOT / "specs" / "fused_attention.yaml")), "fused_attention_cpu.h")
    assert "static void rows_case" not in src
    # the tiles are kept for the call where the query rows of a head (or GQA group) are more than one block
    assert src.count("const bool memo_on = ex_i > rb_n;") == 2
    bodies = _block_loop_bodies(src)
    assert len(bodies) == 2
    # the chunk of block kernels with a GEMM sum: longer where no mask hides elements (causal=false), so that the
    # per-chunk row passes are amortised; the causal specialisation keeps the shorter one (less masked work)
    assert "const bool ok = true;" in bodies[0] and "const bool ok = true;" not in bodies[1]
    # ... and the pass after the contraction reads no flag there (its stores are not conditional)
    assert "const bool ok = el_ok[jj];" not in bodies[0] and "const bool ok = el_ok[jj];" in bodies[1]
    # a masked element's score holds the mask value (-inf); without a mask every score is computed: no fill
    assert "el_s[jj] = (-rf::kInf);" not in bodies[0] and "el_s[jj] = (-rf::kInf);" in bodies[1]
    # without a mask every chunk; with the causal mask each row's range of j (j <= i + Sk - Sq) is worked out with
    # its indices, and a run walks only the chunks in the union of its rows' ranges (past the diagonal: none)
    assert f"for (int64_t c0 = 0; c0 < ex_j; c0 += {SCHUNK_OPEN})" in bodies[0] and "rvis_hi" not in bodies[0]
    assert "vhi = std::min<int64_t>(vhi, static_cast<int64_t>((ix_i + sz_Sk + (int64_t(-1) * sz_Sq))) + 1);" in bodies[1]
    assert "vlo = std::max" not in bodies[1]
    assert "vis_hi = std::max(vis_hi, rvis_hi[q]);" in bodies[1]
    assert f"const int64_t c_begin = vis_lo < vis_hi ? vis_lo / {SCHUNK} * {SCHUNK} : 0;" in bodies[1]
    assert f"for (int64_t c0 = c_begin; c0 < c_end; c0 += {SCHUNK})" in bodies[1]
    assert f"for (int64_t c0 = 0; c0 < ex_j; c0 += {SCHUNK})" not in bodies[1]
    # the mask is that one bound alone, so a chunk inside a row's range takes no mask pass: all flags set at once
    assert ("if (c0 >= rvis_lo[rb] && c0 + cn <= rvis_hi[rb]) {\n            std::memset(el_ok, 1, "
            "static_cast<size_t>(cn));") in bodies[1]
    for body, C in zip(bodies, (SCHUNK_OPEN, SCHUNK)):
        # rows are walked with the K/V indices (b, and h through the GQA head g) outermost; runs share the key
        assert "walked in the order (b, h, i)" in body
        assert "rkey[rb * 2 + 0] = static_cast<double>(ix_b);" in body
        assert "rkey[rb * 2 + 1] = static_cast<double>(lt_g);" in body
        # the GQA group (an integer division) at most once per row of the block (again only where h moved), not
        # again per element of a pack; the rows' indices counted up from the block's first, not divided out per row
        assert body.count("rf::idiv(") == 2 and "rlt_g[rb] = lt_g;" in body
        assert "if (rb == 0 || ix_h != rix_h[rb - 1]) pl_g = rf::idiv(ix_h, rf::idiv(sz_H, sz_Hk));" in body
        assert "if (++cx_i == ex_i) { cx_i = 0; if (++cx_h == ex_h) { cx_h = 0; ++cx_b; } }" in body
        assert "int64_t rem = p0 + rb;" not in body
        assert "const int64_t lt_g = rlt_g[rs];" in body
        # the row each packed element is read with: found for all the chunk's elements at once per run (a search
        # per element down the rows was 18 % of the causal block function), for the K pack and the V pack
        assert f"rf::first_rows(bel_ok, {C}, r0, r1, cn, frow_ok);" in body
        assert f"rf::first_rows(bel_cnt, {C}, r0, r1, cn, frow_cnt);" in body
        assert "const int64_t rs = !(jj < cn) || frow_ok[jj] < 0 ? -1 : r0 + frow_ok[jj];" in body
        assert "const int64_t rs = frow_cnt[jj] < 0 ? -1 : r0 + frow_cnt[jj];" in body
        assert "for (int64_t q = r0; q < r1; ++q) if (bel_" not in body
        # q . k: each element's K row located once per chunk for the run, then packed by register transposes
        # (panels of 32 elements, [c][32] each) and one GEMM tile against the q rows (a short run: the rows widened
        # and the NT tile)
        assert re.search(r"pk\d+_rows\[jj\] = &t_k\[", body)
        # (the tile kept for the call where later blocks share the key: packed only where the memo misses)
        assert re.search(r"const int64_t slot = pk\d+_memo.find\(c0 / \d+, tag, pk\d+_real, hit\);", body)
        assert re.search(rf"if \(!hit\) rf::pack_transposed_panels\({C}, ex_c, pk\d+_rows, pt, ex_c \* 32\);", body)
        assert re.search(rf"rf::gemm_tile_nt\(r1 - r0, {C}, ex_c, browbuf\d+ \+ r0 \* ex_c, ex_c, pk\d+, ex_c", body)
        assert re.search(rf"rf::gemm_tile_panels\(r1 - r0, {C}, ex_c, browbuf\d+ \+ r0 \* ex_c, ex_c, pt, ex_c \* 32, "
                         rf"bdots\d+", body)
        assert re.search(r"el_s\[jj\] = \(p_softmax_scale \* dots\d+\[jj\]\);", body)
        assert not re.search(r"float dot\d+ = 0.0f;", body)
        # o[d] += p_j v[j, d]: the weights per row (0 where not counted: where the score is at its mask value, which
        # a masked score holds, so no flag bytes are read in the float loop), then V packed once (panels of 32 d,
        # [element][32] each) and one GEMM tile; a tile with an inf/NaN reads the same layout element by element
        # the weights are exp(s - m): their exponents (-inf where not counted), then rf::exp_sum in place, whose
        # sum is the denominator's chunk (no second pass over the weights); the max over the scores' buffer is
        # rf::max_of (no keyed lane loop)
        assert re.search(r"wts\d+\[jj\] = !\(el_s\[jj\] == \(-rf::kInf\)\) \? x : -rf::kInf;", body)
        assert not re.search(r"wts\d+\[jj\] = el_cnt", body)
        w = re.search(r"const float (wsum\d+) = rf::exp_sum\(wts\d+, cn\);", body)
        assert w and re.search(rf"acc\d+ = acc\d+ \+ {w.group(1)};", body) and "rf::lanes_total" not in body
        assert re.search(r"acc\d+ = rf::max\(acc\d+, rf::max_of\(el_s, cn\)\);", body) and "rf::kmax" not in body
        assert "const int64_t ix_d = n0;" in body and "float* dp = dst + x0" not in body
        assert re.search(rf"bad \|= rf::pack_row_panels\(&t_v\[.*\(ix_d\)\], nt, dst, {C} \* 32\) \? 1u : 0u;", body)
        assert re.search(rf"rf::gemm_tile_panels\(r1 - r0, nt, cn, bwts\d+ \+ r0 \* {C}, {C}, pt, {C} \* 32, bst_o", body)
        assert f"acc[x] = acc[x] + w * pt[x / 32 * {C * 32} + jj * 32 + x % 32];" in body
        # the correction is applied per row before the tile is folded in, and skipped where it is exactly 1
        assert "if (cr_o != 1.0f) for (int64_t r = col_lo; r < col_hi; ++r) st_o[r] = st_o[r] * cr_o;" in body
        # out[b, i, h, d]: d innermost, so a copy of the loop for a unit stride (and the strided one for the rest)
        assert "if (ost_out[3] == 1) {" in body
        assert "rf::store(&o_out[ix_b * ost_out[0] + ix_i * ost_out[1] + ix_h * ost_out[2] + ix_d], " in body
        assert "rf::store(&o_out[ix_b * ost_out[0] + ix_i * ost_out[1] + ix_h * ost_out[2] + ix_d * ost_out[3]], " in body
        assert body.index("st_o[r] = st_o[r] * cr_o") < body.index("rf::gemm_tile_panels(r1 - r0, nt, cn")


def test_fold_factor_rows_are_packed_by_the_row_helper():
    """A fold's streamed factor that is one read of a row-contiguous input (V) is packed from the row as it is; one
    that is an expression of reads is evaluated into a row of values first; both through rf::pack_row_panels, the
    one packing loop (tests/cpu_gemm_levels.cpp checks it at every x86 level)."""
    text = (ROOT / "tests" / "specs" / "causal_attention.yaml").read_text()
    plain = cpu_source(derive(parse_spec(text, "plain.yaml")), "plain_cpu.h")
    expr_text = text.replace("o: sum(exp(s - m) * v[b, j, d])", "o: sum(exp(s - m) * (v[b, j, d] + k[b, j, d]))")
    assert expr_text != text
    expr = cpu_source(derive(parse_spec(expr_text, "expr.yaml")), "expr_cpu.h")
    for src in (plain, expr):
        assert "float* dp = dst + x0" not in src and "bad |= rf::is_finite_bits(v)" not in src
    assert re.search(r"bad \|= rf::pack_row_panels\(&t_v\[.*\(ix_d\)\], nt, dst, \d+ \* 32\) \? 1u : 0u;", plain)
    assert "float vals[" not in plain
    assert re.search(r"for \(int64_t ix_d = n0; ix_d < n0 \+ nt; \+\+ix_d\) vals\[ix_d - n0\] = \(rf::ld\(t_k\[.*"
                     r"\+ rf::ld\(t_v\[", expr)
    assert re.search(r"bad \|= rf::pack_row_panels\(vals, nt, dst, \d+ \* 32\) \? 1u : 0u;", expr)


def test_attention_query_rows_are_read_in_their_dtype():
    from generator.codegen.cpu import native_inputs

    op = derive(load_spec(ROOT / "specs" / "fused_attention.yaml"))
    # q (the contraction's row factor) is read in its own dtype like k and v: no float32 copy of it in the glue
    assert native_inputs(op) == {"q", "k", "v"}
    src = cpu_source(op, "fused_attention_cpu.h")
    assert "const T_q* __restrict__ t_q = static_cast<const T_q*>(A.t_q);" in src
    for body in _block_loop_bodies(src):
        # a run of PAIR_RUN rows or more on bf16 pairs takes the row's bits as its pair words; otherwise the row is
        # widened into its buffer (the float tiles and shorter runs read it) and, for pairs, rounded back
        q = "t_q[(ix_b) * st_q[0] + (ix_i) * st_q[1] + (ix_h) * st_q[2] + "
        raw = re.search(rf"if \(std::is_same<T_q, rf::bf16_t>::value && (pk\d+)_bf && r1 - r0 >= {PAIR_RUN}\) \{{\n.*\n\s+"
                        rf"std::memcpy\(\1a \+ rb \* \(ex_c / 2\), &{re.escape(q)}\(int64_t\(0\)\)\], "
                        r"ex_c \* sizeof\(T_q\)\);\n\s+\} else \{\n\s+for \(int64_t ix_c = 0; ix_c < ex_c; \+\+ix_c\) "
                        rf"(rowbuf\d+)\[ix_c\] = rf::ld\({re.escape(q)}\(ix_c\)\]\);\n\s+"
                        rf"if \(\1_bf && r1 - r0 >= {PAIR_RUN}\) rf::pairs_from_floats\(1, ex_c, \2, ", body)
        assert raw, body[:3000]
        # the tile is on pairs under the same condition (a run of 8 to 32 rows too: not the widened NT tile)
        pk = raw.group(1)
        assert f"if (r1 - r0 <= {NT_RUN} && !({pk}_bf && r1 - r0 >= {PAIR_RUN})) {{" in body
        assert f"if ({pk}_bf && r1 - r0 >= {PAIR_RUN}) {{" in body


def test_mask_bounds_give_each_row_its_range_of_the_streamed_index():
    """visible_bounds: conjuncts linear in j with an integer other side bound a row's range (a window's lower end,
    a tensor's length); a conjunct on an element let is left out (it can only hide more)."""
    sw = _block_loop_bodies(cpu_source(derive(load_spec(ROOT / "specs" / "sliding_window_attention.yaml")), "s.h"))[0]
    assert ("vlo = std::max<int64_t>(vlo, static_cast<int64_t>((ix_i + sz_Sk + (int64_t(-1) * p_window) + "
            "(int64_t(-1) * sz_Sq))) + 1);") in sw
    assert "vhi = std::min<int64_t>(vhi, static_cast<int64_t>((ix_i + sz_Sk + (int64_t(-1) * sz_Sq))) + 1);" in sw
    masked = _block_loop_bodies(_masked_spec_source())[0]  # mask: j <= i and j < lens[b] and jm >= 0
    assert "vhi = std::min<int64_t>(vhi, static_cast<int64_t>(ix_i) + 1);" in masked
    assert "vhi = std::min<int64_t>(vhi, static_cast<int64_t>(rf::ld(t_lens[(ix_b) * st_lens[0]])));" in masked
    assert masked.count("vhi = std::min") == 2 and "vlo = std::max" not in masked
    # ... and since jm >= 0 is not one of them, every chunk takes its mask pass (no shortcut for whole chunks)
    assert "std::memset(el_ok, 1" not in masked and "std::memset(el_ok, 1" in sw


def test_fp8_weight_decoded_once_per_tile():
    src = cpu_source(derive(load_spec(ROOT / "specs" / "fp8_quant_gemm.yaml")), "fp8_quant_gemm_cpu.h")
    for body in _block_loop_bodies(src):
        assert "walked in the order (m)" in body  # the weight ignores m: one run per block
        # W[n, k] is read along k: packed [n][element] with contiguous reads (and the rows ahead prefetched), then
        # one NT tile; the chunk is longer (WCHUNK) so that each read is a stretch of a weight row, not one line
        assert re.search(r"dst\[jj\] = v;", body) and "rf::ld(t_w[" in body
        # ... and where W is contiguous along k, each row's stretch decoded by vectors, the loop kept for other strides
        dec = body.index("if (st_w[1] == 1) {")
        assert re.search(r"bad \|= rf::e4m3_to_floats\(reinterpret_cast<const uint8_t\*>\(t_w \+ ix_n \* st_w\[0\] \+ "
                         r"c0\), cn, dst\) \? 1u : 0u;\s*continue;", body[dec:])
        assert body.index("__builtin_prefetch(&t_w[") < dec < body.index("rf::ld(t_w[")
        assert "__builtin_prefetch(&t_w[" in body and "c0 += 256" in body
        assert re.search(r"rf::gemm_tile_nt\(r1 - r0, nt, cn, bwts\d+ \+ r0 \* 256, 256, pk\d+, 256, bst_acc", body)
        assert body.count("rf::ld(t_w[") == 1  # read only where the tile is packed
        # every element counts (no mask, no mask value): the quantised x is the weight as it is, no flag read
        assert re.search(r"wts\d+\[jj\] = rf::round_e4m3\(", body) and not re.search(r"wts\d+\[jj\] = el_cnt", body)
        # the output row of N floats: a copy of its loop for a unit stride, which vectorises
        assert "if (ost_out[1] == 1) {" in body and "rf::store(&o_out[ix_m * ost_out[0] + ix_n], " in body
        # a run of more than NT_RUN rows (or of 16 or 32, which fill its columns) takes the register-blocked tile
        # instead, transposed: acc^T = tile x w^T, its weights packed into panels once per chunk (before the column
        # tiles), the decoded tile read as it is
        tc = r"r1 - r0 > 32 \|\| \(r1 - r0\) % 16 == 0"
        pack = re.search(r"if \(!pairs && \(" + tc + r"\)\) \{\s*(//[^\n]*\n\s*)*for \(int64_t q = r0; q < r1; \+\+q\) (wts\d+)_rows"
                         r"\[q - r0\] = b(wts\d+) \+ q \* 256;\s*rf::pack_transposed_panels\(r1 - r0, cn, (wts\d+)_rows, "
                         r"(wts\d+)t, 8192\);", body)
        assert pack and len({pack.group(i) for i in (2, 3, 4, 5)}) == 1
        long = re.search(r"if \(" + tc + r"\) \{\s*(//[^\n]*\n\s*)*rf::gemm_tile_panels_tc\(nt, r1 - r0, cn, pk\d+, 256, "
                         r"(wts\d+)t, 8192, bst_acc \+ r0 \* szf \+ n0, szf, true\);", body)
        assert long and long.group(2) == pack.group(2)
        assert pack.start() < body.index("for (int64_t n0 = ") < long.start() < body.index("rf::gemm_tile_nt(")
        assert "pack_transposed_panels(nt," not in body  # no tile transposed per column tile
    # the weight is decoded once per block, so the blocks are as large as they may be (up to 128 rows) and threads
    # beyond the blocks share out columns; attention (whose tasks of a column range would repeat q.k) keeps two
    # blocks per thread where there are several threads, for balance
    assert src.count("const int64_t rb_n = std::max<int64_t>(1, std::min<int64_t>(128, A.rows));") == len(_block_loop_bodies(src))
    assert "const int64_t half" not in src  # no two-blocks-per-thread size to work out
    att = cpu_source(derive(load_spec(ROOT / "specs" / "fused_attention.yaml")), "fused_attention_cpu.h")
    assert "const int64_t half = nthr == 1 ? A.rows : (A.rows + 2 * nthr - 1) / (2 * nthr);" in att
    assert "std::min<int64_t>(128, half >= 32 ? half : (A.rows + nthr - 1) / nthr)" in att


def test_masked_spec_keeps_per_element_order():
    """The contraction tile is computed after the lets it reads and before the lets that read it."""
    row = _block_loop_bodies(_masked_spec_source())[0]
    use = re.search(r"el_s\[jj\] = .*dots\d+\[jj\]", row)
    assert use and row.index("const bool ok = ") < row.index("rf::gemm_tile_panels(") < use.start()


def test_long_rows_take_fewer_rows_per_task():
    """A row kernel's grain (rows per task of the thread pool) shrinks with the row: 64 rows of a 32k vocabulary are
    split across threads, 64 rows of 64 experts are not (torch's thread pool splits a range into tasks of at
    least the grain)."""
    src = cpu_source(derive(load_spec(ROOT / "specs" / "logsumexp.yaml")), "logsumexp_cpu.h")
    assert re.search(r"const int64_t grain = std::max<int64_t>\(1, std::min<int64_t>\(64, 65536 / "
                     r"std::max<int64_t>\(1, static_cast<int64_t>\(A\.sz_\w+\)\)\)\);", src)


def test_few_rows_share_fold_columns_across_tasks():
    """Block kernels whose only carried states are GEMM folds over one free index split that index across tasks
    where there are fewer blocks than threads (at least 256 columns per task): the fold's state is initialised,
    corrected, packed and stored over the task's columns only, and an output without that index (lse) is stored
    by the first task."""
    src = cpu_source(derive(load_spec(ROOT / "specs" / "fp8_quant_gemm.yaml")), "fp8_quant_gemm_cpu.h")
    assert "const int64_t ncol = nblk == 0 || nblk >= nthr ? 1 : std::max<int64_t>(1, std::min<int64_t>((nthr + nblk - 1) / " \
           "nblk, (A.sz_N) / 256));" in src
    for body in _block_loop_bodies(src):
        assert "std::fill(st_acc + col_lo, st_acc + col_hi, 0.0f);" in body
        assert "if (cr_acc != 1.0f) for (int64_t r = col_lo; r < col_hi; ++r) st_acc[r] = st_acc[r] * cr_acc;" in body
        assert "for (int64_t n0 = col_lo; n0 < col_hi; n0 += " in body
        assert "for (int64_t ix_n = col_lo; ix_n < col_hi; ++ix_n)" in body
        assert "ex_n; ++" not in body
    src = cpu_source(derive(load_spec(ROOT / "specs" / "fused_attention.yaml")), "fused_attention_cpu.h")
    for body in _block_loop_bodies(src):
        assert re.search(r"if \(cpart == 0\) \{\n\s*rf::store\(&o_lse\[", body)


def _masked_cross_entropy_source() -> str:
    """Cross-entropy over the first n[t] classes of each row (a mask): the one-hot sum must stay in the element loop,
    where the mask decides whether the target's element counts."""
    text = (ROOT / "tests" / "specs" / "cross_entropy.yaml").read_text()
    text = text.replace('labels: {shape: [T], dtype: [int32], values: "[0, V)"}',
                        'labels: {shape: [T], dtype: [int32], values: "[0, V)"}\n  n: {shape: [T], dtype: [int32], '
                        'values: "[0, V]"}')
    text = text.replace('    x: "logits[t, e]"\n', '    x: "logits[t, e]"\n  mask: "e < n[t]"\n')
    assert "mask:" in text and "n: {" in text
    return cpu_source(derive(parse_spec(text, "masked_cross_entropy.yaml")), "masked_cross_entropy_cpu.h")


def test_one_hot_sum_is_read_at_its_index():
    """A sum that picks one element by its index, sum(where(e == target[t], x, 0)), is read once per row at e =
    target[t] after the pass, in bounds only (0 otherwise), instead of a 64-bit compare and select per element; a
    masked row keeps it in the element loop (the mask decides whether that element counts)."""
    for spec, state in (("specs/softmax_cross_entropy.yaml", "xt"), ("tests/specs/cross_entropy.yaml", "xt")):
        src = cpu_source(derive(load_spec(ROOT / spec)), "x_cpu.h")
        (body,) = _row_loop_bodies(src)
        assert "(ix_e ==" not in body
        reads = re.findall(r"const int64_t ix_e = rf::ld\(t_\w+\[\(ix_t\) \* st_\w+\[0\]\]\);\n\s*"
                           rf"if \(ix_e >= 0 && ix_e < ex_e\) st_{state} = st_{state} \+ rf::ld\(t_\w+\[", body)
        assert len(reads) == 1, body
        # after the chunk loop, before the output
        assert body.index("for (int64_t c0 = 0;") < body.index("if (ix_e >= 0") < body.index("// output")
    body = _row_loop_bodies(_masked_cross_entropy_source())[0]
    assert "if (ix_e >= 0" not in body and "rf::sel((ix_e == rf::ld(t_labels[" in body
    # compared with a float (which an index equals only where it is integral): kept as a select too
    text = (ROOT / "tests" / "specs" / "cross_entropy.yaml").read_text()
    text = text.replace('labels: {shape: [T], dtype: [int32], values: "[0, V)"}', "labels: {shape: [T], dtype: [float32]}")
    assert "dtype: [float32]}" in text
    body = _row_loop_bodies(cpu_source(derive(parse_spec(text, "float_labels.yaml")), "float_labels_cpu.h"))[0]
    assert "if (ix_e >= 0" not in body and re.search(r"rf::sel\(\(static_cast<float>\(ix_e\) == hv\d+\)", body)


def test_lane_loops_stay_loops_until_vectorised():
    """Every LANES-wide loop of a branch-free reduction carries `#pragma GCC unroll 1`: unrolled before the
    vectoriser saw it, gcc 12 vectorised the loop over lane groups instead, across lanes, with a transpose per
    group (the cross-entropy kernel 35-40 % slower than with the pragma)."""
    for spec in ("softmax_cross_entropy", "logsumexp", "moe_route"):
        src = cpu_source(derive(load_spec(ROOT / "specs" / f"{spec}.yaml")), "x_cpu.h")
        heads = re.findall(r"for \(; jl \+ 16 <= cn; jl \+= 16\) \{\n(.*)\n(.*)\n", src)
        assert heads, spec
        for pragma, loop in heads:
            assert pragma.strip() == "#pragma GCC unroll 1" and loop.strip() == "for (int u = 0; u < 16; ++u) {", spec


def test_kept_terms_are_summed_by_exp_sum():
    """row_softmax keeps each chunk's terms exp(y - m_c) for its output (TermCache): the exponents are written
    where the terms are kept and rf::exp_sum turns them into the terms in place and sums them, with no lane loop
    (whose 16 partial sums lived in a stack array)."""
    src = cpu_source(derive(load_spec(ROOT / "specs" / "row_softmax.yaml")), "row_softmax_cpu.h")
    for body in _row_loop_bodies(src):
        assert "tcrow[(tc_n ? c0 : 0) + jj] = (el_y[jj] + (-1.0f * st_m_new_safe));" in body
        assert "acc2 = acc2 + rf::exp_sum(tcrow + (tc_n ? c0 : 0), cn);" in body
        assert "jl + 16 <= cn" not in body
