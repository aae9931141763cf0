"""`plait hf export`: a plait checkpoint -> a HuggingFace Llama folder.

(Loading goes the other way without a command: `plait train --train.init_from HF_DIR` continues
training a HuggingFace model, and `plait generate --checkpoint HF_DIR` samples from one.)
"""

from __future__ import annotations

NAME = "hf"
HELP = "HuggingFace interop (plait hf export --checkpoint RUN --out DIR)"


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="hf_command", metavar="ACTION", required=True)
    exp = sub.add_parser("export", allow_abbrev=False, help="write a checkpoint as config.json + safetensors")
    exp.add_argument("--checkpoint", required=True, help="step_XXXXXXXX folder or run folder")
    exp.add_argument("--out", required=True, help="new folder")
    exp.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"], help="dtype of the saved weights (default bf16)")


def run(args, extra) -> int:
    import sys

    import torch

    from plait.hf import check_new_folder, mark_byte_level, save_hf, write_special_tokens
    from plait.tokenizer import ByteTokenizer
    from plait.train import model_from_checkpoint

    check_new_folder(args.out)  # before the load, which takes minutes for a large model
    model, tokenizer, cfg, folder = model_from_checkpoint(args.checkpoint)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    out = save_hf(dict(model.named_parameters()), cfg.model, args.out, dtype)
    if getattr(tokenizer, "path", None):
        tokenizer.save_to(out)
    elif isinstance(tokenizer, ByteTokenizer):  # no tokenizer.json exists for bytes: the folder says so
        mark_byte_level(out)
    write_special_tokens(out, tokenizer)
    print(f"exported {folder} -> {out}", file=sys.stderr)  # resolved once: its warnings said once
    return 0
