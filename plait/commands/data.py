"""`plait data prepare` (documents -> token shards) and `plait data tokenizer` (train a BPE)."""

from __future__ import annotations

import os

NAME = "data"
HELP = "prepare training data (plait data prepare --input PATHS --out DIR) or train a tokenizer"
INPUT_HELP = ("text files, .jsonl / .parquet files, folders of them (searched recursively), or a "
              "HuggingFace datasets folder (save_to_disk)")


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = sub.add_parser("prepare", allow_abbrev=False, help="tokenize documents into memory-mapped shards")
    prep.add_argument("--input", nargs="+", required=True, help=INPUT_HELP)
    prep.add_argument("--out", required=True, help="new folder for the shards and meta.json")
    prep.add_argument("--tokenizer", help="HuggingFace tokenizer.json (default: built-in bytes, vocab 256)")
    prep.add_argument("--text-field", default="text", help="field holding the text in JSONL / Parquet / datasets rows")
    prep.add_argument("--val-fraction", type=float, default=0.01,
                      help="share of documents held out for validation (0 holds out none, which training refuses)")
    prep.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8),
                      help="tokenizing processes (default: min(CPU count, 8)); the shards do not depend on it")

    tok = sub.add_parser("tokenizer", allow_abbrev=False, help="train a byte-level BPE tokenizer.json for `prepare --tokenizer`")
    tok.add_argument("--input", nargs="+", required=True, help=INPUT_HELP)
    tok.add_argument("--vocab", type=int, default=32000, help="vocabulary size, including the EOS token")
    tok.add_argument("--out", required=True, help="the tokenizer.json file to write")
    tok.add_argument("--text-field", default="text", help="field holding the text in JSONL / Parquet / datasets rows")


def run(args, extra) -> int:
    from plait.errors import bad_value

    if args.data_command == "tokenizer":
        return _tokenizer(args)
    from plait.prepare import prepare
    from plait.tokenizer import from_path

    if not 0 <= args.val_fraction < 0.5:
        raise bad_value("--val-fraction", args.val_fraction, "must be in [0, 0.5)")
    if args.workers < 1:
        raise bad_value("--workers", args.workers, "must be 1 or more")
    prepare(args.input, args.out, from_path(args.tokenizer), args.val_fraction,
            text_field=args.text_field, workers=args.workers)
    return 0


def _tokenizer(args) -> int:
    import itertools
    import sys
    from pathlib import Path

    from plait.prepare import collect_sources, iter_texts, mended_note
    from plait.errors import bad_value
    from plait.tokenizer import train_bpe

    if args.vocab < 257:
        raise bad_value("--vocab", args.vocab, "must be at least 257 (the 256 bytes and the EOS token)")
    out = Path(args.out).expanduser()
    if out.exists():
        raise bad_value("--out", args.out, "exists; choose another file name or delete it")
    if not out.parent.is_dir():
        raise bad_value("--out", args.out, f"its folder {out.parent} does not exist; create it first")
    try:  # before training, which can take long, not after it (/proc/x.json was a traceback)
        out.touch(exist_ok=False)
        out.unlink()
    except OSError as e:
        raise bad_value("--out", args.out, f"cannot be written ({e.strerror}); choose a writable folder") from None
    sources = collect_sources(args.input)
    if not sources:
        raise bad_value("--input", " ".join(args.input), "holds no text, .jsonl or .parquet files")
    counts: dict = {}
    texts = iter_texts(args.input, args.text_field, counts)
    first = next(texts, None)
    if first is None:  # as `data prepare` refuses it: a tokenizer of the 256 bytes alone, written with rc 0
        field = " (check --text-field)" if any(s.kind != "text" for s in sources) else ""
        raise bad_value("--input", " ".join(args.input), f"holds no readable UTF-8 text to train on: every file "
                        f"is empty or not UTF-8{field}")
    tok = train_bpe(itertools.chain([first], texts), args.vocab, out, show_progress=sys.stderr.isatty())
    if counts.get("mended"):
        print(mended_note(counts["mended"]), file=sys.stderr)
    short = (f" - fewer than the {args.vocab} asked: the text held no more pairs to merge (more text reaches it)"
             if tok.vocab_size < args.vocab else "")
    print(f"wrote {out}: byte-level BPE, vocab {tok.vocab_size} (EOS id {tok.eos_id}){short}; "
          f"use it with `plait data prepare --tokenizer {out}`", file=sys.stderr)
    return 0
