"""redfuser-ops: fused cascaded-reduction kernels, generated ahead of time, as torch ops.

Importing the package loads the compiled library (``torch.ops.redfuser.*`` then exists) and the
generated modules (fake implementations for torch.compile, typed wrappers re-exported here).
"""

from __future__ import annotations

import json
from importlib import metadata as _metadata
from typing import Any

import torch

from . import _loader

_loader.load_library()

__all__ = ["check_inputs", "format_info", "info", "library_path", "set_check_inputs", "warm_up"]

for _mod in _loader.import_generated():
    for _name in getattr(_mod, "__all__", ()):
        globals()[_name] = getattr(_mod, _name)
        __all__.append(_name)
del _mod

try:
    __version__ = _metadata.version("redfuser-ops")
except _metadata.PackageNotFoundError:  # pragma: no cover - not installed as a distribution
    __version__ = _loader.build_info().get("version", "unknown")


def set_check_inputs(on: bool) -> bool:
    """Whether the ops check the values of index tensors on CUDA as they do on the CPU (for example that every
    used ``block_table`` entry of ``mla_decode`` lies in ``[0, NB)``); returns the previous setting.

    The check reads the index tensors back from the device, a host synchronisation per call: off by default
    (then an out-of-domain index never reads or writes outside a tensor, see the README), so that the ops stay
    CUDA-graph capturable. The build setting ``REDFUSER_CHECK_INPUTS=ON`` makes it the default. On the CPU the
    values are always checked.
    """
    return bool(torch.ops.redfuser._set_check_inputs(bool(on)))


def warm_up(device: int | torch.device | None = None) -> int:
    """Loads and configures (module load, shared-memory attributes) every CUDA kernel that runs on `device`
    (default: the current CUDA device); returns how many. Call it before capturing a CUDA graph whose ops have not
    run on that device yet: init never runs inside a capture then. The first eager call of any op on a device does
    the same for its family. Returns 0 on a build without CUDA kernels."""
    if device is None:
        index = torch.cuda.current_device()
    else:
        index = torch.device(device).index if not isinstance(device, int) else device
        index = torch.cuda.current_device() if index is None else index
    return int(torch.ops.redfuser._warm_up(int(index)))


def check_inputs() -> bool:
    """The current `set_check_inputs` setting."""
    return bool(torch.ops.redfuser._check_inputs())


def library_path() -> str:
    """Path of the loaded ``_C.so``."""
    return str(_loader.load_library())


def info() -> dict[str, Any]:
    """What this installation contains and runs on.

    Keys: ``version``, ``torch_target`` (oldest torch the library supports), ``torch_built_with``,
    ``torch`` (the running torch), ``cuda`` (CUDA version the kernels were compiled with, or
    None), ``families`` and ``archs`` (CUDA code in the library), ``ops`` (op -> schema and
    variants), ``library`` (path), ``cuda_available`` and ``devices`` (what torch sees now).
    """
    data = _loader.build_info()
    data["library"] = library_path()
    data["torch"] = torch.__version__
    data["cuda_available"] = bool(torch.cuda.is_available())
    devices = []
    if data["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            devices.append({"index": i, "name": torch.cuda.get_device_name(i), "capability": f"sm_{major}{minor}"})
    data["devices"] = devices
    return data


def format_info(data: dict[str, Any] | None = None) -> str:
    """Human-readable form of `info()`."""
    d = info() if data is None else data
    lines = [
        f"redfuser-ops {d['version']}",
        f"  library:      {d['library']}",
        f"  torch:        {d['torch']} (library targets torch >= {d['torch_target']}, built with {d['torch_built_with']})",
        f"  CUDA:         {d['cuda'] or 'none (CPU-only build)'}",
        f"  arch families: {', '.join(d['families']) or 'none'}"
        + (f" ({'; '.join(d['archs'])})" if d["archs"] else ""),
    ]
    if d["devices"]:
        for dev in d["devices"]:
            lines.append(f"  device {dev['index']}:     {dev['name']} ({dev['capability']})")
    else:
        lines.append("  devices:      no CUDA device visible to torch")
    ops = d["ops"]
    lines.append(f"  ops ({len(ops)}):")
    for name, op in ops.items():
        variants = op["variants"]
        by_dev: dict[str, int] = {}
        for v in variants:
            key = v["device"] if not v["family"] else f"{v['device']}/{v['family']}"
            by_dev[key] = by_dev.get(key, 0) + 1
        summary = ", ".join(f"{k}: {n}" for k, n in sorted(by_dev.items()))
        lines.append(f"    torch.ops.redfuser.{name}: {len(variants)} variants ({summary})")
        if op.get("schema"):
            lines.append(f"      {op['schema']}")
    return "\n".join(lines)


def _info_json() -> str:
    return json.dumps(info(), indent=2, sort_keys=True)
