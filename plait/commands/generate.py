"""`plait generate`: sample text from a checkpoint."""

from __future__ import annotations

NAME = "generate"
HELP = "sample text from a trained checkpoint"


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True, help="a step_XXXXXXXX folder, a run folder (newest valid checkpoint) or a HuggingFace model folder")
    p.add_argument("--prompt", default="def ", help="text to continue (empty: start a new document); of a prompt longer than the "
                   "model's context (model.max_seq_len) only the last tokens that fit are read")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate after the prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample only among the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (with --temperature above 0)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")


def run(args, extra) -> int:
    from plait.launch_env import one_process

    one_process("generate")
    from plait.errors import bad_value

    if args.max_new_tokens < 0:
        raise bad_value("--max-new-tokens", args.max_new_tokens, "must be zero or more")
    if not 0 <= args.temperature < float("inf"):  # NaN included: it fails every comparison
        raise bad_value("--temperature", args.temperature, "must be zero (greedy) or a positive number")
    if args.top_k < 0:
        raise bad_value("--top-k", args.top_k, "must be zero (off) or more")
    from plait.validate import check_seed

    check_seed("--seed", args.seed)
    from plait.generate import sample
    from plait.train import model_from_checkpoint

    device = _device(args.device)
    model, tokenizer, cfg, _ = model_from_checkpoint(args.checkpoint, device)
    if tokenizer is None:  # an HF folder that does not say how its ids read as text
        from plait.hf import no_tokenizer

        raise no_tokenizer(args.checkpoint, cfg.model.vocab_size)
    if tokenizer.vocab_size > cfg.model.vocab_size:  # a prompt could hold ids the model has no row for
        raise bad_value("--checkpoint", args.checkpoint, f"has a tokenizer of {tokenizer.vocab_size} tokens for a model "
                        f"of vocabulary {cfg.model.vocab_size}: the tokenizer belongs to another model; put the "
                        "model's own tokenizer.json beside its weights")
    prompt = [int(i) for i in tokenizer.encode(args.prompt)] or [document_start(tokenizer)]
    if prompt == [None]:
        raise bad_value("--prompt", args.prompt, "gives no tokens, and the checkpoint's tokenizer has no end-of-text "
                        "or start token and drops newlines, so nothing stands for a document's start; give a prompt "
                        "of some text")
    ids = sample(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(args.prompt + tokenizer.decode(ids))
    return 0


def document_start(tokenizer) -> int | None:
    """The token an empty prompt stands for: what precedes every document in plait's data, the
    tokenizer's EOS, or the newline that ends each document of a tokenizer without one (bytes).
    (Token 0 instead is a NUL byte, which the model never saw and continues with garbage.)
    A tokenizer with neither (WordPiece drops "\n": encode gives []) starts with its BOS if it has
    one; else None: nothing stands for a start."""
    eos = getattr(tokenizer, "eos_id", None)
    if eos is not None:
        return int(eos)
    newline = tokenizer.encode("\n")
    if len(newline):
        return int(newline[-1])
    bos = getattr(tokenizer, "bos_id", None)
    return None if bos is None else int(bos)


def _device(name: str):
    """The torch device --device names, or one line saying why it cannot be used here."""
    import torch

    from plait.errors import bad_value

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise bad_value("--device", name, "is not a device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise bad_value("--device", name, "is not supported; use cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise bad_value("--device", name, "no CUDA device is visible on this machine; use --device cpu")
        if (device.index or 0) >= torch.cuda.device_count():
            raise bad_value("--device", name, f"only {torch.cuda.device_count()} CUDA device(s) are visible; "
                            f"use cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return device
