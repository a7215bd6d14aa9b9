"""The benchmark harness, the SASS-table machinery and the GPU run script, exercised on the CPU (< 60 s).

- bench/gpu_run.sh --dry-run with a wheel made from the installed distribution: installs it into a temp venv,
  collects the GPU test selection, runs a tiny CPU benchmark, writes its files and summary;
- the harness: a peer that fails is recorded (no crash), a wrong implementation is flagged, a spent budget
  skips cases, results.md and the summary show all three;
- bench/sass.py on synthetic cuobjdump output: parsing, the rules, the committed-table comparison.
Timings are never asserted.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import torch

import redfuser_ops  # noqa: F401 - loads the library: torch.ops.redfuser.*
from bench import cases, report, sass, timing
from bench.cases import OPS
from bench.run import Runner

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------------
# gpu_run.sh --dry-run
# ----------------------------------------------------------------------------------------------------------

def wheel_from_installed(dest: Path) -> Path:
    """A wheel holding exactly the files of the installed redfuser-ops distribution (its RECORD rewritten)."""
    dist = metadata.distribution("redfuser-ops")
    files = [f for f in dist.files or [] if "__pycache__" not in f.parts and f.name not in
             ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json") and not f.name.endswith(".pyc")]
    assert any(f.name == "_C.so" for f in files), "the installed distribution lists no _C.so"
    distinfo = next(f.parts[0] for f in files if f.parts[0].endswith(".dist-info"))
    tag = next(line.split(":", 1)[1].strip() for line in (dist.read_text("WHEEL") or "").splitlines()
               if line.startswith("Tag:"))
    name, version = distinfo.removesuffix(".dist-info").rsplit("-", 1)
    path = dest / f"{name}-{version}-{tag}.whl"
    rows = io.StringIO()
    writer = csv.writer(rows, lineterminator="\n")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for f in files:
            data = Path(f.locate()).read_bytes()
            z.writestr(str(f), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            writer.writerow([str(f), f"sha256={digest}", len(data)])
        writer.writerow([f"{distinfo}/RECORD", "", ""])
        z.writestr(f"{distinfo}/RECORD", rows.getvalue())
    return path


def test_gpu_run_dry_run(tmp_path):
    wheel = wheel_from_installed(tmp_path)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, REDFUSER_GPU_RUN_SECONDS="150")
    env.pop("PYTHONPATH", None)
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_run.sh"), "--dry-run", str(wheel), str(out)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=170, check=False)
    log = (out / "gpu_run.log").read_text() if (out / "gpu_run.log").is_file() else r.stdout
    assert r.returncode == 0, log[-6000:] + r.stderr[-2000:]
    assert "installed: " in log and "/venv/" in log.split("installed: ", 1)[1].splitlines()[0], log[-4000:]
    assert "tests/test_sass.py::test_build_kind_is_declared" in log  # the GPU selection was collected
    assert "tests/gpu/test_gpu_runtime.py::" in log
    assert "=================== summary" in r.stdout
    data = json.loads((out / "bench" / "results.json").read_text())
    assert data["complete"] and data["ceilings"]["copy_GBps"] > 0
    ours = [x for x in data["results"] if x["impl"] == "redfuser"]
    assert {x["op"] for x in ours} == set(OPS)  # every op with bench cases, the YAML-only ones too
    assert all(x["status"] == "ok" and x["correct"]["ok"] for x in ours), [x for x in ours if x["status"] != "ok"]
    assert (out / "bench" / "results.md").is_file() and (out / "junit.xml").is_file()
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files  # what the device tool brings back
    assert all(len(p.relative_to(out).parts) <= 3 for p in files)


# ----------------------------------------------------------------------------------------------------------
# the harness
# ----------------------------------------------------------------------------------------------------------

def _tiny_case(extra_impls):
    case = cases.attention_case(2, 33, 33, 2, 1, 64, torch.float32, True, "cpu", "prefill", ["eager"], 0)
    case.impls += extra_impls
    return case


def test_failing_peer_and_wrong_result_are_recorded():
    def broken(q, k, v):
        raise RuntimeError("No available kernel.  Aborting execution.\nmore detail")

    def wrong(q, k, v):
        out, lse = torch.ops.redfuser.fused_attention(q, k, v, True, None)
        return out * 1.01, lse

    case = _tiny_case([cases.Impl("broken", broken), cases.Impl("wrong", wrong)])
    runner = Runner("cpu", budget_s=60, quick=True, size="tiny", cache_bytes=1 << 20, mem_cap=1 << 26,
                    log=lambda s: None)
    ceilings = {"copy_GBps": 10.0, "matmul_TFLOPs": {"float32": 0.1}}
    res = {r["impl"]: r for r in runner.run_case(case, ceilings, None)}
    assert res["redfuser"]["status"] == "ok" and res["redfuser"]["correct"]["ok"]
    assert res["eager"]["status"] == "ok" and res["eager"]["correct"]["ok"]
    assert res["broken"]["status"] == "error" and "No available kernel" in res["broken"]["error"]
    assert res["wrong"]["status"] == "ok" and not res["wrong"]["correct"]["ok"]
    r = res["redfuser"]
    assert r["flops"] == 4 * 2 * 2 * 64 * (33 * 34 // 2)
    assert r["frac_matmul"] == pytest.approx(r["tflops"] / 0.1)
    assert r["frac_copy"] == pytest.approx(r["gbps"] / 10.0)

    data = {"machine": "t", "results": list(res.values()), "ceilings": ceilings, "complete": True,
            "options": {}, "device": {}, "versions": {}}
    md = report.markdown(data)
    assert "err[1]" in md and "No available kernel" in md and "✗" in md and "WRONG: wrong" in md
    s = report.summary(data)
    assert "wrong results 1" in s and "peer errors 1" in s


def test_mla_and_fp8_cases_run_and_judge_their_peers():
    """The CPU cases of mla_decode and fp8_quant_gemm: the op and its CPU peer pass their checks, a perturbed
    result does not."""
    runner = Runner("cpu", budget_s=60, quick=True, size="tiny", cache_bytes=1 << 20, mem_cap=1 << 26,
                    log=lambda s: None)
    ceilings = {"copy_GBps": 10.0, "matmul_TFLOPs": {"float32": 0.1}}
    for make, peer in ((cases.mla_cases, "eager"), (cases.gemm_cases, "two_pass_torch")):
        for case in make("cpu", "tiny"):  # mla: Sq 1, and Sq 3 causal (the peer's causal limit)
            res = {r["impl"]: r for r in runner.run_case(case, ceilings, {peer})}
            assert set(res) == {"redfuser", peer}
            for r in res.values():
                assert r["status"] == "ok" and r["correct"]["ok"], (case.name, r)
        case = make("cpu", "tiny")[0]  # a fresh case: its check caches the reference of the inputs it first sees
        inputs = case.make_inputs(torch.Generator().manual_seed(0), "cpu")
        good = case.impls[0].fn(*inputs)
        assert case.check("redfuser", good, inputs)["ok"], case.name
        bad = (good[0] * 1.05 + 0.05, good[1]) if isinstance(good, tuple) else good * 1.05 + 0.05
        assert not case.check("bad", bad, inputs)["ok"], case.name


def test_spent_budget_skips_and_route_check_flags_bad_ids():
    runner = Runner("cpu", budget_s=0, quick=True, size="tiny", cache_bytes=1 << 20, mem_cap=1 << 26,
                    log=lambda s: None)
    res = runner.run_case(_tiny_case([]), {}, None)
    assert {r["status"] for r in res} == {"skipped"}

    case = cases.route_case("dsv3-e256-top8-sigmoid-bias-g8k4", 17, torch.bfloat16, "cpu", [], 0)
    inputs = case.make_inputs(torch.Generator().manual_seed(0), "cpu")
    w, ids = torch.ops.redfuser.moe_route(inputs[0], 8, "sigmoid", True, inputs[1], 8, 4, 2.5)
    assert case.check("redfuser", (w, ids), inputs)["ok"]
    bad = ids.clone()
    bad[3, 0] = (bad[3, 0] + 1) % 256
    got = case.check("bad", (w, bad), inputs)
    assert not got["ok"] and got["ids_bad_rows"] >= 1


def test_route_check_tells_ties_from_errors():
    """A peer that breaks a tie its own way is not wrong; one that picks a smaller key is."""
    case = cases.route_case("e64-top6-softmax", 2, torch.float32, "cpu", [], 0)
    logits = torch.arange(64, dtype=torch.float32).flip(0).repeat(2, 1) / 8  # expert i has key rank i
    logits[:, 40] = logits[:, 5]  # expert 40 ties with expert 5, the last one chosen
    w, ids = torch.ops.redfuser.moe_route(logits, 6)
    assert ids[0].tolist() == [0, 1, 2, 3, 4, 5]
    got = case.check("redfuser", (w, ids), (logits, None))
    assert got["ok"] and got["ids_tie_rows"] == 0 and got["ids_bad_rows"] == 0
    swapped = ids.clone()
    swapped[:, 5] = 40  # the other side of the tie: allowed
    got = case.check("tie", (w, swapped), (logits, None))
    assert got["ok"] and got["ids_tie_rows"] == 2 and got["ids_bad_rows"] == 0
    worse = ids.clone()
    worse[1, 5] = 7  # a smaller key than the unchosen expert 6
    got = case.check("bad", (w, worse), (logits, None))
    assert not got["ok"] and got["ids_bad_rows"] == 1
    unordered = ids.clone()
    unordered[0, [0, 1]] = unordered[0, [1, 0]]  # right set, wrong order
    assert case.check("order", (w, unordered), (logits, None))["ids_bad_rows"] == 1


def test_visible_pairs_and_machine_name():
    for sq in (1, 2, 7, 64):
        for sk in (1, 3, 64, 65):
            brute = sum(min(sk, max(0, i + sk - sq + 1)) for i in range(sq))
            assert cases.visible_pairs(sq, sk, True) == brute
            assert cases.visible_pairs(sq, sk, False) == sq * sk
    assert timing.machine_name("cpu").startswith("cpu-")


def test_interleaved_timer_rounds_sets_contexts_and_errors():
    """The implementations of a case are timed in rounds, one call each; call c of the rounds reads set c mod n;
    each call runs inside its context, which is not timed; one that raises is left out after that, the others go
    on. (What is asserted is the order and count of the calls, never a time.)"""
    log = []
    entered = []

    def ctx_of(name):
        class Ctx:
            def __enter__(self):
                entered.append(name)

            def __exit__(self, *exc):
                entered.append("/" + name)
        return Ctx

    def call_of(name, fail_at=None):
        def call(args):
            assert entered[-1] == name  # inside its own context
            log.append((name, args[0]))
            if fail_at is not None and sum(1 for n, _ in log if n == name) == fail_at:
                raise RuntimeError("stops here")
        return call

    timer = timing.Timer("cpu", target_s=0.0, min_reps=6, max_reps=6, warmup=1)
    sets = [(i,) for i in range(4)]
    got = timer.interleaved([call_of("a"), call_of("b", fail_at=4), call_of("c")], sets,
                            [ctx_of("a"), ctx_of("b"), ctx_of("c")])
    # each: 1 warm-up (set 0) + 1 sizing call (set 0), then the rounds
    assert log[:6] == [("a", 0), ("a", 0), ("b", 0), ("b", 0), ("c", 0), ("c", 0)]
    rounds = log[6:]
    assert [n for n, _ in rounds[:6]] == ["a", "b", "c", "a", "b", "c"]
    assert [s for _, s in rounds[:6]] == [1, 2, 3, 0, 1, 2]  # one counter over all the rounds' calls
    assert sum(1 for n, _ in rounds if n == "b") == 2  # its 4th call raised: out after that
    assert [n for n, _ in rounds[6:]] == ["a", "c"] * 4
    assert isinstance(got[1], RuntimeError)
    assert got[0].reps == 6 and got[2].reps == 6 and got[0].p10_s <= got[0].median_s <= got[0].p90_s
    assert entered.count("a") == entered.count("/a") == 1 + 6  # warm-up and sizing in one entry
    assert timer(lambda x: None, sets).reps == 6
    with pytest.raises(RuntimeError, match="alone"):
        timer(lambda x: (_ for _ in ()).throw(RuntimeError("alone")), sets)


def test_bench_run_tiny_filtered(tmp_path):
    from bench.run import main

    rc = main(["--device", "cpu", "--tiny", "--ops", "moe_route", "--impls", "eager", "--filter", "T1 ",
               "--out", str(tmp_path), "--no-plots", "--budget", "60"])
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert {r["impl"] for r in data["results"]} == {"redfuser", "eager"}
    assert all(r["params"]["T"] == 1 for r in data["results"])
    assert "moe_route" in (tmp_path / "results.md").read_text()


# ----------------------------------------------------------------------------------------------------------
# bench/sass.py on synthetic cuobjdump output
# ----------------------------------------------------------------------------------------------------------

def _elf(arch: str, variant: str, body: str) -> str:
    return (f"\nFatbin elf code:\n================\narch = {arch}\ncode version = [1,8]\nhost = linux\n"
            f"compile_size = 64bit\nidentifier = /build/gen/cuda/{variant.rsplit('__', 1)[1]}/{variant}.cu\n{body}")


def _res(fn: str, reg: int, shared: int = 0, local: int = 0) -> str:
    return (f"\nResource usage:\n Common:\n  GLOBAL:0\n Function {fn}:\n  REG:{reg} STACK:0 SHARED:{shared} "
            f"LOCAL:{local} CONSTANT[0]:552 TEXTURE:0 SURFACE:0 SAMPLER:0\n")


def _sass(fn: str, ops: list[str]) -> str:
    lines = [f"\n\tcode for sm_90a\n\t.target\tsm_90a\n\n\t\tFunction : {fn}",
             '\t.headerflags\t@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"']
    for i, op in enumerate(ops):
        lines.append(f"        /*{i * 16:04x}*/                   {op} ;    /* 0x000fe20000000800 */")
        lines.append("                                                /* 0x000fe20000000800 */")
    return "\n".join(lines) + "\n"


ATT = "fused_attention__bf16_d128_causal__sm90a"
CMB = "fused_attention_combine__bf16_d128__sm90a"
MOE = "moe_route__bf16_e256__sm90a"


def _synthetic(att_ops, moe_ops, moe_local=0):
    res = (_elf("sm_90a", ATT, _res(ATT + "_kernel", 168, 1024)) + _elf("sm_90a", CMB, _res(CMB + "_kernel", 40))
           + _elf("sm_90", MOE, _res(MOE + "_kernel", 56, 0, moe_local)))
    sa = (_elf("sm_90a", ATT, _sass(ATT + "_kernel", att_ops)) + _elf("sm_90a", CMB, _sass(CMB + "_kernel", ["EXIT"]))
          + _elf("sm_90", MOE, _sass(MOE + "_kernel", moe_ops)))
    return sorted(sass.parse_sass(sa, sass.parse_resource_usage(res)).values(), key=lambda k: k.key())


def test_sass_parsing_rules_and_tables(tmp_path):
    good = _synthetic(["UTMALDG.2D [UR8], [UR4]", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ", "@!P0 EXIT"],
                      ["SHFL.BFLY PT, R3, R2, 0x10, 0x1f", "@P0 BRA 0x100", "EXIT"])
    byv = {k.variant: k for k in good}
    assert byv[ATT].reg == 168 and byv[ATT].shared == 1024 and byv[ATT].arch == "sm_90a"
    assert byv[ATT].counts == {"UTMALDG": 1, "HGMMA": 1} and byv[ATT].instrs == 3
    assert byv[MOE].arch == "sm_90a"  # cuobjdump's 'sm_90' name of an sm_90a cubin
    variants = [{"name": v, "device": "cuda", "family": "sm90a"} for v in (ATT, CMB, MOE)]
    assert sass.violations(good, variants) == []

    bad = _synthetic(["HMMA.16816.F32.BF16 R4, R8, R12, R4", "EXIT"], ["STL [R1], R2", "LDL R2, [R1]", "EXIT"],
                     moe_local=16)
    problems = "\n".join(sass.violations(bad, variants + [{"name": "fused_attention__x__sm90a", "device": "cuda",
                                                           "family": "sm90a"}]))
    assert f"{ATT}: no HGMMA" in problems and f"{ATT}: no UTMALDG" in problems
    assert f"{MOE}: 1 x LDL" in problems and f"{MOE}: 1 x STL" in problems and "16 B of local memory" in problems
    assert "fused_attention__x__sm90a: registered as a CUDA variant but no SASS" in problems
    odd = _synthetic(["EXIT"], ["EXIT"])
    odd[0].variant = "new_op__bf16__sm90a"
    assert "new_op__bf16__sm90a: no rule" in "\n".join(sass.violations(odd))

    tables = sass.tables(good)
    assert list(tables) == ["sm90a"]
    md, js = tables["sm90a"]
    assert f"| {ATT} | {ATT}_kernel | sm_90a | attention | 168 | 1024 | 0 | 0 |" in md
    assert [k["variant"] for k in json.loads(js)["kernels"]] == sorted([ATT, CMB, MOE])
    assert "missing" in sass.compare_tables(tables, tmp_path)[0]
    sass.write_tables(tables, tmp_path)
    assert sass.compare_tables(tables, tmp_path) == []
    changed = sass.tables(bad)
    diff = sass.compare_tables(changed, tmp_path)
    assert len(diff) == 1 and "python -m bench.sass --update" in diff[0] and "-| " in diff[0]


def test_gemm_case_peers_and_check():
    """fp8_quant_gemm cases: the op and the CPU two-pass peer pass ACCEPTANCE.md's rule; a wrong result fails it."""
    case = cases.gemm_case("small", 5, torch.bfloat16, "cpu", 0)
    assert case.flops == 2.0 * 5 * 512 * 512 and [i.name for i in case.impls] == ["redfuser", "two_pass_torch"]
    inputs = case.make_inputs(torch.Generator().manual_seed(0), "cpu")
    for impl in case.impls:
        got = case.check(impl.name, impl.fn(*inputs), inputs)
        assert got["ok"], (impl.name, got)
    bad = case.impls[0].fn(*inputs).clone()
    bad[0, 3] += 1.0
    assert not case.check("redfuser", bad, inputs)["ok"]


def test_subset_table_comparison_checks_each_built_kernel():
    """A subset build (CI) compares kernel by kernel: a changed or unknown kernel is a difference; committed rows
    of variants the subset did not build are not."""
    from bench.sass import _compare_subset

    row = {"function": "k1", "arch": "sm_90a", "reg": 168, "local": 0, "counts": {"HGMMA": 16}}
    other = dict(row, function="k2")
    committed = {"kernels": [row, other]}
    assert _compare_subset("sm90a", {"kernels": [row]}, committed) == []
    spilled = dict(row, local=8)
    assert "differs" in _compare_subset("sm90a", {"kernels": [spilled]}, committed)[0]
    assert "not in the committed table" in _compare_subset("sm90a", {"kernels": [dict(row, function="k3")]},
                                                           committed)[0]
    assert _compare_subset("sm90a", {"kernels": []}, committed)
    unlisted: list[str] = []
    assert _compare_subset("sm90a", {"kernels": [dict(row, function="k3")]}, committed, unlisted) == []
    assert unlisted == ["k3 (sm_90a)"]
