"""Timers and machine ceilings.

GPU: one pair of CUDA events around every call, after warm-up; the median over the calls. Inputs rotate over
several buffer sets whose total size is a few times the last-level cache, so a case does not run out of a
warm L2 unless its inputs are that small anyway. No CUDA graphs: a peer that launches many small kernels pays
its launch gaps, as it does in eager code. CPU: time.perf_counter around every call, same structure.

The implementations of one case are timed in rounds (`Timer.interleaved`): each round calls each of them once, so
that a slower phase of a shared machine (another tenant's burst, a memory bandwidth dip) falls on all of them
alike rather than on whichever was being timed then. Call c of the whole sequence reads input set c mod n, so each
call's inputs were last touched n calls before, as when one implementation is timed alone.

Ceilings, measured in the same run: the device copy bandwidth (a large device-to-device copy, bytes read plus
bytes written) and the dense matmul rate (bf16 on GPU; fp32 and bf16 on CPU) on random data.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Timing:
    median_s: float
    p10_s: float
    p90_s: float
    reps: int

    def as_dict(self) -> dict[str, float | int]:
        return {"time_us": self.median_s * 1e6, "p10_us": self.p10_s * 1e6, "p90_us": self.p90_s * 1e6,
                "reps": self.reps}


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


class Timer:
    """Times calls whose inputs rotate over `arg_sets`: one callable alone (`timer(fn, arg_sets)`), or several in
    rounds (`timer.interleaved`)."""

    def __init__(self, device: str, target_s: float = 0.05, min_reps: int = 5, max_reps: int = 200,
                 warmup: int = 2) -> None:
        self.device = device
        self.target_s = target_s
        self.min_reps = min_reps
        self.max_reps = max_reps
        self.warmup = warmup

    def __call__(self, fn: Callable[..., Any], arg_sets: Sequence[tuple]) -> Timing:
        """Times `fn(*args)` alone, args rotating over `arg_sets`; raises what it raises."""
        t = self.interleaved([lambda args: fn(*args)], arg_sets)[0]
        if isinstance(t, BaseException):
            raise t
        return t

    def interleaved(self, calls: Sequence[Callable[[tuple], Any]], arg_sets: Sequence[tuple],
                    contexts: Sequence[Callable[[], Any]] | None = None) -> list[Timing | BaseException]:
        """Times the callables of `calls` (each takes one input set) in rounds, one call of each per round, and
        returns each one's Timing, or the exception that stopped it (it is left out of the rounds after that).
        contexts[k], where given, makes a context entered around each call of calls[k] outside its timed part.
        The number of rounds fills about `target_s` per callable at their mean time per call."""
        n = len(arg_sets)
        ctxs = list(contexts) if contexts is not None else [contextlib.nullcontext] * len(calls)
        out: list[Timing | BaseException | None] = [None] * len(calls)
        one = [0.0] * len(calls)
        for k, call in enumerate(calls):
            try:
                with ctxs[k]():
                    for i in range(self.warmup):
                        call(arg_sets[i % n])
                    sync(self.device)
                    t0 = time.perf_counter()
                    call(arg_sets[0])
                    sync(self.device)
                    one[k] = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - recorded as that implementation's result
                out[k] = e
        live = [k for k in range(len(calls)) if out[k] is None]
        if not live:
            return out  # type: ignore[return-value]
        reps = self._reps(sum(one[k] for k in live) / len(live))
        times: list[list[float]] = [[] for _ in calls]
        timed = self._cuda_call if self.device == "cuda" else self._cpu_call
        c = 1
        for _ in range(reps):
            for k in live:
                if out[k] is not None:
                    continue
                try:
                    with ctxs[k]():
                        times[k].append(timed(calls[k], arg_sets[c % n]))
                except Exception as e:  # noqa: BLE001
                    out[k] = e
                c += 1
        if self.device == "cuda":
            torch.cuda.synchronize()
            times = [[s.elapsed_time(e) / 1e3 for s, e in ts] for ts in times]  # type: ignore[misc]
        for k in live:
            if out[k] is None:
                ts = times[k]
                out[k] = Timing(statistics.median(ts), _quantile(ts, 0.1), _quantile(ts, 0.9), len(ts))
        return out  # type: ignore[return-value]

    @staticmethod
    def _cpu_call(call: Callable[[tuple], Any], args: tuple) -> float:
        t0 = time.perf_counter()
        call(args)
        return time.perf_counter() - t0

    @staticmethod
    def _cuda_call(call: Callable[[tuple], Any], args: tuple):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call(args)
        b.record()
        return a, b

    def _reps(self, one_call_s: float) -> int:
        if one_call_s <= 0:
            return self.max_reps
        return int(min(self.max_reps, max(self.min_reps, math.ceil(self.target_s / one_call_s))))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------
# The machine
# ----------------------------------------------------------------------------------------------------------

def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")


def _cpuinfo(key: str) -> str | None:
    """The value of the first /proc/cpuinfo line that starts with `key` (None where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The CPU's feature flags (lscpu's "Flags", from /proc/cpuinfo), so that results name the vector units."""
    return (_cpuinfo("flags") or "").split()


def last_level_cache_bytes(device: str) -> int:
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
    best = 0
    for idx in range(8):
        base = f"/sys/devices/system/cpu/cpu0/cache/index{idx}"
        try:
            with open(f"{base}/size") as f:
                txt = f.read().strip()
        except OSError:
            continue
        m = re.match(r"(\d+)([KMG]?)", txt)
        if m:
            best = max(best, int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)])
    return best or 32 * 2**20


def describe(device: str) -> dict[str, Any]:
    d: dict[str, Any] = {"type": device, "host_cpu": cpu_model(), "host_threads": os.cpu_count(),
                         "torch_threads": torch.get_num_threads(), "cache_bytes": last_level_cache_bytes(device),
                         "load_average_at_start": load_average()}
    if device == "cuda":
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        d.update(name=p.name, capability=f"sm_{p.major}{p.minor}", sms=p.multi_processor_count,
                 memory_bytes=p.total_memory)
    else:
        d["name"] = cpu_model()
        d["cpu_flags"] = cpu_flags()
    return d


def load_average() -> list[float] | None:
    """The host's 1/5/15-minute load averages: other work on a shared CPU makes CPU timings noisy."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_name(device: str) -> str:
    if device == "cuda":
        return _slug(torch.cuda.get_device_name(torch.cuda.current_device()))
    model = _slug(cpu_model())
    model = re.sub(r"-(\d+-core-processor|processor|cpu)$", "", model)
    return f"cpu-{model}-{torch.get_num_threads()}t"


# ----------------------------------------------------------------------------------------------------------
# Ceilings
# ----------------------------------------------------------------------------------------------------------

def measure_ceilings(device: str, quick: bool = False) -> dict[str, Any]:
    """{'copy_GBps': ..., 'matmul_TFLOPs': {dtype name: rate}} measured now, on random data."""
    timer = Timer(device, target_s=0.1 if not quick else 0.03, min_reps=5, max_reps=50)
    out: dict[str, Any] = {"matmul_TFLOPs": {}}
    gen = torch.Generator(device=device).manual_seed(0)
    if device == "cuda":
        nbytes = 2**30  # a few ms: no reason to shrink it for --quick
    else:
        nbytes = 2**28 if not quick else 2**26
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_(generator=gen)
    dst = torch.empty_like(src)
    t = timer(lambda d=dst, s=src: d.copy_(s), [()])
    out["copy_GBps"] = 2 * nbytes / t.median_s / 1e9
    out["copy_bytes"] = nbytes
    del src, dst
    if device == "cuda":
        sizes = {"bfloat16": 8192}
    else:
        sizes = {"float32": 2048 if not quick else 1024, "bfloat16": 1024 if not quick else 512}
    for name, n in sizes.items():
        dt = getattr(torch, name)
        x = torch.randn(n, n, device=device, generator=gen).to(dt)
        y = torch.randn(n, n, device=device, generator=gen).to(dt)
        t = timer(lambda x=x, y=y: torch.mm(x, y), [()])
        out["matmul_TFLOPs"][name] = 2 * n**3 / t.median_s / 1e12
        out[f"matmul_size_{name}"] = n
    return out


def matmul_rate_for(ceilings: dict[str, Any], dtype: torch.dtype) -> tuple[str, float | None]:
    """The matmul ceiling a case in `dtype` is compared with: its own dtype where measured, else bf16 for
    half precision (fp16 and bf16 tensor cores run at the same rate on Hopper), else fp32."""
    rates = ceilings.get("matmul_TFLOPs", {})
    name = str(dtype).removeprefix("torch.")
    if name in rates:
        return name, rates[name]
    if dtype in (torch.float16, torch.bfloat16) and "bfloat16" in rates:
        return "bfloat16", rates["bfloat16"]
    if "float32" in rates:
        return "float32", rates["float32"]
    return name, None
