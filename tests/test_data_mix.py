"""`--data.mix`: several prepared folders drawn by weight, a pure function of (seed, step) that
every data-parallel layout slices the same way; one-line errors for bad mixes."""

import numpy as np
import pytest
import torch

from plait.config import DataConfig, build_config
from plait.data import MixedData, TokenData, open_data, parse_mix
from plait.prepare import prepare
from plait.errors import UserError
from plait.tokenizer import ByteTokenizer
from plait.validate import validate_config

KW = dict(seq_len=16, seed=11)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Three prepared folders whose most common byte says where a window came from: 'aaa0aaa1...'."""
    root = tmp_path_factory.mktemp("mix")
    out = {}
    for letter in "abc":
        src = root / f"src_{letter}"
        src.mkdir()
        for i in range(6):
            (src / f"{i}.txt").write_text("".join(f"{letter * 3}{j % 10}" for j in range(75 + 12 * i)))
        out[letter] = prepare([str(src)], root / letter, ByteTokenizer(), val_fraction=0.3, quiet=True)
    return out


def _sources(x: torch.Tensor) -> list[str]:
    """The folder of each row: its most common byte ('\\n' ends documents)."""
    return [chr(int(torch.mode(row).values)) for row in x]


def test_each_step_takes_floor_or_ceil_of_its_share_and_the_long_run_share_is_the_weight(folders):
    mix = MixedData(f"{folders['a']}:0.7,{folders['b']}:0.2,{folders['c']}:0.1")
    counts = []
    for step in range(300):
        x, _ = mix.batch(step, 0, micro_batch=10, grad_accum=1, dp_rank=0, dp_size=1, **KW)
        src = _sources(x)
        counts.append([src.count(k) for k in "abc"])
    counts = np.array(counts)
    assert set(counts[:, 0]) == {7} and set(counts[:, 1]) == {2} and set(counts[:, 2]) == {1}
    # weights that do not divide the batch: each step gets floor or ceil, the mean is the weight
    mix = MixedData(f"{folders['a']}:2,{folders['b']}:1")  # relative weights: 2/3 and 1/3
    shares = []
    for step in range(300):
        x, _ = mix.batch(step, 0, micro_batch=4, grad_accum=1, dp_rank=0, dp_size=1, **KW)
        shares.append(_sources(x).count("a"))
    assert set(shares) <= {2, 3} and abs(np.mean(shares) / 4 - 2 / 3) < 0.02


def test_a_small_weight_is_not_starved(folders):
    mix = MixedData(f"{folders['a']}:0.95,{folders['b']}:0.05")
    seen = [_sources(mix.batch(s, 0, micro_batch=2, grad_accum=1, dp_rank=0, dp_size=1, **KW)[0]).count("b")
            for s in range(400)]
    assert abs(np.mean(seen) / 2 - 0.05) < 0.015  # unbiased even where w * batch < 1


def test_the_global_batch_is_the_same_at_every_layout_and_on_resume(folders):
    spec = f"{folders['a']}:0.5,{folders['b']}:0.3,{folders['c']}:0.2"
    mix = MixedData(spec)
    one = torch.cat([mix.batch(7, m, micro_batch=2, grad_accum=4, dp_rank=0, dp_size=1, **KW)[0] for m in range(4)])
    # 2 ranks x 2 micro-steps of 2, and 4 ranks x 1 micro-step of 2: the same 8 windows in order
    two = torch.cat([mix.batch(7, m, micro_batch=2, grad_accum=2, dp_rank=r, dp_size=2, **KW)[0]
                     for m in range(2) for r in range(2)])
    four = torch.cat([mix.batch(7, 0, micro_batch=2, grad_accum=1, dp_rank=r, dp_size=4, **KW)[0] for r in range(4)])
    assert torch.equal(one, two) and torch.equal(one, four)
    # a resumed run opens the folders afresh and asks for step 7: the same rows
    again = MixedData(spec).batch(7, 3, micro_batch=2, grad_accum=4, dp_rank=0, dp_size=1, **KW)
    assert torch.equal(again[0], one[6:]) and torch.equal(again[1][:, :-1], one[6:, 1:])
    assert not torch.equal(mix.batch(8, 0, micro_batch=8, grad_accum=1, dp_rank=0, dp_size=1, **KW)[0], one)


def test_folders_of_equal_size_do_not_draw_the_same_offsets(tmp_path):
    starts = []
    for name in ("x", "y"):
        src = tmp_path / f"src_{name}"
        src.mkdir()
        letters = np.random.default_rng(0).integers(97, 123, 20000)  # identical corpora
        (src / "0.txt").write_text(bytes(letters.astype(np.uint8)).decode())
        starts.append(prepare([str(src / "0.txt")], tmp_path / name, ByteTokenizer(), quiet=True))
    mix = MixedData(f"{starts[0]}:1,{starts[1]}:1")
    x, _ = mix.batch(0, 0, micro_batch=16, grad_accum=1, dp_rank=0, dp_size=1, **KW)
    rows = {tuple(r.tolist()) for r in x}
    assert len(rows) == 16  # same data, same seed: only per-folder streams keep the rows distinct


def test_validation_and_documents_come_from_every_folder(folders):
    mix = MixedData(f"{folders['a']}:0.5,{folders['b']}:0.5")
    vals = list(mix.val_batches(3, micro_batch=4, dp_rank=0, dp_size=1, **KW))
    assert sorted(set(sum((_sources(x) for x, _ in vals), []))) == ["a", "b"]
    assert [torch.equal(x, y) for (x, _), (y, _) in zip(vals, mix.val_batches(3, micro_batch=4, dp_rank=0,
                                                                                dp_size=1, **KW))] == [True] * 3
    kw = dict(micro_batch=8, grad_accum=1, dp_rank=0, dp_size=1, **KW)
    x, _ = mix.batch(2, 0, **kw)
    ids = mix.batch_documents(2, 0, **kw)
    assert torch.equal(ids[:, 1:] != ids[:, :-1], x[:, :-1] == ord("\n"))
    mix.check(256, 16)
    with pytest.raises(UserError, match="model.vocab_size"):
        mix.check(100, 16)
    assert mix.tokenizer().spec == {"kind": "byte"}


def test_open_data_picks_the_mix_or_the_folder(folders):
    assert isinstance(open_data(DataConfig(mix=f"{folders['a']}:1,{folders['b']}:3")), MixedData)
    assert isinstance(open_data(DataConfig(path=str(folders["a"]))), TokenData)


@pytest.mark.parametrize("spec, needle", [
    ("A", "entry 'A' has no weight; write DIR:WEIGHT"),
    ("A:0.5,B:0", "weight 0 of B must be a positive number"),
    ("A:-1", "weight -1 of A must be a positive number"),
    ("A:nan", "weight nan of A must be a positive number"),
    ("A:lots", "weight 'lots' of A is not a number"),
    ("A:1,A:2", "names A twice"),
    (" , ", "names no folder"),
    # each finite, their sum not: every weight became 0 after normalizing, silently
    ("A:1e308,B:1e308", "weights sum past the largest number; only their ratios count"),
])
def test_bad_mixes_are_one_line(spec, needle):
    with pytest.raises(UserError) as e:
        parse_mix(spec)
    assert str(e.value).startswith("data.mix = ") and needle in str(e.value) and "\n" not in str(e.value)


def test_validate_checks_the_mix_before_anything_runs(folders):
    with pytest.raises(UserError, match="data.mix = .*weight 0 of"):
        validate_config(build_config({"data": {"mix": f"{folders['a']}:0"}}))
    with pytest.raises(UserError, match="data.mix = .*is set beside data.path"):
        validate_config(build_config({"data": {"mix": f"{folders['a']}:1", "path": str(folders["b"])}}))


def test_folders_must_share_the_tokenizer(folders, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from plait.tokenizer import train_bpe

    tok = train_bpe(["abc " * 50], 270, tmp_path / "tok.json")
    other = prepare([str(tmp_path / "tok.json")], tmp_path / "hf", tok, quiet=True)
    with pytest.raises(UserError, match=r"data.mix = .*hf was prepared with another tokenizer or vocabulary"):
        MixedData(f"{folders['a']}:1,{other}:1")
    with pytest.raises(UserError, match="data.mix = .*meta.json missing"):
        MixedData(f"{folders['a']}:1,{tmp_path / 'nowhere'}:1")
    assert tokenizers  # the library trained the tokenizer above


def test_a_folder_too_short_for_the_sequence_is_named(folders):
    """Which of the mix's folders is too short (the line blamed train.seq_len without naming it)."""
    mix = MixedData(f"{folders['a']}:1,{folders['b']}:1")
    with pytest.raises(UserError) as e:
        mix.check(256, 100_000)
    assert str(e.value).startswith("train.seq_len = 100000: is longer than the train split of ") and \
        str(folders["a"]) in str(e.value)
