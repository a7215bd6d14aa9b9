"""The benchmark harness: `python -m bench.run [options]` (from the repository root, against the installed
redfuser_ops). Writes <out>/results.json (after every case, so a killed run still leaves its results),
<out>/results.md and PNG plots (matplotlib, where installed). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import signal
import sys
import time
import traceback
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch

from . import ROOT, timing
from .cases import OPS, Case, Impl

SCHEMA = 1
STICKY_CUDA_ERRORS = ("illegal memory access", "unspecified launch failure", "device-side assert",
                      "misaligned address", "illegal instruction", "CUDA error: an illegal")


def _short_error(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".strip()
    lines = [ln for ln in msg.splitlines() if ln.strip()]
    text = " ".join(lines[:3])
    return text[:400]


class Runner:
    def __init__(self, device: str, budget_s: float, quick: bool, size: str, cache_bytes: int,
                 mem_cap: int, log=print) -> None:
        self.device = device
        self.deadline = time.monotonic() + budget_s
        self.size = size
        self.cache_bytes = cache_bytes
        self.mem_cap = mem_cap
        self.log = log
        self.aborted: str | None = None
        if device == "cuda":
            self.timer = timing.Timer(device, target_s=0.02 if quick else 0.05, min_reps=5,
                                      max_reps=100 if quick else 200)
        else:
            self.timer = timing.Timer(device, target_s=0.15 if quick else 0.3, min_reps=3, max_reps=20, warmup=1)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def n_buffers(self, case: Case) -> int:
        if case.input_bytes <= 0:
            return 1
        want = math.ceil(3 * self.cache_bytes / case.input_bytes)
        fit = max(1, self.mem_cap // case.input_bytes)
        return int(max(1, min(want, fit, 16 if self.device == "cuda" else 4)))

    def run_case(self, case: Case, ceilings: dict[str, Any], impl_filter: set[str] | None) -> list[dict]:
        results = []
        base = {"op": case.op, "group": case.group, "case": case.name, "params": case.params,
                "flops": case.flops, "bytes": case.bytes}
        impls = [i for i in case.impls if impl_filter is None or i.name in impl_filter or i.name == "redfuser"]
        if self.aborted or self.remaining() <= 1.0:
            why = self.aborted or "time budget spent"
            return [{**base, "impl": i.name, "status": "skipped", "error": why} for i in impls]
        gen = torch.Generator(device=self.device).manual_seed(zlib.crc32(case.name.encode()))
        try:
            n = self.n_buffers(case)
            sets = [case.make_inputs(gen, self.device) for _ in range(n)]
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: record, go on
            return [{**base, "impl": i.name, "status": "error", "error": "inputs: " + _short_error(e)} for i in impls]
        mm_name, mm_rate = timing.matmul_rate_for(ceilings, case.dtype)
        copy_bw = ceilings.get("copy_GBps")
        rows: dict[str, dict[str, Any]] = {}
        timed: list[Impl] = []
        for impl in impls:  # each one's result checked first, then the ones that ran timed together
            r = rows[impl.name] = {**base, "impl": impl.name, "buffers": n}
            if self.aborted or self.remaining() <= 0.5:
                r.update(status="skipped", error=self.aborted or "time budget spent")
                continue
            t0 = time.monotonic()
            try:
                with _entered(impl):
                    out = impl.fn(*sets[0])
                    timing.sync(self.device)
                    r["correct"] = case.check(impl.name, out, sets[0])
                    del out
                timed.append(impl)
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is a result, not a crash
                self._record_error(r, e, case.name, impl.name)
            r["wall_s"] = round(time.monotonic() - t0, 3)
        if self.aborted:  # a CUDA error in a check poisoned the context: nothing more runs on it
            for impl in timed:
                rows[impl.name].update(status="skipped", error=self.aborted)
            timed = []
        t0 = time.monotonic()
        try:
            got = self.timer.interleaved([_call_of(impl) for impl in timed], sets,
                                         [lambda impl=impl: _entered(impl) for impl in timed])
        except Exception as e:  # noqa: BLE001 - e.g. a CUDA error surfacing at the final synchronize
            got = [e] * len(timed)
        wall = (time.monotonic() - t0) / max(1, len(timed))
        for impl, t in zip(timed, got):
            r = rows[impl.name]
            r["wall_s"] = round(r["wall_s"] + wall, 3)
            if isinstance(t, BaseException):
                self._record_error(r, t, case.name, impl.name)
                continue
            r.update(status="ok", **t.as_dict())
            sec = t.median_s
            r["tflops"] = case.flops / sec / 1e12
            r["gbps"] = case.bytes / sec / 1e9
            r["matmul_ceiling"] = mm_name
            r["frac_matmul"] = r["tflops"] / mm_rate if mm_rate else None
            r["frac_copy"] = r["gbps"] / copy_bw if copy_bw else None
        for impl in impls:
            results.append(rows[impl.name])
            if rows[impl.name]["status"] != "skipped":
                self.log(_line(rows[impl.name]))
        del sets
        gc.collect()
        if self.device == "cuda" and not self.aborted:
            torch.cuda.empty_cache()
        return results

    def _record_error(self, r: dict[str, Any], e: BaseException, case: str, impl: str) -> None:
        r.update(status="error", error=_short_error(e))
        if self.device == "cuda":
            if any(s in str(e) for s in STICKY_CUDA_ERRORS):
                self.aborted = f"aborted after a CUDA error in {case} / {impl}"
            else:
                torch.cuda.empty_cache()


@contextlib.contextmanager
def _entered(impl: Impl):
    """`impl`'s context (an SDPA backend, say) around a call, with the benchmark's warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if impl.context is None:
            yield
        else:
            with impl.context():
                yield


def _call_of(impl: Impl):
    """`impl.fn` as a callable of one input set (Timer.interleaved's form)."""
    return lambda args: impl.fn(*args)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _line(r: dict) -> str:
    head = f"  {r['op']:<16} {r['case']:<44} {r['impl']:<15}"
    if r["status"] != "ok":
        return f"{head} {r['status']}: {r.get('error', '')[:100]}"
    c = r.get("correct", {})
    ok = "ok" if c.get("ok") else "WRONG"
    return (f"{head} {r['time_us']:>11.1f} us {r['tflops']:>8.2f} TFLOP/s {r['gbps']:>8.1f} GB/s  "
            f"err {c.get('max_err', float('nan')):.2e} <= {c.get('bound', float('nan')):.2e} {ok}")


def _versions() -> dict[str, Any]:
    import redfuser_ops

    v = {"python": platform.python_version(), "torch": torch.__version__, "redfuser_ops": redfuser_ops.__version__,
         "redfuser_ops_path": redfuser_ops.__file__, "cuda": torch.version.cuda}
    try:
        import subprocess

        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10,
                                  check=False).stdout.strip()

        v["git"] = git("rev-parse", "--short", "HEAD") or None
        # sources changed since that commit (results folders aside): the numbers are not that commit's
        if v["git"] and git("status", "--porcelain", "--", ".", ":(exclude)bench/results"):
            v["git"] += "+uncommitted changes"
    except Exception:  # noqa: BLE001
        v["git"] = None
    return v


def _library_summary() -> dict[str, Any]:
    import redfuser_ops

    info = redfuser_ops.info()
    return {"library": info.get("library"), "families": info.get("families"), "cuda": info.get("cuda"),
            "variants": {op: [v["name"] for v in d["variants"]] for op, d in info["ops"].items()}}


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--ops", default="", help="comma-separated ops (default: all, the four shipped ops first, then the "
                   "ops made only of their YAML)")
    p.add_argument("--impls", default=None,
                   help="comma-separated implementations to time besides redfuser (default: all peers), e.g. "
                        "sdpa_flash,eager")
    p.add_argument("--quick", action="store_true", help="fewer lengths and shorter timing per case")
    p.add_argument("--tiny", action="store_true", help="a handful of small cases (smoke test, CI)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run; cases left when it is spent are recorded as skipped "
                        "(default: unlimited)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: bench/results/<machine>)")
    p.add_argument("--machine", default=None, help="machine name for the default output folder")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--filter", default=None, help="only cases whose name contains this text")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("bench: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    import redfuser_ops  # noqa: F401 - loads the library, registers torch.ops.redfuser.*

    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    machine = args.machine or timing.machine_name(device)
    out = args.out or ROOT / "bench" / "results" / machine
    out.mkdir(parents=True, exist_ok=True)
    budget = args.budget if args.budget is not None else math.inf
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] or list(OPS)
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        print(f"bench: unknown ops {unknown}; known: {sorted(OPS)}", file=sys.stderr)
        return 2
    impl_filter = set(args.impls.split(",")) if args.impls else None

    # SIGTERM (timeout's default) ends the run like Ctrl-C: results so far are written
    signal.signal(signal.SIGTERM, _interrupt)

    data: dict[str, Any] = {
        "schema": SCHEMA, "machine": machine, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": timing.describe(device), "versions": _versions(), "library": _library_summary(),
        "options": {"size": size, "budget_s": None if math.isinf(budget) else budget, "ops": ops,
                    "impls": sorted(impl_filter) if impl_filter else "all", "filter": args.filter,
                    "argv": sys.argv[1:] if argv is None else argv},
        "ceilings": {}, "results": [], "complete": False,
    }
    json_path = out / "results.json"
    print(f"bench: {device} ({data['device']['name']}), {size} cases, budget "
          f"{'none' if math.isinf(budget) else f'{budget:.0f} s'}, writing to {out}", flush=True)
    interrupted = False
    try:
        t0 = time.monotonic()
        data["ceilings"] = timing.measure_ceilings(device, quick=size != "full")
        data["ceilings"]["seconds"] = round(time.monotonic() - t0, 2)
        c = data["ceilings"]
        print(f"ceilings: copy {c['copy_GBps']:.1f} GB/s, matmul "
              + ", ".join(f"{k} {v:.2f} TFLOP/s" for k, v in c["matmul_TFLOPs"].items()), flush=True)
        write_json(json_path, data)
        cases: list[Case] = []
        for op in ops:
            cases += OPS[op](device, size)
        if args.filter:
            cases = [c for c in cases if args.filter in c.name]
        cases.sort(key=lambda c: c.priority)  # stable: the order inside a priority is kept
        remaining_budget = budget - (time.monotonic() - t_start)
        runner = Runner(device, remaining_budget, size != "full", size, data["device"]["cache_bytes"],
                        mem_cap=(2 << 30) if device == "cuda" else (256 << 20),
                        log=lambda s: print(s, flush=True))
        for case in cases:
            data["results"] += runner.run_case(case, data["ceilings"], impl_filter)
            write_json(json_path, data)
        data["complete"] = runner.aborted is None and not any(r["status"] == "skipped" for r in data["results"])
        if runner.aborted:
            data["aborted"] = runner.aborted
    except KeyboardInterrupt:
        interrupted = True
        data["aborted"] = "interrupted (signal or Ctrl-C)"
        print("bench: interrupted; writing what was measured", flush=True)
    except Exception as e:  # noqa: BLE001 - keep what was measured
        data["aborted"] = "crashed: " + _short_error(e)
        traceback.print_exc()
    data["elapsed_s"] = round(time.monotonic() - t_start, 1)
    data["device"]["load_average_at_end"] = timing.load_average()
    write_json(json_path, data)
    from . import report

    (out / "results.md").write_text(report.markdown(data))
    plots = [] if args.no_plots else report.plots(data, out)
    print(report.summary(data))
    print(f"bench: wrote {json_path}, {out / 'results.md'}" + "".join(f", {p}" for p in plots), flush=True)
    if interrupted:
        return 130
    return 0 if "crashed" not in str(data.get("aborted", "")) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
