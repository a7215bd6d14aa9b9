"""Timers and machine ceilings.

GPU: one pair of CUDA events around every call, after warm-up; the median over the calls. Inputs rotate over
several buffer sets whose total size is a few times the last-level cache, so a case does not run out of a
warm L2 unless its inputs are that small anyway. No CUDA graphs: a peer that launches many small kernels pays
its launch gaps, as it does in eager code. CPU: time.perf_counter around every call, same structure.

Ceilings, measured in the same run: the device copy bandwidth (a large device-to-device copy, bytes read plus
bytes written) and the dense matmul rate (bf16 on GPU; fp32 and bf16 on CPU) on random data.
"""

from __future__ import annotations

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
    """Times `fn(args)` for args rotating over `arg_sets`."""

    def __init__(self, device: str, target_s: float = 0.05, min_reps: int = 5, max_reps: int = 200,
                 warmup: int = 2) -> None:
        self.device = device
        self.target_s = target_s
        self.min_reps = min_reps
        self.max_reps = max_reps
        self.warmup = warmup

    def __call__(self, fn: Callable[..., Any], arg_sets: Sequence[tuple]) -> Timing:
        n = len(arg_sets)
        for i in range(self.warmup):
            fn(*arg_sets[i % n])
        if self.device == "cuda":
            return self._cuda(fn, arg_sets)
        return self._cpu(fn, arg_sets)

    def _reps(self, one_call_s: float) -> int:
        if one_call_s <= 0:
            return self.max_reps
        return int(min(self.max_reps, max(self.min_reps, math.ceil(self.target_s / one_call_s))))

    def _cpu(self, fn, arg_sets) -> Timing:
        n = len(arg_sets)
        t0 = time.perf_counter()
        fn(*arg_sets[0])
        reps = self._reps(time.perf_counter() - t0)
        times = []
        for i in range(reps):
            args = arg_sets[(i + 1) % n]
            t0 = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - t0)
        return Timing(statistics.median(times), _quantile(times, 0.1), _quantile(times, 0.9), reps)

    def _cuda(self, fn, arg_sets) -> Timing:
        n = len(arg_sets)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(3):
            fn(*arg_sets[i % n])
        b.record()
        torch.cuda.synchronize()
        reps = self._reps(a.elapsed_time(b) / 3e3)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            args = arg_sets[(i + 3) % n]
            starts[i].record()
            fn(*args)
            ends[i].record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
        return Timing(statistics.median(times), _quantile(times, 0.1), _quantile(times, 0.9), reps)


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
