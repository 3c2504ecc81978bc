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
MIB = 2**20


def _mib(n: int) -> str:
    return f"{n / MIB:.2f} MiB"


def _yes(value) -> str:
    return "yes" if value else "no"


def file_lines(f: dict) -> list[str]:
    line = f"file: {f['path']}, {_mib(f['size_bytes'])} ({f['size_bytes']} bytes), {f['format']}"
    if f.get("version") is not None:
        line += f" v{f['version']}"
    if "alignment" in f:
        line += f", alignment {f['alignment']}, {f['metadata_keys']} metadata keys, {f['tensors']} tensors"
    return [line]


def architecture_lines(a: dict) -> list[str]:
    known = "" if a["known"] else f" (not one jaxinfer runs: {', '.join(a['supported_architectures'])})"
    lines = [f"architecture: {a['name']}{known}"]
    c = a["config"]
    if c is None:
        lines.append(f"  shapes: unknown, no config: {a['config_error']}")
        return lines
    lines.append(f"  {c['n_layer']} layers, d={c['n_embd']}, ffn={c['n_ff']}, heads={c['n_head']}/{c['n_head_kv']} kv "
                 f"of {c['head_dim']}, vocab={c['n_vocab']}, context {c['n_ctx_train']}, rope theta "
                 f"{c['rope_theta']:g} on {c['rope_dim']} dims, rms eps {c['rms_eps']:g}, FFN "
                 f"{c['gate_activation']}(gate) * {c['up_activation']}(up)")
    return lines


def type_lines(rows: list[dict], kernels: dict) -> list[str]:
    cpu_ext = kernels["cpu_ext"]
    isa = f"cpu_ext {cpu_ext['isa']}" if cpu_ext["available"] else f"cpu_ext unavailable ({cpu_ext['reason']})"
    lines = [f"tensor types (backend {kernels['backend']}, products {kernels['products']}, {isa}):"]
    width = max((len(r["type"]) for r in rows), default=4)
    for r in rows:
        approx = "" if r["bytes_exact"] else "~"
        tensors = f"{r['tensors']:>5} tensor{'s' if r['tensors'] != 1 else ' '}"
        lines.append(f"  {r['type']:<{width}} {tensors} {approx}{_mib(r['bytes']):>12} "
                     f"{100 * r['share']:5.1f}%  {r['kernel']}")
    return lines


def feature_lines(report: dict) -> list[str]:
    p, s, h, g = report["powerinfer"], report["sparsity"], report["hybrid_split"], report["gpu"]
    n_layer = (report["architecture"]["config"] or {}).get("n_layer", "?")
    lines = [f"powerinfer: magic PWRI {_yes(p['pwri_magic'])}, ffn_down_t in {p['layers_with_ffn_down_t']}/{n_layer} "
             f"layers, fc1/fc2 predictors in {p['layers_with_predictor']}/{n_layer}, sparse_threshold "
             f"{'absent' if p['sparse_threshold'] is None else format(p['sparse_threshold'], 'g')}"]
    dense = s.get("dense_skips_natural_zeros")
    dense_text = "unknown (no config)" if dense is None else (
        "yes (ReLU-family activation: natural zeros skipped)" if dense else "no (no natural zeros to skip)")
    t = s["calibrated_thresholds"]
    if t["present"]:
        levels = t.get("levels")
        thresholds = f"unusable ({t['error']})" if "error" in t else \
            ", ".join(f"{m}:{','.join(v)}" for m, v in levels.items()) or "none calibrated"
    else:
        thresholds = "none (python -m jaxinfer.calibrate)"
    lines.append(f"sparsity: --sparsity dense skips zeros {dense_text}; predictor {_yes(s['predictor'])}; "
                 f"calibrated gate/hidden thresholds: {thresholds}")
    if h["profile_present"]:
        profile = "valid" if h.get("profile_valid") else f"unusable ({h.get('profile_error', 'no config')})"
    else:
        profile = "absent (python -m jaxinfer.profile)"
    lines.append(f"hybrid split (--vram-budget): {_yes(h['applies'])}; activation profile {profile} at "
                 f"{h['activation_profile']}; splits {', '.join(h['tensors']) or 'no FFN tensors'} "
                 f"({_mib(h['tensor_bytes'])}); GPU index {'present' if h['gpu_index_present'] else 'absent'}")
    types = "all types supported" if g["types_supported"] else f"unsupported {', '.join(g['unsupported_types'])}"
    lines.append(f"gpu path: {types} ({g['products']}, {g['attention']}); Pallas sparse FFN "
                 f"{_yes(g['pallas_sparse_ffn'])} ({g['pallas_sparse_ffn_note']}); this machine: {g['backend_here']}")
    return lines


def format_report(report: dict) -> str:
    lines = file_lines(report["file"])
    if "architecture" in report:
        lines += architecture_lines(report["architecture"])
        lines += type_lines(report["tensor_types"], report["kernels"])
        lines += feature_lines(report)
    lines.append(f"problems: {len(report['problems'])}")
    lines += [f"  - {problem}" for problem in report["problems"]]
    lines += [f"note: {note}" for note in report["notes"]]
    verdict = report["verdict"]
    lines.append(f"verdict: {verdict['status']}: {verdict['reason']}")
    return "\n".join(lines)


@exit_on_error
def main(argv):
    if len(argv) != 2:
        raise JaxinferError("give one model file: python -m jaxinfer.inspect MODEL.gguf [--json]"
                            if len(argv) < 2 else f"unexpected arguments: {' '.join(argv[2:])}")
    from jaxinfer import inspection

    report = inspection.inspect_model(argv[1])
    print(json.dumps(report, indent=1) if FLAGS.json else format_report(report))
    sys.exit(0 if report["verdict"]["status"] != inspection.DOES_NOT_RUN else 1)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
