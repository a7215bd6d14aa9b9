"""Benchmark cases: for each op, the shapes, the implementations timed (the op and its peers), the bytes and
flops of a case, and the correctness check on a small slice against redfuser_ops.reference.

Sizes (see docs/benchmarks.md):
- fused_attention prefill: Sq = Sk = S, batch = max(1, TOKENS // S) and heads = HIDDEN // D so that every S does
  about the same number of tokens (the convention of flash-attention's benchmarks); causal and not; bf16/fp16
  (CUDA) or fp32/bf16 (CPU); D 64 and 128. flops = 4 * B * H * D * (visible query-key pairs), which is
  4*B*H*Sq*Sk*D, about halved for causal. bytes = q + k + v + out + lse, each once.
- fused_attention decode: Sq = 1, long Sk, GQA; the shapes that take the split-KV path.
- moe_route: the router configurations of DeepSeek-V2-Lite (64 experts), DeepSeek-V2 (160, 8 groups keep 3),
  a plain 256-expert softmax router, and DeepSeek-V3 (256, sigmoid + bias, 8 groups keep 4, top 8,
  renormalised, x2.5); T tokens. bytes = logits + bias + weights + ids; flops counted as E * (5 + topk) per
  token (scoring, then one compare per element per selection round): a rough count, the op is bound by
  memory and latency.
- fp8_quant_gemm: the linear layers of DeepSeek-V3 and Llama-3-8B (GEMMS) at M 1, 16, 128, 1024, 4096 tokens, bf16
  activations, e4m3 weights with per-channel scales; peers: per-token quantisation in torch + torch._scaled_mm
  with row-wise scales and the plain bf16 torch.mm on a bf16 weight (CUDA), or a float32 matmul of the quantised
  values with the weight held in float32 (CPU). flops = 2 M N K; bytes = x + w + w_scale + out, each once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from . import peers

DT_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass
class Impl:
    name: str
    fn: Callable[..., Any]
    context: Callable[[], Any] | None = None  # entered around the calls (e.g. an SDPA backend)


@dataclass
class Case:
    op: str
    group: str  # table the case goes to: "prefill", "decode", "route"
    name: str
    params: dict[str, Any]
    dtype: torch.dtype
    flops: float
    bytes: float
    input_bytes: int  # one input set (buffer rotation)
    make_inputs: Callable[[torch.Generator, str], tuple]
    impls: list[Impl]
    check: Callable[[str, Any, tuple], dict[str, Any]]
    priority: int = 0
    extra_inputs: Callable[[str], tuple] | None = field(default=None)


# ----------------------------------------------------------------------------------------------------------
# fused_attention
# ----------------------------------------------------------------------------------------------------------

def visible_pairs(Sq: int, Sk: int, causal: bool) -> int:
    """Number of (query, key) pairs a bottom-right causal (or full) mask leaves visible."""
    if not causal:
        return Sq * Sk
    off = Sk - Sq  # query i sees keys j <= i + off
    total = 0
    # rows with i + off + 1 in [1, Sk]: closed form over the ranges
    lo = max(0, -off)  # first row that sees a key
    full_from = max(lo, Sk - off - 1)  # rows from here on see all Sk keys
    full_from = min(full_from, Sq)
    if full_from > lo:
        a, b = lo + off + 1, full_from - 1 + off + 1
        total += (a + b) * (full_from - lo) // 2
    total += (Sq - full_from) * Sk
    return total


def _attention_check(Sq: int, Sk: int, H: int, Hk: int, causal: bool) -> Callable[[str, Any, tuple], dict]:
    """Checks the last rows of batch 0 for one key/value head and its query heads, by ACCEPTANCE.md's rule:
    max|out - ref| <= 2 * max|plain - ref| + 1e-5, with ref in float64 (float32 for half inputs) and plain the
    attention written with torch ops in the inputs' dtype; lse within 1e-3 where finite."""
    from redfuser_ops import reference

    rows = min(Sq, 128)
    g = H // Hk
    cache: dict[str, Any] = {}

    def check(impl: str, result: Any, inputs: tuple) -> dict[str, Any]:
        q, k, v = inputs[:3]
        out, lse = (result[0], result[1]) if isinstance(result, (tuple, list)) else (result, None)
        qs, ks, vs = q[:1, Sq - rows:, :g], k[:1, :, :1], v[:1, :, :1]
        ref_dtype = torch.float64 if q.dtype == torch.float32 else torch.float32
        if not cache:
            r_out, r_lse = reference.fused_attention(qs, ks, vs, causal, None, dtype=ref_dtype)
            p_out, _ = reference.fused_attention(qs, ks, vs, causal, None, dtype=q.dtype)
            cache.update(r_out=r_out, r_lse=r_lse.float(),
                         plain_err=_maxerr(p_out.to(ref_dtype), r_out))
        o = out[:1, Sq - rows:, :g].to(ref_dtype)
        err = _maxerr(o, cache["r_out"])
        bound = 2 * cache["plain_err"] + 1e-5
        res: dict[str, Any] = {"max_err": err, "bound": bound, "plain_err": cache["plain_err"],
                               "slice": f"b0, rows {Sq - rows}..{Sq - 1}, heads 0..{g - 1}"}
        ok = err <= bound
        if lse is not None:
            got = lse[:1, :g, Sq - rows:].float()
            want = cache["r_lse"]
            fin = torch.isfinite(want)
            same_inf = bool(torch.equal(torch.isfinite(got), fin)) and bool(torch.equal(got[~fin], want[~fin]))
            lse_err = _maxerr(got[fin], want[fin]) if bool(fin.any()) else 0.0
            res["lse_err"] = lse_err
            ok = ok and same_inf and lse_err <= 1e-3
        res["ok"] = bool(ok)
        return res

    return check


def _maxerr(a: Tensor, b: Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    d = (a - b).abs()
    if not bool(torch.isfinite(d).all()):
        return math.inf
    return float(d.max())


def attention_case(B: int, Sq: int, Sk: int, H: int, Hk: int, D: int, dtype: torch.dtype, causal: bool,
                   device: str, group: str, peer_names: list[str], priority: int) -> Case:
    esize = torch.tensor([], dtype=dtype).element_size()
    pairs = visible_pairs(Sq, Sk, causal)
    flops = 4.0 * B * H * D * pairs
    nbytes = float(B * (2 * Sq * H * D + 2 * Sk * Hk * D) * esize + B * H * Sq * 4)
    input_bytes = B * (Sq * H + 2 * Sk * Hk) * D * esize
    g = H // Hk
    scale = D**-0.5
    kind = "causal" if causal else "full"
    name = (f"{DT_SHORT[dtype]} d{D} S{Sq} {kind} B{B} H{H}" if group == "prefill"
            else f"{DT_SHORT[dtype]} d{D} Sq{Sq} Sk{Sk} B{B} H{H}/{Hk} {kind}")
    params = {"B": B, "Sq": Sq, "Sk": Sk, "H": H, "Hk": Hk, "D": D, "dtype": DT_SHORT[dtype], "causal": causal}

    def make_inputs(gen: torch.Generator, dev: str) -> tuple:
        q = torch.randn(B, Sq, H, D, generator=gen, device=dev, dtype=dtype)
        k = torch.randn(B, Sk, Hk, D, generator=gen, device=dev, dtype=dtype)
        v = torch.randn(B, Sk, Hk, D, generator=gen, device=dev, dtype=dtype)
        return q, k, v

    mask_holder: dict[str, Tensor | None] = {}

    def mask() -> Tensor | None:
        if "m" not in mask_holder:
            mask_holder["m"] = peers.causal_mask(Sq, Sk, device) if causal else None
        return mask_holder["m"]

    impls = [Impl("redfuser", lambda q, k, v: torch.ops.redfuser.fused_attention(q, k, v, causal, None))]
    sdpa_ok = not causal or Sq == Sk  # SDPA's is_causal is top-left aligned
    for peer in peer_names:
        if peer.startswith("sdpa_"):
            if not sdpa_ok:
                continue
            backend = peer.removeprefix("sdpa_")
            impls.append(Impl(peer, peers.sdpa_attention(causal, g),
                              peers.sdpa_context(None if backend == "default" else backend)))
        elif peer == "eager":
            impls.append(Impl(peer, lambda q, k, v: peers.plain_attention(q, k, v, mask(), scale, g)))
        elif peer == "compile":
            impls.append(Impl(peer, lambda q, k, v: peers.compiled_plain_attention(scale, g, causal)(q, k, v, mask())))
    return Case("fused_attention", group, name, params, dtype, flops, nbytes, input_bytes, make_inputs, impls,
                _attention_check(Sq, Sk, H, Hk, causal), priority)


ATTN_PEERS = {"cuda": ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "eager", "compile"],
              "cpu": ["sdpa_default", "sdpa_math", "eager", "compile"]}


def attention_cases(device: str, size: str) -> list[Case]:
    """size: 'full', 'quick' or 'tiny'. Priority: bf16 (fp32 on CPU) d128 first, then decode, then the rest."""
    if device == "cuda":
        dtypes = [torch.bfloat16, torch.float16]
        tokens, hidden = 16384, 2048
        lengths = {"full": [512, 1024, 2048, 4096, 8192, 16384], "quick": [1024, 4096, 16384],
                   "tiny": [512]}[size]
        decode = [(1, 32, 8, 16384), (8, 32, 8, 8192), (64, 32, 8, 2048), (1, 32, 8, 131072)]
    else:
        dtypes = [torch.float32, torch.bfloat16]
        tokens, hidden = 2048, 256
        lengths = {"full": [256, 512, 1024, 2048], "quick": [256, 1024, 2048], "tiny": [64, 128]}[size]
        decode = [(1, 8, 2, 8192), (4, 8, 8, 2048)]
    heads = [128, 64] if size != "tiny" else [64]
    if size == "tiny":
        dtypes = dtypes[:1]
        decode = [(2, 4, 2, 1000)] if device == "cpu" else decode[:1]
    elif size == "quick":
        decode = decode[:3]
    peer_names = ATTN_PEERS[device]
    cases = []
    for di, dtype in enumerate(dtypes):
        for hi, D in enumerate(heads):
            prio = 0 if (di, hi) == (0, 0) else 10 + 2 * di + hi
            for S in lengths:
                for causal in (False, True):
                    cases.append(attention_case(max(1, tokens // S), S, S, max(1, hidden // D), max(1, hidden // D),
                                                D, dtype, causal, device, "prefill", peer_names, prio))
    for B, H, Hk, Sk in decode:
        cases.append(attention_case(B, 1, Sk, H, Hk, 128 if size != "tiny" else 64, dtypes[0], False, device,
                                    "decode", peer_names, 1))
    if device == "cpu" and size != "tiny":  # the shape of issue 14's table: B1 S1024 H8 D128, fp32 and bf16
        for dtype in dtypes:
            cases.append(attention_case(1, 1024, 1024, 8, 8, 128, dtype, False, device, "prefill", peer_names, 0))
    return cases


# ----------------------------------------------------------------------------------------------------------
# moe_route
# ----------------------------------------------------------------------------------------------------------

ROUTERS = {
    # name: (E, topk, scoring, renormalize, bias, n_group, topk_group, routed_scaling_factor)
    "e64-top6-softmax": (64, 6, "softmax", False, False, 1, 1, 1.0),
    "e160-top6-softmax-g8k3": (160, 6, "softmax", False, False, 8, 3, 1.0),
    "e256-top8-softmax-renorm": (256, 8, "softmax", True, False, 1, 1, 1.0),
    "dsv3-e256-top8-sigmoid-bias-g8k4": (256, 8, "sigmoid", True, True, 8, 4, 2.5),
}


def _route_check(router: tuple, T: int) -> Callable[[str, Any, tuple], dict]:
    """On the first rows: the ids must equal the float64 reference's, or else be a selection the reference's rule
    allows when ties are broken otherwise (torch.topk breaks ties its own way, and bf16 logits tie often): every
    chosen expert's group among the best topk_group groups, no unchosen expert of a group that must be kept
    above a chosen one, keys in descending order (all to a relative 1e-6). The weights must match the reference
    scores of the ids chosen (renormalised and scaled) to 1e-5 (fp32 logits) or 2e-2 (fp16/bf16)."""
    E, topk, scoring, renorm, _, ng, tg, scale = router
    rows = min(T, 512)
    size = E // ng

    def check(impl: str, result: Any, inputs: tuple) -> dict[str, Any]:
        from redfuser_ops import reference

        logits, bias = inputs
        w, ids = result
        lg = logits[:rows].cpu()  # the check runs on the CPU: its row loop reads single elements
        bias = bias.cpu() if bias is not None else None
        w, ids = w[:rows].cpu(), ids[:rows].cpu()
        _, rids, key, gscore = reference.moe_route(lg, topk, scoring, renorm, bias, ng, tg, scale, return_keys=True)
        x = lg.double()
        scores = torch.softmax(x, dim=-1) if scoring == "softmax" else torch.sigmoid(x)
        got = ids.long()
        in_range = bool(((got >= 0) & (got < E)).all())
        if not in_range:
            return {"ids_bad_rows": rows, "ids_tie_rows": 0, "rows": rows, "max_err": math.inf, "bound": 0.0,
                    "ok": False, "why": "ids outside [0, E)"}
        same = (got == rids).all(dim=1)
        tie_rows = bad_rows = 0
        for r in torch.nonzero(~same).flatten().tolist():
            if _valid_selection(got[r], key[r], gscore[r], size, tg):
                tie_rows += 1
            else:
                bad_rows += 1
        s = torch.gather(scores, 1, got)
        if renorm:
            tot = s.sum(-1, keepdim=True)
            s = s / torch.where(tot == 0, torch.ones_like(tot), tot)
        s = s * scale
        tol = 1e-5 if logits.dtype == torch.float32 else 2e-2
        werr = _maxerr(w.double(), s)
        return {"ids_bad_rows": bad_rows, "ids_tie_rows": tie_rows, "rows": rows, "max_err": werr, "bound": tol,
                "ok": bool(bad_rows == 0 and werr <= tol)}

    return check


def _valid_selection(chosen: Tensor, key: Tensor, gscore: Tensor, size: int, topk_group: int,
                     rel: float = 1e-6) -> bool:
    """Whether `chosen` (expert ids in order) is the grouped top-k of `key` under some way of breaking ties."""
    if len(set(chosen.tolist())) != chosen.numel():
        return False

    def tol(v: float) -> float:
        return rel * max(abs(v), 1e-30)

    k = key[chosen]
    if bool((k[1:] > k[:-1] + rel * k[:-1].abs().clamp_min(1e-30)).any()):
        return False  # not in descending order of key
    groups = set((chosen // size).tolist())
    if len(groups) > topk_group:
        return False
    ng = gscore.numel()
    thresh = float(torch.sort(gscore, descending=True).values[topk_group - 1])
    if any(float(gscore[g]) < thresh - tol(thresh) for g in groups):
        return False  # a chosen expert's group is not among the best
    must_keep = groups | {g for g in range(ng) if float(gscore[g]) > thresh + tol(thresh)}
    lowest = float(k.min())
    chosen_set = set(chosen.tolist())
    for g in must_keep:
        for e in range(g * size, (g + 1) * size):
            if e not in chosen_set and float(key[e]) > lowest + tol(lowest):
                return False  # an unchosen candidate beats a chosen one
    return True


def route_case(router_name: str, T: int, dtype: torch.dtype, device: str, peer_names: list[str],
               priority: int) -> Case:
    router = ROUTERS[router_name]
    E, topk, scoring, renorm, has_bias, ng, tg, scale = router
    esize = torch.tensor([], dtype=dtype).element_size()
    nbytes = float(T * E * esize + (E * 4 if has_bias else 0) + T * topk * 8)
    flops = float(T * E * (5 + topk))
    params = {"T": T, "E": E, "topk": topk, "scoring": scoring, "renormalize": renorm, "bias": has_bias,
              "n_group": ng, "topk_group": tg, "routed_scaling_factor": scale, "dtype": DT_SHORT[dtype],
              "router": router_name}
    bias_holder: dict[str, Tensor | None] = {}

    def make_inputs(gen: torch.Generator, dev: str) -> tuple:
        if "b" not in bias_holder:
            bias_holder["b"] = (torch.randn(E, generator=gen, device=dev) * 0.1 if has_bias else None)
        logits = (torch.randn(T, E, generator=gen, device=dev) * 2).to(dtype)
        return logits, bias_holder["b"]

    impls = [Impl("redfuser", lambda lg, b: torch.ops.redfuser.moe_route(lg, topk, scoring, renorm, b, ng, tg, scale))]
    for peer in peer_names:
        if peer == "eager":
            impls.append(Impl(peer, lambda lg, b: peers.torch_route(lg, b, topk, scoring, renorm, ng, tg, scale)))
        elif peer == "compile":
            impls.append(Impl(peer, lambda lg, b: peers.compiled_torch_route(topk, scoring, renorm, ng, tg, scale)(lg, b)))
    return Case("moe_route", "route", f"{router_name} T{T} {DT_SHORT[dtype]}", params, dtype, flops, nbytes,
                T * E * esize, make_inputs, impls, _route_check(router, T), priority)


def route_cases(device: str, size: str) -> list[Case]:
    tokens = {"cuda": {"full": [1, 64, 1024, 16384], "quick": [1, 64, 1024, 16384], "tiny": [1, 64]},
              "cpu": {"full": [1, 64, 1024, 4096], "quick": [1, 64, 1024, 4096], "tiny": [1, 64]}}[device][size]
    routers = list(ROUTERS) if size != "tiny" else ["e64-top6-softmax", "dsv3-e256-top8-sigmoid-bias-g8k4"]
    peer_names = ["eager", "compile"]
    cases = []
    for r in routers:
        prio = 2 if r.startswith("dsv3") else 3
        for T in tokens:
            cases.append(route_case(r, T, torch.bfloat16, device, peer_names, prio))
    return cases


# ----------------------------------------------------------------------------------------------------------
# softmax_cross_entropy, logsumexp: ops made only of their YAML spec (one pass over rows of a vocabulary)
# ----------------------------------------------------------------------------------------------------------

def _rows_check(op: str, eps: float) -> Callable[[str, Any, tuple], dict]:
    """On the first rows, ACCEPTANCE.md's rule: max|out - ref| <= 2 * max|plain - ref| + 1e-5, ref the op written
    with torch in float64, plain the same in the inputs' dtype (torch's cross_entropy with reduction='none' is the
    meaning of softmax_cross_entropy)."""
    import torch.nn.functional as F

    def torch_op(x: Tensor, target: Tensor | None) -> Tensor:
        if op == "logsumexp":
            return torch.logsumexp(x, dim=-1)
        return F.cross_entropy(x, target.long(), reduction="none", label_smoothing=eps)

    def check(impl: str, result: Any, inputs: tuple) -> dict[str, Any]:
        x = inputs[0][:64].cpu()
        target = inputs[1][:64].cpu() if len(inputs) > 1 else None
        ref = torch_op(x.double(), target)
        plain = _maxerr(torch_op(x, target).double(), ref)
        err = _maxerr(result[:64].cpu().double(), ref)
        return {"max_err": err, "bound": 2 * plain + 1e-5, "plain_err": plain, "ok": bool(err <= 2 * plain + 1e-5)}

    return check


def _topk_check(k: int) -> Callable[[str, Any, tuple], dict]:
    """On the first rows: the ids pick the k largest logits (their values equal torch.topk's sorted values, whatever
    the order of ties) and the probabilities obey ACCEPTANCE.md's rule against the float64 softmax at those values
    (plain: torch.softmax in float32)."""

    def check(impl: str, result: Any, inputs: tuple) -> dict[str, Any]:
        x = inputs[0][:64].cpu()
        probs, ids = (r[:64].cpu() for r in result)
        want = x.double().topk(k, dim=-1).values
        ids_ok = bool(torch.equal(x.double().gather(-1, ids.long()), want))
        ref = torch.softmax(x.double(), dim=-1).topk(k, dim=-1).values
        plain = _maxerr(torch.softmax(x.float(), dim=-1).topk(k, dim=-1).values.double(), ref)
        err = _maxerr(probs.double(), ref)
        return {"max_err": err, "bound": 2 * plain + 1e-5, "plain_err": plain, "ids_ok": ids_ok,
                "ok": bool(ids_ok and err <= 2 * plain + 1e-5)}

    return check


def topk_case(T: int, V: int, k: int, dtype: torch.dtype) -> Case:
    """vocab_topk (top-k of a vocabulary for sampling) against torch: softmax in float32, then topk (the
    probabilities materialised); bytes = the logits read once + the outputs."""
    esize = torch.tensor([], dtype=dtype).element_size()

    def make_inputs(gen: torch.Generator, dev: str) -> tuple:
        return ((torch.randn(T, V, generator=gen, device=dev) * 4).to(dtype),)

    def eager(x):
        top = torch.softmax(x.float(), dim=-1).topk(k, dim=-1)
        return top.values, top.indices

    impls = [Impl("redfuser", lambda x: torch.ops.redfuser.vocab_topk(x, k)), Impl("eager", eager),
             Impl("compile", torch.compile(eager, dynamic=False))]
    return Case("vocab_topk", "rows", f"T{T} V{V} k{k} {DT_SHORT[dtype]}", {"T": T, "V": V, "k": k,
                "dtype": DT_SHORT[dtype]}, dtype, float(T * V * 4), float(T * V * esize + T * k * 12), T * V * esize,
                make_inputs, impls, _topk_check(k), 5)


def topk_cases(device: str, size: str) -> list[Case]:
    if device == "cuda":  # stream_row with a selection: a CTA per row, never split
        shapes = {"full": [(1, 128256, 50), (64, 128256, 50), (1024, 128256, 50), (1024, 32000, 8)],
                  "quick": [(64, 128256, 50), (1024, 128256, 50)], "tiny": [(64, 128256, 50)]}[size]
    else:
        shapes = {"full": [(1, 128256, 50), (64, 32000, 50), (16, 128256, 50)],
                  "quick": [(64, 32000, 50), (16, 128256, 50)], "tiny": [(4, 1000, 5)]}[size]
    return [topk_case(T, V, k, dt) for T, V, k in shapes for dt in [torch.float32, torch.bfloat16][:1 if size == "tiny" else 2]]


# ----------------------------------------------------------------------------------------------------------
# mla_decode
# ----------------------------------------------------------------------------------------------------------

def mla_case(B: int, ctx: int, Hq: int, Sq: int, dtype: torch.dtype, causal: bool, device: str,
             peer_names: list[str], priority: int) -> Case:
    """Every sequence holds `ctx` keys in 64-row pages placed at random in the cache. bytes = the cache rows read
    (ctx x 576 per sequence) + q + out + lse; flops = 2 * B * Hq * Sq * ctx * (576 + 512) (q.k and p.v)."""
    page, D, dv = 64, 576, 512
    esize = torch.tensor([], dtype=dtype).element_size()
    mb = -(-ctx // page)
    nbytes = float(B * ctx * D * esize + B * Sq * Hq * (D + dv) * esize + B * Hq * Sq * 4)
    flops = 2.0 * B * Hq * Sq * ctx * (D + dv)
    scale = D**-0.5
    params = {"B": B, "ctx": ctx, "Hq": Hq, "Sq": Sq, "dtype": DT_SHORT[dtype], "causal": causal}

    def make_inputs(gen: torch.Generator, dev: str) -> tuple:
        q = torch.randn(B, Sq, Hq, D, generator=gen, device=dev, dtype=dtype)
        kv = torch.randn(B * mb, page, 1, D, generator=gen, device=dev, dtype=dtype)
        table = torch.randperm(B * mb, generator=gen, device=dev).to(torch.int32).reshape(B, mb)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        return q, kv, table, lens

    impls = [Impl("redfuser", lambda q, kv, t, n: torch.ops.redfuser.mla_decode(q, kv, t, n, dv, None, causal))]
    for peer in peer_names:
        if peer == "eager":
            impls.append(Impl(peer, lambda q, kv, t, n: peers.torch_mla_decode(q, kv, t, n, dv, scale, causal)))
        elif peer == "compile":
            impls.append(Impl(peer, lambda q, kv, t, n: peers.compiled_torch_mla_decode(dv, scale, causal)(q, kv, t, n)))
    name = f"{DT_SHORT[dtype]} B{B} ctx{ctx} Hq{Hq} Sq{Sq}" + (" causal" if causal else "")
    return Case("mla_decode", "decode", name, params, dtype, flops, nbytes, B * (ctx * D + Sq * Hq * D) * esize,
                make_inputs, impls, _mla_check(Sq, Hq, causal), priority)


def _mla_check(Sq: int, Hq: int, causal: bool) -> Callable[[str, Any, tuple], dict]:
    """ACCEPTANCE.md's rule on sequence 0 (all heads): ref in float32 from the half inputs, plain = the same
    attention in the inputs' dtype; lse within 1e-3."""
    from redfuser_ops import reference

    cache: dict[str, Any] = {}

    def check(impl: str, result: Any, inputs: tuple) -> dict[str, Any]:
        q, kv, table, lens = (x[:1] if i != 1 else x for i, x in enumerate(inputs))
        out, lse = result
        if not cache:
            r_out, r_lse = reference.mla_decode(q, kv, table, lens, 512, None, causal, dtype=torch.float32)
            p_out, _ = reference.mla_decode(q, kv, table, lens, 512, None, causal, dtype=q.dtype)
            cache.update(r_out=r_out, r_lse=r_lse, plain_err=_maxerr(p_out.float(), r_out))
        err = _maxerr(out[:1].float(), cache["r_out"])
        lse_err = _maxerr(lse[:1].float(), cache["r_lse"])
        bound = 2 * cache["plain_err"] + 1e-5
        return {"max_err": err, "bound": bound, "plain_err": cache["plain_err"], "lse_err": lse_err,
                "slice": "sequence 0", "ok": bool(err <= bound and lse_err <= 1e-3)}

    return check


def rows_case(op: str, T: int, V: int, dtype: torch.dtype, eps: float = 0.1) -> Case:
    esize = torch.tensor([], dtype=dtype).element_size()
    params = {"T": T, "V": V, "dtype": DT_SHORT[dtype]} | ({"label_smoothing": eps} if op != "logsumexp" else {})

    def make_inputs(gen: torch.Generator, dev: str) -> tuple:
        x = (torch.randn(T, V, generator=gen, device=dev) * 4).to(dtype)
        if op == "logsumexp":
            return (x,)
        target = torch.randint(0, V, (T,), generator=gen, device=dev)
        target[::7] = -100  # some ignored tokens
        return x, target

    if op == "logsumexp":
        def eager(x):
            return torch.logsumexp(x.float(), dim=-1)
        ours = torch.ops.redfuser.logsumexp
    else:
        def eager(x, t):
            return torch.nn.functional.cross_entropy(x.float(), t, reduction="none", label_smoothing=eps)

        def ours(x, t):
            return torch.ops.redfuser.softmax_cross_entropy(x, t, eps)
    impls = [Impl("redfuser", ours), Impl("eager", eager), Impl("compile", torch.compile(eager, dynamic=False))]
    return Case(op, "rows", f"T{T} V{V} {DT_SHORT[dtype]}", params, dtype, float(T * V * 4), float(T * V * esize + T * 12),
                T * V * esize, make_inputs, impls, _rows_check(op, eps), 5)


def _rows_cases(op: str) -> Callable[[str, str], list[Case]]:
    def cases(device: str, size: str) -> list[Case]:
        if device == "cuda":  # the stream_row template (a CTA per row): vocabularies of 32k and 128k (Llama 3)
            shapes = {"full": [(1024, 128256), (4096, 128256), (8192, 32000), (16, 128256)],
                      "quick": [(1024, 128256), (4096, 32000)], "tiny": [(64, 128256)]}[size]
            dts = [torch.bfloat16, torch.float32][:1 if size == "tiny" else 2]
            return [rows_case(op, T, V, dt) for T, V in shapes for dt in dts]
        shapes = {"full": [(64, 32000), (16, 128256), (512, 32000)], "quick": [(64, 32000), (16, 128256)],
                  "tiny": [(4, 1000)]}[size]
        return [rows_case(op, T, V, dt) for T, V in shapes for dt in [torch.float32, torch.bfloat16][:1 if size == "tiny" else 2]]

    return cases


# ----------------------------------------------------------------------------------------------------------
# rms_norm_fp8_quant, row_softmax: ops made only of their YAML spec whose outputs are indexed by the streamed
# axis (a final pass over the row writes each element; on CUDA stream_row's final pass, split rows: a final program)
# ----------------------------------------------------------------------------------------------------------
E4M3_MAX, E4M3_MIN_SCALE = 448.0, 1.0 / (448.0 * 512.0)  # vLLM's per-token convention (specs/rms_norm_fp8_quant.yaml)


def _rms_quant_torch(x: Tensor, w: Tensor, eps: float, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """RMS norm then per-token quantisation written with torch ops in `dtype` (float32: what vLLM's native path
    computes); returns (y / scale clamped to +-448, scale), not yet rounded to e4m3."""
    xd = x.to(dtype)
    y = xd * torch.rsqrt(xd.square().mean(dim=-1, keepdim=True) + eps) * w.to(dtype)
    scale = (y.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=E4M3_MIN_SCALE)
    return (y / scale).clamp(-E4M3_MAX, E4M3_MAX), scale[:, 0]


def _rms_quant_check(eps: float) -> Callable[[str, Any, tuple], dict]:
    """On the first rows: q within one e4m3 unit of the e4m3 rounding of the float64 reference, scale within a
    relative 5e-6 of it (tests/test_per_element_outputs.py judges the same way)."""

    def check(impl: str, result: Any, inputs: tuple) -> dict[str, Any]:
        x, w = inputs[0][:64].cpu(), inputs[1].cpu()
        q, scale = result[0][:64].cpu().double(), result[1][:64].cpu().double()
        ref_v, ref_s = _rms_quant_torch(x, w, eps, torch.float64)
        ref_q = ref_v.to(torch.float8_e4m3fn).double()
        unit = torch.exp2(torch.floor(torch.log2(torch.maximum(q.abs(), ref_q.abs()).clamp(min=2.0**-6))) - 3)
        q_units = ((q - ref_q).abs() / unit).max().item()
        rel = ((scale - ref_s).abs() / ref_s).max().item()
        return {"max_err": q_units, "bound": 1.0, "q_max_units": q_units, "scale_rel_err": rel,
                "ok": bool(q_units <= 1 and rel <= 5e-6)}

    return check


def rms_quant_case(T: int, N: int, dtype: torch.dtype, eps: float = 1e-6) -> Case:
    esize = torch.tensor([], dtype=dtype).element_size()

    def make_inputs(gen: torch.Generator, dev: str) -> tuple:
        x = (torch.randn(T, N, generator=gen, device=dev) * 3).to(dtype)
        w = (1 + 0.5 * torch.randn(N, generator=gen, device=dev)).to(dtype)
        return x, w

    def eager(x, w):
        v, scale = _rms_quant_torch(x, w, eps)
        return v.to(torch.float8_e4m3fn), scale

    def ours(x, w):
        return torch.ops.redfuser.rms_norm_fp8_quant(x, w, eps)

    impls = [Impl("redfuser", ours), Impl("eager", eager), Impl("compile", torch.compile(eager, dynamic=False))]
    return Case("rms_norm_fp8_quant", "rows", f"T{T} N{N} {DT_SHORT[dtype]}", {"T": T, "N": N, "dtype": DT_SHORT[dtype]},
                dtype, float(T * N * 8), float(T * N * (esize + 1) + N * esize + T * 4), T * N * esize + N * esize,
                make_inputs, impls, _rms_quant_check(eps), 5)


def rms_quant_cases(device: str, size: str) -> list[Case]:
    # the same shapes on CUDA (stream_row: one CTA per row, a final pass writes q); never run on a GPU yet
    shapes = {"full": [(1, 4096), (128, 4096), (128, 7168), (1024, 4096), (1024, 7168)],
              "quick": [(1, 4096), (128, 4096), (128, 7168)], "tiny": [(4, 256)]}[size]
    return [rms_quant_case(T, N, dt) for T, N in shapes for dt in [torch.float32, torch.bfloat16][:1 if size == "tiny" else 2]]


def _softmax_check(impl: str, result: Any, inputs: tuple) -> dict[str, Any]:
    """On the first rows, ACCEPTANCE.md's rule against torch.softmax in float64 (plain: in the inputs' dtype)."""
    x = inputs[0][:64].cpu()
    ref = torch.softmax(x.double(), dim=-1)
    plain = _maxerr(torch.softmax(x, dim=-1).double(), ref)
    err = _maxerr(result[:64].cpu().double(), ref)
    return {"max_err": err, "bound": 2 * plain + 1e-5, "plain_err": plain, "ok": bool(err <= 2 * plain + 1e-5)}


def softmax_case(T: int, E: int, dtype: torch.dtype) -> Case:
    esize = torch.tensor([], dtype=dtype).element_size()

    def make_inputs(gen: torch.Generator, dev: str) -> tuple:
        return ((torch.randn(T, E, generator=gen, device=dev) * 4).to(dtype),)

    def eager(x):
        return torch.softmax(x, dim=-1)

    impls = [Impl("redfuser", torch.ops.redfuser.row_softmax), Impl("eager", eager),
             Impl("compile", torch.compile(eager, dynamic=False))]
    return Case("row_softmax", "rows", f"T{T} E{E} {DT_SHORT[dtype]}", {"T": T, "E": E, "dtype": DT_SHORT[dtype]},
                dtype, float(T * E * 5), float(2 * T * E * esize), T * E * esize, make_inputs, impls, _softmax_check, 5)


def softmax_cases(device: str, size: str) -> list[Case]:
    shapes = {"full": [(64, 32000), (1024, 4096), (16, 128256)], "quick": [(64, 32000), (1024, 4096)],
              "tiny": [(4, 1000)]}[size]
    return [softmax_case(T, E, dt) for T, E in shapes for dt in [torch.float32, torch.bfloat16][:1 if size == "tiny" else 2]]


def mla_cases(device: str, size: str) -> list[Case]:
    """(B, ctx, Hq[, Sq]): small batches at long contexts take the split-KV path; B 64..128 at 4k..16k with Hq 16 is
    the bandwidth target, Hq 128 the compute-bound one; Sq 2 (causal) is speculative / multi-token decoding."""
    if device == "cuda":
        dtypes = [torch.bfloat16]
        shapes = {"full": [(b, c, h) for h in (16, 128) for b in (1, 8, 64, 128) for c in (1024, 4096, 16384, 32768)]
                  + [(64, 4096, 16, 2), (64, 4096, 128, 2)],
                  "quick": [(64, 4096, 16), (128, 16384, 16), (1, 32768, 16), (64, 4096, 128), (8, 16384, 128)],
                  "tiny": [(2, 1000, 16)]}[size]
    else:
        dtypes = [torch.bfloat16]
        # issue 14's shape (B4 Hq16 L4096) first; (B, ctx, Hq, Sq) with Sq > 1 causal
        shapes = {"full": [(4, 4096, 16), (1, 4096, 16), (8, 4096, 16), (8, 2048, 128), (8, 2048, 16, 2)],
                  "quick": [(4, 4096, 16), (1, 4096, 16), (8, 1024, 128)],
                  "tiny": [(2, 300, 16), (2, 300, 4, 3)]}[size]
    peer_names = ["eager", "compile"] if size != "tiny" else ["eager"]
    out = []
    for dt in dtypes:
        for B, ctx, Hq, *sq in shapes:
            Sq = sq[0] if sq else 1
            out.append(mla_case(B, ctx, Hq, Sq, dt, Sq > 1, device, peer_names, 4))
    return out


# ----------------------------------------------------------------------------------------------------------
# fp8_quant_gemm
# ----------------------------------------------------------------------------------------------------------

# (N, K) of the linear layers: DeepSeek-V3 (q_a+kv_a down projection, q_b up projection, attention output) and
# Llama-3-8B (fused qkv, MLP down projection)
GEMMS = {
    "dsv3-qkv-a": (2112, 7168), "dsv3-q-b": (24576, 1536), "dsv3-o": (7168, 16384), "dsv3-wo-b": (7168, 2048),
    "llama3-qkv": (6144, 4096), "llama3-down": (4096, 14336), "llama3-o": (4096, 4096),
    "small": (512, 512),  # CPU smoke test only
}


def _gemm_check(M: int, N: int, K: int) -> Callable[[str, Any, tuple], dict]:
    """ACCEPTANCE.md's rule on the first rows: max|out - ref| <= 2 * max|two_pass - ref| + 1e-2 * max|ref|, ref in
    float64 from x @ (w * w_scale)^T and two_pass quantise-then-GEMM in float32, computed on the CPU."""
    rows = min(M, 8)
    cache: dict[str, Any] = {}

    def check(impl: str, result: Any, inputs: tuple) -> dict[str, Any]:
        from redfuser_ops import reference

        x, w, ws = (t[:rows].cpu() if i == 0 else t.cpu() for i, t in enumerate(inputs[:3]))
        if not cache:
            wsf = ws.expand(N)
            r = reference.fp8_quant_gemm(x, w, wsf)
            two = reference.fp8_quant_gemm_two_pass(x, w, wsf).double()
            cache.update(r=r, bound=2 * _maxerr(two, r) + 1e-2 * float(r.abs().max()))
        err = _maxerr(result[:rows].cpu().double(), cache["r"])
        return {"max_err": err, "bound": cache["bound"], "rows": rows, "ok": bool(err <= cache["bound"])}

    return check


def gemm_case(gemm: str, M: int, dtype: torch.dtype, device: str, priority: int) -> Case:
    N, K = GEMMS[gemm]
    esize = torch.tensor([], dtype=dtype).element_size()
    flops = 2.0 * M * N * K
    nbytes = float(M * K * esize + N * K + 4 * N + M * N * esize)
    params = {"M": M, "N": N, "K": K, "dtype": DT_SHORT[dtype], "gemm": gemm}

    def make_inputs(gen: torch.Generator, dev: str) -> tuple:
        x = torch.randn(M, K, generator=gen, device=dev).to(dtype)
        w = (torch.randn(N, K, generator=gen, device=dev) * 0.05).to(torch.float8_e4m3fn)
        ws = torch.rand(N, generator=gen, device=dev) + 0.5
        if dev == "cuda":  # the bf16/fp16 weight a plain model holds (for torch.mm)
            return x, w, ws, (w.to(dtype) * ws.to(dtype)[:, None])
        return x, w, ws, w.float()  # the CPU two-pass path's weight: the e4m3 values in float32, converted once

    impls = [Impl("redfuser", lambda x, w, ws, wd: torch.ops.redfuser.fp8_quant_gemm(x, w, ws))]
    if device == "cuda":
        impls.append(Impl("two_pass_scaled_mm", lambda x, w, ws, wd: peers.two_pass_scaled_mm(x, w, ws, dtype)))
        impls.append(Impl("mm_" + DT_SHORT[dtype], lambda x, w, ws, wd: torch.mm(x, wd.t())))
    else:
        impls.append(Impl("two_pass_torch", lambda x, w, ws, wf: peers.two_pass_torch(x, wf, ws, dtype)))
    return Case("fp8_quant_gemm", "gemm", f"{gemm} M{M} {DT_SHORT[dtype]}", params, dtype, flops, nbytes,
                M * K * esize + N * K * (1 + esize) + 4 * N, make_inputs, impls, _gemm_check(M, N, K), priority)


def gemm_cases(device: str, size: str) -> list[Case]:
    if device == "cuda":
        ms = {"full": [1, 16, 128, 1024, 4096], "quick": [1, 16, 128, 1024, 4096], "tiny": [1, 128]}[size]
        gemms = list(GEMMS) if size == "full" else ["dsv3-q-b", "dsv3-wo-b", "llama3-qkv", "llama3-down"]
    else:
        ms = {"full": [1, 16, 128, 1024], "quick": [1, 16, 128], "tiny": [1, 16]}[size]
        # llama3-o at M 128 is issue 14's shape (N 4096, K 4096); tiny: a smoke test in seconds
        gemms = {"full": ["llama3-o", "dsv3-wo-b", "llama3-qkv"], "quick": ["llama3-o", "dsv3-wo-b"],
                 "tiny": ["small"]}[size]
    if size == "tiny" and device == "cuda":
        gemms = gemms[:1]
    return [gemm_case(g, M, torch.bfloat16, device, 4 if g.startswith("dsv3") or g == "llama3-o" else 5)
            for g in gemms for M in ms]


OPS = {"fused_attention": attention_cases, "moe_route": route_cases, "mla_decode": mla_cases, "fp8_quant_gemm": gemm_cases,
       "softmax_cross_entropy": _rows_cases("softmax_cross_entropy"), "logsumexp": _rows_cases("logsumexp"),
       "rms_norm_fp8_quant": rms_quant_cases, "row_softmax": softmax_cases, "vocab_topk": topk_cases}
