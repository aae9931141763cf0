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
PP8 = ["--pp", "8", "--dp", "1", "--microbatches", "8", "--train.micro_batch", "1"]
LAYOUTS = {  # name: (layers, arguments); two chunks a rank (v = 2) need 16 layers for 8 ranks
    "tp8": (8, ["--tp", "8", "--dp", "1", "--train.micro_batch", "8"]),
    "pp8-1f1b": (8, [*PP8, "--schedule", "1f1b"]),
    "pp8-zb": (8, [*PP8, "--schedule", "zb"]),
    "pp8-interleaved": (16, [*PP8, "--schedule", "interleaved", "--parallel.v", "2"]),
    "pp8-zbv": (16, [*PP8, "--schedule", "zbv", "--parallel.v", "2"]),
    "tp4-dp2-zero3": (8, ["--tp", "4", "--dp", "2", "--zero", "3", "--train.micro_batch", "4"]),
    "cp2-tp4": (8, ["--cp", "2", "--tp", "4", "--dp", "1", "--train.micro_batch", "8"]),
}


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory):
    """The one-process run of each model depth, made when a layout first needs it."""
    made = {}

    def reference(layers: int):
        if layers not in made:
            made[layers] = tmp_path_factory.mktemp(f"eight{layers}") / "one"
            assert main(cli_train(corpus, made[layers], dict(M8, n_layers=layers), 3, ["--train.micro_batch", "8"])) == 0
        return made[layers]

    return reference


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_eight_process_layout_trains_as_one_process(corpus, tmp_path, references, name):
    layers, args = LAYOUTS[name]
    out = tmp_path / name
    assert main(cli_train(corpus, out, dict(M8, n_layers=layers), 3, ["--nproc", "8", *args])) == 0
    if "--parallel.v" in args:
        assert "v = 2" in (out / "config.toml").read_text()  # two chunks a rank, as asked
    assert_same_cli_run(out, references(layers), 3)
