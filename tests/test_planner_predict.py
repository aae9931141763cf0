"""`predict`: one layout -> memory by component, traffic per mesh dim, step time, MFU. The traffic
counts are the seeds' formulas applied to a whole layout (seed files in ../shared/seeds/)."""

import dataclasses

import pytest

from plait.config import PRESETS, ModelConfig
from plait.errors import UserError
from plait.planner import costs, memory
from plait.planner.costs import ModelDims
from plait.planner.hardware import GIB, cluster
from plait.planner.layout import Layout, stage_layers
from plait.planner.predict import MEMORY_PARTS, TIME_PARTS, predict
from plait.planner.search import Space, search

GPT3 = ModelDims.gpt(96, 12288, 96)
L8B = ModelDims.from_config(ModelConfig(**PRESETS["8b"]), seq=4096)


def test_param_count_matches_plaits_model():
    """The planner counts exactly the parameters plait's Llama module holds (tied and untied)."""
    import torch  # noqa: F401 - the model needs it

    from plait.model import Transformer

    for name in ("tiny", "small"):
        cfg = ModelConfig(**PRESETS[name])
        for tie in (True, False):
            cfg.tie_embeddings = tie
            model = Transformer(cfg)
            assert sum(p.numel() for p in model.parameters()) == costs.param_count(ModelDims.from_config(cfg))


def test_tp_collectives_per_layer():
    """Seed 000: TP all-reduces 4 times per layer (2 forward, 2 backward): 4L = 384 for GPT-3 per
    micro-batch, each of b s h activations. With SP each all-reduce becomes an all-gather plus a
    reduce-scatter: twice the count, the same bytes. Full recomputation repeats the forward's
    collectives that backward needs."""
    c = cluster("a100-80gb", 1, 8)

    def layers(traffic):  # the layers' collectives (the vocabulary's ends are priced apart)
        return dataclasses.replace(traffic, collectives=tuple(x for x in traffic.collectives
                                                              if not x.what.startswith(("vocab", "partial"))))

    ar = layers(predict(GPT3, Layout(tp=8, sp=False), c, 1).traffic["tp"])
    assert ar.count == 4 * 96 == 384
    act = 2048 * 12288 * 2
    assert ar.collectives[0].size_bytes == act
    assert ar.bytes_per_device == pytest.approx(384 * 2 * 7 / 8 * act)
    sp = layers(predict(GPT3, Layout(tp=8, sp=True), c, 1).traffic["tp"])
    assert sp.count == 768 and sp.bytes_per_device == pytest.approx(ar.bytes_per_device)
    # plait's full recomputation stops at the last tensor backward needs, so it replays the
    # attention's all-reduce but not the MLP's (Megatron's reentrant recompute replays both: 6)
    rc = layers(predict(GPT3, Layout(tp=8, sp=False, recompute="full"), c, 1).traffic["tp"])
    assert rc.count == 5 * 96
    whole = layers(predict(GPT3, Layout(tp=8, sp=False, recompute="full", recompute_whole=True), c, 1).traffic["tp"])
    assert whole.count == 6 * 96
    rc_sp = layers(predict(GPT3, Layout(tp=8, sp=True, recompute="full"), c, 1).traffic["tp"])
    assert rc_sp.count == 11 * 96  # 4 + 4 + the replayed 2 all-gathers and 1 reduce-scatter
    four = layers(predict(GPT3, Layout(tp=8, sp=False), c, 4).traffic["tp"])
    assert four.count == 4 * 384  # per micro-batch


def test_tp_without_sp_runs_the_hidden_states_pointwise_work_on_every_rank():
    """Without sequence parallelism each TP rank runs the norms and residual adds (Llama; GPT also
    its bias-dropout-adds) on the whole micro-batch: those bytes are not divided by tp, while RoPE,
    the activations and attention's output copy, on tensors TP splits, are."""
    from plait.planner import roofline

    c, tokens, e = cluster("a100-80gb", 1, 8), 4096, 2.0
    for d in (GPT3, L8B):
        whole, split = roofline.POINTWISE_ELEMENTS[d.arch](d)
        for tp in (1, 8):
            sp, rep = roofline.layer_times(d, tokens, c, tp, sp=True), roofline.layer_times(d, tokens, c, tp, sp=False)
            assert sp.pointwise_forward_s == pytest.approx(roofline.kernel_time_s(0.0, e * tokens * (whole + split) / tp, c))
            assert rep.pointwise_forward_s == pytest.approx(roofline.kernel_time_s(0.0, e * tokens * (whole + split / tp), c))
            assert rep.forward_s - sp.forward_s == pytest.approx(rep.pointwise_forward_s - sp.pointwise_forward_s)
            assert (rep.forward_s > sp.forward_s) == (tp > 1)
    assert roofline.POINTWISE_ELEMENTS["gpt"](GPT3) == (11 * 12288, 2 * 12288 + 2 * 4 * 12288)


def test_dp_traffic_ddp_zero1_zero2_zero3():
    """Seeds 000/003: DDP all-reduce 2P(N-1)/N; ZeRO-1 and -2 reduce-scatter + all-gather, the same
    2P ("free"); ZeRO-3 3P(N-1)/N (1.5x) less the second gather of what plait keeps gathered from
    forward into backward (embedding, output, norm gains), paid again for every micro-batch; a
    pipeline stage's ZeRO-3 gathers and reduces once a step."""
    c = cluster("h100", 1, 8)
    psi = costs.param_count(L8B)
    vol = {z: predict(L8B, Layout(dp_shard=8, zero=z, embedding_rows="off"), c, 8).traffic for z in (0, 1, 2, 3)}
    assert vol[0]["dp"].bytes_per_device == pytest.approx(2 * 7 / 8 * psi * 2)
    # DDP with the embedding as rows (auto: 8 ranks x 4096 tokens < 2 x 128k rows): 8b's untied
    # embedding leaves the all-reduce; every rank's 4096 ids (int64) and bf16 gradients are gathered
    rows = predict(L8B, Layout(dp_shard=8, zero=0), c, 8).traffic["dp"]
    embed = L8B.vocab * L8B.hidden
    assert rows.bytes_per_device == pytest.approx(2 * 7 / 8 * (psi - embed) * 2 + 7 / 8 * 8 * L8B.seq * (L8B.hidden * 2 + 8))
    assert vol[1]["dp_shard"].bytes_per_device == pytest.approx(2 * 7 / 8 * psi * 2)
    assert vol[2]["dp_shard"].bytes_per_device == pytest.approx(2 * 7 / 8 * psi * 2)
    once = psi - L8B.layers * costs.block_linear_share(L8B, 1)  # embedding, output, norm gains
    assert vol[3]["dp_shard"].bytes_per_device == pytest.approx((3 * psi - once) * 7 / 8 * 2)
    z3_m4 = predict(L8B, Layout(dp_shard=8, zero=3), c, 32).traffic["dp_shard"]
    assert z3_m4.bytes_per_device == pytest.approx(4 * (3 * psi - once) * 7 / 8 * 2)
    pp_z3 = predict(L8B, Layout(pp=2, dp_shard=4, zero=3), c, 32).traffic["dp_shard"]
    stage = predict(L8B, Layout(pp=2, dp_shard=4, zero=3), c, 32)
    assert pp_z3.bytes_per_device == pytest.approx(2 * 3 / 4 * pp_z3.collectives[0].size_bytes)  # one AG + one RS
    assert [x.count for x in stage.traffic["dp_shard"].collectives] == [1, 1]
    z2_m4 = predict(L8B, Layout(dp_shard=8, zero=2), c, 32).traffic["dp_shard"]
    assert z2_m4.bytes_per_device == pytest.approx((4 + 1) * 7 / 8 * psi * 2)  # RS per micro-batch
    hsdp = predict(L8B, Layout(dp_replicate=2, dp_shard=4, zero=3), c, 8).traffic
    assert hsdp["dp_replicate"].bytes_per_device == pytest.approx(2 * 1 / 2 * psi / 4 * 2)


def test_pp_traffic():
    """Seeds 000/001: PP sends (B/M) s h per micro-batch each way; a middle stage sends 2M of them."""
    c = cluster("h100", 1, 8)
    p = predict(L8B, Layout(pp=4, dp_shard=2), c, 16)
    t = p.traffic["pp"]
    assert p.microbatches == 8 and t.count == 16
    assert t.bytes_per_device == pytest.approx(16 * 4096 * 4096 * 2)


def test_memory_by_zero_stage():
    """The breakdown is state_bytes of the rank's parameters; at ZeRO-3's peak (the end of the
    forward) only the root unit is gathered -- not the whole model that seed 001 lists as "Temp
    (AllGather): M" -- and with one micro-batch no gradient chunk exists yet. plait's ZeRO-3 keeps
    the fp32 master as the shard: 2 bytes per parameter over N below the paper's (2 + 2 + K) Psi / N,
    and the paper's form is still there for the seeds' tables."""
    c = cluster("h100", 1, 8)
    psi = costs.param_count(L8B)
    mixed = memory.PRECISIONS["mixed"]
    for z in (0, 1, 2, 3):
        p = predict(L8B, Layout(dp_shard=8, zero=z), c, 8)
        st = memory.state_bytes(psi, z, 8, mixed, shard_is_master=True)
        assert p.memory_bytes["parameters"] == pytest.approx(st.params)
        assert p.memory_bytes["optimizer_states"] == pytest.approx(st.optimizer)
        assert set(p.memory_bytes) == set(MEMORY_PARTS)
    paper, plait = memory.state_bytes(psi, 3, 8, mixed), memory.state_bytes(psi, 3, 8, mixed, shard_is_master=True)
    assert paper.total == pytest.approx(16 * psi / 8)
    assert plait.total == pytest.approx(14 * psi / 8) and plait.params == pytest.approx(4 * psi / 8)
    z3 = predict(L8B, Layout(dp_shard=8, zero=3), c, 8)
    root = costs.embedding_params(L8B) + costs.head_params(L8B)
    assert z3.memory_bytes["zero3_gather"] == pytest.approx(root * 2)
    assert z3.memory_bytes["zero3_gather"] < psi * 2 / 7
    assert z3.memory_bytes["gradients"] == 0 and z3.state_bytes["gradients"] == pytest.approx(2 * psi / 8)
    accum = predict(L8B, Layout(dp_shard=8, zero=3), c, 16)  # the second micro-batch's forward holds them
    assert accum.memory_bytes["gradients"] == pytest.approx(2 * psi / 8)


def test_first_stage_holds_l_layers_of_activations():
    """Korthikanti et al. 2022: under 1F1B the first stage keeps p micro-batches of its L/p layers,
    i.e. L layers' worth; interleaving multiplies that by 1 + (p-1)/(p v); GPipe keeps all m."""
    c = cluster("h100", 1, 8)
    per_layer = memory.layer_activation_bytes(L8B, 4096, 1)
    p = predict(L8B, Layout(pp=4, dp_shard=2), c, 16)
    assert p.memory_rank == 0
    assert p.memory_bytes["activations"] == pytest.approx(L8B.layers * per_layer)
    il = predict(L8B, Layout(pp=4, dp_shard=2, schedule="interleaved", v=2), c, 16)
    assert il.memory_bytes["activations"] == pytest.approx(L8B.layers * per_layer * (1 + 3 / 8))
    gp = predict(L8B, Layout(pp=4, dp_shard=2, schedule="gpipe"), c, 16)
    assert gp.memory_bytes["activations"] == pytest.approx(8 * L8B.layers / 4 * per_layer)
    rc = predict(L8B, Layout(pp=4, dp_shard=2, recompute="full"), c, 16)
    assert rc.memory_bytes["activations"] < p.memory_bytes["activations"] / 10


def test_fits_verdict_and_time_parts():
    c = cluster("h100", 1, 8)
    p = predict(L8B, Layout(tp=2, pp=2, dp_shard=2, zero=1), c, 32)
    assert p.fits == (p.memory_total_bytes <= p.capacity_bytes) and p.capacity_bytes == 80 * GIB
    assert set(p.time_s) == set(TIME_PARTS)
    assert sum(p.time_s.values()) == pytest.approx(p.step_time_s)
    assert p.mfu == pytest.approx(p.model_flops_per_step / (p.step_time_s * 8 * 989e12))
    assert p.model_flops_per_step == pytest.approx(costs.model_flops_per_token(L8B) * 32 * 4096)
    big = predict(ModelDims.from_config(ModelConfig(**PRESETS["405b"])), Layout(dp_shard=8), c, 8)
    assert not big.fits and big.headroom_bytes < 0


def test_links_follow_placement():
    """TP inside a node rides NVLink; pp across nodes rides InfiniBand (seeds 000/002: TP within
    the node, PP across)."""
    c = cluster("h100", 4, 8)
    p = predict(L8B, Layout(tp=8, pp=4), c, 32)
    assert not p.traffic["tp"].crosses_nodes and p.traffic["tp"].link.name.startswith("NVLink")
    assert p.traffic["pp"].crosses_nodes and p.traffic["pp"].link.name.startswith("InfiniBand")


def test_faster_hardware_is_faster_and_simulation_matches_estimate_when_even():
    c = cluster("h100", 1, 8)
    lay = Layout(tp=2, pp=4, dp_shard=1, zero=0)
    slow = predict(L8B, lay, cluster("a100-80gb", 1, 8), 32)
    fast = predict(L8B, lay, c, 32)
    assert fast.step_time_s < slow.step_time_s
    est = predict(L8B, lay, c, 32, exact=False)
    assert est.step_time_s == pytest.approx(fast.step_time_s, rel=0.05)


def test_layout_errors_are_one_line():
    c = cluster("h100", 1, 8)
    bad = [(Layout(tp=4), 8), (Layout(tp=3, dp_shard=1), 8), (Layout(dp_shard=8, micro_batch=3), 8),
           (Layout(dp_shard=4, cp=2), 8), (Layout(pp=8, schedule="interleaved", v=8), 64),
           (Layout(dp_shard=8), 0)]
    d = ModelDims.from_config(ModelConfig(**PRESETS["8b"]), seq=4094)
    for lay, gb in bad:
        with pytest.raises(UserError) as e:
            predict(d, lay, c, gb)
        assert "\n" not in str(e.value)
    with pytest.raises(UserError):
        Layout(zero=4)
    with pytest.raises(UserError):
        ModelDims(4, 100, 3, 3, 10, 10, 10)  # heads do not divide hidden
    with pytest.raises(UserError):
        ModelDims(-1, 128, 4, 4, 10, 10, 10)


def test_stage_layers_even_and_uneven():
    assert stage_layers(80, 4) == [20] * 4
    assert sum(stage_layers(126, 16)) == 126 and max(stage_layers(126, 16)) - min(stage_layers(126, 16)) == 1
    assert stage_layers(10, 4)[0] == 2 and stage_layers(10, 4)[-1] == 2  # extras go to the middle


def test_balanced_stages_lighten_the_last_stage_by_its_head():
    """parallel.stage_layers = balance: the contiguous split whose slowest stage is fastest when the
    last stage also runs the output head. For the 8b shape with 16 layers on 2 stages the head costs
    about 2.2 layers: 9,7 - the split measured fastest on 2 x H100 (bench/results/pp-h100-2gpu.json)
    - and the planner prices it faster than the even split, as measured."""
    import itertools

    from plait.config import build_config
    from plait.parallel.stages import balanced_counts, resolve_counts
    from plait.planner.inputs import model_dims

    assert balanced_counts(16, 4, 1.0, 0.0) == [4, 4, 4, 4]
    for layers, stages, head in ((7, 3, 1.5), (10, 4, 2.2), (12, 5, 0.4), (6, 6, 3.0)):
        got = balanced_counts(layers, stages, 1.0, head)
        assert sum(got) == layers and min(got) >= 1
        cost = lambda c: max(c[:-1] + [c[-1] + head])  # noqa: E731
        brute = min(cost(list(c)) for c in itertools.product(range(1, layers + 1), repeat=stages) if sum(c) == layers)
        assert cost(got) == brute, (layers, stages, head, got)
    m = build_config({"model": {"preset": "8b", "n_layers": 16}}).model
    assert resolve_counts("balance", m, 2048, 2) == [9, 7]
    assert resolve_counts("", m, 2048, 2) is None and resolve_counts("10,6", m, 2048, 2) == [10, 6]
    d = model_dims("8b", layers=16, seq=2048)
    c = cluster("h100", 1, 2)
    even = predict(d, Layout(pp=2, zero=1), c, 8)
    bal = predict(d, Layout(pp=2, zero=1, stage_split="balance"), c, 8)
    assert bal.step_time_s < 0.95 * even.step_time_s
    best = search(d, c, 8, space=Space(pp=(2,), zero=(0,), micro_batch=(1,), recompute=("none",), schedule=("1f1b",)))
    assert best.best.layout.stage_split == "balance"


def test_zero3_root_unit_and_fused_loss_passes_are_priced():
    """ZeRO-3 without a pipeline gathers the root unit (embedding, norms) and the first block as
    each micro-batch's forward begins, the last block as its backward begins, and reduce-scatters
    the first block and the root last, nothing to hide any of them behind: each micro-batch adds
    exactly those transfers to the step, attributed to ZeRO-3. An untied output matrix is a unit
    of its own, gathered beside the last layer's forward and reduce-scattered beside the backward:
    here (no profile, 32 layers) hidden entirely, so 8B's exposed root transfers halve. Runs
    recorded while it was in the root (`zero3_whole_root`) are priced with it there.
    And the last stage's F carries the fused loss's memory-bound passes: the output matrix's fp32
    weight-gradient buffer costs time per micro-batch, independent of the tokens."""
    from plait.planner import roofline
    from plait.planner.stage_costs import stage_costs, zero3_passes
    from plait.planner.traffic import Collective

    d = ModelDims.from_config(ModelConfig(**PRESETS["8b"]), seq=2048)
    c = cluster("h100", 1, 4)
    c = dataclasses.replace(c, intra=dataclasses.replace(c.intra, efficiency=1.0))  # the head's transfers hide
    prec = memory.precision("mixed")
    lay = Layout(dp_shard=4, zero=3, micro_batch=1)
    sc = stage_costs(d, lay, c, prec)
    link = sc.links["shard"][0]
    root, block = sc.root_params[0], costs.tp_share(d, 1)[0]

    def moved(op, params, per):
        return Collective(op, params * per, 4, 1, "").time_s(link)

    blocks = 2 * moved("all_gather", block, prec.param_bytes) + moved("reduce_scatter", block, prec.wire_grad_bytes)

    def ends(params):
        return moved("all_gather", params, prec.param_bytes) + moved("reduce_scatter", params, prec.wire_grad_bytes)

    head = costs.output_share(d, 1)
    assert head == d.vocab * d.hidden and root == costs.embedding_params(d) + costs.head_params(d)
    # with the passes on the compute stream (zero3_passes): the root's cast and pack, the head's cast
    r_cast, r_pack, _ = zero3_passes(root - head, 4, prec, 1)
    h_cast, _, _ = zero3_passes(head, 4, prec, 1)
    want = ends(root - head) + blocks + roofline.kernel_time_s(0.0, r_cast + h_cast + r_pack, c)
    assert sc.root_zero3_s == pytest.approx(want) and want > 0
    whole = stage_costs(d, dataclasses.replace(lay, zero3_whole_root=True), c, prec)
    w_cast, w_pack, _ = zero3_passes(root, 4, prec, 1)
    assert whole.root_zero3_s == pytest.approx(ends(root) + blocks + roofline.kernel_time_s(0.0, w_cast + w_pack, c))
    split_passes = roofline.kernel_time_s(0.0, r_cast + h_cast + r_pack, c)
    whole_passes = roofline.kernel_time_s(0.0, w_cast + w_pack, c)
    # the transfers: embedding = output (+ latencies, a norm)
    assert 1.95 < (whole.root_zero3_s - blocks - whole_passes) / (want - blocks - split_passes) < 2.0
    tied = dataclasses.replace(d, tie_embeddings=True)  # nothing to split: the same either way
    assert stage_costs(tied, lay, c, prec).root_zero3_s == pytest.approx(
        stage_costs(tied, dataclasses.replace(lay, zero3_whole_root=True), c, prec).root_zero3_s)
    # beside a link the layers' transfers already fill, the head's reduce-scatter is exposed too: only
    # part of its gather, beside the last layer's forward, still hides
    slow = dataclasses.replace(c, intra=dataclasses.replace(c.intra, gbps=c.intra.gbps / 50))
    s_split = stage_costs(d, lay, slow, prec).root_zero3_s
    s_whole = stage_costs(d, dataclasses.replace(lay, zero3_whole_root=True), slow, prec).root_zero3_s
    head_ag = Collective("all_gather", head * prec.param_bytes, 4, 1, "").time_s(slow.intra)
    assert 0 < s_whole - s_split < 0.5 * head_ag
    one, eight = predict(d, lay, c, 4), predict(d, lay, c, 32)  # 1 and 8 micro-batches a GPU
    sc8 = stage_costs(d, lay, c, prec, 8)
    assert eight.time_s["zero3"] - 8 * sc8.layer["zero3"] * d.layers == pytest.approx(8 * sc8.root_zero3_s)
    assert one.time_s["zero3"] - sc.layer["zero3"] * d.layers == pytest.approx(sc.root_zero3_s)
    assert predict(d, Layout(dp_shard=4, zero=2, micro_batch=1), c, 32).time_s["zero3"] == 0
    # the head's passes, at the HBM roof: 4 bytes a logit; a weight of the output matrix 10 bytes in
    # one chunk (d: 2048 tokens of a 128k vocabulary fit one), 24 over several (8 sequences), 36 as
    # plait ran it before the 1/count moved into the softmax (its eager norm unpriced, as then); the
    # final norm 10 bytes an element of (tokens, dim) compiled, 110 eager
    gemm = roofline.linear_time_s("fwd", 2048, d.hidden, d.vocab, c)
    for kw, per_weight, norm in (({}, 10, 10), ({"eager_norm": True}, 10, 110), ({"eager": True}, 36, 0)):
        f, b = roofline.head_times(d, 2048, c, **kw)
        passes = roofline.kernel_time_s(0.0, 4 * 2048 * d.vocab + per_weight * d.vocab * d.hidden
                                        + norm * 2048 * d.hidden, c)
        assert f == pytest.approx(gemm + passes), kw
    f8, _ = roofline.head_times(d, 8 * 2048, c)
    passes = roofline.kernel_time_s(0.0, 4 * 8 * 2048 * d.vocab + 24 * d.vocab * d.hidden + 10 * 8 * 2048 * d.hidden, c)
    assert f8 == pytest.approx(roofline.linear_time_s("fwd", 8 * 2048, d.hidden, d.vocab, c) + passes)
    assert roofline.head_times(d, 2048, c, eager=True)[0] - gemm > 0.5 * gemm


def test_the_gradients_backward_makes_last_are_reduced_after_it():
    """DDP and ZeRO-2 reduce buckets as the backward frees them, but the first stage's embedding
    gets its gradient when the backward ends: its all-reduce (reduce-scatter) has nothing left to
    hide behind and adds to the step in full (4 x H100, 1b DDP: 3.0 ms of all-reduce ran alone
    after the backward). Hiding it with the rest fails this."""
    from plait.planner.stage_costs import stage_costs
    from plait.planner.traffic import Collective

    d = ModelDims.from_config(ModelConfig(**PRESETS["1b"]), seq=2048)
    c = cluster("h100", 1, 4)
    prec = memory.precision("mixed")
    embed = costs.tp_share(d, 1)[1]
    for zero, op, group in ((0, "all_reduce", "grad"), (2, "reduce_scatter", "shard")):
        lay = Layout(dp_shard=4, zero=zero, micro_batch=8, embedding_rows="off")
        sc = stage_costs(d, lay, c, prec)
        assert sc.last_params[0] == embed
        tail = Collective(op, embed * prec.wire_grad_bytes, 4, 1, "").time_s(sc.links[group][0])
        assert predict(d, lay, c, 32).time_s["dp_sync"] >= tail * (1 - 1e-9) and tail > 0
        if zero == 0:  # as rows (on; auto leaves 1b's tied matrix dense) only their all-gather is left after it
            gather = Collective("all_gather", 4 * 8 * 2048 * (d.hidden * 2 + 8), 4, 1, "").time_s(sc.links[group][0])
            assert predict(d, dataclasses.replace(lay, embedding_rows="auto"), c, 32).time_s["dp_sync"] >= tail * (1 - 1e-9)
            rows = predict(d, dataclasses.replace(lay, embedding_rows="on"), c, 32).time_s["dp_sync"]
            assert gather * (1 - 1e-9) <= rows < tail
    # with a pipeline, a later stage's last bucket is one bucket, not the embedding
    sc = stage_costs(d, Layout(pp=2, dp_shard=2, micro_batch=1), cluster("h100", 1, 4), prec)
    assert sc.last_params[1] < embed


def test_the_head_in_the_last_stages_backward_slot_speeds_gpipe_and_nothing_else():
    """plait's fused loss forms the head's gradients as it computes the loss: 3-4 layers of 1b's work.
    In the last stage's F slot it paced GPipe's whole forward phase; in the B slot (the executor
    since, plait/parallel/pipeline.py) GPipe's 1b step on 4 x H100 is priced >= 10% faster, while
    1F1B, interleaved and ZB-H1, which run the last stage's F and B back to back, are unchanged."""
    d = ModelDims.from_config(ModelConfig(**PRESETS["1b"]), seq=2048)
    c = cluster("h100", 1, 4)
    for sched, v, gain in (("gpipe", 1, 1.10), ("1f1b", 1, 1.0), ("interleaved", 2, 1.0), ("zb", 1, 1.0)):
        lay = Layout(pp=4, dp_shard=1, zero=1, micro_batch=2, schedule=sched, v=v, stage_split="balance",
                     head_wgrad_in_b=True)  # ZB-H1's output-matrix gradient in B too: the slot alone moves
        now = predict(d, lay, c, 16).step_time_s
        before = predict(d, dataclasses.replace(lay, head_in_forward=True), c, 16).step_time_s
        if gain > 1:
            assert before >= gain * now, (sched, before, now)
        else:
            assert before == pytest.approx(now, rel=1e-3), (sched, before, now)


def test_the_output_matrix_gradient_in_w_shortens_zero_bubble_steps_only():
    """A zero-bubble last stage forms the output matrix's gradient in its W (plait/loss.py): a third
    of the head's matmuls, 1b's largest, leaves the B the stages before wait on. Priced on 4 x H100
    at 8 micro-batches: 1b's ZB-H1 step >= 5% shorter and ZB-V's >= 8% (bubbles 24.7 -> 18.0% and
    25.7 -> 18.6% when written), 1F1B and interleaved unchanged; the rank with the head holds each
    pending micro-batch's d(loss)/d(logits) (16-bit, tokens x vocabulary) until its W."""
    d = ModelDims.from_config(ModelConfig(**PRESETS["1b"]), seq=2048)
    c = cluster("h100", 1, 4)
    for sched, v, split, gain in (("zb", 1, "5,5,5,1", 1.05), ("zbv", 2, "balance", 1.08),
                                  ("1f1b", 1, "5,5,5,1", 1.0), ("interleaved", 2, "balance", 1.0)):
        lay = Layout(pp=4, dp_shard=1, zero=1, micro_batch=1, schedule=sched, v=v, stage_split=split)
        now, before = predict(d, lay, c, 8), predict(d, dataclasses.replace(lay, head_wgrad_in_b=True), c, 8)
        if gain > 1:
            assert before.step_time_s >= gain * now.step_time_s and now.bubble < before.bubble, sched
        else:
            assert before.step_time_s == pytest.approx(now.step_time_s, rel=1e-9), sched
    zbv = Layout(pp=4, dp_shard=1, zero=1, micro_batch=1, schedule="zbv", v=2, stage_split="balance")
    from plait.planner.memory import loss_chunk_bytes

    now = predict(d, zbv, c, 8)  # the chunk as the loss forms it, and pp = 4 pending W at 2 bytes a logit
    assert now.memory_rank == 0 and now.memory_bytes["loss_chunk"] == \
        pytest.approx(loss_chunk_bytes(d, 2048) + 4 * 2048 * d.vocab * 2)


def test_zb_v_puts_both_ends_and_one_tied_matrix_on_rank_0():
    """ZB-V's V: rank 0 holds the embedding and the head, so a tied matrix is held once there, where
    a looped schedule keeps a second copy on its last rank; the fused loss's chunk is priced on rank
    0; the balanced split evens out ranks' pairs of stages with rank 0's carrying the head; and the
    planner's activations follow each chunk's own layers."""
    from plait.planner.memory import precision
    from plait.planner.stage_costs import split_layers, stage_costs

    cfg = ModelConfig(**PRESETS["1b"])
    d = ModelDims.from_config(cfg, seq=2048)
    assert d.tie_embeddings
    c, prec = cluster("h100", 1, 4), precision("mixed")
    _, embed, head = costs.tp_share(d, 1)
    one = stage_costs(d, Layout(pp=4, dp_shard=1, zero=1, micro_batch=2, schedule="1f1b"), c, prec)
    zbv = stage_costs(d, Layout(pp=4, dp_shard=1, zero=1, micro_batch=2, schedule="zbv", v=2), c, prec)
    assert one.root_params == (embed, 0, 0, head + embed)  # the last rank's own copy of the tied matrix
    assert zbv.root_params == (embed + head, 0, 0, 0)
    counts = split_layers(d, 8, "balance", "zbv")
    assert sum(counts) == d.layers and counts[0] + counts[-1] < min(counts[r] + counts[7 - r] for r in (1, 2, 3))
    p = predict(d, Layout(pp=4, dp_shard=1, zero=1, micro_batch=2, schedule="zbv", v=2, stage_split="balance"), c, 16)
    loss_on = p.memory_rank == 0
    assert (p.memory_bytes["loss_chunk"] > 0) == loss_on


def test_zero3_cast_once_prices_one_cast_a_step_and_the_kept_copy():
    """parallel.zero3_cast_once: a unit's chunk is cast once a step, not at every gather (twice a
    micro-batch for a block, once for the root and head), and its 16-bit copy stays through the
    step. With m micro-batches a GPU the step saves the other casts' passes over the HBM; memory
    grows by 2 bytes a parameter over the shard group."""
    import dataclasses

    from plait.planner import roofline
    from plait.planner.stage_costs import stage_costs, zero3_passes

    d = ModelDims.from_config(ModelConfig(**PRESETS["8b"]), seq=2048)
    c = cluster("h100", 1, 2)
    prec = memory.precision("mixed")
    m = 4
    every = Layout(dp_shard=2, zero=3, micro_batch=1)
    once = dataclasses.replace(every, zero3_cast_once=True)
    a, b = predict(d, every, c, 2 * m), predict(d, once, c, 2 * m)
    block = costs.tp_share(d, 1)[0]
    cast_every = zero3_passes(block, 2, prec, m, 2)[0]
    cast_once = zero3_passes(block, 2, prec, m, 2, True)[0]
    assert cast_once == pytest.approx(cast_every / (2 * m))  # one of the 2m a step
    sa, sb = stage_costs(d, every, c, prec, m), stage_costs(d, once, c, prec, m)
    saved = roofline.kernel_time_s(0.0, cast_every - cast_once, c)
    assert sum(map(sum, sa.durations)) - sum(map(sum, sb.durations)) >= d.layers * saved * 0.99  # + the root's
    assert b.step_time_s < a.step_time_s
    kept = sa.rank_params[0] / 2 * prec.param_bytes
    assert b.memory_bytes["parameters"] - a.memory_bytes["parameters"] == pytest.approx(kept)
    assert b.state_bytes["parameters"] - a.state_bytes["parameters"] == pytest.approx(kept)
    with pytest.raises(Exception, match="zero3_cast_once"):
        Layout(dp_shard=2, zero=2, micro_batch=1, zero3_cast_once=True)


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("gpipe", 1), ("zb", 1), ("interleaved", 2), ("zbv", 2)])
def test_a_long_schedule_extends_its_steady_state_as_simulating_it_does(name, v):
    """Past 32 pp micro-batches `simulate_makespan` simulates 16 pp and 32 pp and extends the line
    between them: for uneven stages (random F, B, W per stage) the makespan, the bubble and each
    rank's end match the full simulation (periodic schedules to rounding; ZB-V, whose order is
    chosen by cost as it goes, within 1%)."""
    import random

    from plait.planner.predict import _simulated, simulate_makespan

    rnd = random.Random(7)
    for pp in (2, 4):
        durs = tuple((rnd.uniform(1, 2), rnd.uniform(1.5, 3), rnd.uniform(0.5, 1.5) if name in ("zb", "zbv") else 0.0)
                     for _ in range(pp * v))
        costs = tuple(tuple(x / 3 for x in d) for d in durs) if name == "zbv" else None
        m = 80 * pp
        full, line = _simulated(name, pp, m, v, durs, 1e-3, costs), simulate_makespan(name, pp, m, v, durs, 1e-3, costs)
        tol = 1e-2 if name == "zbv" else 1e-9
        assert line[0] == pytest.approx(full[0], rel=tol) and line[1] == pytest.approx(full[1], abs=tol)
        assert line[2] == pytest.approx(full[2], rel=tol)
