"""Kernel registry: what every tunable kernel declares, and how an op picks its launch config.

Two declarations per kernel, so that an op never imports its registry entry:

- :class:`LaunchSpace`, in the op's module: what the op needs at run time. ``space``: candidate values per launch
  parameter; ``constraint`` rejects combinations that are invalid for a shape (it returns the reason);
  ``fixed_dims`` / ``bucketed_dims``: which shape dimensions form the shape key, exact or rounded up to a power of
  two (token, batch and context counts); ``default(phase, shape)``: the config used when the tuning database has
  nothing better. The op calls :meth:`LaunchSpace.launch_config`.
- :class:`KernelSpec`, in the op's ``<op>_spec.py``, which imports the op: its launch space and what measuring
  needs: ``make_inputs`` / ``run`` / ``reference`` / ``compare`` (a fresh random problem, the kernel with an explicit
  config, the pure-PyTorch oracle and the agreement test), ``cost`` and ``baseline`` (the floor in bytes and FLOPs,
  and what a user would run instead), ``model_dims`` (the kernel's dims from a model's config.json, for the tuner).
  :func:`register` adds it; the tuner, the bench and the tests read it.

Launch configs come from the tuning database (:mod:`tuning_db`, a leaf package) that :func:`database` opens on first
use (``$DSA_TUNING_DB`` or the packaged folder); :func:`use_database` makes another one current. Nothing is opened
or installed as a side effect of an import.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch

from tuning_db import Database, ShapeKey, bucket, shape_text  # noqa: F401  (re-exported: the names specs use)

Config = dict[str, Any]
Shape = Mapping[str, int]
Inputs = dict[str, Any]


class ConfigError(ValueError):
    """A config that names an unknown parameter, a value outside the space, or breaks a constraint."""


@dataclass(frozen=True)
class Cost:
    """The work of one call: bytes that must cross device memory, and FLOPs on the named unit."""

    bytes: float
    flops: float = 0.0
    flop_dtype: str = "bf16"  # which measured matmul rate bounds the FLOPs: "bf16" or "fp8"


@dataclass
class LaunchSpace:
    """An op's launch parameters: what the op needs at run time (module docstring). Declared in the op's module."""

    name: str
    phases: tuple[str, ...]
    space: dict[str, tuple[Any, ...]]
    default: Callable[[str, Shape], Config]
    fixed_dims: tuple[str, ...]
    bucketed_dims: tuple[str, ...]
    constraint: Callable[[Config, Shape], str | None] = lambda config, shape: None
    _cache: dict = field(default_factory=dict, repr=False)

    def shape_key(self, phase: str, shape: Shape) -> ShapeKey:
        """Exact fixed dims, power-of-two bucketed counts; a missing dimension is an error."""
        if phase not in self.phases:
            raise ValueError(f"{self.name}: phase must be one of {self.phases}, got {phase!r}")
        missing = [d for d in (*self.fixed_dims, *self.bucketed_dims) if d not in shape]
        if missing:
            raise ValueError(f"{self.name}: shape lacks dimensions {missing} (got {dict(shape)})")
        return ShapeKey.of(phase, shape, self.fixed_dims, self.bucketed_dims)

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
        """The config an op launches with: the current database's stored config for this shape, else the default.

        What the database returns is validated here, and an invalid stored config falls back to the (validated)
        default. Host-side and cached per (phase, shape, device) as given and the database's :func:`generation`,
        so it is cheap on every call and never launches anything (safe inside CUDA-graph capture once warmed up).
        """
        key = (phase, tuple(shape.items()), device, generation())  # as given: a hit does no other work
        hit = self._cache.get(key)
        if hit is not None:
            return dict(hit)
        from .runtime import device_name

        config = database().lookup(self, phase, dict(shape), device_name(device))
        if config is None or not self.is_valid(config, shape):  # a database that is not ours may err
            config = self.validate(dict(self.default(phase, shape)), shape)
        if len(self._cache) >= MAX_CACHED:
            self._cache.clear()
        self._cache[key] = dict(config)
        return dict(config)


LAUNCH_FIELDS = ("name", "phases", "space", "default", "fixed_dims", "bucketed_dims", "constraint")


@dataclass
class KernelSpec:
    """A registered kernel: its op's :class:`LaunchSpace` and what measuring and tuning need (module docstring).

    ``model_dims(config)``: the kernel's dims that a model's config.json fixes, one dict per problem the model poses
    (e.g. one per weight matrix), read through :mod:`.model_dims`; ``count_roles``: what each bucketed dim counts
    (``batch``, ``tokens``, ``context`` or ``pages``), so a tuner can lay batch sizes and context lengths over them.
    """

    launch: LaunchSpace
    make_inputs: Callable[[str, Shape, torch.device, int], Inputs]
    run: Callable[[Inputs, Config], Any]
    reference: Callable[[Inputs], Any]
    compare: Callable[[Any, Any], str | None]
    cost: Callable[[str, Shape], Cost]
    bench_shapes: Callable[[str, bool], list[dict[str, int]]]
    baseline: Callable[[Inputs], Any] | None = None
    baseline_name: str = ""
    source_modules: tuple[Any, ...] = ()
    model_dims: Callable[[dict[str, Any]], list[dict[str, int]]] | None = None
    count_roles: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, **fields) -> "KernelSpec":
        """A spec from flat fields, those of its :class:`LaunchSpace` among them (a throw-away kernel's, a test's)."""
        launch = {k: fields.pop(k) for k in LAUNCH_FIELDS if k in fields}
        return cls(launch=LaunchSpace(**launch), **fields)

    def replace(self, **changes) -> "KernelSpec":
        """A copy with ``changes`` to any field, its launch space's included (a fresh launch-config cache)."""
        launch = {k: changes.pop(k, getattr(self.launch, k)) for k in LAUNCH_FIELDS}
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "launch"}
        return KernelSpec.of(**launch, **{**fields, **changes})

    @property
    def name(self) -> str:
        return self.launch.name

    @property
    def phases(self) -> tuple[str, ...]:
        return self.launch.phases

    @property
    def space(self) -> dict[str, tuple[Any, ...]]:
        return self.launch.space

    @property
    def fixed_dims(self) -> tuple[str, ...]:
        return self.launch.fixed_dims

    @property
    def bucketed_dims(self) -> tuple[str, ...]:
        return self.launch.bucketed_dims

    def default(self, phase: str, shape: Shape) -> Config:
        return self.launch.default(phase, shape)

    def constraint(self, config: Config, shape: Shape) -> str | None:
        return self.launch.constraint(config, shape)

    def shape_key(self, phase: str, shape: Shape) -> ShapeKey:
        return self.launch.shape_key(phase, shape)

    def validate(self, config: Config, shape: Shape) -> Config:
        return self.launch.validate(config, shape)

    def is_valid(self, config: Config, shape: Shape) -> bool:
        return self.launch.is_valid(config, shape)

    def configs(self, shape: Shape) -> Iterator[Config]:
        return self.launch.configs(shape)

    def space_size(self) -> int:
        return self.launch.space_size()

    def launch_config(self, phase: str, shape: Shape, device: torch.device | str | None = None) -> Config:
        return self.launch.launch_config(phase, shape, device)

    def source_hash(self) -> str:
        """Short hash of the kernel's source modules: a stored record is only trusted for the same code."""
        h = hashlib.sha256()
        for module in self.source_modules:
            h.update(inspect.getsource(module).encode())
        return h.hexdigest()[:12]


# -- the registry -------------------------------------------------------------------------------
MAX_CACHED = 4096  # launch configs kept per kernel; past this the cache starts over
_KERNELS: dict[str, KernelSpec] = {}
_database: Database | None = None
_generation = 0  # bumped whenever another database becomes current


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


def source_hash(name: str) -> str | None:
    """The source hash of the registered kernel ``name`` (None: not registered): the database's freshness test."""
    spec = _KERNELS.get(name)
    return None if spec is None else spec.source_hash()


def database() -> Database:
    """The tuning database ops read launch configs from: the one :func:`use_database` made current, else the one in
    ``$DSA_TUNING_DB`` (default: the packaged ``tuning_db/data``), opened on first use."""
    return _database if _database is not None else use_database()


def use_database(db: Database | str | None = None) -> Database:
    """Make ``db`` the database every op reads (a :class:`tuning_db.Database`, a folder, or None: ``$DSA_TUNING_DB``
    or the packaged one) and return it; the ops' cached launch decisions start over."""
    global _database, _generation
    if not isinstance(db, Database):
        db = Database(db, source_hash=source_hash)
    _database = db
    _generation += 1
    return db


def generation() -> tuple[int, int]:
    """Changes whenever a launch config may change (another database, or records added to the current one): caches
    of launch decisions key on it."""
    return _generation, -1 if _database is None else _database.generation
