"""Communication volumes and times: every number of the seeds that follows from stated inputs.

Seed files live in ../shared/seeds/: 000 = Day 10 quick reference, 001 = parallelism one-pager,
002 = distributed training guide, 003 = lecture 07 transcript, 004 = lecture 11 notes."""

import math

import pytest

from plait.planner.hardware import Link
from plait.planner.traffic import bytes_per_device, collective_time_s, steps

GB = 1e9


def bw(gbps, latency_us=0.0):
    return Link("test", gbps, latency_us)


def test_ring_all_reduce_4_gpus_1gb():
    """Seed 000 sec. 11: 4 GPUs, P = 1 GB: reduce-scatter 0.25 GB x 3 = 0.75 GB, all-gather 0.75 GB,
    1.5 GB per device = 2P(N-1)/N; 75% of the 2P approximation; N=1024: 1.998 GB (99.9%)."""
    assert bytes_per_device("reduce_scatter", 1 * GB, 4) == pytest.approx(0.75 * GB)
    assert bytes_per_device("all_gather", 1 * GB, 4) == pytest.approx(0.75 * GB)
    assert bytes_per_device("all_reduce", 1 * GB, 4) == pytest.approx(1.5 * GB)
    assert bytes_per_device("all_reduce", 1 * GB, 4) / (2 * GB) == pytest.approx(0.75)
    big = bytes_per_device("all_reduce", 1 * GB, 1024)
    assert big / GB == pytest.approx(1.998, abs=5e-4) and round(big / (2 * GB) * 100, 1) == 99.9
    assert steps("all_reduce", 4) == 6 and steps("all_gather", 4) == 3


def test_seed_001_four_gpu_example_is_1_5x_not_3x():
    """Seed 001 says all-reduce on 4 GPUs "sends/receives ~3x parameter size"; its own formula
    2(N-1)/N gives 1.5x (3 is N-1, not the volume). Pinned: 1.5."""
    assert bytes_per_device("all_reduce", 1.0, 4) == pytest.approx(1.5)


def test_all_gather_volume_per_device():
    """Seed 001's table gives all-gather "(N-1) x data" but reduce-scatter "(N-1)/N x data". Per
    device an all-gather of an S-byte result sends (N-1)/N x S; "(N-1) x data" is right only if
    "data" is each rank's S/N input shard. Seed 000 sec. 11 has the correct P(N-1)/N."""
    S, N = 8 * GB, 8
    assert bytes_per_device("all_gather", S, N) == pytest.approx((N - 1) / N * S)
    assert bytes_per_device("all_gather", S, N) == pytest.approx((N - 1) * (S / N))
    assert bytes_per_device("all_gather", S, N) != pytest.approx((N - 1) * S)


def test_ring_all_reduce_volume_is_bounded_independent_of_n():
    """Seeds 002/004: ring all-reduce moves O(model size) per GPU whatever N: < 2S, -> 2S."""
    for n in (2, 8, 64, 4096):
        assert bytes_per_device("all_reduce", 1.0, n) < 2.0
    assert bytes_per_device("all_reduce", 1.0, 10**6) == pytest.approx(2.0, rel=1e-5)


GPT3_PARAMS, L, S, H = 175e9, 96, 2048, 12288


def test_gpt3_dp_and_fsdp_volumes():
    """Seed 000: GPT-3 175B in fp16, P = 350 GB; DP 2P = 700 GB; FSDP 3P = 1050 GB = 1.5x DP
    (per device, the N -> infinity limit of the ring formulas 2P(N-1)/N and 3P(N-1)/N)."""
    P = GPT3_PARAMS * 2
    assert P == 350 * GB
    n = 10**6
    dp = bytes_per_device("all_reduce", P, n)
    fsdp = 2 * bytes_per_device("all_gather", P, n) + bytes_per_device("reduce_scatter", P, n)
    assert dp == pytest.approx(700 * GB, rel=1e-5)
    assert fsdp == pytest.approx(1050 * GB, rel=1e-5)
    assert fsdp / dp == pytest.approx(1.5)
    # on 1024 GPUs the exact ring figure is 0.1% under the seed's 700 GB
    assert bytes_per_device("all_reduce", P, 1024) / GB == pytest.approx(699.3, abs=0.05)


def test_gpt3_dp_total_traffic_on_1024_gpus():
    """Seed 000: per-device 700 GB x 1024 GPUs = 716.8 TB of total traffic."""
    assert 700 * GB * 1024 / 1e12 == pytest.approx(716.8)


def test_gpt3_tp_and_pp_volumes():
    """Seed 000's GPT-3 table: TP "1228 GB", PP "45 GB", with frequencies TP 4L = 384 and PP
    2M(N-1) = 448 (M=32, N=8). The batch is not stated; B = 64 sequences of S = 2048 in fp16 is the
    only one that gives 45 GB for PP: 2(N-1) boundaries-directions x B S H x 2 bytes = 45.1 GB (all
    boundaries together). The same B with 4L all-reduces of B S H x 2 bytes gives 1237 GB for TP at
    GPT-3's H = 12288; the seed's 1228 GB comes out exactly for H = 12200. Pinned: 1236.95 GB. (Both
    lines count each collective's payload once, while the DP line counts the all-reduce's 2x: the
    table mixes conventions; docs/planner.md.)"""
    B, M, N = 64, 32, 8
    assert 4 * L == 384 and 2 * M * (N - 1) == 448
    pp_total = 2 * M * (N - 1) * (B // M) * S * H * 2
    assert pp_total / GB == pytest.approx(45.1, abs=0.05)
    tp_total = 4 * L * B * S * H * 2
    assert tp_total / GB == pytest.approx(1236.95, abs=0.01)
    assert 4 * L * B * S * 12200 * 2 / GB == pytest.approx(1228.0, abs=0.1)


def test_dp_and_fsdp_times_on_200_gbs():
    """Seed 000: InfiniBand 200 GB/s: DP 700 GB -> 3.5 s, FSDP 1050 GB -> 5.25 s (1.5x)."""
    ib = bw(200)
    P = 350 * GB
    n = 10**6  # the seed's large-N limit
    dp = collective_time_s("all_reduce", P, n, ib)
    fsdp = 2 * collective_time_s("all_gather", P, n, ib) + collective_time_s("reduce_scatter", P, n, ib)
    assert dp == pytest.approx(3.5, rel=1e-5) and fsdp == pytest.approx(5.25, rel=1e-5)


def test_70b_all_reduce_on_8_gpus():
    """Seed 002: 70B fp16 gradients on 8 GPUs: 2 x 140 GB x 7/8 = 245 GB; 600 GB/s NVLink -> 0.41 s;
    50 GB/s InfiniBand -> 4.9 s; against 2 s of compute +20% and +245%."""
    vol = bytes_per_device("all_reduce", 140 * GB, 8)
    assert vol == pytest.approx(245 * GB)
    nv = collective_time_s("all_reduce", 140 * GB, 8, bw(600))
    ib = collective_time_s("all_reduce", 140 * GB, 8, bw(50))
    assert round(nv, 2) == 0.41 and ib == pytest.approx(4.9)
    assert round(nv / 2 * 100) == 20 and ib / 2 == pytest.approx(2.45)


def test_practical_numbers_table():
    """Seed 002 "Practical Numbers": all-reduce of 140 GB in 0.23 s on 600 GB/s and 2.8 s on 50 GB/s
    divide the data size by the bandwidth, dropping the ring's 2(N-1)/N = 1.75 on 8 GPUs. The same
    seed's own 245 GB gives 0.41 s and 4.9 s: pinned. 1 GB pipeline transfer on 50 GB/s = 20 ms
    holds. TP all-reduce of 16 MB on 600 GB/s: 0.027 ms is again size / bandwidth; over 8 GPUs the
    ring sends 1.75 x 16 MB: 0.047 ms, and 14 steps of NVLink's ~1 us latency make it 0.061 ms."""
    assert 140 / 600 == pytest.approx(0.233, abs=1e-3) and 140 / 50 == 2.8  # what the seed computed
    assert collective_time_s("all_reduce", 140 * GB, 8, bw(600)) == pytest.approx(0.408, abs=1e-3)
    assert collective_time_s("all_reduce", 140 * GB, 8, bw(50)) == pytest.approx(4.9)
    assert collective_time_s("send_recv", 1 * GB, 2, bw(50)) == pytest.approx(0.020)
    assert 16e6 / 600e9 * 1e3 == pytest.approx(0.027, abs=5e-4)
    assert collective_time_s("all_reduce", 16e6, 8, bw(600)) * 1e3 == pytest.approx(0.0467, abs=1e-4)
    assert collective_time_s("all_reduce", 16e6, 8, bw(600, 1.0)) * 1e3 == pytest.approx(0.0607, abs=1e-4)


def test_pipeline_activation_message():
    """Seed 002: batch 32, seq 2048, d_model 8192, fp16: 32 x 2048 x 8192 x 2 = 1 GB per stage
    boundary -- exactly 1 GiB (1.07e9 bytes)."""
    assert 32 * 2048 * 8192 * 2 == 1 << 30


def test_tp_all_reduce_per_layer():
    """Seed 002: Megatron TP does 2 all-reduces per layer forward, each "~2 x batch x seq x d_model
    bytes" -- the ring's 2(N-1)/N x the activation bytes, which is < 2 x."""
    act = 8 * 2048 * 8192 * 2
    assert bytes_per_device("all_reduce", act, 8) == pytest.approx(2 * 7 / 8 * act)
    assert bytes_per_device("all_reduce", act, 8) < 2 * act


def test_fsdp_collectives_per_step():
    """Seed 000 counts FSDP "~100 per step (per layer)". With one all-gather per layer forward, one
    backward and one reduce-scatter per layer, GPT-3's L = 96 gives 3L = 288 collectives per
    forward-backward; "~100" is one pass over the layers."""
    from plait.planner.traffic import fsdp_collectives_per_step

    assert fsdp_collectives_per_step(96, 1) == 288
    assert fsdp_collectives_per_step(96, 4) == 4 * 288


def test_alpha_beta():
    link = bw(100, 5.0)
    t = collective_time_s("all_gather", 1e9, 4, link)
    assert t == pytest.approx(3 * 5e-6 + 0.75e9 / 100e9)
    assert collective_time_s("all_reduce", 1e9, 1, link) == 0
    assert math.isclose(collective_time_s("send_recv", 0, 2, link), 5e-6)


def test_the_ring_is_timed_for_the_bytes_its_traffic_table_counts():
    """The ring's backward passes the K/V blocks again and the fp32 dK/dV accumulators, one hop further
    (the traffic table's two rows); its time was priced as twice the K/V blocks' alone (at cp 2 in
    bf16: 2 units of a block against 5). On a link so slow that attention hides nothing, the time
    is the table's bytes over the link."""
    import dataclasses

    from plait.planner import inputs
    from plait.planner.hardware import cluster
    from plait.planner.predict import predict

    c = cluster("h100", 1, 2)
    c = dataclasses.replace(c, intra=dataclasses.replace(c.intra, gbps=0.5, latency_us=0.0))
    p = predict(inputs.model_dims("1b", seq=8192), inputs.make_layout(c, cp=2, micro_batch=1), c, 2, "mixed")
    t = p.traffic["cp"]
    assert p.time_s["cp"] == pytest.approx(sum(x.time_s(t.link) for x in t.collectives), rel=0.02)


def test_tensor_parallel_is_timed_for_every_collective_its_traffic_table_counts():
    """The step priced only the layers' TP collectives; those at the model's ends (the vocab-parallel
    embedding's and loss's regions, the loss's logsumexp gather) and the step's all-reduce of partial
    gradients were in the traffic table only. On a link too slow for anything to hide, the time is
    the table's bytes over the link."""
    import dataclasses

    from plait.planner import inputs
    from plait.planner.hardware import cluster
    from plait.planner.predict import predict

    c = cluster("h100", 1, 2)
    c = dataclasses.replace(c, intra=dataclasses.replace(c.intra, gbps=0.05, latency_us=0.0))
    for sp in (True, False):
        p = predict(inputs.model_dims("1b", seq=2048), inputs.make_layout(c, tp=2, micro_batch=2, sp=sp), c, 4,
                    "mixed")
        t = p.traffic["tp"]
        table = sum(x.time_s(t.link) for x in t.collectives)
        assert p.time_s["tp"] + p.time_s["dp_sync"] == pytest.approx(table, rel=0.01), sp


def test_a_gpt_pipelines_tied_sum_carries_the_word_embedding_alone():
    """GPT's position table lives on the first stage only; the tied sum over the pipeline's ends
    counted it too ((V + s) x h: 156.0 MiB a TP rank at 175B, TP 8, where V x h is 150.0)."""
    from plait.planner.hardware import cluster
    from plait.planner.inputs import model_dims
    from plait.planner.layout import Layout
    from plait.planner.predict import predict

    d = model_dims(None, "gpt", True, layers=96, hidden=12288, heads=96, kv_heads=96, ffn=4 * 12288, vocab=51200,
                   seq=2048)
    p = predict(d, Layout(tp=8, pp=16, dp_shard=8, micro_batch=1, sp=False), cluster("a100-80gb", 128, 8), 1536)
    (tied,) = p.traffic["pp_ends"].collectives
    assert tied.size_bytes == 51200 * 12288 * 2 / 8
