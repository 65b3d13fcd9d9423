"""Kernel registry: what every tunable kernel declares, and how an op picks its launch config.

A kernel module builds one :class:`KernelSpec` and calls :func:`register`. The tuner, the benchmark
and the ops all read the same spec:

- ``space``: candidate values per launch parameter; ``constraint`` rejects combinations that are
  invalid for a shape (it returns the reason);
- ``fixed_dims`` / ``bucketed_dims``: which shape dimensions form the shape key, exact or rounded up to a
  power of two (token, batch and context counts);
- ``default(phase, shape)``: the config used when the tuning database has nothing better;
- ``make_inputs`` / ``run`` / ``reference`` / ``compare``: a fresh random problem, the kernel with an
  explicit config, the pure-PyTorch oracle and the agreement test;
- ``cost`` and ``baseline``: the floor (bytes and FLOPs) and what a user would run instead.

Ops call :meth:`KernelSpec.launch_config`, which asks the installed config lookup (host side, cached) and
falls back to the default. ``import dsa_triton`` installs the tuning database as that lookup, in plain sight
(:func:`set_config_lookup`); nothing else installs one on import.
"""
from __future__ import annotations

import hashlib
import inspect
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch

from .hostmath import next_pow2

Config = dict[str, Any]
Shape = Mapping[str, int]
Inputs = dict[str, Any]


class ConfigError(ValueError):
    """A config that names an unknown parameter, a value outside the space, or breaks a constraint."""


def shape_text(shape: Shape) -> str:
    """The one text form of a shape, dims sorted by name: ``{"L": 5000, "B": 3}`` -> ``"B=3,L=5000"``."""
    return ",".join(f"{k}={int(v)}" for k, v in sorted(shape.items()))


def bucket(n: int) -> int:
    """Round a count up to a power of two (0 stays 0): 1->1, 3->4, 4096->4096, 4097->8192."""
    if n < 0:
        raise ValueError(f"bucket: count must be >= 0, got {n}")
    return 0 if n == 0 else next_pow2(n)


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

    def as_dict(self) -> dict[str, int]:
        return dict(self.dims)


@dataclass(frozen=True)
class Cost:
    """The work of one call: bytes that must cross device memory, and FLOPs on the named unit."""

    bytes: float
    flops: float = 0.0
    flop_dtype: str = "bf16"  # which measured matmul rate bounds the FLOPs: "bf16" or "fp8"


@dataclass
class KernelSpec:
    name: str
    phases: tuple[str, ...]
    space: dict[str, tuple[Any, ...]]
    default: Callable[[str, Shape], Config]
    fixed_dims: tuple[str, ...]
    bucketed_dims: tuple[str, ...]
    make_inputs: Callable[[str, Shape, torch.device, int], Inputs]
    run: Callable[[Inputs, Config], Any]
    reference: Callable[[Inputs], Any]
    compare: Callable[[Any, Any], str | None]
    cost: Callable[[str, Shape], Cost]
    bench_shapes: Callable[[str, bool], list[dict[str, int]]]
    constraint: Callable[[Config, Shape], str | None] = lambda config, shape: None
    baseline: Callable[[Inputs], Any] | None = None
    baseline_name: str = ""
    source_modules: tuple[Any, ...] = ()
    _cache: dict = field(default_factory=dict, repr=False)

    # -- shape keys -------------------------------------------------------------------------
    def shape_key(self, phase: str, shape: Shape) -> ShapeKey:
        """Exact fixed dims, power-of-two bucketed counts; a missing dimension is an error."""
        if phase not in self.phases:
            raise ValueError(f"{self.name}: phase must be one of {self.phases}, got {phase!r}")
        missing = [d for d in (*self.fixed_dims, *self.bucketed_dims) if d not in shape]
        if missing:
            raise ValueError(f"{self.name}: shape lacks dimensions {missing} (got {dict(shape)})")
        dims = [(d, int(shape[d])) for d in self.fixed_dims]
        dims += [(d, bucket(int(shape[d]))) for d in self.bucketed_dims]
        return ShapeKey(phase, tuple(sorted(dims)))

    # -- configs ------------------------------------------------------------------------------
    def validate(self, config: Config, shape: Shape) -> Config:
        """Return a copy of ``config`` if it is a dict whose every parameter is known, in its space (type included:
        ``16.0`` is not ``16``) and the constraint holds; else raise :class:`ConfigError` naming the parameter (or
        ``config``, for what is not a dict)."""
        if not isinstance(config, Mapping):
            raise ConfigError(f"{self.name}: config must be a dict of launch parameters, got {type(config).__name__}")
        unknown = set(config) - set(self.space)
        if unknown:
            raise ConfigError(f"{self.name}: unknown parameters {sorted(unknown)}")
        missing = set(self.space) - set(config)
        if missing:
            raise ConfigError(f"{self.name}: config lacks parameters {sorted(missing)}")
        for k, v in config.items():
            if not any(type(v) is type(c) and v == c for c in self.space[k]):
                raise ConfigError(f"{self.name}: {k}={v!r} is not among the candidates {self.space[k]}")
        reason = self.constraint(config, shape)
        if reason:
            raise ConfigError(f"{self.name}: config {config} is invalid for {dict(shape)}: {reason}")
        return dict(config)

    def is_valid(self, config: Config, shape: Shape) -> bool:
        try:
            self.validate(config, shape)
            return True
        except ConfigError:
            return False

    def configs(self, shape: Shape) -> Iterator[Config]:
        """Every valid config of the space for ``shape`` (the exhaustive search order)."""
        names = list(self.space)
        for values in itertools.product(*(self.space[n] for n in names)):
            config = dict(zip(names, values))
            if self.is_valid(config, shape):
                yield config

    def space_size(self) -> int:
        return math.prod(len(v) for v in self.space.values())

    def launch_config(self, phase: str, shape: Shape, device: torch.device | str | None = None) -> Config:
        """The config an op launches with: the installed lookup's stored config for this shape, else the default.

        The lookup is given the spec (nothing is looked up by name again); what it returns is validated here, and
        an invalid stored config falls back to the (validated) default. Host-side and cached per (phase, shape, device) as given
        and the lookup installed, so it is cheap on every call and never launches anything (safe inside
        CUDA-graph capture once warmed up).
        """
        key = (phase, tuple(shape.items()), device, _lookup_generation)  # as given: a hit does no other work
        hit = self._cache.get(key)
        if hit is not None:
            return dict(hit)
        from .runtime import device_name

        config = None if _lookup is None else _lookup(self, phase, dict(shape), device_name(device))
        if config is None or not self.is_valid(config, shape):  # a lookup that is not the database may err
            config = self.validate(dict(self.default(phase, shape)), shape)
        self._cache[key] = dict(config)
        return dict(config)

    def source_hash(self) -> str:
        """Short hash of the kernel's source modules: a stored record is only trusted for the same code."""
        h = hashlib.sha256()
        for module in self.source_modules:
            h.update(inspect.getsource(module).encode())
        return h.hexdigest()[:12]


# -- the registry -------------------------------------------------------------------------------
_KERNELS: dict[str, KernelSpec] = {}
ConfigLookup = Callable[["KernelSpec", str, dict[str, int], str], "Config | None"]
_lookup: ConfigLookup | None = None
_lookup_generation = 0


def register(spec: KernelSpec) -> KernelSpec:
    """Add a kernel; names are unique and every phase's default must be valid on its bench shapes."""
    if spec.name in _KERNELS:
        raise ValueError(f"kernel {spec.name!r} is already registered")
    if not spec.phases:
        raise ValueError(f"kernel {spec.name!r}: declares no phase")
    for phase in spec.phases:
        for gpu in (False, True):
            for shape in spec.bench_shapes(phase, gpu):
                spec.validate(dict(spec.default(phase, shape)), shape)
    _KERNELS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a kernel (tests register throw-away specs)."""
    _KERNELS.pop(name, None)


def get(name: str) -> KernelSpec:
    try:
        return _KERNELS[name]
    except KeyError:
        raise KeyError(f"no kernel {name!r}; registered: {sorted(_KERNELS)}") from None


def kernels() -> list[KernelSpec]:
    """Every registered kernel, by name."""
    return [_KERNELS[n] for n in sorted(_KERNELS)]


def lookup_generation() -> int:
    """Bumped by every :func:`set_config_lookup`: caches of launch decisions key on it."""
    return _lookup_generation


def set_config_lookup(fn: ConfigLookup | None) -> None:
    """Install the function ops ask for stored configs: ``fn(spec, phase, shape, device) -> config or None``.

    ``shape`` is the exact (unbucketed) shape, so a database can prefer an exact match over the same bucket; a
    returned config must be valid for ``spec`` and ``shape`` (:meth:`KernelSpec.is_valid`). ``import dsa_triton``
    installs the tuning database; tests install their own. Clears the caches.
    """
    global _lookup, _lookup_generation
    _lookup = fn
    _lookup_generation += 1
    for spec in _KERNELS.values():
        spec._cache.clear()


def config_lookup() -> ConfigLookup | None:
    """The installed lookup (None: every op launches with its default)."""
    return _lookup
