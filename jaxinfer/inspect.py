"""python -m jaxinfer.inspect MODEL.gguf [--json]: what a GGUF file is and how jaxinfer would run it here.

Reads the file's metadata and tensor infos only (memory-mapped; no weight is loaded) and reports: the file (size,
GGUF version, GGUF or PowerInfer magic, alignment), the architecture and the model's shapes, every tensor type with
its tensors, bytes and share of the file, the kernel each type gets on this machine (cpu_ext ISA, or XLA on
dequantized weights), whether the sparse modes, the hot/cold split and the GPU path apply, the PowerInfer extensions
present, every problem the checks of a run find, and a one-line verdict.

Exit status: 0 when the model runs (perhaps with limitations), 1 when it does not, 2 for a usage error or a path
that cannot be read. --json prints one JSON object instead of the text.
"""

import json
import sys

from absl import app, flags

from jaxinfer.cli import parse_flags
from jaxinfer.errors import JaxinferError, exit_on_error

flags.DEFINE_bool("json", False, "print the report as one JSON object (for tools) instead of text")
FLAGS = flags.FLAGS


@exit_on_error
def main(argv):
    if len(argv) != 2:
        raise JaxinferError("give one model file: python -m jaxinfer.inspect MODEL.gguf [--json]"
                            if len(argv) < 2 else f"unexpected arguments: {' '.join(argv[2:])}")
    from jaxinfer import inspection

    report = inspection.inspect_model(argv[1])
    print(json.dumps(report, indent=1) if FLAGS.json else inspection.format_report(report))
    sys.exit(0 if report["verdict"]["status"] != inspection.DOES_NOT_RUN else 1)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
