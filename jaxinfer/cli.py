"""Shared command-line plumbing: llama.cpp-style flag spellings and one-line flag errors."""

import sys

from absl import flags

# Help of the flags that more than one CLI defines.
DOWN_T_TYPE_HELP = ("type of the down projection transposed for a sparse --sparsity (one row per neuron, so inactive "
                    "rows are skipped): same (the model's own; a second rounding) or q8_0 (near-lossless, 1.7x the "
                    "bytes of Q4_1)")


def define_split_flags():
    """The flags of a hot/cold split between accelerator and host (generate, perplexity). The calling CLI adopts them
    (flags.adopt_module_key_flags) so that its --help lists them."""
    flags.DEFINE_float("vram_budget", -1.0, "GiB of accelerator memory: place hot FFN neurons there and the rest on "
                       "the host CPU (needs an activation profile, python -m jaxinfer.profile); -1: no split")
    flags.DEFINE_bool("reset_gpu_index", False, "solve the hot/cold split again instead of reusing "
                      "MODEL.generated.gpuidx")
    flags.DEFINE_bool("disable_gpu_index", False, "run without a hot/cold split even when --vram-budget is given")
    flags.DEFINE_string("activation_dir", None, "activation profile folder (default: activation/ beside the model)")


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
