"""Pipeline schedules as data: well formed, deadlock-free, and with the bubbles and memory the
seeds and papers state."""

import dataclasses

import pytest

from plait.cli import main
from plait.errors import UserError
from plait.parallel.rules import flag_field, run_field
from plait.parallel.schedules import (Action, Schedule, ScheduleError, build_schedule, check, check_args,
                                      check_no_pipeline, compute_order, in_flight, peak_activation_units)
from plait.planner.simulate import render, simulate, unit_durations

GRID = [(name, v, pp, m)
        for name, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved", (2, 3)), ("zb", (1,)), ("zbv", (2,)))
        for v in vs for pp in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16)
        if not (name == "interleaved" and (pp < 2 or m % pp)) and not (name == "zbv" and pp < 2)]


@pytest.mark.parametrize("name,v,pp,m", GRID)
def test_every_schedule_is_well_formed_and_cannot_deadlock(name, v, pp, m):
    """check(): one F/B(/W) per (micro-batch, stage) on the right rank, F before B before W, every
    receive before its consumer, sends and receives paired, and a rendezvous execution that ends."""
    s = build_schedule(name, pp, m, v)
    assert check(s) > 0
    tl = simulate(s)
    assert tl.makespan_s > 0


def _bubble(name, pp, m, v=1):
    return simulate(build_schedule(name, pp, m, v)).bubble_fraction


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 8), (4, 16), (8, 32), (3, 7)])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(pp, m):
    """Seeds 000, 001, 002: bubble fraction (N-1)/(M+N-1), from simulating the action lists."""
    for name in ("gpipe", "1f1b"):
        assert _bubble(name, pp, m) == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 4, 2), (8, 16, 2), (3, 9, 3)])
def test_interleaved_bubble_shrinks_by_v(pp, m, v):
    """Narayanan et al. 2021: interleaving v chunks divides the bubble by v: (p-1)/(v m + p-1)."""
    assert _bubble("interleaved", pp, m, v) == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-12)


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 4), (4, 8), (8, 16), (5, 12)])
def test_zb_h1_bubble_is_a_third_of_1f1b(pp, m):
    """Qi et al. 2023: with T_F = T_B = T_W, ZB-H1 idles (p-1)(T_F + T_B - T_W) per rank against
    1F1B's (p-1)(T_F + T_B + T_W): a third."""
    zb = simulate(build_schedule("zb", pp, m))
    one = simulate(build_schedule("1f1b", pp, m), unit_durations(1, 2, 0))
    idle_zb = pp * zb.makespan_s - sum(zb.busy_s)
    idle_1f1b = pp * one.makespan_s - sum(one.busy_s)
    assert idle_zb / pp == pytest.approx(pp - 1)
    assert idle_1f1b / pp == pytest.approx(3 * (pp - 1))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (4, 32), (8, 16), (8, 32)])
def test_zb_v_places_a_v_and_idles_less_than_zb_h1(pp, m):
    """ZB-V (Qi et al. 2023): rank r runs stages r and 2p-1-r, so rank 0 holds both ends of the
    model; with T_F = T_B = T_W per chunk and m >= 2p it idles no more than ZB-H1 (at 4 and 8
    ranks: less, and at most a third of 1F1B's bubble), holding at most 2p chunk-micro-batches
    between F and W on any rank (pp whole micro-batches: 1F1B's first rank's activations)."""
    s = build_schedule("zbv", pp, m, 2)
    assert s.place(0) == (0, 0) and s.place(2 * pp - 1) == (0, 1) and s.place(pp) == (pp - 1, 1)
    assert [s.stage(r, 1) for r in range(pp)] == list(range(2 * pp - 1, pp - 1, -1))
    zbv, zb, one = (_bubble(*a) for a in (("zbv", pp, m, 2), ("zb", pp, m), ("1f1b", pp, m)))
    assert zbv <= zb, (zbv, zb)
    if pp >= 4:
        assert zbv < zb and zbv <= (0.34 if pp == 8 else 0.22) * one, (zbv, zb, one)
    for r in range(pp):
        assert peak_activation_units("zbv", pp, m, 2, r, 1.0) <= 2 * pp
    # the one boundary inside a rank (stage pp-1 -> pp on the last rank) carries no message
    assert not any(a.peer == pp - 1 for a in s.ranks[pp - 1] if not a.is_compute)


def test_zb_v_messages_go_out_at_the_moment_that_made_them():
    """ZB-V's activations and gradients flow both ways between neighbours. Placed as 1F1B places
    them (each receive just before its consumer, each send right after its producer), the order
    found for uneven stages lets two neighbours each wait in a batch for a message the other posts
    later: the checker finds the deadlock. The lists plait runs post each message at the moment of
    the list-scheduling run that produced it, on both ranks, and pass - for any stage costs (random
    ones here), keeping every rank within pp micro-batches of the heaviest rank's chunks (each
    counted by its F cost, plus a tenth for its input) - and so does every link's order, which NCCL
    matches by position."""
    import random

    from plait.parallel.schedules import _with_p2p

    costs = ((0.5, 1, 0.5), (1, 0.5, 0.5), (1, 3, 1), (1, 1, 1))
    good = build_schedule("zbv", 2, 3, 2, costs)
    assert check(good) > 0
    naive = dataclasses.replace(good, ranks=tuple(
        tuple(_with_p2p([[a] for a in good.compute_actions(r)], r, 2, 2, "zbv")) for r in range(2)))
    with pytest.raises(ScheduleError, match="deadlock"):
        check(naive)
    rng = random.Random(0)
    for _ in range(40):
        pp, m = rng.choice([2, 3, 4, 8]), rng.randint(1, 20)
        costs = tuple((rng.choice([0.0, 0.5, 1, 2]), rng.choice([0.5, 1, 3, 8]), rng.choice([0.0, 0.5, 1]))
                      for _ in range(2 * pp))
        s = build_schedule("zbv", pp, m, 2, costs)
        assert check(s) > 0, (pp, m, costs)
        weight = [[costs[s.stage(r, c)][0] + 0.1 for c in (0, 1)] for r in range(pp)]
        for r in range(pp):
            held = peak_activation_units("zbv", pp, m, 2, r, 1.0, costs, weight[r])
            assert held <= pp * max(map(sum, weight)) + 1e-9, (pp, m, costs, r)
    # rank 0's first activation sent after its second: rank 1 would read one as the other
    acts = list(good.ranks[0])
    i, j = [k for k, a in enumerate(acts) if a.kind == "SEND_F"][:2]
    acts.insert(j, acts.pop(i))
    with pytest.raises(ScheduleError, match="another order"):
        check(_mutate(good, 0, acts))
    # the last rank's turn from chunk 0 to chunk 1 is local: its F must come after the F it takes from
    acts = list(good.ranks[1])
    f0 = next(k for k, a in enumerate(acts) if a.kind == "F" and a.chunk == 0 and a.microbatch == 0)
    f1 = next(k for k, a in enumerate(acts) if a.kind == "F" and a.chunk == 1 and a.microbatch == 0)
    acts[f0], acts[f1] = acts[f1], acts[f0]
    with pytest.raises(ScheduleError, match="before the F of stage 1"):
        check(_mutate(good, 1, acts))


def test_seed_bubble_tables():
    """Seed 002 (distributed training guide): P=4 M=32 -> 3/35 = 8.6%; P=4 M=4 -> 3/7 = 43%;
    P=4 M=16 -> 3/19 = 16%; P=4 M=64 -> 3/67 = 4.5%; P=8 M=64 -> 7/71 = 9.9%.
    Seed 001: N=4, M=16 -> ~16%. Seed 000: N=4, M=16 exact 3/19 = 15.8%."""
    table = {(4, 32): 0.086, (4, 4): 0.43, (4, 16): 0.16, (4, 64): 0.045, (8, 64): 0.099}
    for (p, m), seed in table.items():
        got = _bubble("1f1b", p, m)
        assert got == pytest.approx((p - 1) / (m + p - 1))
        assert round(got, 3 if seed < 0.1 else 2) == pytest.approx(seed, abs=1e-9)
    assert round(_bubble("1f1b", 4, 16) * 100, 1) == 15.8


def test_seed_approximation_is_bubble_over_compute():
    """Seed 000 calls 3/16 = 18.75% "an approximation" of 3/19 = 15.8% for N=4, M=16. Both are exact:
    3/19 is idle / total time, 3/16 = (N-1)/M is idle / busy time (Megatron's definition). The
    simulation gives both; docs/planner.md explains."""
    tl = simulate(build_schedule("1f1b", 4, 16))
    assert tl.bubble_fraction == pytest.approx(3 / 19)
    assert tl.bubble_over_compute == pytest.approx(3 / 16)
    assert tl.bubble_over_compute == pytest.approx(0.1875)


def test_seed_rule_m_at_least_4n_keeps_bubble_under_25_percent():
    """Seeds 000/001: M >= 4N keeps the bubble under 25% (even by the (N-1)/M measure)."""
    for n in (2, 4, 8, 16):
        tl = simulate(build_schedule("1f1b", n, 4 * n))
        assert tl.bubble_over_compute < 0.25 and tl.bubble_fraction < 0.25


def test_seed_pp_sends_per_step_2m_n_minus_1():
    """Seed 000: PP communicates 2M(N-1) = 448 times per step for M=32, N=8 (each micro-batch's
    activation forward and gradient backward across each of the N-1 boundaries)."""
    s = build_schedule("1f1b", 8, 32)
    sends = sum(a.kind.startswith("SEND") for acts in s.ranks for a in acts)
    recvs = sum(a.kind.startswith("RECV") for acts in s.ranks for a in acts)
    assert sends == recvs == 2 * 32 * (8 - 1) == 448


def test_in_flight_micro_batches():
    """1F1B holds at most pp - rank micro-batches (seed 002: "at most P ... instead of M"); GPipe
    all M; interleaving holds (1 + (p-1)/(p v)) times 1F1B's on rank 0 (Korthikanti et al. 2022)."""
    pp, m = 4, 16
    one, gp = build_schedule("1f1b", pp, m), build_schedule("gpipe", pp, m)
    assert [in_flight(one, r)[0] for r in range(pp)] == [4, 3, 2, 1]
    assert [in_flight(gp, r)[0] for r in range(pp)] == [m] * pp
    for v in (2, 4):
        units = peak_activation_units("interleaved", pp, m, v, 0, 0.0)  # in chunks (1/v of a stage)
        assert units / v / pp == pytest.approx(1 + (pp - 1) / (pp * v))
    zb = build_schedule("zb", pp, m)
    assert [in_flight(zb, r)[0] for r in range(pp)] == [4, 3, 2, 1]  # 1F1B's activation limit
    assert [in_flight(zb, r)[1] for r in range(pp)] == [1, 2, 3, 4]  # W passes that wait


def test_compute_order_matches_built_lists():
    for name, v in (("1f1b", 1), ("interleaved", 2), ("zb", 1), ("zbv", 2)):
        s = build_schedule(name, 4, 8, v)
        assert compute_order(name, 4, 8, v) == tuple(tuple(s.compute_actions(r)) for r in range(4))


def _mutate(s: Schedule, rank: int, acts: list) -> Schedule:
    ranks = list(s.ranks)
    ranks[rank] = tuple(acts)
    return dataclasses.replace(s, ranks=tuple(ranks))


def test_checker_catches_broken_lists():
    """A checker that cannot fail proves nothing: corrupt a good schedule in four ways."""
    s = build_schedule("1f1b", 4, 8)
    acts = list(s.ranks[1])
    # 1. B before its F
    i_f = next(i for i, a in enumerate(acts) if a.kind == "F" and a.microbatch == 0)
    i_b = next(i for i, a in enumerate(acts) if a.kind == "B" and a.microbatch == 0)
    bad = acts.copy()
    bad[i_f], bad[i_b] = bad[i_b], bad[i_f]
    with pytest.raises(ScheduleError):
        check(_mutate(s, 1, bad))
    # 2. a send dropped
    bad = [a for a in acts if not (a.kind == "SEND_F" and a.microbatch == 3)]
    with pytest.raises(ScheduleError, match="unpaired"):
        check(_mutate(s, 1, bad))
    # 3. a micro-batch's backward missing
    bad = [a for a in acts if not (a.kind == "B" and a.microbatch == 5)]
    with pytest.raises(ScheduleError):
        check(_mutate(s, 1, bad))
    # 4. receives moved ahead of the sends they wait behind: rendezvous deadlock
    comm = [a for a in acts if not a.is_compute]
    recvs_first = sorted(comm, key=lambda a: not a.kind.startswith("RECV"))
    bad = recvs_first + [a for a in acts if a.is_compute]
    with pytest.raises(ScheduleError):
        check(_mutate(s, 1, bad))


def test_bad_requests_are_one_line_user_errors():
    for args in (("foo", 4, 8, 1), ("1f1b", 0, 8, 1), ("1f1b", 4, -1, 1), ("interleaved", 4, 8, 1),
                 ("interleaved", 4, 6, 2), ("interleaved", 1, 4, 2), ("1f1b", 4, 8, 2), ("zbv", 4, 8, 1),
                 ("zbv", 1, 8, 2)):
        with pytest.raises(UserError) as e:
            build_schedule(*args)
        assert "\n" not in str(e.value)
    assert check_args("ZB-H1", 4, 8, 1) == "zb" and check_args("ZB-V", 4, 8, 2) == "zbv"


@pytest.mark.parametrize("call,plan,train", [
    # each caller's own names: plait plan's flags, plait train's fields (rules.run_field)
    (lambda f: check_args("1f1b", 4, 8, 2, field=f), "--v = 2", "parallel.v = 2"),
    (lambda f: check_args("interleaved", 1, 8, 2, field=f), "--pp = 1", "parallel.pp = 1"),
    (lambda f: check_args("interleaved", 4, 6, 2, field=f), "--microbatches = 6", "parallel.microbatches = 6"),
    (lambda f: check_args("foo", 4, 8, 1, field=f), "--schedule = 'foo'", "parallel.schedule = 'foo'"),
    # more stage passes than plait schedules: refused at once (1000 x 10000 ran for minutes into GBs)
    (lambda f: check_args("1f1b", 1000, 10000, 1, field=f), "--microbatches = 10000", "parallel.microbatches = 10000"),
    (lambda f: check_no_pipeline("1f1b", 2, field=f), "--v = 2", "parallel.v = 2"),
    (lambda f: check_no_pipeline("zb", 1, field=f), "--schedule = 'zb'", "parallel.schedule = 'zb'"),
])
def test_schedule_errors_name_each_callers_knob(call, plan, train):
    for field, name, other in ((flag_field, plan, train), (run_field, train, plan)):
        with pytest.raises(UserError) as e:
            call(field)
        assert str(e.value).startswith(name) and other.split(" = ")[0] not in str(e.value)


def test_virtual_stages_without_a_pipeline_say_what_they_need():
    with pytest.raises(UserError) as e:
        check_no_pipeline("1f1b", 2)  # --v 2 given, --schedule not: 1f1b is only the default
    msg = str(e.value)
    assert msg.startswith("--v = 2:") and "--pp > 1" in msg and "--schedule interleaved" in msg
    check_no_pipeline("1f1b", 1)


def test_p2p_time_lengthens_the_pipeline():
    s = build_schedule("1f1b", 4, 8)
    assert simulate(s, p2p_s=0.1).makespan_s > simulate(s).makespan_s


def test_action_is_small_and_frozen():
    a = Action("F", 3, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.kind = "B"
    assert a.label(2) == "F3b" and a.label() == "F3"


def test_render_draws_every_rank():
    text = render(simulate(build_schedule("1f1b", 4, 4)))
    rows = text.splitlines()
    assert len(rows) == 4 and rows[0].startswith("rank  0 | F0 F1 F2 F3")
    assert "B3" in rows[3]


def test_schedule_command(capsys):
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert "bubble 27.27%" in out and "rank  3 |" in out and "no deadlock" in out
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved", "--v", "2"]) == 0
    assert "bubble 15.79%" in capsys.readouterr().out
    assert main(["schedule", "--pp", "4", "--microbatches", "6", "--schedule", "interleaved"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "multiple of 4" in err




def test_schedule_command_orders_zbv_by_the_costs_it_times(capsys):
    """ZB-V's order is list-scheduled over the stages' F/B/W costs: the command builds it with the
    --f/--b/--w it then simulates (it built it for equal costs: 29.41% here, not 11.11%)."""
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "zbv", "--b", "1.5", "--w", "0.5"]) == 0
    costs = ((0.5, 0.75, 0.25),) * 8  # per stage: a rank's two chunks share its --f, --b, --w
    want = simulate(build_schedule("zbv", 4, 8, 2, costs), unit_durations(0.5, 0.75, 0.25)).bubble_fraction
    assert f"bubble {want:.2%}" in capsys.readouterr().out and want < 0.12

@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_schedule_command_refuses_w_where_backward_is_not_split(name, capsys):
    # only zb and zbv time a separate W: elsewhere --w was silently ignored
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", name, "--w", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--w = 5.0: {name} has no separate weight-gradient pass" in err
    assert "--schedule zb or zbv" in err
    for split in ("zb", "zbv"):
        assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", split, "--w", "0.5"]) == 0
        assert "W = 0.5 per rank" in capsys.readouterr().out


def test_schedule_command_png_that_cannot_be_written_is_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "file").write_text("a file, not a folder")
    for png in (tmp_path / "s.txt", tmp_path / "file" / "s.png"):  # matplotlib's ValueError, an OSError
        assert main(["schedule", "--pp", "2", "--microbatches", "2", "--png", str(png)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--png = '{png}': cannot be written (" in err
        assert err.rstrip().endswith("use a .png, .pdf or .svg path")
    assert main(["schedule", "--pp", "2", "--microbatches", "2", "--png", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").stat().st_size > 0
    # a folder was written beside itself as folder.png, and said `wrote FOLDER`
    assert main(["schedule", "--pp", "2", "--microbatches", "2", "--png", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err and not tmp_path.with_suffix(".png").exists()


def test_schedule_command_png_in_a_missing_folder_is_refused_like_plot_out(tmp_path, capsys):
    """It created the missing folders (a typo in one left a new tree) where `plait plot --out` refuses."""
    png = tmp_path / "nope" / "deeper" / "s.png"
    assert main(["schedule", "--pp", "2", "--microbatches", "2", "--png", str(png)]) == 2
    out, err = capsys.readouterr()
    assert err == f"plait schedule: error: --png = '{png}': its folder {png.parent} does not exist; create it first\n"
    assert out == "" and not (tmp_path / "nope").exists()  # refused before the schedule was printed


def test_schedule_command_png_without_a_suffix_says_the_file_it_wrote(tmp_path, capsys):
    """matplotlib adds .png to a name without a suffix: `wrote` named a file that was not there."""
    pytest.importorskip("matplotlib")
    capsys.readouterr()
    assert main(["schedule", "--pp", "2", "--microbatches", "2", "--png", str(tmp_path / "timeline")]) == 0
    assert f"wrote {tmp_path / 'timeline.png'}" in capsys.readouterr().out
    assert (tmp_path / "timeline.png").stat().st_size > 0 and not (tmp_path / "timeline").exists()

def test_checker_finds_a_real_deadlock():
    """Rank 0 wants micro-batch 0's gradient before it sends micro-batch 1; rank 1 wants micro-batch
    1 before it sends that gradient: each waits on the other."""
    from plait.parallel.schedules import _with_p2p

    r0 = [[Action("F", 0)], [Action("B", 0)], [Action("F", 1)], [Action("B", 1)]]
    r1 = [[Action("F", 0)], [Action("F", 1)], [Action("B", 0)], [Action("B", 1)]]
    s = Schedule("custom", 2, 2, 1, False, (tuple(_with_p2p(r0, 0, 2, 1)), tuple(_with_p2p(r1, 1, 2, 1))))
    with pytest.raises(ScheduleError, match="deadlock"):
        check(s)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(s)


def _spans(tl, delay=None):
    """A simulated timeline as the executor records spans (rank, start, end, kind, micro-batch,
    chunk); `delay(span)` shifts a span later, as a late message would."""
    out = []
    for s in tl.spans:
        shift = delay(s) if delay else 0.0
        out.append((s.rank, s.start_s + shift, s.end_s + shift, s.action.kind, s.action.microbatch, s.action.chunk))
    return out


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved", 2), ("zb", 1)])
def test_replayed_bubble_separates_unequal_stages_from_waiting(name, v):
    """Replaying measured action times through the schedule gives the bubble the stages' costs force:
    equal to the measured bubble when nothing else waited, unchanged when messages arrive late (the
    measured bubble grows), and above the equal-cost simulation when the last stage is slower."""
    from plait import timeline as tl

    sched = build_schedule(name, 4, 8, v)
    slow_last = simulate(sched, lambda r, a: (2.0 if r == 3 else 1.0) * (1.0 if a.kind == "F" else 2.0 / (1 + sched.split_backward)))
    spans = _spans(slow_last)
    assert tl.replayed_bubble(spans, sched) == pytest.approx(slow_last.bubble_fraction, abs=1e-12)
    assert tl.bubble(spans, 4) == pytest.approx(slow_last.bubble_fraction, abs=1e-12)
    assert slow_last.bubble_fraction > simulate(sched).bubble_fraction + 0.05
    # a transfer stalls the pipeline for 4.0 at mid-step: every action from there on starts later
    mid = slow_last.makespan_s / 2
    late = _spans(slow_last, lambda s: 4.0 if s.start_s >= mid else 0.0)
    assert tl.bubble(late, 4) > tl.bubble(spans, 4) + 0.01
    assert tl.replayed_bubble(late, sched) == pytest.approx(slow_last.bubble_fraction, abs=1e-12)


def test_measured_split_moves_layers_off_a_slow_head():
    """From measured stage times (8b at PP 4 on 4 x H200: a layer 4.5 ms, the head and loss 17 ms, the
    FLOP-balanced split 8,9,9,6) the fitted split takes layers off the last stage; the fit recovers
    the costs it was given, and a balanced run gets no advice."""
    from plait import timeline as tl
    from plait.parallel.stages import measured_split

    layer, head = 4.5e-3, 17e-3
    counts = [8, 9, 9, 6]
    now = [n * layer + (head if s == 3 else 0.0) for s, n in enumerate(counts)]
    best, times = measured_split(now, counts)
    assert best == [9, 9, 9, 5] and max(times) == pytest.approx(9 * layer)
    assert times[3] == pytest.approx(5 * layer + head)
    # the same times as a timeline's spans: one F and one B per micro-batch and stage
    m = 4
    spans = [(r, 0.0, now[r] / 2, k, mb, 0) for r in range(4) for mb in range(m) for k in ("F", "B")]
    advice = tl.split_advice(spans, 4, 1, m, counts)
    assert advice["suggested_stage_layers"] == "9,9,9,5" and advice["stage_ms"][3] == pytest.approx(44.0)
    even = [9 * layer, 9 * layer, 9 * layer, 5 * layer + head]
    spans = [(r, 0.0, even[r], "F", mb, 0) for r in range(4) for mb in range(m)]
    assert "suggested_stage_layers" not in tl.split_advice(spans, 4, 1, m, [9, 9, 9, 5])
    # an embedding that costs layers' time moves layers off the first stage too
    first = [8 * layer + 3 * layer, 8 * layer, 8 * layer, 8 * layer]
    assert measured_split(first, [8, 8, 8, 8])[0][0] < 8


def test_a_schedule_too_large_to_build_is_one_line_at_once(capsys):
    """pp x v x micro-batches above `MAX_STAGE_MICROBATCHES` is refused before anything is built,
    with the most micro-batches that would do; the largest allowed still builds."""
    from plait.parallel.schedules import MAX_STAGE_MICROBATCHES

    assert main(["schedule", "--pp", "1000", "--microbatches", "10000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use at most 1,048 micro-batches at pp x v = 1000" in err[0], err
    assert check_args("1f1b", 2, MAX_STAGE_MICROBATCHES // 2, 1) == "1f1b"


def test_a_timelines_equal_cost_bubble_is_the_schedule_commands():
    """A run's ZB-V order follows its stages' costs; its report's "simulated with equal costs" bubble
    simulated that order with equal costs (11.1% at pp 2, m 4) where `plait schedule` says 7.7%."""
    from plait import timeline as tl
    from plait.parallel.schedules import build_schedule
    from plait.planner.simulate import simulate

    costs = ((1.0, 1.0, 1.0), (1.0, 1.0, 1.0), (1.0, 1.0, 1.0), (4.0, 4.0, 1.0))  # a heavy head on the last stage
    ran = build_schedule("zbv", 2, 4, 2, costs)
    equal = build_schedule("zbv", 2, 4, 2)
    assert ran.ranks != equal.ranks  # the costs changed the order
    spans = [(s.rank, s.start_s, s.end_s, s.action.kind, s.action.microbatch, s.action.chunk) for s in simulate(ran).spans]
    got = tl.report(spans, ran, [1, 1, 1, 1])["simulated_bubble"]
    assert got == pytest.approx(simulate(equal).bubble_fraction) and got == pytest.approx(1 / 13)
