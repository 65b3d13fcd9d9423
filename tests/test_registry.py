"""Registry logic: bucketing, shape keys, config validation, defaults and the database lookup."""
import pytest
import torch

from dsa_triton import registry
from dsa_triton.registry import ConfigError, Cost, KernelSpec, ShapeKey, bucket
from tuning_db import Database


def toy_spec(name="toy_scale", default=None, **overrides) -> KernelSpec:
    """A throw-away spec over y = 2x with a BLOCK that must divide N."""
    fields = dict(
        name=name,
        phases=("decode", "prefill"),
        space={"BLOCK": (16, 32, 64), "num_warps": (1, 2, 4)},
        default=default or (lambda phase, shape: {"BLOCK": 16, "num_warps": 1}),
        fixed_dims=("D",),
        bucketed_dims=("T",),
        make_inputs=lambda phase, shape, device, seed: {"x": torch.randn(shape["T"], shape["D"], generator=torch.Generator().manual_seed(seed))},
        run=lambda inputs, config: inputs["x"] * 2,
        reference=lambda inputs: inputs["x"] * 2,
        compare=lambda out, ref: None if torch.equal(out, ref) else "mismatch",
        cost=lambda phase, shape: Cost(bytes=8.0 * shape["T"] * shape["D"]),
        bench_shapes=lambda phase, gpu: [{"T": 3, "D": 64}],
        constraint=lambda config, shape: None if shape["D"] % config["BLOCK"] == 0 else "BLOCK must divide D",
    )
    fields.update(overrides)
    return KernelSpec.of(**fields)


@pytest.mark.parametrize("n, want", [(0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (4096, 4096), (4097, 8192), (131071, 131072)])
def test_bucket_rounds_up_to_power_of_two(n, want):
    assert bucket(n) == want


def test_bucket_rejects_negative():
    with pytest.raises(ValueError):
        bucket(-1)


def test_shape_key_buckets_only_bucketed_dims():
    spec = toy_spec()
    key = spec.shape_key("decode", {"T": 100, "D": 96})
    assert key == ShapeKey("decode", (("D", 96), ("T", 128)))
    assert str(key) == "decode:D=96,T=128"
    assert ShapeKey.parse(str(key)) == key
    # a fixed dim is never bucketed: D=96 and D=128 are different keys
    assert spec.shape_key("decode", {"T": 100, "D": 128}) != key
    # same bucket, same key
    assert spec.shape_key("decode", {"T": 65, "D": 96}) == key


def test_shape_key_rejects_missing_dims_and_unknown_phase():
    spec = toy_spec()
    with pytest.raises(ValueError, match="lacks dimensions"):
        spec.shape_key("decode", {"T": 4})
    with pytest.raises(ValueError, match="phase"):
        spec.shape_key("train", {"T": 4, "D": 64})


def test_validate_rejects_bad_configs():
    spec = toy_spec()
    shape = {"T": 4, "D": 48}
    assert spec.validate({"BLOCK": 16, "num_warps": 2}, shape)
    with pytest.raises(ConfigError, match="unknown"):
        spec.validate({"BLOCK": 16, "num_warps": 2, "extra": 1}, shape)
    with pytest.raises(ConfigError, match="lacks"):
        spec.validate({"BLOCK": 16}, shape)
    with pytest.raises(ConfigError, match="candidates"):
        spec.validate({"BLOCK": 128, "num_warps": 2}, shape)
    with pytest.raises(ConfigError, match="divide"):
        spec.validate({"BLOCK": 32, "num_warps": 2}, shape)


def test_configs_enumerates_only_valid_ones():
    spec = toy_spec()
    assert spec.space_size() == 9
    all_ok = list(spec.configs({"T": 4, "D": 64}))
    assert len(all_ok) == 9
    some = list(spec.configs({"T": 4, "D": 48}))
    assert {c["BLOCK"] for c in some} == {16}
    assert len(some) == 3


def test_register_rejects_invalid_default_and_duplicates():
    bad = toy_spec("toy_bad_default", default=lambda phase, shape: {"BLOCK": 128, "num_warps": 1})
    with pytest.raises(ConfigError):
        registry.register(bad)
    assert "toy_bad_default" not in [s.name for s in registry.kernels()]
    missing = toy_spec("toy_missing_default", default=lambda phase, shape: {"BLOCK": 16})
    with pytest.raises(ConfigError, match="lacks"):
        registry.register(missing)
    spec = registry.register(toy_spec("toy_dup"))
    try:
        with pytest.raises(ValueError, match="already registered"):
            registry.register(toy_spec("toy_dup"))
        assert registry.get("toy_dup") is spec
    finally:
        registry.unregister("toy_dup")
    with pytest.raises(KeyError):
        registry.get("toy_dup")


class Lookup(Database):
    """A database whose lookup is ``fn(spec, phase, shape, device)``."""

    def __init__(self, fn):
        super().__init__()
        self.lookup = fn


def test_launch_config_uses_lookup_then_default():
    spec = toy_spec()
    shape = {"T": 5, "D": 64}
    seen = []

    def lookup(spec, phase, exact_shape, device):
        seen.append((spec.name, phase, exact_shape, device))
        return {"BLOCK": 64, "num_warps": 4} if exact_shape["T"] == 5 else None

    previous = registry.database()
    try:
        registry.use_database(Lookup(lookup))
        assert spec.launch_config("decode", shape, "cpu") == {"BLOCK": 64, "num_warps": 4}
        assert seen == [("toy_scale", "decode", {"T": 5, "D": 64}, "cpu-interpreter")]
        spec.launch_config("decode", shape, "cpu")
        assert len(seen) == 1, "a second call must be served from the cache"
        # no stored record: the default
        assert spec.launch_config("decode", {"T": 6, "D": 64}, "cpu") == {"BLOCK": 16, "num_warps": 1}
        # a stored config that is invalid for the shape is ignored, not launched
        assert spec.launch_config("decode", {"T": 5, "D": 48}, "cpu") == {"BLOCK": 16, "num_warps": 1}
        # the phase is part of the cache key
        registry.use_database(Lookup(lambda spec, phase, s, d: {"BLOCK": 32, "num_warps": 2} if phase == "prefill" else None))
        assert spec.launch_config("decode", shape, "cpu")["BLOCK"] == 16
        assert spec.launch_config("prefill", shape, "cpu")["BLOCK"] == 32
    finally:
        registry.use_database(previous)


def test_launch_config_returns_a_copy():
    spec = toy_spec()
    config = spec.launch_config("decode", {"T": 2, "D": 64}, "cpu")
    config["BLOCK"] = 999
    assert spec.launch_config("decode", {"T": 2, "D": 64}, "cpu")["BLOCK"] != 999


def test_exact_mismatch_names_the_first_difference():
    from dsa_triton.checks import exact_mismatch

    a = torch.tensor([1.0, float("nan"), -0.5])
    assert exact_mismatch([("x", a, a.clone()), ("fp8", a.to(torch.float8_e4m3fn), a.to(torch.float8_e4m3fn))]) is None
    assert "x: 1 of 3" in exact_mismatch([("x", a, torch.tensor([1.0, 7.0, -0.5]))])  # NaN is not 7
    assert "x: torch.float32(3,) vs reference torch.float16(3,)" == exact_mismatch([("x", a, a.half())])
    assert exact_mismatch([("ok", a, a), ("ids", torch.arange(3), torch.arange(1, 4))]).startswith("ids: 3 of 3")
