"""An untied embedding looked up from its fp32 master (`plait.parallel.embedding_master`): no 16-bit
copy of the table exists, and training, evaluation and checkpoints are bit for bit what they were
with the copy."""

import torch

from plait.config import Config, ModelConfig, TrainConfig
from plait.model import build_model
from plait.parallel import embedding_master
from plait.parallel.data_parallel import apply_data_parallel

CFG = ModelConfig(preset="custom", vocab_size=97, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=96,
                  max_seq_len=64, tie_embeddings=False)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 97, (2, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _engine(monkeypatch, master_only: bool, model_cfg=CFG):
    if not master_only:
        monkeypatch.setattr(embedding_master, "master_only_name", lambda *a: None)
    else:
        monkeypatch.undo()
    model = build_model(model_cfg, seed=0).to(torch.bfloat16)
    cfg = Config(model=model_cfg, train=TrainConfig(lr=1e-2, grad_clip=0.5, weight_decay=0.1))
    return model, apply_data_parallel(model, cfg)


def _train(model, engine, steps=3):
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for micro in range(2):  # two backwards a step: the second adds into the first's piece
            x, y = _batch(10 * step + micro)
            loss = model(x, y)
            loss.backward()
            total += loss.detach().float()
        _, norm = engine.step(1e-2, total)
        losses.append(total)
        norms.append(norm)
    return torch.stack(losses), torch.stack(norms)


def test_no_16bit_copy_of_the_table_and_the_same_training_bit_for_bit(monkeypatch, tmp_path):
    runs = []
    for master_only in (False, True):
        model, engine = _engine(monkeypatch, master_only)
        flat, opt = engine.opt.flat, engine.opt
        table = CFG.vocab_size * CFG.dim
        if master_only:
            assert flat.data.numel() == flat.numel - table  # the copy's 2 bytes a table element are gone
            assert model.embed.weight.dtype == torch.float32
            assert model.embed.weight.untyped_storage().data_ptr() == opt.master.untyped_storage().data_ptr()
        else:
            assert flat.data.numel() == flat.numel and model.embed.weight.dtype == torch.bfloat16
        losses, norms = _train(model, engine)
        with torch.no_grad():  # evaluation's lookup: the same rows in the compute dtype
            logits = model(_batch(99)[0])
        runs.append((losses, norms, opt.master.clone(), logits, engine))
    (l0, n0, m0, g0, _), (l1, n1, m1, g1, eng) = runs
    assert torch.equal(l0, l1) and torch.equal(n0, n1)
    assert torch.equal(m0, m1) and torch.equal(g0, g1)
    # a checkpoint saved and loaded again: the table's master reached through the parameter
    eng.save(tmp_path)
    eng.opt.master.zero_()
    eng.load(tmp_path)
    assert torch.equal(eng.opt.master, m1)
    assert torch.equal(eng.model.embed.weight.reshape(-1), m1[_slot(eng.opt.flat)])


def _slot(flat):
    s = flat.slots[flat.hole_index]
    return slice(s.offset, s.offset + s.numel)


def test_a_step_whose_backward_never_reaches_the_table_updates_it_with_zeros(monkeypatch):
    """The piece of a table no backward reached reads zeros (not the last step's gradient)."""
    model, engine = _engine(monkeypatch, True)
    _train(model, engine, steps=1)
    flat = engine.opt.flat
    x, y = _batch(5)
    with torch.no_grad():
        h = model.embed(x)
    model.hidden(None, h.requires_grad_(False)).sum().backward()  # the blocks only
    flat.settle()
    assert flat._grads[flat.hole_index] is not None and not flat._grads[flat.hole_index].any()


def test_tied_tensor_split_or_fp32_tables_keep_their_copy():
    tied = build_model(ModelConfig(**{**CFG.__dict__, "tie_embeddings": True}), seed=0).to(torch.bfloat16)
    from plait.parallel.engine import TensorSplit

    assert embedding_master.master_only_name(tied, TensorSplit(), 1) is None  # the output head's matmul reads it
    untied = build_model(CFG, seed=0)
    assert embedding_master.master_only_name(untied, TensorSplit(), 1) is None  # fp32: its own master
    untied = untied.to(torch.bfloat16)
    assert embedding_master.master_only_name(untied, TensorSplit(), 2) is None  # vocabulary-parallel
    assert embedding_master.master_only_name(untied, TensorSplit(), 1) == "embed.weight"


def test_a_pipelines_first_stage_in_bf16_trains_the_table_as_one_process_does(corpus, tmp_path):
    """`plait train --pp 2 --train.dtype bf16` (untied): the first stage's engine has no data-parallel
    peer, so its table has no 16-bit copy and its gradient reaches the master through the lookup.
    The table after four steps is where one fp32 process takes it (no lookup from a master there:
    fp32 parameters are their own), up to bf16's rounding; a table whose gradient never landed
    would have moved by its weight decay alone."""
    from dp_runs import cli_train
    from plait.cli import main
    from plait.parallel.sharded_state import full_weights

    model = {"preset": "custom", "vocab_size": 259, "dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
             "ffn_dim": 64, "max_seq_len": 64, "tie_embeddings": "false"}
    common = ["--train.dtype", "bf16", "--train.micro_batch", "2", "--train.lr", "3e-3", "--checkpoint.every", "4"]
    one, pp = tmp_path / "one", tmp_path / "pp"
    fp32 = [c if c != "bf16" else "fp32" for c in common]
    assert main(cli_train(corpus, one, model, 4, [*fp32, "--train.grad_accum", "2"])) == 0
    assert main(cli_train(corpus, pp, model, 4, [*common, "--nproc", "2", "--pp", "2", "--microbatches", "2"])) == 0

    def table(run):
        return full_weights(sorted((run / "checkpoints").iterdir())[-1])["embed.weight"]

    start = build_model(ModelConfig(**{**model, "tie_embeddings": False}), seed=0).embed.weight.detach()  # by (seed, name)
    a, b = table(one), table(pp)
    moved = (a - start).norm()
    assert (b - a).norm() < 0.25 * moved, ((b - a).norm(), moved)  # 0.09 measured; 1.0 with no gradient
