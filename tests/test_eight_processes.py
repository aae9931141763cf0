"""The 8-process layouts of a full node, on CPU: TP 8 (two key/value heads replicated over eight
ranks), PP 8 with 1F1B and with ZB-H1 (one layer a stage), PP 8 interleaved and ZB-V (two chunks
a rank, a 16-layer model), TP 4 x ZeRO-3 over DP 2, and CP 2 x TP 4
(two query heads a rank, the ring over pairs), each end to end through `plait train` against one process on the same global batch of 8
sequences: the same losses and the same weights. (HSDP x TP is in test_tp_train.py; PP 2 x TP 2 x
DP 2 in test_pipeline.py; CP 2 x TP 2 x PP 2 in test_context_parallel.py.)"""

from __future__ import annotations

import pytest

from dp_runs import assert_same_cli_run, cli_train
from plait.cli import main

M8 = {"preset": "custom", "vocab_size": 259, "dim": 64, "n_layers": 8, "n_heads": 8, "n_kv_heads": 2,
      "ffn_dim": 96, "max_seq_len": 64}
LAYOUTS = {
    "tp8": ["--tp", "8", "--dp", "1", "--train.micro_batch", "8"],
    "pp8-1f1b": ["--pp", "8", "--dp", "1", "--schedule", "1f1b", "--microbatches", "8", "--train.micro_batch", "1"],
    "pp8-zb": ["--pp", "8", "--dp", "1", "--schedule", "zb", "--microbatches", "8", "--train.micro_batch", "1"],
    "tp4-dp2-zero3": ["--tp", "4", "--dp", "2", "--zero", "3", "--train.micro_batch", "4"],
    "cp2-tp4": ["--cp", "2", "--tp", "4", "--dp", "1", "--train.micro_batch", "8"],
}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("eight") / "one"
    assert main(cli_train(corpus, out, M8, 3, ["--train.micro_batch", "8"])) == 0
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_eight_process_layout_trains_as_one_process(corpus, tmp_path, reference, name):
    out = tmp_path / name
    assert main(cli_train(corpus, out, M8, 3, ["--nproc", "8", *LAYOUTS[name]])) == 0
    assert_same_cli_run(out, reference, 3)


M16 = dict(M8, n_layers=16)
V2 = {
    "pp8-interleaved": ["--pp", "8", "--dp", "1", "--schedule", "interleaved", "--parallel.v", "2",
                        "--microbatches", "8", "--train.micro_batch", "1"],
    "pp8-zbv": ["--pp", "8", "--dp", "1", "--schedule", "zbv", "--parallel.v", "2", "--microbatches", "8",
                "--train.micro_batch", "1"],
}


@pytest.fixture(scope="module")
def reference16(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("eight16") / "one"
    assert main(cli_train(corpus, out, M16, 3, ["--train.micro_batch", "8"])) == 0
    return out


@pytest.mark.parametrize("name", list(V2))
def test_eight_ranks_of_two_chunks_train_as_one_process(corpus, tmp_path, reference16, name):
    out = tmp_path / name
    assert main(cli_train(corpus, out, M16, 3, ["--nproc", "8", *V2[name]])) == 0
    assert "v = 2" in (out / "config.toml").read_text()  # two chunks a rank, as asked
    assert_same_cli_run(out, reference16, 3)

