"""`plait eval --checkpoint RUN_OR_HF_DIR [--data DIR]`: held-out loss and perplexity of a checkpoint.

Without --data a plait checkpoint is evaluated on the data its run trained on (its config's
data.path, the built-in corpus of the default job included); an HF folder or a run that drew from a
mix (data.mix) names no one folder, so it needs --data.

The windows are `TokenData.val_batches` with the run's seed, sequence length and validation set
(train.eval_batches global batches, read a micro-batch at a time) unless overridden, i.e. the
windows the run itself validated on at whatever layout it ran: a checkpoint's `val_loss` is
reproduced (to rounding, and where the run validated in FP8 to FP8's error: evaluation runs the
plain matmuls), and two checkpoints evaluated on the same folder with the same flags see the same
tokens. Checkpoints saved before validation read whole global batches logged their loss over
eval_batches micro-batches per rank, fewer windows than this default reads.
"""

from __future__ import annotations

NAME = "eval"
HELP = "held-out loss and perplexity of a checkpoint (any layout, or a HuggingFace Llama folder) on prepared data"


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="a step_XXXXXXXX folder, a run folder (newest valid checkpoint) or a HuggingFace Llama folder")
    p.add_argument("--data", default="", help="a folder made by `plait data prepare`; its validation split is read "
                   "(default: the data the checkpoint's run trained on)")
    p.add_argument("--batches", type=int, default=None, help="batches to average (default: the run's validation set, train.eval_batches global batches)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per batch (default: the run's train.micro_batch)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the run's train.seq_len; an HF folder's: "
                   "256, or its max_position_embeddings if shorter)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")


def run(args, extra) -> int:
    from plait.launch_env import one_process

    one_process("eval")
    from plait.data import TokenData
    from plait.errors import bad_value

    for flag in ("batches", "batch_size", "seq_len"):  # 0 read as "the run's value" where a user typed it
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise bad_value(f"--{flag.replace('_', '-')}", getattr(args, flag), "must be a positive integer (leave it "
                            "out for the run's value)")
        setattr(args, flag, getattr(args, flag) or 0)
    path = args.data or run_data(args.checkpoint)
    data = TokenData(path, field="--data")  # before the model: a wrong folder costs no loading
    r = evaluate(args.checkpoint, data, batches=args.batches, batch_size=args.batch_size,
                 seq_len=args.seq_len, device=args.device)
    print(f"{r['checkpoint']} on {path} (validation): loss {r['loss']:.4f}, perplexity {r['perplexity']:.3f} "
          f"over {r['tokens']:,} tokens ({r['batches']} batch{'es' if r['batches'] != 1 else ''} x {r['batch_size']} "
          f"x {r['seq_len']}){_repeats(r, data)}")
    return 0


def _repeats(r: dict, data) -> str:
    """Where the windows scored outnumber the held-out tokens, say so: they were drawn from fewer
    tokens, each scored several times (the loss is still the mean over the split's windows)."""
    held = data.splits["val"].tokens
    return f", windows drawn from {held:,} held-out tokens, some scored more than once" if r["tokens"] > held else ""


def run_data(checkpoint: str) -> str:
    """The prepared folder a plait checkpoint's run trained on. Read from its saved config alone:
    `evaluate` verifies the checkpoint's files, and a second sha256 pass over a large checkpoint
    would double the wait."""
    import json
    from pathlib import Path

    from plait import checkpoint as ckpt
    from plait import hf
    from plait.errors import bad_value
    from plait.resume import saved_config

    if hf.is_hf_dir(checkpoint):
        raise bad_value("--data", "", f"{checkpoint} is a HuggingFace folder, which records no training data; "
                        "give --data DIR (a folder made by `plait data prepare`)")
    p = Path(checkpoint).expanduser()
    state = p / "train_state.json"  # a step folder; else a run folder's saved config
    saved = json.loads(state.read_text())["config"] if state.is_file() else (saved_config(p) or (None,))[0]
    if saved is None:
        ckpt.resolve_for_reading(checkpoint)  # nothing there: the checkpoint's own one-line error
        raise bad_value("--data", "", f"{checkpoint} records no training data; give --data DIR")
    data = saved["data"]
    if data.get("mix"):
        raise bad_value("--data", "", f"the run drew from several folders (data.mix = {data['mix']!r}); "
                        "give --data DIR, one of them")
    return data["path"]


def _global_batch(folder, t) -> int:
    """Sequences per optimizer step of the run whose checkpoint `folder` was read (resolved and
    verified once: resolving it again hashed the checkpoint twice and said each skipped one twice);
    an HF folder records none: one micro-batch."""
    import json

    state = folder / "train_state.json"
    if not state.is_file():
        return t.micro_batch
    return int(json.loads(state.read_text()).get("global_batch") or t.micro_batch * t.grad_accum)


def evaluate(checkpoint: str, data, *, batches: int = 0, batch_size: int = 0, seq_len: int = 0,
             device: str = "cpu") -> dict:
    """Mean next-token loss over the validation windows, and perplexity = exp(loss).

    Every batch has batch_size x seq_len targets, so the mean of batch means is the mean over all
    tokens. Read-only: the checkpoint is loaded for inference only.
    """
    import math

    import torch

    from plait.errors import bad_value
    from plait.tokenizer import same_tokenizer
    from plait.train import model_from_checkpoint

    from plait.commands.generate import _device

    device = _device(device)  # a name torch does not know (mps, foo) is one line too, not a traceback
    model, tokenizer, cfg, folder = model_from_checkpoint(checkpoint, device)
    if data.vocab_size > cfg.model.vocab_size:
        raise bad_value("--data", str(data.path), f"has vocabulary {data.vocab_size}, larger than the model's "
                        f"{cfg.model.vocab_size}; use data prepared with the model's tokenizer")
    # an HF folder that does not say which tokenizer it had (tokenizer None): trust the vocab check
    if tokenizer is not None and not same_tokenizer(tokenizer, data):
        raise bad_value("--data", str(data.path), "was prepared with another tokenizer than the checkpoint's; "
                        "prepare it with the model's tokenizer.json")
    t = cfg.train
    if not batches:  # the run's validation set: eval_batches of its global batch, a micro-batch at a time
        batches = max(1, -(-t.eval_batches * _global_batch(folder, t) // (batch_size or t.micro_batch)))
    # an HF folder records no training length: the trainer's default one may exceed its
    # max_position_embeddings (a plait run's train.seq_len never exceeds its max_seq_len)
    batch_size, seq_len = batch_size or t.micro_batch, seq_len or min(t.seq_len, cfg.model.max_seq_len)
    if seq_len > cfg.model.max_seq_len:
        raise bad_value("--seq-len", seq_len, f"exceeds the model's max_seq_len {cfg.model.max_seq_len}; use a shorter one")
    if not data.has_val:  # else the length check below would blame --seq-len for a split of 0 tokens
        raise bad_value("--data", str(data.path), "has no validation split (prepared with --val-fraction 0); prepare "
                        "it again with --val-fraction above 0")
    longest = max((len(s) for s in data.splits["val"].shards), default=0)
    if longest < seq_len + 1:
        raise bad_value("--seq-len", seq_len, f"is longer than the validation split of {data.path} "
                        f"({longest} tokens in its largest shard); use a shorter --seq-len")
    model.eval()
    losses = []
    # a run trained with data.document_mask validated with it: each token attends within its
    # document only (without it, eval gave another loss than the run's val_loss)
    mask = bool(cfg.data.document_mask)
    with torch.no_grad():
        for batch in data.val_batches(batches, micro_batch=batch_size, dp_rank=0, dp_size=1, seq_len=seq_len,
                                      seed=t.seed, documents=mask):
            x, y, docs = (*batch, None)[:3]
            losses.append(model(x.to(device), y.to(device),
                                docs=None if docs is None else docs.to(device)).float().item())
    loss = sum(losses) / len(losses)
    return {"checkpoint": str(folder), "loss": loss, "perplexity": math.exp(loss),
            "tokens": batches * batch_size * seq_len, "batches": batches, "batch_size": batch_size, "seq_len": seq_len}
