"""The GPU and link catalog, overrides, and the roofline, against the seeds' figures.

Seed files live in ../shared/seeds/: 000 = Day 10 quick reference, 001 = parallelism one-pager,
002 = distributed training guide, 003 = lecture 07 transcript, 004 = lecture 11 notes."""

import pytest

from plait.errors import UserError
from plait.planner.hardware import GPUS, LINKS, apply_overrides, cluster, gpu
from plait.planner.roofline import attainable_flops, gemm_time_s, kernel_time_s, ridge_intensity


def test_bandwidth_ratio_a100_v100():
    """Seed 000: A100 1555 GB/s vs V100 900 GB/s -> 1.73x, the speed-up it observes."""
    assert round(GPUS["a100-40gb"].hbm_gbps / GPUS["v100"].hbm_gbps, 2) == 1.73


def test_seed_gpu_figures():
    """Seed 000 key numbers: V100 125 TFLOPS, 900 GB/s; A100 312 TFLOPS, 1555 GB/s; H100 "1000"
    TFLOPS -- dense bf16 is 989 (plait's MFU peak). Seed 004: H100 80 GB, 3.35 TB/s, 132 SMs =
    16,896 FP32 cores (128 per SM) and 528 tensor cores (4 per SM); A100 80 GB."""
    assert gpu("v100").tflops["fp16"] == 125 and gpu("v100").hbm_gbps == 900
    assert gpu("a100-40gb").tflops["bf16"] == 312 and gpu("a100-40gb").hbm_gbps == 1555
    h = gpu("h100")
    assert h.tflops["bf16"] == 989 and round(h.tflops["bf16"], -2) == 1000
    assert h.hbm_gib == 80 and h.hbm_gbps == 3350
    assert h.sms * 128 == 16896 and h.sms * 4 == 528
    assert gpu("a100").hbm_gib == 80 and gpu("h200").tflops["bf16"] == 989


def test_seed_004_hundredfold_growth_mixes_sparse_and_dense():
    """Seed 004: P100 22 -> H100 1979 FP16 TFLOPS, "~100x in 7 years". 1979 is the H100's 2:4-sparse
    figure; dense it is 989, so the like-for-like growth is 989 / 21.2 (P100 dense fp16) = 47x."""
    assert 1979 / 22 == pytest.approx(90, abs=0.5)
    assert 2 * gpu("h100").tflops["fp16"] == pytest.approx(1979, abs=1)
    assert gpu("h100").tflops["fp16"] / 21.2 == pytest.approx(46.7, abs=0.1)


def test_link_defaults_are_the_seeds():
    """Seeds: NVLink 600 GB/s (A100), 900 GB/s (H100); PCIe Gen4 ~32, Gen5 ~64 GB/s; InfiniBand
    HDR ~50, NDR ~100 GB/s per port (seed 002); Ethernet 25 GB/s (seed 004); latencies NVLink ~1 us,
    IB 1-5 us, PCIe ~1 us (seed 002). NVLink / IB = 6-12x (seed 002)."""
    assert LINKS["nvlink3"].gbps == 600 and LINKS["nvlink4"].gbps == 900
    assert LINKS["pcie4"].gbps == 32 and LINKS["pcie5"].gbps == 64
    assert LINKS["ib-hdr"].gbps == 50 and LINKS["ib-ndr"].gbps == 100 and LINKS["ethernet"].gbps == 25
    assert LINKS["nvlink3"].latency_us == 1 and 1 <= LINKS["ib-ndr"].latency_us <= 5
    assert LINKS["nvlink3"].gbps / LINKS["ib-ndr"].gbps == 6 and LINKS["nvlink3"].gbps / LINKS["ib-hdr"].gbps == 12


def test_seed_infiniband_figures_are_different_units():
    """Seed 001: "IB ~200 Gb/s" (bits, one HDR port); seed 000: "~200 GB/s" (bytes): eight HDR
    ports of a DGX A100 node, one per GPU, 8 x 200 Gb/s / 8 = 200 GB/s per node; seed 004's 400 GB/s
    is the DGX H100's eight NDR ports (8 x 400 Gb/s). Per GPU and direction: 25 / 50 GB/s."""
    hdr_port_gbytes = 200 / 8
    assert 8 * hdr_port_gbytes == 200 and 8 * 400 / 8 == 400
    assert LINKS["ib-hdr"].gbps == 2 * hdr_port_gbytes  # seed 002 counts both directions


def test_bandwidth_hierarchy():
    """Seed 004: HBM 3350 > NVLink 900 > InfiniBand (node) 400 > Ethernet 25 GB/s."""
    assert gpu("h100").hbm_gbps > LINKS["nvlink4"].gbps > 8 * LINKS["ib-ndr"].gbps / 2 > LINKS["ethernet"].gbps


def test_overrides():
    c = cluster("h100", 2, 8)
    c2 = apply_overrides(c, {"link.nvlink-gbps": "370", "link.ib-latency-us": "8", "gpu.tflops": "900",
                             "gpu.efficiency": "0.5", "link.inter": "ethernet"})
    assert c2.intra.gbps == 370 and c.intra.gbps == 900
    assert c2.inter.name.startswith("Ethernet")
    assert c2.peak_flops == 900e12 and c2.matmul_efficiency == 0.5
    assert apply_overrides(c, {"link.inter-latency-us": "8"}).inter.latency_us == 8
    for bad in ({"link.nvlink-gbps": "fast"}, {"link.warp-gbps": "1"}, {"gpu.color": "1"}, {"foo.bar": "1"},
                {"link.nvlink-gbps": "0"}, {"gpu.efficiency": "2"}):
        with pytest.raises(UserError) as e:
            apply_overrides(c, bad)
        assert "\n" not in str(e.value)
    with pytest.raises(UserError):
        gpu("tpu")


def test_roofline():
    """Seed 000: performance = min(peak, bandwidth x arithmetic intensity)."""
    assert attainable_flops(989e12, 3.35e12, 10) == pytest.approx(33.5e12)  # memory-bound
    assert attainable_flops(989e12, 3.35e12, 1000) == 989e12  # compute-bound
    c = cluster("h100", matmul_efficiency=1.0, hbm_efficiency=1.0)
    assert ridge_intensity(c) == pytest.approx(989e12 / 3.35e12)
    assert kernel_time_s(1e12, 0, c) == pytest.approx(1 / 989)
    # a big square matmul is compute-bound, a matrix-vector product memory-bound
    assert gemm_time_s(8192, 8192, 8192, c) == pytest.approx(2 * 8192**3 / 989e12)
    assert gemm_time_s(1, 8192, 8192, c) == pytest.approx(2 * (8192 + 8192 * 8192 + 8192) / 3.35e12)


def test_scaling_efficiency_arithmetic():
    """Seed 002: 1.9x on 2 GPUs = 95%, 7.2x on 8 = 90%, 51x on 64 = 80%, 180x on 256 = 70%."""
    for speedup, n, pct in ((1.9, 2, 95), (7.2, 8, 90), (51, 64, 80), (180, 256, 70)):
        assert round(speedup / n * 100) == pct
