"""What the test machine's CPU offers the CPU kernels (read from /proc/cpuinfo; False where it cannot be read)."""

from __future__ import annotations

import os


def _cpuinfo(key: str) -> str:
    """The value of the first `key` line of /proc/cpuinfo ("" where there is none or it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((v.strip() for k, _, v in (line.partition(":") for line in f) if k.strip() == key), "")
    except OSError:
        return ""


def cpu_flag(name: str) -> bool:
    return name in _cpuinfo("flags").split()


def cpu_vendor() -> str:
    return _cpuinfo("vendor_id")


def bf16_pair_tiles() -> bool:
    """Whether the block kernels multiply bf16 tiles as pairs here (ops_src/cpu_math.h: rf::bf16_dot): the CPU has
    AVX512_BF16 and REDFUSER_CPU_BF16_DOT is 1, or is not 0 on an AMD CPU (the default: vdpbf16ps is twice the float
    tile's rate on Zen 4 and half of it on the Xeon measured)."""
    env = os.environ.get("REDFUSER_CPU_BF16_DOT")
    return cpu_flag("avx512_bf16") and env != "0" and (env == "1" or cpu_vendor() == "AuthenticAMD")


def ops_in_subprocess(tmp_path, inputs, call: str, env: dict, threads: int | None = None):
    """What `call` (an expression over `ins`, the saved `inputs`) gives in a fresh interpreter with `env` added to
    the environment, run from tmp_path (the installed package, not the source tree): the CPU kernels' switches
    (REDFUSER_CPU_BF16_DOT, REDFUSER_CPU_TILE_MEMO) are read once per process. `threads`: torch's threads there."""
    import subprocess
    import sys

    import torch

    torch.save(inputs, tmp_path / "in.pt")
    code = ("import sys, torch, redfuser_ops\n"
            + (f"torch.set_num_threads({int(threads)})\n" if threads else "")
            + f"ins = torch.load(sys.argv[1])\ntorch.save({call}, sys.argv[2])\n")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   env=dict(os.environ, **env), check=True, timeout=300, cwd=tmp_path)
    return torch.load(tmp_path / "out.pt")
