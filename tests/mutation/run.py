"""Mutation runner: plants each mutant of the catalogue (tests/mutation/catalogue.py) in a clean copy of the tree,
rebuilds the CPU-only library where the mutant changes what goes into it, runs the tests that should catch it and
prints a table of killed / survived with the test that killed it.

    python -m tests.mutation                      # the whole catalogue
    python -m tests.mutation --sample 3 --seed 7  # a short random sample
    python -m tests.mutation --only cpp-e4m3-noop,forms-guard-never-refuses
    python -m tests.mutation --check              # only: every patch applies to the tree, exactly once
    python -m tests.mutation --list

The clean tree is this checkout's working tree (tracked files and untracked ones git does not ignore). Every mutant
is planted in the same copy (<workdir>/src, rewritten in place: only files whose bytes differ are written, so that
the shared build directory <workdir>/build rebuilds only what the mutant changes). A rebuilding mutant installs the
CPU-only library with `pip install --no-build-isolation -C cmake.define.REDFUSER_ARCHS= --target <workdir>/site`
and its tests see that install first on PYTHONPATH; a mutant of Python code that the tests import from the source
tree (the engine, the CUDA templates and bridges) needs no build: its tests run against the copy's `generator`
(tests/conftest.py puts the source tree on sys.path) and the installed `redfuser_ops`.

A mutant is killed when its test selection fails (pytest exit 1 with a FAILED test) or hangs past the timeout;
it survives when the selection passes. A patch that does not apply exactly once, a build that fails and a test run
that errors otherwise (collection error, exit 2-5) are errors. The exit status is 0 only if every mutant run was
killed.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tests.mutation.catalogue import MUTANTS, Mutant

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Result:
    mutant: Mutant
    status: str  # killed | survived | error
    detail: str  # the killing test, or what went wrong
    seconds: float


def tree_files(root: Path = ROOT) -> dict[str, tuple[bytes, int]]:
    """The clean tree, read once (edits made while a run goes on do not reach it): the files git tracks or would
    track (untracked, not ignored), relative to root -> (bytes, mode)."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                         capture_output=True).stdout.decode()
    return {p: ((root / p).read_bytes(), (root / p).stat().st_mode) for p in sorted(out.split("\0"))
            if p and (root / p).is_file()}


def write_changed(dst: Path, data: bytes) -> bool:
    """Write data to dst unless dst already holds exactly it (an unchanged file keeps its mtime, so the build does
    not see it change); whether it was written."""
    if dst.is_file() and dst.read_bytes() == data:
        return False
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(data)
    return True


def sync_tree(src: Path, files: dict[str, tuple[bytes, int]]) -> None:
    """Make src hold exactly the clean tree: write the files whose bytes differ (so they get a new mtime and the
    build sees them change), remove files that are not in it (build outputs of the copy stay out of it)."""
    for rel, (data, mode) in files.items():
        if write_changed(src / rel, data):
            os.chmod(src / rel, mode & 0o7777)
    for p in sorted(src.rglob("*"), reverse=True):
        rel = p.relative_to(src).as_posix()
        if p.is_file() and rel not in files and "__pycache__" not in rel and not rel.startswith(".pytest_cache"):
            p.unlink()


def patch_count(m: Mutant, root: Path = ROOT) -> int:
    """How often the mutant's search text occurs in its file of the tree at root (it must be exactly once)."""
    path = root / m.path
    return path.read_text().count(m.search) if path.is_file() else 0


def installed_library() -> str | None:
    """Where the installed redfuser_ops (the clean build the Python-only mutants' tests load) is; None if none."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import redfuser_ops, sys; sys.stdout.write(redfuser_ops.__file__)"
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd="/", capture_output=True, text=True, env=env)
    return proc.stdout if proc.returncode == 0 else None


def apply(m: Mutant, src: Path) -> None:
    path = src / m.path
    text = path.read_text()
    n = text.count(m.search)
    if n != 1:
        raise ValueError(f"{m.name}: the search text occurs {n} times in {m.path} (must be exactly once)")
    path.write_text(text.replace(m.search, m.replace))


# Mutant builds compile the CPU kernels at -O0 (the release flags are -O3): the kernels' semantics are the same
# (fast-math without finite-math), a full rebuild takes a fraction of the time (at -O1 a full CPU rebuild still
# took about 15 minutes on the shared 2-core machine) and the tests run slower. --kernel-flags release restores
# the release flags.
FAST_KERNEL_FLAGS = "-O0;-ffast-math;-fno-finite-math-only"


def sync_package(src: Path, site: Path) -> list[Path]:
    """Copy each Python file of the copy's redfuser_ops/ over the installed one whose bytes differ (the files the
    build generates, _generated_*.py, exist only in the install and are left alone); returns the files written."""
    files = sorted((src / "redfuser_ops").rglob("*.py"))
    return [site / f.relative_to(src) for f in files if write_changed(site / f.relative_to(src), f.read_bytes())]


def build(src: Path, work: Path, log: Path, kernel_flags: str = FAST_KERNEL_FLAGS) -> tuple[bool, str]:
    """CPU-only build + install of the copy into <work>/site (the build directory is shared: incremental). The
    first build goes through pip (configure, generator, compile, install); later ones run `cmake --build`, which
    re-runs configure (and the generator) only when a generator file or spec changed (CMAKE_CONFIGURE_DEPENDS) and
    recompiles only what changed, then `cmake --install` into the same site, and copies the package's own Python
    files (redfuser_ops/**.py of the copy) over the installed ones where they differ: a mutant there, and the clean
    file again after it."""
    site = work / "site"
    bdir = work / "build"
    cmake = str(Path(sys.executable).parent / "cmake") if (Path(sys.executable).parent / "cmake").exists() else "cmake"
    if (site / "redfuser_ops" / "_C.so").exists() and (bdir / "build.ninja").exists():
        with open(log, "w") as fh:
            for step in ([cmake, "--build", str(bdir)], [cmake, "--install", str(bdir), "--prefix", str(site)]):
                rc = subprocess.run(["nice", *step], check=False, cwd=src, stdout=fh, stderr=subprocess.STDOUT).returncode
                if rc != 0:
                    return False, f"build failed ({step[1]}, exit {rc}; log {log})"
        sync_package(src, site)
        return True, ""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--upgrade",
           "--target", str(site), "-C", "cmake.define.REDFUSER_ARCHS=", "-C", f"build-dir={work / 'build'}",
           *(["-C", f"cmake.define.REDFUSER_CPU_KERNEL_FLAGS={kernel_flags}"] if kernel_flags else []), str(src)]
    with open(log, "w") as fh:
        rc = subprocess.run(["nice", *cmd], check=False, cwd=src, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        return False, f"build failed (exit {rc}; log {log})"
    return True, ""


FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def run_tests(m: Mutant, src: Path, work: Path, log: Path, timeout: float, site: bool) -> tuple[str, str]:
    env = dict(os.environ)
    env.update(m.env)
    env.pop("PYTHONPATH", None)
    if site:
        env["PYTHONPATH"] = str(work / "site")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # one process (-n 0): a crash must end pytest itself (signal), not an xdist worker
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-n", "0", "-rfE", *m.tests]
    try:
        proc = subprocess.run(cmd, check=False, cwd=src, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        log.write_text(f"$ {' '.join(cmd)}\n{e.stdout or ''}{e.stderr or ''}\nTIMEOUT after {timeout} s\n")
        return "killed", f"timeout after {timeout:.0f} s"
    log.write_text(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    if proc.returncode == 0:
        return "survived", ""
    if proc.returncode < 0:  # the test process died (a read out of bounds): the bug shows, though not as a value
        running = re.findall(r"^\S*(tests/\S+\.py)\S* \.*", proc.stdout, re.MULTILINE)
        return "killed", f"crash (signal {-proc.returncode}){' in ' + running[-1] if running else ''}"
    hit = FAILED.search(proc.stdout)
    # a failed test, or an error in a test's setup (a fixture running the generator's numeric self-check); not a
    # collection error (a file that no longer imports: pytest exits 2 then)
    if proc.returncode == 1 and hit and (hit.group(0).startswith("FAILED") or "::" in hit.group(1)):
        return "killed", hit.group(1) + ("" if hit.group(0).startswith("FAILED") else " (error in its setup)")
    return "error", f"pytest exit {proc.returncode} ({hit.group(0) if hit else 'no failed test'}; log {log})"


def run_one(m: Mutant, work: Path, files: dict, timeout: float, kernel_flags: str = FAST_KERNEL_FLAGS,
            src_name: str = "src") -> Result:
    t0 = time.monotonic()
    src = work / src_name
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sync_tree(src, files)
    try:
        apply(m, src)
    except ValueError as e:
        return Result(m, "error", str(e), time.monotonic() - t0)
    if m.needs_build:
        ok, why = build(src, work, logs / f"{m.name}.build.log", kernel_flags)
        if not ok:
            sync_tree(src, files)
            return Result(m, "error", why, time.monotonic() - t0)
    status, detail = run_tests(m, src, work, logs / f"{m.name}.test.log", timeout, site=m.needs_build)
    sync_tree(src, files)  # leave the copy clean (the next build sees the mutated file change back)
    return Result(m, status, detail, time.monotonic() - t0)


def table(results: list[Result]) -> str:
    rows = [("mutant", "area", "build", "status", "seconds", "killed by / detail")]
    for r in results:
        rows.append((r.mutant.name, r.mutant.area, "yes" if r.mutant.needs_build else "no", r.status,
                     f"{r.seconds:.0f}", r.detail))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = []
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:5], widths)) + "  " + row[5])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.mutation", description=__doc__.splitlines()[0])
    ap.add_argument("--sample", type=int, default=0, help="run N mutants drawn at random")
    ap.add_argument("--seed", type=int, default=None, help="seed of the sample (default: time-derived, printed)")
    ap.add_argument("--only", default="", help="comma-separated mutant names")
    ap.add_argument("--no-build", action="store_true", help="only mutants that need no rebuild")
    ap.add_argument("--workdir", default=f"/tmp/redfuser-mutation-{os.getuid()}")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mutant's test run (a hang is a kill)")
    ap.add_argument("--kernel-flags", default=FAST_KERNEL_FLAGS,
                    help="REDFUSER_CPU_KERNEL_FLAGS of mutant builds ('release': the project's default, -O3)")
    ap.add_argument("--lanes", type=int, choices=(1, 2), default=2,
                    help="2: Python-only and rebuilding mutants side by side (default); 1: one after another")
    ap.add_argument("--check", action="store_true", help="only check that every patch applies exactly once")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)

    if args.list:
        for m in MUTANTS:
            print(f"{m.name:40s} {m.area:8s} {'build' if m.needs_build else '     '} {m.path}\n    bug: {m.bug}\n"
                  f"    tests: {' '.join(m.tests)}")
        return 0
    bad = [(m.name, n) for m in MUTANTS if (n := patch_count(m)) != 1]
    for name, n in bad:
        print(f"PATCH DOES NOT APPLY: {name}: search text found {n} times (must be once)")
    if args.check:
        print(f"{len(MUTANTS) - len(bad)} of {len(MUTANTS)} mutants apply exactly once")
        return 1 if bad else 0

    chosen = list(MUTANTS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(names) - {m.name for m in MUTANTS})
        if unknown:
            ap.error(f"unknown mutants: {', '.join(unknown)}")
        chosen = [m for m in chosen if m.name in names]
    if args.no_build:
        chosen = [m for m in chosen if not m.needs_build]
    if args.sample:
        seed = args.seed if args.seed is not None else int(time.time()) % 100_000
        print(f"sample of {args.sample} with --seed {seed}")
        chosen = random.Random(seed).sample(chosen, min(args.sample, len(chosen)))
    # Python-only mutants first, then the rebuilding ones in catalogue order (the catalogue lists them by how much
    # they rebuild: emitter and glue changes touch a few generated files, a runtime header every kernel)
    chosen.sort(key=lambda m: m.needs_build)

    if any(not m.needs_build for m in chosen) and installed_library() is None:
        print("redfuser_ops is not installed in this environment: the Python-only mutants' tests load the installed "
              "library (pip install --no-build-isolation -C cmake.define.REDFUSER_ARCHS= . first)")
        return 2
    work = Path(args.workdir)
    files = tree_files()
    flags = "" if args.kernel_flags == "release" else args.kernel_flags
    t0 = time.monotonic()
    results: list[Result] = []
    lock = threading.Lock()

    def lane(mutants: list[Mutant], src_name: str) -> None:
        """Mutants one after another in one copy of the tree (the rebuilding ones share its build directory)."""
        (work / src_name).mkdir(parents=True, exist_ok=True)
        for m in mutants:
            r = run_one(m, work, files, args.timeout, flags, src_name)
            with lock:
                results.append(r)
                print(f"[{len(results)}/{len(chosen)}] {m.name}: {r.status} {r.detail} ({r.seconds:.0f} s)", flush=True)

    # two lanes side by side: the Python-only mutants in one copy, the rebuilding ones in another (a build is mostly
    # the compiler waiting on one core; the other lane's tests use the rest)
    lanes = [([m for m in chosen if not m.needs_build], "src-py"), ([m for m in chosen if m.needs_build], "src")]
    if args.lanes == 1:
        lanes = [(chosen, "src")]
    threads = [threading.Thread(target=lane, args=ln) for ln in lanes if ln[0]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.sort(key=lambda r: chosen.index(r.mutant))
    print()
    print(table(results))
    killed = sum(r.status == "killed" for r in results)
    print(f"\n{killed} of {len(results)} mutants killed ({len(MUTANTS)} in the catalogue); "
          f"{time.monotonic() - t0:.0f} s wall")
    return 0 if killed == len(results) and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
