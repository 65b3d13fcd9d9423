"""Shape keys: the text form of a shape and its power-of-two bucket, shared by the registry and the records."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


def shape_text(shape: Mapping[str, int]) -> str:
    """The one text form of a shape, dims sorted by name: ``{"L": 5000, "B": 3}`` -> ``"B=3,L=5000"``."""
    return ",".join(f"{k}={int(v)}" for k, v in sorted(shape.items()))


def shape_from_text(text: str) -> dict[str, int]:
    """Inverse of :func:`shape_text`; raises ValueError on a malformed item."""
    shape = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"shape: expected NAME=INT items, got {item!r} in {text!r}")
        try:
            shape[name.strip()] = int(value)
        except ValueError:
            raise ValueError(f"shape: {name.strip()} must be an integer, got {value!r} in {text!r}") from None
    return shape


def bucket(n: int) -> int:
    """Round a count up to a power of two (0 stays 0): 1->1, 3->4, 4096->4096, 4097->8192."""
    if n < 0:
        raise ValueError(f"bucket: count must be >= 0, got {n}")
    return 0 if n == 0 else 1 << (n - 1).bit_length()


@dataclass(frozen=True, order=True)
class ShapeKey:
    """Phase plus named dimensions; bucketed ones already rounded. ``str`` form: ``decode:B=64,L=131072``."""

    phase: str
    dims: tuple[tuple[str, int], ...]

    def __str__(self) -> str:
        return f"{self.phase}:{shape_text(dict(self.dims))}"

    @classmethod
    def parse(cls, text: str) -> "ShapeKey":
        phase, _, rest = text.partition(":")
        dims = tuple((k, int(v)) for k, v in (item.split("=") for item in rest.split(",") if item))
        return cls(phase, tuple(sorted(dims)))

    @classmethod
    def of(cls, phase: str, shape: Mapping[str, int], fixed: tuple[str, ...], bucketed: tuple[str, ...]) -> "ShapeKey":
        """``fixed`` dims exact, ``bucketed`` ones rounded up to a power of two."""
        dims = [(d, int(shape[d])) for d in fixed] + [(d, bucket(int(shape[d]))) for d in bucketed]
        return cls(phase, tuple(sorted(dims)))

    def as_dict(self) -> dict[str, int]:
        return dict(self.dims)
