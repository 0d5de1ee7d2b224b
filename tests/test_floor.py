"""Structure and validation of the speed-of-light helpers. Tiny shapes; timings are never asserted."""

import math

import pytest
import torch

from yggtree.errors import YggError
from yggtree.measure.floor import copy_bandwidth_gbps, floor_summary, matmul_floor_ms, matmul_weights, weight_bytes
from yggtree.runtime.packed import can_pack

KEYS = {"median_ms", "p10_ms", "p90_ms", "weight_bytes", "n_matmuls", "gbps", "width", "repeats", "kernel"}


def test_copy_bandwidth_is_a_positive_float():
    gbps = copy_bandwidth_gbps(nbytes=1 << 16, repeats=3, warmup=1)
    assert isinstance(gbps, float)
    assert gbps > 0 and math.isfinite(gbps)


@pytest.mark.parametrize("kwargs", [{"nbytes": 0}, {"repeats": 0}, {"warmup": -1}])
def test_copy_bandwidth_rejects_bad_arguments(kwargs):
    with pytest.raises(YggError):
        copy_bandwidth_gbps(**{"nbytes": 1024, **kwargs})


def test_weight_bytes_counts_all_tensors():
    ws = [torch.zeros(3, 4), torch.zeros(5, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.float64)]
    assert weight_bytes(ws) == 3 * 4 * 4 + 5 * 2 + 4 * 8
    assert weight_bytes([]) == 0


def test_matmul_weights_keeps_2d_in_order():
    a, b, norm = torch.zeros(3, 4), torch.zeros(4, 3), torch.zeros(4)
    assert [w.shape for w in matmul_weights([a, norm, b])] == [a.shape, b.shape]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 3])
def test_matmul_floor_structure(dtype, width):
    ws = [torch.randn(8, 4), torch.ones(8), torch.randn(6, 8), torch.randn(5, 4)]
    ws = [w.to(dtype) if w.dim() == 2 else w for w in ws]
    res = matmul_floor_ms(ws, width=width, repeats=4, warmup=1)
    assert set(res) == KEYS
    assert res["median_ms"] > 0 and res["p10_ms"] > 0 and res["gbps"] > 0
    assert res["n_matmuls"] == 3
    assert res["weight_bytes"] == weight_bytes(matmul_weights(ws)) == (32 + 48 + 20) * ws[0].element_size()
    assert res["width"] == width and res["repeats"] == 4 and res["kernel"] == "linear"


def test_floor_summary_is_exact():
    """Median, p10, p90 (numpy's linear interpolation) and the streaming rate of given samples."""
    mats = [torch.zeros(4, 8), torch.zeros(2, 8, dtype=torch.bfloat16)]  # 128 + 32 bytes
    res = floor_summary([11.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 1.0], mats, 2, "packed")
    assert res == {"median_ms": 6.0, "p10_ms": 2.0, "p90_ms": 10.0, "weight_bytes": 160, "n_matmuls": 2,
                   "gbps": 160 / (6.0 / 1e3) / 1e9, "width": 2, "repeats": 11, "kernel": "packed"}


@pytest.mark.skipif(not can_pack(torch.nn.Linear(2, 2)), reason="oneDNN packing unavailable")
def test_packed_matmul_floor_times_the_same_weights():
    ws = [torch.randn(8, 4), torch.ones(8), torch.randn(6, 8)]
    res = matmul_floor_ms(ws, width=2, repeats=3, warmup=1, kernel="packed")
    assert set(res) == KEYS and res["kernel"] == "packed"
    assert res["n_matmuls"] == 2 and res["weight_bytes"] == (32 + 48) * 4 and res["median_ms"] > 0


def test_matmul_floor_leaves_global_rng_alone():
    state = torch.get_rng_state()
    matmul_floor_ms([torch.ones(2, 2)], width=1, repeats=1, warmup=0)
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize(
    "weights, kwargs",
    [
        ([torch.ones(2, 2)], {"width": 0}),
        ([torch.ones(2, 2)], {"width": 1, "repeats": 0}),
        ([torch.ones(2)], {"width": 1}),
        ([], {"width": 1}),
        ([torch.ones(2, 2, dtype=torch.int8)], {"width": 1}),
        ([torch.ones(2, 2)], {"width": 1, "kernel": "cublas"}),
    ],
)
def test_matmul_floor_rejects_bad_arguments(weights, kwargs):
    with pytest.raises(YggError):
        matmul_floor_ms(weights, **kwargs)


def test_tiled_matmul_floor_times_the_same_weights():
    from yggtree.runtime.kernels import library_missing

    if library_missing():
        pytest.skip("yggtree's kernel library does not run on this CPU")
    ws = [torch.randn(8, 4), torch.ones(8), torch.randn(20, 8)]  # 20 columns: a padded last tile
    res = matmul_floor_ms(ws, width=2, repeats=3, warmup=1, kernel="tiled")
    assert set(res) == KEYS and res["kernel"] == "tiled"
    assert res["n_matmuls"] == 2 and res["weight_bytes"] == (32 + 160) * 4 and res["median_ms"] > 0
