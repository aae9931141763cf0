"""`plait train --tp` end to end: a run saved at (dp 4, ZeRO-3) resumes at (tp 2 x dp 2, ZeRO-1) and
on one process with the losses of an uninterrupted run; the tensor-parallel run samples text at the
end (every tp rank generating together) and its checkpoint serves `plait generate` and `hf export`."""

from __future__ import annotations

import shutil

import pytest
import torch

from dp_runs import assert_same_cli_run, cli_train
from plait.cli import main
from plait.parallel.sharded_state import full_weights

TPM = {"preset": "custom", "vocab_size": 259, "dim": 48, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
       "ffn_dim": 96, "max_seq_len": 64}


def _args(corpus, out, steps=6, extra=()):
    return cli_train(corpus, out, TPM, steps, extra)


def test_resume_across_tensor_parallel_layouts(corpus, tmp_path, capfd):
    one = tmp_path / "one"
    assert main(_args(corpus, one, extra=["--train.micro_batch", "4"])) == 0
    run = tmp_path / "run"
    assert main(_args(corpus, run, extra=["--nproc", "4", "--dp", "4", "--zero", "3", "--train.micro_batch", "1",
                                          "--train.max_steps_this_run", "3"])) == 0
    solo = tmp_path / "solo"
    shutil.copytree(run, solo)
    # steps 4-6 at tp 2 x dp 2 with ZeRO-1 and SP, sampling at the end on both tp ranks together
    assert main(_args(corpus, run, extra=["--nproc", "4", "--tp", "2", "--dp", "2", "--zero", "1",
                                          "--train.micro_batch", "2", "--train.sample_tokens", "8", "--resume"])) == 0
    assert main(_args(corpus, solo, extra=["--nproc", "1", "--dp", "1", "--zero", "0", "--train.micro_batch", "4",
                                           "--resume"])) == 0
    for folder in (run, solo):
        assert_same_cli_run(folder, one, 6)
    files = sorted(f.name for f in (run / "checkpoints" / "step_00000006").iterdir())
    assert "model.shard003-of-004.pt" in files and "model.pt" not in files  # 2 shards x 2 tp ranks
    out = capfd.readouterr()
    assert "--- sample ---" in out.err
    # the sharded, strided tensor-parallel checkpoint serves inference and export as one model
    assert main(["generate", "--checkpoint", str(run), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert capfd.readouterr().out.startswith("def ")
    pytest.importorskip("safetensors")
    assert main(["hf", "export", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 0
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    embed = exported["model.embed_tokens.weight"]  # in the export's dtype
    assert torch.equal(embed, full_weights(run / "checkpoints" / "step_00000006")["embed.weight"].to(embed.dtype))


@pytest.mark.parametrize("extra, needle", [
    (["--nproc", "2", "--tp", "2", "--model.n_heads", "6", "--model.n_kv_heads", "3"],
     "parallel.tp = 2: and the 3 key/value heads must divide one another (each rank holds kv_heads/tp heads, or "
     "tp/kv_heads ranks share one); choose one of 1"),
    (["--nproc", "4", "--tp", "4", "--model.ffn_dim", "98"], "parallel.tp = 4: must divide the MLP width 98"),
    (["--nproc", "2", "--tp", "2", "--parallel.sp", "sometimes"], "parallel.sp = 'sometimes': choose auto, on, off"),
    (["--nproc", "2", "--tp", "2", "--train.recompute", "half"], "train.recompute = 'half': choose none, selective, full"),
])
def test_bad_tensor_parallel_input_is_one_line(corpus, tmp_path, capfd, extra, needle):
    assert main(_args(corpus, tmp_path / "r", extra=extra)) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_hsdp_x_tp_on_eight_processes_trains_as_one_process(corpus, tmp_path):
    """HSDP (2 replicas x ZeRO-3 over 2 shards) x TP 2 with SP: 8 gloo processes, the same global
    batch of 4 sequences as one process, the same losses and weights."""
    one, hsdp = tmp_path / "one", tmp_path / "hsdp"
    assert main(_args(corpus, one, steps=3, extra=["--train.micro_batch", "4"])) == 0
    assert main(_args(corpus, hsdp, steps=3, extra=["--nproc", "8", "--tp", "2", "--dp", "2", "--parallel.dp_replicate",
                                                   "2", "--zero", "3", "--train.micro_batch", "1"])) == 0
    assert_same_cli_run(hsdp, one, 3)
