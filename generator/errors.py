"""Errors raised by the generator. Every error names where in which spec it comes from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Loc:
    """A place in a spec file: the file, the 1-based line and the dotted key path."""

    file: str
    line: int
    key: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.key}"


UNKNOWN = Loc("<spec>", 0, "")


class SpecError(ValueError):
    """A spec is malformed: bad YAML, a missing or unknown key, a bad expression."""

    def __init__(self, loc: Loc, message: str):
        self.loc = loc
        self.message = message
        super().__init__(f"{loc}: {message}")


class FusionError(ValueError):
    """A cascade cannot be fused: which reduction, which condition, the offending expression."""

    def __init__(self, loc: Loc, reduction: str, condition: str, detail: str):
        self.loc = loc
        self.reduction = reduction
        self.condition = condition
        self.detail = detail
        super().__init__(f"{loc}: reduction '{reduction}' is not fusible: {condition}: {detail}")
