"""Memory: model state under every ZeRO stage and precision convention, activations (Korthikanti
et al. 2022 and plait's Llama), and the seeds' memory figures.

Seed files live in ../shared/seeds/: 000 = Day 10 quick reference, 001 = parallelism one-pager,
002 = distributed training guide, 003 = lecture 07 transcript, 004 = lecture 11 notes."""

import math

import pytest

from plait.planner.memory import (PRECISIONS, Precision, bytes_per_param, gpt_layer_activation_bytes,
                                  interleaved_memory_factor, layer_activation_bytes, max_params_that_fit,
                                  state_bytes, wgrad_fraction)

GB = 1e9
ZERO = PRECISIONS["mixed"]  # 2 + 2 + K, K = 12
LECTURE = PRECISIONS["lecture"]  # 2 + 2 + K, K = 8


def test_both_conventions_come_out_of_one_model():
    """Seed 003: "~16 bytes per parameter" (2 + 2 + 4 + 4 + 4, ZeRO's K = 12) and the "will it fit"
    slide's 12 B/param (K = 8: fp32 master + 16-bit moments, "4 (or 2) bytes" each)."""
    assert ZERO.k == 12 and ZERO.total == 16
    assert LECTURE.k == 8 and LECTURE.total == 12
    assert PRECISIONS["fp32"].total == 16


def test_zero_paper_7_5b_on_64_gpus():
    """Seed 003 (and ZeRO, Rajbhandari et al. 2020, Fig. 1): 7.5B parameters, N_d = 64, K = 12:
    baseline 120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB."""
    psi, n = 7.5e9, 64
    got = [state_bytes(psi, z, n, ZERO).total / GB for z in (0, 1, 2, 3)]
    assert got == pytest.approx([120, 31.40625, 16.640625, 1.875])
    assert [round(x, 1) for x in got] == [120.0, 31.4, 16.6, 1.9]


def test_seed_003_zero_formulas_are_wrong():
    """Seed 003 writes stage 1 as (2 + 2 + K) Psi / N_d and stages 2 and 3 as (2 + K) Psi / N_d.
    Those give 1.875 / 1.64 / 1.64 GB, not the 31.4 / 16.6 / 1.9 the same slide shows. The right
    ones: (4 + K/N_d) Psi, (2 + (2 + K)/N_d) Psi, (2 + 2 + K) Psi / N_d -- pinned here."""
    psi, n, k = 7.5e9, 64, 12
    seed = [(2 + 2 + k) * psi / n, (2 + k) * psi / n, (2 + k) * psi / n]
    right = [(4 + k / n) * psi, (2 + (2 + k) / n) * psi, (2 + 2 + k) * psi / n]
    ours = [state_bytes(psi, z, n, ZERO).total for z in (1, 2, 3)]
    assert ours == pytest.approx(right)
    assert ours[0] != pytest.approx(seed[0]) and ours[2] != pytest.approx(seed[2])
    # seed 003's DDP comparison is right: (4 + K) Psi vs (4 + K / N_gpu) Psi
    assert bytes_per_param(0, n, ZERO) == 4 + k and bytes_per_param(1, n, ZERO) == 4 + k / n


def test_zero_stage_reductions_4x_8x_nx():
    """Seed 001: stage 1 "4x", stage 2 "8x", stage 3 "Nx" less memory: the large-N_d limits of
    16 / (4 + 12/N), 16 / (2 + 14/N), and exactly N for stage 3 (K = 12)."""
    n = 10**6
    base = bytes_per_param(0, 1, ZERO)
    assert base / bytes_per_param(1, n, ZERO) == pytest.approx(4, rel=1e-4)
    assert base / bytes_per_param(2, n, ZERO) == pytest.approx(8, rel=1e-4)
    for n in (4, 64, 1024):
        assert base / bytes_per_param(3, n, ZERO) == pytest.approx(n)


def test_10b_on_8_gpus_table():
    """Seed 002's ZeRO table, 10B parameters on 8 GPUs, params/grads/optimizer/total in GB:
    DP 20/20/80/120, stage 1 20/20/10/50, stage 2 20/2.5/10/32.5, stage 3 2.5/2.5/10/15
    (optimizer 80 GB = 8 B/param: the lecture convention's K = 8)."""
    psi, n = 10e9, 8
    table = {0: (20, 20, 80, 120), 1: (20, 20, 10, 50), 2: (20, 2.5, 10, 32.5), 3: (2.5, 2.5, 10, 15)}
    for z, row in table.items():
        s = state_bytes(psi, z, n, LECTURE)
        assert (s.params / GB, s.grads / GB, (s.master + s.optimizer) / GB, s.total / GB) == pytest.approx(row)


def test_will_it_fit_on_8x_a100_80gb():
    """Seed 003: on 8 x A100 80GB, model state alone: naive DP 12 B/param -> 6.66B; ZeRO-1 5 B/param
    -> 16B; ZeRO-2 2 + 10/8 -> 24.62B; ZeRO-3 12/8 -> 53.33B (80 GB read as 80e9 bytes)."""
    cap = 80 * GB
    assert [bytes_per_param(z, 8, LECTURE) for z in (0, 1, 2, 3)] == [12, 5, 2 + 10 / 8, 12 / 8]
    got = [max_params_that_fit(cap, z, 8, LECTURE) / 1e9 for z in (0, 1, 2, 3)]
    assert [math.floor(x * 100) / 100 for x in got] == [6.66, 16.0, 24.61, 53.33]
    assert round(got[2], 2) == 24.62


def test_70b_training_memory():
    """Seed 002: 70B in fp16 with Adam: model 140 GB, gradients 140 GB, "Adam states 560 GB (FP32
    copy + momentum + variance = 4 x 140)", total ~1 TB, 8-16 GPUs. 560 GB is K = 8 (fp32 master +
    16-bit moments, the lecture convention); with fp32 moments (ZeRO paper, plait) it is 840 GB and
    the total 1120 GB = 14 x 80 GB GPUs for model state alone."""
    s = state_bytes(70e9, 0, 1, LECTURE)
    assert (s.params / GB, s.grads / GB, (s.master + s.optimizer) / GB) == (140, 140, 560)
    assert s.total / GB == 840
    z = state_bytes(70e9, 0, 1, ZERO)
    assert (z.master + z.optimizer) / GB == 840 and z.total / GB == 1120
    assert math.ceil(z.total / (80 * GB)) == 14


def test_model_sizes_and_gpus_needed():
    """Seed 002: fp16 weights: GPT-2 1.5B 3 GB (1 GPU), LLaMA 7B 14 GB (1), 70B 140 GB (2), GPT-3 175B
    350 GB (5), ~1.8T ~3.6 TB (45+) on 80 GB GPUs; seed 001: 175B x 2 bytes = 350 GB."""
    for params, gb, gpus in ((1.5e9, 3, 1), (7e9, 14, 1), (70e9, 140, 2), (175e9, 350, 5), (1.8e12, 3600, 45)):
        w = state_bytes(params, 0, 1, ZERO).params
        assert w / GB == pytest.approx(gb)
        assert math.ceil(w / (80 * GB)) == gpus


def test_175b_state_totals():
    """175B: 2.8 TB of model state at 16 B/param (ZeRO / plait), 2.1 TB at the lecture's 12."""
    assert state_bytes(175e9, 0, 1, ZERO).total / 1e12 == pytest.approx(2.8)
    assert state_bytes(175e9, 0, 1, LECTURE).total / 1e12 == pytest.approx(2.1)


def test_seed_004_fsdp_4w_example():
    """Seed 004: weights W + gradients W + Adam 2W = 4W per GPU; on 4 GPUs 16W in total; FSDP
    shards everything: W per GPU, 4W in total (every role the same dtype)."""
    same = Precision("same", 1, 1, 0, 2)
    assert state_bytes(1.0, 0, 4, same).total == 4 and 4 * state_bytes(1.0, 0, 4, same).total == 16
    assert state_bytes(1.0, 3, 4, same).total == 1 and 4 * state_bytes(1.0, 3, 4, same).total == 4


# ---- activations -------------------------------------------------------------------------------

S, B, H, A = 2048, 1, 12288, 96  # GPT-3


def sbh(x):
    return S * B * H * x


def test_korthikanti_table_2():
    """Korthikanti et al. 2022, Table 2 (per layer, bytes): sbh(34 + 5as/h); TP: sbh(10 + 24/t +
    5as/(ht)); TP + SP: sbh(34/t + 5as/(ht)); TP + selective: sbh(10 + 24/t); TP + SP + selective:
    sbh 34/t; full recomputation: 2 sbh."""
    t = 8
    q = 5 * A * S / H
    assert gpt_layer_activation_bytes(S, B, H, A) == pytest.approx(sbh(34 + q))
    assert gpt_layer_activation_bytes(S, B, H, A, t) == pytest.approx(sbh(10 + 24 / t + q / t))
    assert gpt_layer_activation_bytes(S, B, H, A, t, sp=True) == pytest.approx(sbh(34 / t + q / t))
    assert gpt_layer_activation_bytes(S, B, H, A, t, recompute="selective") == pytest.approx(sbh(10 + 24 / t))
    assert gpt_layer_activation_bytes(S, B, H, A, t, True, "selective") == pytest.approx(sbh(34 / t))
    assert gpt_layer_activation_bytes(S, B, H, A, recompute="full") == pytest.approx(sbh(2))


def test_seed_003_activation_formula_typo():
    """Seed 003 writes sbh(34 + as/h + 5/h) (and sbh(10 + 24/t + 5/(ht)) under TP) while its text
    explains a 5as/h term. The paper's term is 5as/h: for GPT-3 that is 5 x 96 x 2048 / 12288 = 80,
    against the seed's 16.0004. Pinned: 5as/h."""
    ours = gpt_layer_activation_bytes(S, B, H, A) / sbh(1)
    assert ours == pytest.approx(34 + 80)
    assert ours != pytest.approx(34 + A * S / H + 5 / H)


def test_seed_003_ten_sbh_that_tp_does_not_split():
    """Seed 003: with TP alone 10 sbh stays whole -- LayerNorm inputs 4, dropout masks 2, inputs of
    attention and MLP 4 -- and only selective recomputation plus SP brings everything to 34/t."""
    for t in (2, 8, 64, 10**6):
        whole = gpt_layer_activation_bytes(S, B, H, A, t, recompute="selective") - sbh(24 / t)
        assert whole == pytest.approx(sbh(4 + 2 + 4))


def test_korthikanti_5x_reduction():
    """Korthikanti et al. 2022: sequence parallelism + selective recomputation "reduce activation
    memory by 5x" against TP alone: 4.94x for the 530B (a=128, h=20480) and 1T (a=160, h=25600)
    configurations at t = 8, s = 2048 (5.41x for 175B, 6.2x for 22B)."""
    def ratio(a, h):
        return gpt_layer_activation_bytes(2048, 1, h, a, 8) / gpt_layer_activation_bytes(2048, 1, h, a, 8, True, "selective")
    assert ratio(128, 20480) == pytest.approx(21 / 4.25) == pytest.approx(4.94, abs=0.005)
    assert ratio(160, 25600) == pytest.approx(4.94, abs=0.005)
    assert ratio(96, 12288) == pytest.approx(5.41, abs=0.005)
    assert ratio(64, 6144) == pytest.approx(6.2, abs=0.005)


def test_interleaving_memory_factor():
    """Korthikanti et al. 2022 sec. 4.2.3: interleaved 1F1B keeps 1 + (p-1)/(p v) times 1F1B's
    activations on the first stage (the schedule tests derive the same from the action lists)."""
    assert interleaved_memory_factor(4, 2) == pytest.approx(1.375)
    assert interleaved_memory_factor(4, 1) == 1.0


def test_llama_activations():
    """The planner prices plait's block with the runtime's formula (plait.parallel.activations, which
    a measurement checks): for bf16 and no parallelism s b (20 h + 4 d_kv + 8 f) + 8 s b + 4 s b a;
    TP splits the attention and MLP terms; SP splits the norms' too; selective keeps about half;
    full recomputation keeps 2 s b h."""
    from plait.config import PRESETS, ModelConfig
    from plait.planner.costs import ModelDims

    d = ModelDims.from_config(ModelConfig(**PRESETS["8b"]))
    s, b, h, kv, f, a = 8192, 1, d.hidden, d.kv_dim, d.ffn, d.heads
    none = layer_activation_bytes(d, s, b, compiled=False)
    assert none == pytest.approx(s * b * (20 * h + 4 * kv + 8 * f) + 8 * s * b + 4 * s * b * a)
    t8 = layer_activation_bytes(d, s, b, 8, compiled=False)
    assert t8 == pytest.approx(s * b * (16 * h + 4 * h / 8 + 4 * kv / 8 + 8 * f / 8) + 8 * s * b + 4 * s * b * a / 8)
    sp8 = layer_activation_bytes(d, s, b, 8, sp=True, compiled=False)
    assert sp8 == pytest.approx(t8 - (1 - 1 / 8) * (12 * s * b * h + 8 * s * b))  # norms split, matmul inputs whole
    sel = layer_activation_bytes(d, s, b, 1, recompute="selective", compiled=False)
    assert sel == pytest.approx(s * b * (8 * h + 4 * kv + 4 * f) + 4 * s * b * a) and sel < 0.5 * none
    assert layer_activation_bytes(d, s, b, 1, recompute="full", compiled=False) == 2 * s * b * h
    assert layer_activation_bytes(d, s, 4, compiled=False) == pytest.approx(4 * none)  # linear in the micro-batch
    assert 0 < wgrad_fraction(d) <= 1


def test_llama_activations_compiled():
    """What a compiled block keeps (plait's GPU default, the planner's default): the partitioner
    recomputes the norms' fp32 copies and SwiGLU's silu, s b (12 h + 4 d_kv + 6 f) + 8 s b + 4 s b a
    in bf16, about 70% of eager's for the 8b shape; selective drops the second branch's input."""
    from plait.config import PRESETS, ModelConfig
    from plait.planner.costs import ModelDims

    d = ModelDims.from_config(ModelConfig(**PRESETS["8b"]))
    s, b, h, kv, f, a = 8192, 1, d.hidden, d.kv_dim, d.ffn, d.heads
    none = layer_activation_bytes(d, s, b)
    assert none == pytest.approx(s * b * (12 * h + 4 * kv + 6 * f) + 8 * s * b + 4 * s * b * a)
    assert 0.65 < none / layer_activation_bytes(d, s, b, compiled=False) < 0.75
    t8 = layer_activation_bytes(d, s, b, 8)
    assert t8 == pytest.approx(s * b * (8 * h + 4 * h / 8 + 4 * kv / 8 + 6 * f / 8) + 8 * s * b + 4 * s * b * a / 8)
    sp8 = layer_activation_bytes(d, s, b, 8, sp=True)
    assert sp8 == pytest.approx(t8 - (1 - 1 / 8) * (4 * s * b * h + 8 * s * b))  # input, rms and wo's output split
    sel = layer_activation_bytes(d, s, b, 1, recompute="selective")
    assert sel == pytest.approx(s * b * (6 * h + 4 * kv + 4 * f) + 4 * s * b * a)
    assert layer_activation_bytes(d, s, b, 1, recompute="full") == 2 * s * b * h


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb"])
def test_a_ranks_peak_in_flight_stops_growing_once_the_steady_state_begins(name):
    """The planner builds a schedule for at most `saturated(m)` micro-batches when it only needs the
    peak of held activations (a search screens thousands of layouts): past 4 pp micro-batches the
    peak of every rank must be what it is at 4 pp. (ZB-V is built in full: with uneven stages its
    peak keeps growing with m, which the last assertion shows.)"""
    from plait.parallel.schedules import peak_activation_units
    from plait.parallel.stages import stage_work
    from plait.planner import inputs
    from plait.planner.rank_memory import saturated

    for pp in (2, 3, 4, 8):
        v = 2 if name == "interleaved" else 1
        for m in (5 * pp, 8 * pp, 16 * pp):
            assert saturated(name, pp, m) == 4 * pp
            for rank in range(pp):
                for wf in (0.0, 0.5):
                    full = peak_activation_units(name, pp, m, v, rank, wf)
                    assert full == peak_activation_units(name, pp, saturated(name, pp, m), v, rank, wf), \
                        (name, pp, m, rank, wf)
    uneven = stage_work(inputs.model_dims("70b", seq=4096), [0, 0, 2, 4, 1, 4, 1, 1, 2, 2, 3, 4, 3, 1, 4, 0])
    assert saturated("zbv", 8, 128) == 128 and \
        peak_activation_units("zbv", 8, 128, 2, 0, 0.0, uneven) > peak_activation_units("zbv", 8, 32, 2, 0, 0.0, uneven)


def test_pending_head_ws_are_counted_on_the_compute_order_as_on_the_built_schedule():
    """`pending_head_w` counts on the cached compute order; it built the whole schedule with its
    messages (for ZB-V a sort of every send and receive), which took most of a 70b search's time.
    A rank's compute comes out of both in the same order, so the count must be the same."""
    from plait.parallel.schedules import build_schedule, place
    from plait.parallel.stages import stage_work
    from plait.planner import inputs
    from plait.planner.rank_memory import pending_head_w, saturated

    def counted_on_built(name, pp, m, v, costs):
        sched = build_schedule(name, pp, saturated(name, pp, m), v, costs)
        rank, chunk = place(name, pp, v, pp * v - 1)
        n = peak = 0
        for a in sched.ranks[rank]:
            if a.chunk == chunk and a.kind in ("B", "W"):
                n += 1 if a.kind == "B" else -1
                peak = max(peak, n)
        return peak

    d = inputs.model_dims("70b", seq=4096)
    for name, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb", 1), ("zbv", 2)):
        for pp, m in ((2, 4), (4, 8), (4, 12), (8, 16)):
            split = [80 // (pp * v)] * (pp * v)
            split[-1] += 80 - sum(split)
            for costs in (None, stage_work(d, split)):
                assert pending_head_w(name, pp, m, v, costs) == counted_on_built(name, pp, m, v, costs), \
                    (name, pp, m, v)


def test_screening_a_zbv_layout_places_no_messages(monkeypatch):
    """A search screens tens of thousands of layouts in closed form (`predict(exact=False)`); only
    the simulation of its best needs a schedule's sends and receives. Placing ZB-V's for the head's
    pending W count took about half a 70b, 64-GPU search's time."""
    from plait.parallel import schedule_zbv
    from plait.planner import inputs
    from plait.planner.hardware import cluster
    from plait.planner.layout import Layout
    from plait.planner.predict import predict
    from plait.planner.rank_memory import pending_head_w

    def placed(*args, **kw):
        raise AssertionError("the screening placed ZB-V's messages")

    pending_head_w.cache_clear()
    monkeypatch.setattr(schedule_zbv, "zb_v_lists", placed)
    d = inputs.model_dims("8b", seq=4096)
    p = predict(d, Layout(pp=4, dp_shard=2, schedule="zbv", v=2, micro_batch=1), cluster("h100", 1, 8), 64,
                exact=False)
    assert p.memory_total_bytes > 0


def test_one_devices_gradients_are_at_its_peak_only_with_accumulation():
    """One device's gradient pieces are allocated by the backward (plait/flat.py): with one
    micro-batch a step none exists at the forward's peak; with two, the first backward's pieces are
    there at the second forward's. Data-parallel peers keep whole gradient buffers (DDP's buckets);
    a tensor-parallel part without them has pieces too."""
    from plait.planner.hardware import cluster
    from plait.planner.inputs import model_dims
    from plait.planner.layout import Layout
    from plait.planner.predict import predict

    d, c = model_dims("1b", seq=2048), cluster("h200", 1, 1)
    one = predict(d, Layout(micro_batch=4), c, 4).memory_bytes["gradients"]
    two = predict(d, Layout(micro_batch=4), c, 8).memory_bytes["gradients"]
    whole = predict(d, Layout(micro_batch=4, grads_whole=True), c, 4).memory_bytes["gradients"]
    assert one == 0 and two == whole > 0
    ddp = predict(d, Layout(micro_batch=4, dp_shard=2), cluster("h200", 1, 2), 8).memory_bytes["gradients"]
    assert ddp == whole
    # a tensor-parallel part with no data-parallel peer runs the same engine, its pieces a tp share
    tp = predict(d, Layout(micro_batch=4, tp=2), cluster("h200", 1, 2), 4).memory_bytes["gradients"]
    tp_dp = predict(d, Layout(micro_batch=4, tp=2, dp_shard=2), cluster("h200", 1, 4), 8).memory_bytes["gradients"]
    assert tp == 0 and 0 < tp_dp < whole


def test_the_peak_is_the_update_where_its_state_outweighs_the_activations():
    """With few activations (full recomputation, short sequences) the end of the backward - every
    gradient piece (ZeRO-3: every gradient shard) there, the activations gone - is the fuller
    moment. The table priced the forward's end alone: one 1b GPU 18.8 GiB where the update holds
    16 bytes a parameter + the reserve (20.4), so a layout could be said to fit that does not."""
    from plait.planner.costs import param_count
    from plait.planner.hardware import GIB, cluster
    from plait.planner.inputs import model_dims
    from plait.planner.layout import Layout
    from plait.planner.predict import predict

    d, c = model_dims("1b", seq=512), cluster("h100", 1, 1)
    p = predict(d, Layout(micro_batch=1, recompute="full"), c, 1)
    n = param_count(d)
    assert p.memory_bytes["gradients"] == 2 * n and p.memory_bytes["activations"] == 0
    assert sum(p.memory_bytes.values()) == pytest.approx(16 * n + c.reserved_gib * GIB)
    # where the activations outweigh it (2048 tokens, no recomputation) the forward's end stays the peak
    big = predict(model_dims("1b", seq=2048), Layout(micro_batch=8), c, 8)
    assert big.memory_bytes["gradients"] == 0 and big.memory_bytes["activations"] > 0
    # ZeRO-3 at one micro-batch: its gradient shards count once the backward has made them
    z = predict(model_dims("405b"), Layout(tp=4, dp_shard=2, zero=3, micro_batch=8, recompute="full"),
                cluster("h100", 1, 8), 16)
    assert sum(z.memory_bytes.values()) >= 0.999 * 7 * param_count(model_dims("405b")) / 4  # 7 B/param over tp 4
