"""What the test machine's CPU offers the CPU kernels (read from /proc/cpuinfo; False where it cannot be read)."""

from __future__ import annotations

import os


def cpu_flag(name: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and name in line.split() for line in f)
    except OSError:
        return False


def bf16_pair_tiles() -> bool:
    """Whether the block kernels multiply bf16 tiles as pairs here (ops_src/cpu_math.h: rf::bf16_dot): the CPU has
    AVX512_BF16 and REDFUSER_CPU_BF16_DOT is not 0."""
    return cpu_flag("avx512_bf16") and os.environ.get("REDFUSER_CPU_BF16_DOT") != "0"
