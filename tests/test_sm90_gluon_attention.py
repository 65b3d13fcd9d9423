"""The Gluon sparse attention kernel (:mod:`dsa_triton.attention.sparse_attention_gluon`), over a bf16 cache and over
the FP8 latent cache, lowers for the H200 (sm_90a) with Triton's bundled ptxas, in a process without the
interpreter (:mod:`dsa_triton.bench.aot`): no spills, shared memory within Hopper's 227 KiB, the score and value
MMAs split between the two warpgroups (wgmma 64 x 32 and 64 x 256), the gathers 16-byte cp.async (the FP8 scales:
4-byte). The interpreter cannot run Gluon: its numbers are checked by scripts/gluon_attention.py on
the GPU."""
import pytest
import torch

from dsa_triton.attention import sparse_attention_gluon as g
from dsa_triton.attention.sparse_attention_spec import SMEM_BYTES
from dsa_triton.bench import aot

SHAPE = {"M": 128, "H": 128, "k_len": 2048, "tokens_per_split": 512, "num_slots": 131072, "qk_scale": 0.06,
         "s_qr": 73728, "s_qs": 73728, "s_qh": 576, "s_kv": 576, "s_ir": 2048}


def record(num_splits: int, fp8: bool = False, **variant) -> dict:
    """A launch record (:func:`aot.record_launches`'s form) of the DSA decode shape with ``num_splits`` splits, over
    a bf16 cache or (``fp8``) the FP8 latent cache (656-byte rows)."""
    out = "*bf16" if num_splits == 1 else "*fp32"
    shape = {**SHAPE, "s_kv": 656} if fp8 else SHAPE
    types = {"q_ptr": "*bf16", "kv_ptr": "*u8" if fp8 else "*bf16", "idx_ptr": "*i32", "out_ptr": out,
             "lse_ptr": "*fp32", **{name: "fp32" if name == "qk_scale" else "i32" for name in shape}}
    values = {**shape, "D_V": g.GLUON_D_V, "D_R": g.GLUON_D_R, "BLOCK_DV": g.GLUON_D_V, "BLOCK_DR": g.GLUON_D_R,
              "NUM_SPLITS": num_splits, "BLOCK_H": 64, "BLOCK_N": 64, "DOT_FP32": False,
              "KV_FP8": fp8, "GROUP": 128, "ROPE_AT": 528 if fp8 else 0, **variant}  # (bf16: the defaults)
    aligned = [n for n, v in {**types, **shape}.items() if n.endswith("_ptr") or (isinstance(v, int) and v % 16 == 0)]
    return {"module": g.__name__, "kernel": g._sparse_attention_fwd_gluon.__name__, "types": types,
            "values": values, "aligned": aligned, "num_warps": g.GLUON_CONFIG["num_warps"],
            "num_stages": g.GLUON_CONFIG["num_stages"], "ptx_needles": ["cp.async.cg.shared.global [", "cp.async.ca"]}


@pytest.fixture(scope="module")
def compiled():
    try:
        return aot.compile_in_subprocess([record(1), record(4), record(1, fp8=True), record(4, fp8=True)], info=True)
    except (OSError, RuntimeError) as exc:  # ptxas or cuobjdump unusable here
        pytest.skip(f"bundled NVIDIA tools unusable: {exc}")


def test_the_gluon_kernel_compiles_without_spills_within_shared_memory(compiled):
    for result in compiled:
        assert result["error"] is None, result
        assert result["spill_bytes"] == 0 and result["registers"] <= 255, result
        assert result["shared"] <= SMEM_BYTES, result
        assert result["launcher"] in (None, "not built"), result  # the lean path's own launcher passes its parameters


def test_the_gathers_are_cp_async_of_16_bytes(compiled):
    """bf16 q and rows, FP8 bytes and rope values: 16-byte cp.async (``.cg``); only the FP8 scales take 4-byte ones."""
    for result, fp8 in zip(compiled, (False, False, True, True)):
        assert result["ptx_has"] == {"cp.async.cg.shared.global [": True, "cp.async.ca": fp8}, result


def test_each_warpgroup_owns_half_of_the_score_and_value_tiles(compiled):
    """Per tile: 32 + 4 wgmma 64 x 32 x 16 for the scores (K = 512 + 64), 4 wgmma 64 x 256 x 16 for the values."""
    for result in compiled:
        assert result["gmma"] == 40, result


def test_the_dispatch_takes_only_bf16_q_dsa_shapes_on_sm90():
    q, kv = torch.zeros(1, 128, 576, dtype=torch.bfloat16), torch.zeros(64, 576, dtype=torch.bfloat16)
    fp8 = torch.zeros(64, 656, dtype=torch.uint8)  # the FP8 latent cache
    config = {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "num_splits": 4}
    assert g.gluon_fits(q, kv, 512, config) and not g.gluon_applies(q, kv, 512, config)  # a CPU tensor
    assert g.gluon_fits(q, fp8, 512, config) and g.gluon_fits(q, torch.zeros(2, 32, 656, dtype=torch.uint8), 512,
                                                              config)
    assert not g.gluon_fits(q.half(), kv.half(), 512, config)
    assert not g.gluon_fits(q.half(), fp8, 512, config)
    assert not g.gluon_fits(q, kv.view(torch.uint8), 512, config)  # bytes, but not FP8 latent rows
    assert not g.gluon_fits(q, torch.zeros(64, 660, dtype=torch.uint8)[:, 4:], 512, config)  # 4-byte aligned rows
    assert not g.gluon_fits(q, torch.zeros(64, 664, dtype=torch.uint8)[:, :656], 512, config)  # 664-byte stride
    assert not g.gluon_fits(q[..., :80], kv[:, :80], 64, config)
    assert not g.gluon_fits(q, kv, 512, {**config, "BLOCK_N": 32})
    assert not g.gluon_fits(q, kv, 512, {**config, "num_warps": 4})
    assert not g.gluon_fits(q, torch.zeros(64, 580, dtype=torch.bfloat16)[:, 4:], 512, config)  # 8-byte aligned rows
    flat = torch.zeros(64 * 576 + 8, dtype=torch.bfloat16)
    assert g.gluon_aligned(q, kv) and not g.gluon_aligned(q, flat[4:4 + 64 * 576].view(64, 576))  # an 8-byte aligned address


def test_the_speed_variants_compile_without_spills_within_shared_memory():
    """``MAX_XCHG`` and ``LAZY_RESCALE`` (both on) over both caches."""
    try:
        records = [record(4, fp8, MAX_XCHG=True, LAZY_RESCALE=True) for fp8 in (False, True)]
        results = aot.compile_in_subprocess(records, info=True)
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"bundled NVIDIA tools unusable: {exc}")
    for result in results:
        assert result["error"] is None and result["spill_bytes"] == 0 and result["shared"] <= SMEM_BYTES, result
        assert result["gmma"] == 40, result
