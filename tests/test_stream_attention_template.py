"""Tests of the streaming-attention TileLang template (generator/codegen/templates/stream_attention.py).

The softmax AttentionMath below is written by hand *only* to exercise the template; in production
the math comes from the symbolic engine.  Everything here runs on the CPU:
- emission for every variant (valid Python, metadata, names checked);
- `simulate`, which executes the emitted schedule (tiles, causal bounds, boundary masks, guards,
  corrections, split-KV segments and merge) in numpy, against a float64 reference on awkward shapes;
- where tilelang is installed, lowering of a few variants and checks on the generated CUDA.
"""

from __future__ import annotations

import ast
import importlib.util

import numpy as np
import pytest

from generator.codegen.templates import stream_attention as sa

NEG_INF = "-T.infinity(accum_dtype)"

# online softmax + weighted sum (what the engine derives for fused_attention)
SOFTMAX = sa.AttentionMath(
    score="acc_s * softmax_scale",
    mask_value=NEG_INF,
    states=(
        sa.RowState("m", "max", NEG_INF, "s"),
        sa.RowState("l", "sum", "T.float32(0)", "T.exp(s - m_safe)", "T.exp(m_old - m_safe)"),
    ),
    guards=(sa.Guard("m_safe", f"T.if_then_else(m_new == {NEG_INF}, T.float32(0), m_new)"),),
    weight="T.exp(s - m_safe)",
    acc_correction="T.exp(m_old - m_safe)",
    out="T.if_then_else(l == T.float32(0), T.float32(0), o / l)",
    lse="m + T.log(l)",
    merge=sa.MergeForm(
        states=(sa.MergeState("m", "m_seg"), sa.MergeState("l", "l_seg * T.exp(m_seg - m_safe)")),
        guards=(sa.Guard("m_safe", f"T.if_then_else(m == {NEG_INF}, T.float32(0), m)"),),
        acc_term="o_seg * T.exp(m_seg - m_safe)",
    ),
)


def reference(q, k, v, causal, scale):
    """float64 attention, bottom-right causal; rows that see no key -> out 0, lse -inf."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    _, Sq, H, _ = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    g = H // Hk
    kr = np.repeat(k, g, axis=2)
    vr = np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    if causal:
        i = np.arange(Sq)[:, None]
        j = np.arange(Sk)[None, :]
        s = np.where(j <= i + Sk - Sq, s, -np.inf)
    m = s.max(-1, keepdims=True)
    msafe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - msafe)
    l = p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", np.where(l > 0, p / np.where(l > 0, l, 1), 0), vr)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(l))[..., 0]
    return o, lse


def rand_qkv(rng, B, Sq, Sk, H, Hk, D, scale=1.0):
    q = rng.standard_normal((B, Sq, H, D)).astype(np.float32) * scale
    k = rng.standard_normal((B, Sk, Hk, D)).astype(np.float32) * scale
    v = rng.standard_normal((B, Sk, Hk, D)).astype(np.float32)
    return q, k, v


def all_configs():
    for fam in sa.FAMILIES:
        for dt in sa.DTYPES:
            for d in sa.HEAD_DIMS:
                for causal in (False, True):
                    for split in (False, True):
                        yield sa.default_config(fam, dt, d, causal, split)


# ------------------------------------------------------------------------------------ emission


@pytest.mark.parametrize("cfg", list(all_configs()), ids=lambda c: c.variant_name())
def test_emit_every_variant_is_valid_python(cfg):
    text = sa.emit_attention_program(SOFTMAX, cfg)
    compile(text, cfg.variant_name() + ".py", "exec")
    assert f"# variant: {cfg.variant_name()}" in text
    # the metadata block: NAME = <literal> lines before make_prim_func (no tilelang needed)
    ns = {}
    for node in ast.parse(text.split("\n\ndef make_prim_func")[0]).body:
        if isinstance(node, ast.Assign):
            ns[node.targets[0].id] = ast.literal_eval(node.value)
    assert ns["VARIANT"] == cfg.variant_name()
    assert ns["TARGET_ARCH"] == sa.FAMILIES[cfg.family]
    assert ns["CALL_INT_ARGS"] == sa.call_int_args(cfg)
    assert ns["STRIDE_UNIT"] == (1 if sa.uses_tma(cfg) else 8)
    if cfg.split_kv:
        assert ns["STATE_ORDER"] == ("m", "l")
        combine = sa.emit_combine_program(SOFTMAX, cfg)
        compile(combine, "combine.py", "exec")


def test_emission_is_deterministic():
    cfg = sa.default_config("sm90a", "bfloat16", 128, True)
    assert sa.emit_attention_program(SOFTMAX, cfg) == sa.emit_attention_program(SOFTMAX, cfg)


def test_cse_computes_p_and_the_correction_once():
    text = sa.emit_attention_program(SOFTMAX, sa.default_config("sm90a", "bfloat16", 128, False))
    # P = exp(s - m_safe) written once, in place, and reused by the l reduction and P@V
    assert text.count("T.exp(acc_s[i, j] - gd_m_safe[i])") == 1
    assert "acc_t" not in text
    # the l correction equals the accumulator correction: one fragment
    assert text.count("T.exp(st_m_old[i] - gd_m_safe[i])") == 1
    assert "st_l[i] = st_l_old[i] * (acc_scale[i]) + st_l_red[i]" in text


def test_unmasked_tiles_carry_no_mask():
    text = sa.emit_attention_program(SOFTMAX, sa.default_config("sm80", "float16", 64, True))
    assert "if kt >= n_full:" in text
    body = text.split("else:\n")[1].split("\n")[1]
    assert "if_then_else" not in body


def test_loop_bounds_in_the_emitted_program():
    text = sa.emit_attention_program(SOFTMAX, sa.default_config("sm90a", "float16", 128, True, True))
    # never zero iterations (an empty q-block or segment runs one fully masked tile)
    assert "t_stop = T.max(t_end, t_begin + 1)" in text
    assert "for kt in T.Pipelined(t_begin, t_stop, num_stages=2):" in text
    # causal: bottom-right alignment, tiles past the block's last visible key are not visited (the band's bounds at
    # the block's first and last row)
    assert ("kv_end = T.max(T.min(seqlen_k, T.max(q0 + 1 + seqlen_k - seqlen_q, q0 + 127 + 1 + seqlen_k - "
            "seqlen_q)), 0)") in text
    assert "T.min(seqlen_k, q0 + i + 1 + seqlen_k - seqlen_q)" in text
    # heaviest q-blocks first; GQA by index mapping
    assert "q_blk = T.ceildiv(seqlen_q, 128) - 1 - T.truncdiv(bx, num_splits)" in text
    assert "kv_head = T.truncdiv(by, T.truncdiv(heads, heads_kv))" in text


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("weight", "T.exp(s - bogus)", "unknown name 'bogus'"),
        ("score", "acc_s * T.erf(acc_s)", "T.erf is not an allowed intrinsic"),
        ("out", "o / (l", "cannot parse"),
        ("lse", "m + l_old", "unknown name 'l_old'"),
    ],
)
def test_bad_math_is_rejected_with_the_expression_named(field, value, msg):
    bad = sa.dataclasses.replace(SOFTMAX, **{field: value})
    with pytest.raises(ValueError, match=msg):
        sa.emit_attention_program(bad, sa.default_config("sm90a", "float16", 64, False))


def test_guard_is_not_visible_before_its_state():
    # l's term may not read a guard of a later state
    bad = sa.dataclasses.replace(
        SOFTMAX,
        states=(SOFTMAX.states[1], SOFTMAX.states[0]),
    )
    with pytest.raises(ValueError, match="unknown name 'm_safe'"):
        sa.emit_attention_program(bad, sa.default_config("sm90a", "float16", 64, False))


# ------------------------------------------------------------------------------ the schedule, in numpy


SHAPES = [
    # (B, Sq, Sk, H, Hk, D) and the code path it exercises
    (1, 1, 1, 1, 1, 16),  # single element: one masked tail tile
    (2, 17, 113, 4, 2, 16),  # GQA, tails on both axes, several K tiles
    (1, 113, 17, 2, 1, 16),  # MQA, Sq > Sk: causal rows that see no key
    (1, 64, 64, 1, 1, 16),  # exact tile multiples: no tail, causal diagonal tiles only
    (1, 130, 200, 3, 3, 8),  # several q-blocks, causal tile skipping
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_schedule_matches_reference(shape, causal, num_splits):
    B, Sq, Sk, H, Hk, D = shape
    rng = np.random.default_rng(hash((shape, causal, num_splits)) % 2**32)
    q, k, v = rand_qkv(rng, B, Sq, Sk, H, Hk, D)
    scale = D**-0.5
    out, lse = sa.simulate(SOFTMAX, q, k, v, causal, {"softmax_scale": scale}, block_m=64, block_n=32, num_splits=num_splits)
    ref_o, ref_lse = reference(q, k, v, causal, scale)
    assert np.isfinite(out).all()
    assert np.abs(out - ref_o).max() <= 1e-5
    fin = np.isfinite(ref_lse)
    assert (np.isneginf(lse) == np.isneginf(ref_lse)).all()
    assert not np.isnan(lse).any()
    assert np.abs(lse[fin] - ref_lse[fin]).max() <= 1e-4


def test_rows_that_see_no_key_give_zero_and_minus_inf():
    rng = np.random.default_rng(0)
    q, k, v = rand_qkv(rng, 1, 50, 10, 2, 2, 8)
    out, lse = sa.simulate(SOFTMAX, q, k, v, True, {"softmax_scale": 0.3}, block_m=16, block_n=16)
    # query i sees keys j <= i + 10 - 50: the first 40 rows see nothing
    assert (out[:, :40] == 0).all()
    assert np.isneginf(lse[:, :, :40]).all()
    assert np.isfinite(lse[:, :, 40:]).all()


@pytest.mark.parametrize("num_splits", [1, 4])
def test_very_negative_scores_do_not_make_nan(num_splits):
    # every score about -1000: exp(m_old - m_safe) must stay 0 * finite, not 0 * inf
    rng = np.random.default_rng(1)
    q, k, v = rand_qkv(rng, 1, 9, 70, 1, 1, 8)
    q = np.abs(q) * 30
    k = -np.abs(k) * 30
    out, lse = sa.simulate(SOFTMAX, q, k, v, False, {"softmax_scale": 1.0}, block_m=16, block_n=16, num_splits=num_splits)
    ref_o, _ = reference(q, k, v, False, 1.0)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert np.abs(out - ref_o).max() <= 1e-4


def test_guarding_the_old_max_too_would_make_nan():
    # Documents a pitfall for the engine: correcting with exp(m_old_safe - m_safe), where
    # m_old_safe is 0 for the initial -inf, overflows to inf for scores below about -88 and
    # turns the 0 state into 0 * inf = NaN.  The correction must read the unguarded m_old.
    bad = sa.dataclasses.replace(
        SOFTMAX,
        states=(
            SOFTMAX.states[0],
            sa.dataclasses.replace(SOFTMAX.states[1], correction="T.exp(m_old_safe - m_safe)"),
        ),
        acc_correction="T.exp(m_old_safe - m_safe)",
    )
    text = sa.emit_attention_program(bad, sa.default_config("sm90a", "bfloat16", 64, False))
    assert "gd_m_old_safe[i] = T.if_then_else(st_m_old[i] ==" in text  # old guard derived from m_safe
    rng = np.random.default_rng(2)
    q, k, v = rand_qkv(rng, 1, 4, 40, 1, 1, 8)
    out, _ = sa.simulate(bad, np.abs(q) * 30, -np.abs(k) * 30, v, False, {"softmax_scale": 1.0}, block_m=16, block_n=16)
    assert np.isnan(out).any()


def test_low_precision_p_within_the_acceptance_rule():
    # P is cast to the input dtype before P@V, as on the GPU; judge by the ACCEPTANCE rule
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(3)
    B, Sq, Sk, H, Hk, D = 1, 33, 77, 2, 1, 32
    q, k, v = rand_qkv(rng, B, Sq, Sk, H, Hk, D)
    bf = ml_dtypes.bfloat16
    q, k, v = (x.astype(bf).astype(np.float32) for x in (q, k, v))
    scale = D**-0.5
    out, lse = sa.simulate(SOFTMAX, q, k, v, True, {"softmax_scale": scale}, 64, 32, 1, p_dtype=bf)
    ref_o, ref_lse = reference(q, k, v, True, scale)
    # "plain": what a user would write in bf16 (scores, softmax and P@V rounded to bf16)
    plain_o, _ = reference(q, k, v, True, scale)
    s = (np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k, 2, 2)) * scale).astype(bf).astype(np.float32)
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    s = np.where(j <= i + Sk - Sq, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).astype(bf).astype(np.float32)
    plain_o = np.einsum("bhqk,bkhd->bqhd", p, np.repeat(v, 2, 2)).astype(bf).astype(np.float32)
    out_lp = out.astype(bf).astype(np.float32)
    assert np.abs(out_lp - ref_o).max() <= 2 * np.abs(plain_o - ref_o).max() + 1e-5
    fin = np.isfinite(ref_lse)
    assert np.abs(lse[fin] - ref_lse[fin]).max() <= 1e-3


# ----------------------------------------------------------------------------------- split heuristic


def test_num_splits_heuristic():
    f = sa.choose_num_splits
    # a full grid never splits
    assert f(8, 32, 4096, 4096, 128, 128, 132) == 1
    # decode-like: one q-block per head, long context -> split
    n = f(1, 8, 1, 32768, 128, 128, 132)
    assert 2 <= n <= 64
    # never more splits than K/V tiles allow (4 tiles per segment)
    assert f(1, 1, 1, 1000, 128, 128, 132) == 2  # 8 tiles -> at most 2 segments of 4
    assert f(1, 1, 1, 100, 128, 128, 132) == 1
    # integer-only and monotone in the SM count for a fixed small grid
    assert f(1, 4, 1, 65536, 64, 64, 16) <= f(1, 4, 1, 65536, 64, 64, 132)


# ------------------------------------------------------------------------------ lowering (tilelang)


def _lower(tmp_path, cfg, combine=False):
    tilelang = pytest.importorskip("tilelang")
    tvm = pytest.importorskip("tvm")
    text = sa.emit_combine_program(SOFTMAX, cfg) if combine else sa.emit_attention_program(SOFTMAX, cfg)
    path = tmp_path / "variant.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("variant", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    target = tvm.target.Target({"kind": "cuda", "arch": cfg.arch})
    with tvm.transform.PassContext(opt_level=3, config=mod.PASS_CONFIGS), target:
        return tilelang.lower(mod.make_prim_func(), target={"kind": "cuda", "arch": cfg.arch}).kernel_source


def test_lower_sm90a_uses_tma_and_wgmma(tmp_path):
    src = _lower(tmp_path, sa.default_config("sm90a", "bfloat16", 64, True))
    assert "tl::tma_load(" in src and "wgmma_ss" in src and "wgmma_rs" in src
    assert "tma_store" in src  # O tile: TMA store clips rows past seqlen_q
    assert "CUDART_INF_F" in src  # masked scores and the m guard


def test_lower_sm80_uses_16_byte_zero_filling_cp_async(tmp_path):
    src = _lower(tmp_path, sa.default_config("sm80", "float16", 64, False))
    # K/V tiles: 16-byte cp.async whose source size is 0 past seqlen_k (zero fill, no read)
    assert "cp_async_gs_conditional<16>" in src
    assert "mma_sync" in src


def test_lower_combine(tmp_path):
    src = _lower(tmp_path, sa.default_config("sm90a", "float16", 64, False, True), combine=True)
    assert "logf" in src and "expf" in src

