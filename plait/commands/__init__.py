"""One module per `plait <command>`: argument parsing only; the work lives in the concept modules.

Each module defines NAME, HELP, `add_arguments(parser)` and `run(args, extra) -> int`, where `extra`
holds the arguments argparse did not know (the `--section.key value` config overrides). Modules are
found by listing this package, so adding a command touches no other file. Keep imports at module level
light (no torch): every command module is imported to build `plait --help`.
"""
