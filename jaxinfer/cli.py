"""Shared command-line plumbing: llama.cpp-style flag spellings and one-line flag errors."""

import sys

from absl import flags


def _underscore(arg: str) -> str:
    """`--kl-divergence-base=x` -> `--kl_divergence_base=x`: llama.cpp spells flags with dashes, absl with
    underscores; both spellings work."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return "--" + name[2:].replace("-", "_") + sep + value


def parse_flags(argv):
    """absl `flags_parser`: a bad flag is one `error: ...` line and exit status 2."""
    try:
        return flags.FLAGS([_underscore(a) for a in argv])
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
