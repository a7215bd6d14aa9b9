"""Finds and loads the compiled library, then the generated Python modules.

The library (``_C.so``) is a LibTorch stable-ABI extension without any Python C API: it is
loaded with ``torch.ops.load_library``, which runs its op registrations. The generated modules
``redfuser_ops/_generated*.py`` (written by the generator at build time) register the fake
(meta) implementations and define the typed wrappers.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import pkgutil
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

_PACKAGE = __name__.rpartition(".")[0]
_LIB_NAME = "_C"
_loaded_path: Path | None = None


def library_path() -> Path:
    """Path of the compiled library of the installed package."""
    spec = importlib.util.find_spec(f"{_PACKAGE}.{_LIB_NAME}")
    if spec is not None and spec.origin and Path(spec.origin).is_file():
        return Path(spec.origin)
    here = Path(__file__).resolve().parent / f"{_LIB_NAME}.so"
    if here.is_file():
        return here
    raise ImportError(
        f"{_PACKAGE}: the compiled library {_LIB_NAME}.so was not found next to "
        f"{Path(__file__).parent}. Is this the source tree rather than an installed package? "
        "Install it with `pip install .` and import it from outside the source directory."
    )


def load_library() -> Path:
    """Load ``_C.so`` into torch (once) and return its path."""
    global _loaded_path
    if _loaded_path is None:
        path = library_path()
        try:
            torch.ops.load_library(str(path))
        except OSError as e:
            raise ImportError(f"{_PACKAGE}: cannot load {path}: {e}") from e
        _loaded_path = path
    return _loaded_path


def generated_module_names() -> list[str]:
    """Names of the generated modules shipped in the package, sorted."""
    pkg = importlib.import_module(_PACKAGE)
    return sorted(
        m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name.startswith("_generated")
    )


def import_generated() -> list[ModuleType]:
    """Import every ``_generated*`` module (fake impls, typed wrappers), sorted by name."""
    return [importlib.import_module(f"{_PACKAGE}.{name}") for name in generated_module_names()]


def build_info() -> dict[str, Any]:
    """What the library reports about itself (``torch.ops.redfuser._build_info``)."""
    load_library()
    return json.loads(torch.ops.redfuser._build_info())
