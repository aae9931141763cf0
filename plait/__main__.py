"""`python -m plait ...` (and `torchrun ... -m plait train ...`): the `plait` command."""

from plait.cli import entry

if __name__ == "__main__":
    entry()
