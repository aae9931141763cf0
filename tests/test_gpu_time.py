"""The split of a step's GPU time into compute, exposed and overlapped communication, and idle."""

from plait.gpu_time import split


def test_split_counts_overlap_once_and_exposed_communication_apart():
    # compute on two streams overlapping each other (0-40, 30-60), an NCCL kernel 50-80 (10 us
    # beside compute, 20 alone), a gap 80-90, compute 90-100; microseconds over 2 steps
    kernels = [("gemm", 0, 40), ("elementwise", 30, 60), ("ncclDevKernel_AllReduce", 50, 80), ("gemm", 90, 100)]
    g = split(kernels, steps=2)
    ms = 1e-3 / 2
    assert abs(g["window_ms"] - 100 * ms) < 1e-12
    assert abs(g["compute_ms"] - 70 * ms) < 1e-12
    assert abs(g["overlapped_ms"] - 10 * ms) < 1e-12
    assert abs(g["exposed_comm_ms"] - 20 * ms) < 1e-12
    assert abs(g["idle_ms"] - 10 * ms) < 1e-12
    assert g["top"][0][0] == "gemm" and abs(g["top"][0][1] - 50 * ms) < 1e-12


def test_communication_beside_compute_on_several_windows():
    kernels = [("gemm", 0, 10), ("ncclKernel_x", 5, 25), ("gemm", 20, 30), ("ncclKernel_x", 28, 29)]
    g = split(kernels)
    assert abs(g["overlapped_ms"] - (5 + 5 + 1) * 1e-3) < 1e-12
    assert abs(g["exposed_comm_ms"] - 10 * 1e-3) < 1e-12
    assert g["idle_ms"] == 0


def test_no_kernels_is_all_zero():
    assert split([])["window_ms"] == 0.0


def test_gaps_name_the_kernels_around_each_idle_stretch():
    # idle 80-90 (after the all-reduce, which ends last of the kernels before it) and 100-130
    kernels = [("gemm", 0, 40), ("ncclDevKernel_AllReduce", 50, 80), ("elementwise", 30, 60), ("gemm", 90, 100),
               ("optimizer", 130, 140)]
    g = split(kernels)
    assert [(round(ms * 1e3), a, b) for ms, a, b in g["gaps"]] == [
        (30, "gemm", "optimizer"), (10, "ncclDevKernel_AllReduce", "gemm")]
