"""The seesaw Gluon kernel (:mod:`dsa_triton.attention.sparse_attention_seesaw`) lowers for the H200 (sm_90a) with
Triton's bundled ptxas (:mod:`dsa_triton.bench.aot`): no spills, no ptxas performance advisory (e.g. wgmma
serialized), shared memory within Hopper's 227 KiB, 8 warps in all (two warpgroups by ``gl.warp_specialize``), each
warpgroup's score MMA a whole 64 x 64 tile and its value MMA 256 columns. Its numbers are checked on the GPU by
``scripts/gluon_attention.py --only bf16 --kernels gluon,seesaw``."""
import pytest

from dsa_triton.attention import sparse_attention_seesaw as seesaw
from dsa_triton.attention.sparse_attention_spec import SMEM_BYTES
from dsa_triton.bench import aot
from tests.test_sm90_gluon_attention import record


def seesaw_record(num_splits: int) -> dict:
    """:func:`record`'s launch of the DSA decode shape over a bf16 cache, for the seesaw kernel."""
    return {**record(num_splits), "module": seesaw.__name__, "kernel": seesaw._sparse_attention_fwd_seesaw.__name__,
            "num_warps": seesaw.seesaw_meta({"num_warps": 8})["num_warps"]}


@pytest.fixture(scope="module")
def compiled():
    try:
        return aot.compile_in_subprocess([seesaw_record(1), seesaw_record(4)], info=True)
    except (OSError, RuntimeError) as exc:  # ptxas or cuobjdump unusable here
        pytest.skip(f"bundled NVIDIA tools unusable: {exc}")


def test_the_seesaw_kernel_compiles_without_spills_or_advisories_within_shared_memory(compiled):
    for result in compiled:
        assert result["error"] is None, result
        assert result["spill_bytes"] == 0 and result["registers"] <= 255 and result["advisories"] == [], result
        assert result["shared"] <= SMEM_BYTES, result
        assert result["launcher"] in (None, "not built"), result
        assert result["ptx_has"] == {"cp.async.cg.shared.global [": True, "cp.async.ca": False}, result


def test_each_warpgroup_scores_whole_tiles_and_owns_half_of_the_values(compiled):
    """Per warpgroup and pair: 32 + 4 wgmma 64 x 64 x 16 for its tile's scores (K = 512 + 64), 2 x 4 wgmma
    64 x 256 x 16 for its value columns of both tiles; each warpgroup's code apart (x 2). One wait each for the
    scores and the two value MMAs."""
    for result in compiled:
        assert result["gmma"] == 2 * (36 + 8) and result["depbar"] == 2 * 3, result


def test_the_seesaw_meta_takes_4_warps_and_a_bf16_cache_only():
    assert seesaw.seesaw_meta({"num_warps": 8, "BLOCK_N": 64}) == {"num_warps": 4, "BLOCK_N": 64}
    with pytest.raises(AssertionError):
        seesaw.seesaw_meta({"num_warps": 8, "KV_FP8": True})
