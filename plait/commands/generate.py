"""`plait generate`: sample text from a checkpoint."""

from __future__ import annotations

NAME = "generate"
HELP = "sample text from a trained checkpoint"


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True, help="a step_XXXXXXXX folder, or a run folder (newest valid checkpoint)")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample only among the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")


def run(args, extra) -> int:
    from plait.errors import bad_value

    if args.max_new_tokens < 0:
        raise bad_value("--max-new-tokens", args.max_new_tokens, "must be zero or more")
    if args.temperature < 0:
        raise bad_value("--temperature", args.temperature, "must be zero (greedy) or more")
    if args.top_k < 0:
        raise bad_value("--top-k", args.top_k, "must be zero (off) or more")
    from plait.generate import sample
    from plait.train import model_from_checkpoint

    model, tokenizer, _ = model_from_checkpoint(args.checkpoint, args.device)
    prompt = [int(i) for i in tokenizer.encode(args.prompt)]
    ids = sample(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(args.prompt + tokenizer.decode(ids))
    return 0
