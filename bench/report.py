"""Tables, plots and the short summary of a results.json (`python -m bench.report [--summary] results.json`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import OrderedDict
from pathlib import Path

GROUP_TITLES = {
    ("fused_attention", "prefill"): "fused_attention, prefill (Sq = Sk): TFLOP/s",
    ("fused_attention", "decode"): "fused_attention, decode (Sq = 1, split-KV shapes): time in µs",
    ("moe_route", "route"): "moe_route: time in µs",
    ("fp8_quant_gemm", "gemm"): "fp8_quant_gemm (bf16 x, e4m3 w, per-channel scales): TFLOP/s",
}
RATE_GROUPS = ("prefill", "gemm")  # tables in TFLOP/s (higher is better); the others in µs


def _impl_order(rows: list[dict]) -> list[str]:
    seen: OrderedDict[str, None] = OrderedDict()
    for r in rows:
        seen.setdefault(r["impl"], None)
    names = list(seen)
    return (["redfuser"] if "redfuser" in names else []) + [n for n in names if n != "redfuser"]


def _by_case(rows: list[dict]) -> OrderedDict[str, dict[str, dict]]:
    out: OrderedDict[str, dict[str, dict]] = OrderedDict()
    for r in rows:
        out.setdefault(r["case"], {})[r["impl"]] = r
    return out


def _fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "–"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if 0 < abs(x) < 1:
        return f"{x:.2g}"  # small rates (a CPU's TFLOP/s) keep two significant digits
    return f"{x:.{digits}f}"


def _metric(r: dict, group: str) -> float | None:
    if r.get("status") != "ok":
        return None
    return r["tflops"] if group in RATE_GROUPS else r["time_us"]


def _better(a: float, b: float, group: str) -> bool:
    return a > b if group in RATE_GROUPS else a < b


def best_peer(impls: dict[str, dict], group: str) -> tuple[str | None, float | None]:
    """The fastest correct peer of a case."""
    best, val = None, None
    for name, r in impls.items():
        if name == "redfuser":
            continue
        m = _metric(r, group)
        if m is None or not r.get("correct", {}).get("ok", False):
            continue
        if val is None or _better(m, val, group):
            best, val = name, m
    return best, val


def speedup(ours: float, peer: float, group: str) -> float:
    return ours / peer if group in RATE_GROUPS else peer / ours


def _groups(data: dict) -> OrderedDict[tuple[str, str], list[dict]]:
    g: OrderedDict[tuple[str, str], list[dict]] = OrderedDict()
    for key in GROUP_TITLES:
        rows = [r for r in data.get("results", []) if (r["op"], r["group"]) == key]
        if rows:
            g[key] = rows
    for r in data.get("results", []):
        key = (r["op"], r["group"])
        if key not in g:
            g[key] = [x for x in data["results"] if (x["op"], x["group"]) == key]
    return g


def markdown(data: dict) -> str:
    dev, ver, opt = data.get("device", {}), data.get("versions", {}), data.get("options", {})
    lines = [f"# Benchmarks: {data.get('machine')}", ""]
    where = f"{dev.get('name')}"
    if dev.get("type") == "cuda":
        where += f" ({dev.get('capability')}, {dev.get('sms')} SMs, L2 {dev.get('cache_bytes', 0) / 2**20:.0f} MiB)"
    else:
        where += f" ({dev.get('torch_threads')} torch threads, last-level cache {dev.get('cache_bytes', 0) / 2**20:.0f} MiB)"
    state = "complete" if data.get("complete") else \
        "INCOMPLETE: " + str(data.get("aborted") or "cases skipped (time budget)")
    families = ", ".join(data.get("library", {}).get("families") or []) or "none"
    lines += [
        (f"- when: {data.get('created')}; {data.get('elapsed_s')} s; cases: {opt.get('size')}, budget "
         f"{opt.get('budget_s') or 'none'} s; {state}"),
        (f"- device: {where}; host {dev.get('host_cpu')}, load average (1/5/15 min) at start "
         f"{dev.get('load_average_at_start')}, at end {dev.get('load_average_at_end')}"),
        (f"- redfuser-ops {ver.get('redfuser_ops')} (git {ver.get('git')}), torch {ver.get('torch')}, "
         f"CUDA {ver.get('cuda')}, Python {ver.get('python')}; arch families in the library: {families}"),
        f"- command: `python -m bench.run {' '.join(opt.get('argv') or [])}`",
    ]
    vector = [f for f in dev.get("cpu_flags") or [] if f.startswith(("avx", "amx", "fma", "f16c", "sse4"))]
    if vector:
        lines.append(f"- CPU vector flags: {' '.join(vector)} (all {len(dev['cpu_flags'])} flags in results.json)")
    lines += [
        "",
    ]
    c = data.get("ceilings", {})
    if c:
        mm = c.get("matmul_TFLOPs", {})
        lines += ["## Ceilings, measured in this run", "",
                  "| copy bandwidth (read + write) | " + " | ".join(f"matmul {k}" for k in mm) + " |",
                  "|---|" + "---|" * len(mm),
                  f"| {_fmt(c.get('copy_GBps'))} GB/s | " + " | ".join(f"{_fmt(v, 2)} TFLOP/s" for v in mm.values()) + " |",
                  ""]
    errors: OrderedDict[tuple[str, str], list[str]] = OrderedDict()
    for (op, group), rows in _groups(data).items():
        impls = _impl_order(rows)
        title = GROUP_TITLES.get((op, group), f"{op}, {group}")
        lines += [f"## {title}", ""]
        extra = ["% of matmul"] if group in RATE_GROUPS else ["GB/s", "% of copy"]
        head = ["case", "redfuser", *extra, *[i for i in impls if i != "redfuser"], "vs best peer", "correct"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for case, by_impl in _by_case(rows).items():
            cells = [case]
            for name in impls:
                r = by_impl.get(name)
                if r is None:
                    cell = ""
                elif r["status"] == "ok":
                    cell = _fmt(_metric(r, group))
                    if not r.get("correct", {}).get("ok", False):
                        cell += " ✗"
                elif r["status"] == "skipped":
                    cell = "skip"
                else:
                    key = (name, r.get("error", ""))
                    errors.setdefault(key, []).append(case)
                    cell = f"err[{list(errors).index(key) + 1}]"
                cells.append(cell)
                if name == "redfuser":
                    if r is not None and r["status"] == "ok":
                        if group in RATE_GROUPS:
                            cells.append(_fmt(100 * r["frac_matmul"]) if r.get("frac_matmul") else "–")
                        else:
                            cells.append(_fmt(r.get("gbps")))
                            cells.append(_fmt(100 * r["frac_copy"]) if r.get("frac_copy") else "–")
                    else:
                        cells += ["–"] * len(extra)
            ours = by_impl.get("redfuser")
            peer, val = best_peer(by_impl, group)
            if ours and ours["status"] == "ok" and val:
                cells.append(f"{speedup(_metric(ours, group), val, group):.2f}x {peer}")
            else:
                cells.append("–")
            bad = [n for n, r in by_impl.items() if r["status"] == "ok" and not r.get("correct", {}).get("ok", False)]
            if ours and ours["status"] == "ok":
                cc = ours.get("correct", {})
                mine = f"{cc.get('max_err', float('nan')):.1e} ≤ {cc.get('bound', float('nan')):.1e}"
                if "ids_bad_rows" in cc:
                    mine = f"ids ok, w err {cc.get('max_err', float('nan')):.1e}" if cc.get("ok") else \
                        f"ids wrong in {cc['ids_bad_rows']}/{cc['rows']} rows"
            else:
                mine = "–"
            cells.append(mine + (f"; WRONG: {', '.join(bad)}" if bad else ""))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if errors:
        lines += ["## Errors (a peer that cannot run a case)", "", "| # | impl | error | cases |", "|---|---|---|---|"]
        for i, ((name, err), cases) in enumerate(errors.items(), 1):
            shown = ", ".join(cases[:3]) + (f" and {len(cases) - 3} more" if len(cases) > 3 else "")
            lines.append(f"| {i} | {name} | {err.replace('|', '/')[:300]} | {shown} |")
        lines.append("")
    lines += [
        "## How this was measured", "",
        ("Each case is timed per call (CUDA events around every call on a GPU, time.perf_counter on the CPU) after "
        "warm-up, and the median is shown; inputs rotate over several buffer sets totalling about three times the "
        "last-level cache (up to a memory cap), so large cases are not served from a warm cache. No CUDA graphs: "
        "an implementation that launches many kernels pays its launch gaps. bytes = each input read once and each "
        "output written once; flops = 4·B·H·D·(visible query-key pairs) for attention. Correctness: every "
        "implementation's output on a slice of the first input set against redfuser_ops.reference (ACCEPTANCE.md's "
        "rules); ✗ marks a result outside the bound. 'vs best peer' compares with the fastest correct peer "
        "(> 1 means redfuser is faster). See docs/benchmarks.md."),
        "",
    ]
    return "\n".join(lines)


def summary(data: dict, max_rows: int = 40) -> str:
    """A short text table: per group the cases run, wrong results, and redfuser against the best peer."""
    out = []
    status = "complete" if data.get("complete") else f"INCOMPLETE ({data.get('aborted') or 'time budget'})"
    c = data.get("ceilings", {})
    mm = ", ".join(f"{k} {_fmt(v)}" for k, v in c.get("matmul_TFLOPs", {}).items())
    out.append(f"== bench {data.get('machine')}: {status}, {data.get('elapsed_s')} s; copy "
               f"{c.get('copy_GBps', float('nan')):.0f} GB/s, matmul TFLOP/s {mm}")
    rows_out = []
    for (op, group), rows in _groups(data).items():
        cases = _by_case(rows)
        n_ok = sum(1 for v in cases.values() if v.get("redfuser", {}).get("status") == "ok")
        wrong = [f"{case}/{n}" for case, v in cases.items() for n, r in v.items()
                 if r["status"] == "ok" and not r.get("correct", {}).get("ok", False)]
        errs = sum(1 for v in cases.values() for r in v.values() if r["status"] == "error")
        skipped = sum(1 for v in cases.values() for r in v.values() if r["status"] == "skipped")
        ratios = []
        for case, v in cases.items():
            ours = v.get("redfuser")
            peer, val = best_peer(v, group)
            if ours and ours["status"] == "ok" and val:
                ratios.append(speedup(_metric(ours, group), val, group))
            unit = "TFLOP/s" if group in RATE_GROUPS else "us"
            rows_out.append(f"  {case:<46} redfuser {_fmt(_metric(ours, group) if ours else None):>9} {unit:<7}"
                            f"  best peer {(peer or '-'):<15} {_fmt(val):>9}"
                            + (f"  x{ratios[-1]:.2f}" if ours and ours['status'] == 'ok' and val else ""))
        gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios)) if ratios else float("nan")
        out.append(f"{op}/{group}: {len(cases)} cases, redfuser ran {n_ok}, wrong results {len(wrong)}"
                   f"{' (' + ', '.join(wrong[:4]) + ')' if wrong else ''}, peer errors {errs}, skipped {skipped}; "
                   f"geo-mean speed-up vs best correct peer {gm:.2f}x")
    if len(rows_out) > max_rows:
        rows_out = rows_out[: max_rows - 1] + [f"  ... {len(rows_out) - max_rows + 1} more in results.md"]
    return "\n".join(out + rows_out)


def plots(data: dict, out: Path) -> list[Path]:
    """fused_attention.png (TFLOP/s against S per dtype/D/causal, decode times) and moe_route.png (time against
    T per router). Needs matplotlib; without it, nothing is drawn and a note is printed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed; no plots (pip install matplotlib)")
        return []
    written = []
    res = [r for r in data.get("results", []) if r["status"] == "ok"]
    machine = data.get("machine")

    pre = [r for r in res if r["op"] == "fused_attention" and r["group"] == "prefill"]
    dec = [r for r in res if r["op"] == "fused_attention" and r["group"] == "decode"]
    if pre or dec:
        combos = sorted({(r["params"]["dtype"], r["params"]["D"]) for r in pre}, key=lambda t: (t[0], -t[1]))
        nrows = len(combos) + (1 if dec else 0)
        fig = plt.figure(figsize=(12, 3.2 * max(nrows, 1)))
        gs = fig.add_gridspec(max(nrows, 1), 2)
        for row, (dt, D) in enumerate(combos):
            for col, causal in enumerate((False, True)):
                ax = fig.add_subplot(gs[row, col])
                sel = [r for r in pre if r["params"]["dtype"] == dt and r["params"]["D"] == D
                       and r["params"]["causal"] == causal]
                for name in _impl_order(sel):
                    pts = sorted((r["params"]["Sq"], r["tflops"]) for r in sel if r["impl"] == name)
                    if pts:
                        ax.plot(*zip(*pts), marker="o", lw=2.5 if name == "redfuser" else 1.2, label=name)
                ax.set_xscale("log", base=2)
                ax.set_title(f"{dt} d{D} {'causal' if causal else 'full'}", fontsize=9)
                ax.set_xlabel("S (= Sq = Sk)", fontsize=8)
                ax.set_ylabel("TFLOP/s", fontsize=8)
                ax.grid(alpha=0.3)
                ax.tick_params(labelsize=7)
                if row == 0 and col == 0:
                    ax.legend(fontsize=7)
        if dec:
            ax = fig.add_subplot(gs[nrows - 1, :])
            cases = list(_by_case(dec))
            names = _impl_order(dec)
            width = 0.8 / max(len(names), 1)
            for i, name in enumerate(names):
                ys = [next((r["time_us"] for r in dec if r["case"] == c and r["impl"] == name), 0) for c in cases]
                ax.bar([x + i * width for x in range(len(cases))], ys, width, label=name)
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cases))], cases, fontsize=7)
            ax.set_yscale("log")
            ax.set_ylabel("µs (log)", fontsize=8)
            ax.set_title("decode (Sq = 1)", fontsize=9)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3, axis="y")
        written.append(_save(plt, fig, out, "fused_attention", machine))

    moe = [r for r in res if r["op"] == "moe_route"]
    if moe:
        routers = list(OrderedDict.fromkeys(r["params"]["router"] for r in moe))
        ncols = 2
        nrows = (len(routers) + 1) // 2
        fig, axes = plt.subplots(nrows, ncols, figsize=(11, 3.4 * nrows), squeeze=False)
        for i, router in enumerate(routers):
            ax = axes[i // ncols][i % ncols]
            sel = [r for r in moe if r["params"]["router"] == router]
            for name in _impl_order(sel):
                pts = sorted((r["params"]["T"], r["time_us"]) for r in sel if r["impl"] == name)
                if pts:
                    ax.plot(*zip(*pts), marker="o", lw=2.5 if name == "redfuser" else 1.2, label=name)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(router, fontsize=9)
            ax.set_xlabel("tokens T", fontsize=8)
            ax.set_ylabel("µs", fontsize=8)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=7)
        for j in range(len(routers), nrows * ncols):
            axes[j // ncols][j % ncols].axis("off")
        written.append(_save(plt, fig, out, "moe_route", machine))
    return written


def _save(plt, fig, out: Path, op: str, machine: str) -> Path:
    fig.suptitle(f"{op} on {machine}", fontsize=11)
    fig.tight_layout()
    p = out / f"{op}.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    return p


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    p.add_argument("results", type=Path, help="results.json")
    p.add_argument("--summary", action="store_true", help="print the short summary only")
    p.add_argument("--plots", action="store_true", help="(re)draw the plots next to results.json")
    args = p.parse_args(argv)
    if not args.results.is_file():
        print(f"bench.report: no {args.results}", file=sys.stderr)
        return 1
    data = json.loads(args.results.read_text())
    if args.summary:
        print(summary(data))
        return 0
    (args.results.parent / "results.md").write_text(markdown(data))
    if args.plots:
        plots(data, args.results.parent)
    print(summary(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
