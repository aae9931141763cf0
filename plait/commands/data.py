"""`plait data prepare`: text files -> token shards."""

from __future__ import annotations

NAME = "data"
HELP = "prepare training data (plait data prepare --input PATHS --out DIR)"


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = sub.add_parser("prepare", help="tokenize text files or folders into memory-mapped shards")
    prep.add_argument("--input", nargs="+", required=True, help="text files and/or folders (searched recursively)")
    prep.add_argument("--out", required=True, help="new folder for the shards and meta.json")
    prep.add_argument("--tokenizer", help="HuggingFace tokenizer.json (default: built-in bytes, vocab 256)")
    prep.add_argument("--val-fraction", type=float, default=0.01, help="share of files held out for validation")


def run(args, extra) -> int:
    from plait.data import prepare
    from plait.errors import bad_value
    from plait.tokenizer import from_path

    if not 0 <= args.val_fraction < 0.5:
        raise bad_value("--val-fraction", args.val_fraction, "must be in [0, 0.5)")
    prepare(args.input, args.out, from_path(args.tokenizer), args.val_fraction)
    return 0
