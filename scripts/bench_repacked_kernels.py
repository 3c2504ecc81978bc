"""Where the repacked kernels win: y = x · Wᵀ for W repacked eight rows to a group (quant.pack_rows_x8,
quantized_matmul with interleave 8) against the row kernels on GGUF's rows and against dequantize + XLA's f32 GEMM
(what quant.matmul runs past the row kernels' 128 tokens), by tokens per call:

    python scripts/bench_repacked_kernels.py [--types Q4_0,Q8_0] [--shapes 4096x4096,1536x576] [--tokens 1,128,512]
        [--isa best] [--repeats 5]

Each timing is the best of --repeats calls of one jitted product on one weight (from cache once it fits there);
GFLOP/s counts 2 rows x cols x tokens. The row kernels and XLA are timed on the same weight's rows.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from gguf import GGMLQuantizationType

import cpu_ext
from jaxinfer import quant
from jaxinfer.cli import check_list, check_range, parse_flags, parse_shape
from jaxinfer.errors import JaxinferError, exit_on_error
from jaxinfer.synthetic import encode_tensor

flags.DEFINE_list("types", ["Q4_0", "Q8_0", "Q4_1", "IQ4_NL"], "GGML weight types (repacked ones)")
flags.DEFINE_list("shapes", ["4096x4096", "1536x576"], "rows x cols of W (7B attention, SmolLM2's gate/up)")
flags.DEFINE_list("tokens", ["1", "4", "64", "128", "512", "2048"], "tokens per call")
flags.DEFINE_integer("repeats", 5, "timed calls per product; the best is shown")
flags.DEFINE_string("isa", "best", "cpu_ext kernels: best, avx512, avx2 or scalar")
check_list("tokens", 1)
check_range("repeats", 1)
FLAGS = flags.FLAGS


def cases() -> list[tuple[str, GGMLQuantizationType, int, int]]:
    """(name, type, rows, cols) for every --types and --shapes pair; JaxinferError on a type without repacked kernels,
    a shape that is not ROWSxCOLS of positive sizes, a row that is not whole blocks, or no pair at all."""
    repacked = sorted(t.name for t in quant.REPACKED_TYPES)
    if not FLAGS.types or not set(FLAGS.types) <= set(repacked):
        raise JaxinferError(f"--types: the repacked types are {', '.join(repacked)}, got {','.join(FLAGS.types)}")
    if not FLAGS.shapes:
        raise JaxinferError("--shapes must name at least one ROWSxCOLS")
    found = []
    for name in FLAGS.types:
        qtype = GGMLQuantizationType[name]
        block = quant.QUANT_SIZES[qtype][0]
        for shape in FLAGS.shapes:
            rows, cols = parse_shape(shape, "ROWSxCOLS", "4096x4096")
            if cols % block:
                raise JaxinferError(f"--shapes: a {name} row is whole blocks of {block} values, got {shape}")
            found.append((name, qtype, rows, cols))
    return found


def best_time(f, *args) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(FLAGS.repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return min(times)


@exit_on_error
def main(argv):
    del argv
    todo = cases()
    try:
        cpu_ext.select_isa(FLAGS.isa)
    except ValueError as e:
        raise JaxinferError(f"--isa: {e}") from None
    rng = np.random.default_rng(0)
    print(f"kernels: {cpu_ext.isa()}; ms per call (GFLOP/s of the repacked kernels); repacked / XLA speed-up")
    print("| type | rows x cols | tokens | row kernels | repacked | dequantize + XLA | repacked vs XLA |")
    print("|---|---|---|---|---|---|---|")
    for name, qtype, rows, cols in todo:
        w = quant.QuantArray(jnp.asarray(encode_tensor(rng.normal(size=(rows, cols)).astype(np.float32), qtype,
                                                       rng)), qtype, (rows, cols))
        packed = quant.pack_rows_x8(w)
        kw = dict(qtype=qtype, rows=rows, cols=cols)
        row = jax.jit(lambda x, d: cpu_ext.quantized_matmul(x, d, **kw))
        x8 = jax.jit(lambda x, d: cpu_ext.quantized_matmul(x, d, **kw, interleave=8))
        xla = jax.jit(lambda x, d: x @ quant.dequantize(quant.QuantArray(d, qtype, (rows, cols))).T)
        for tokens in map(int, FLAGS.tokens):
            x = jnp.asarray(rng.normal(size=(tokens, cols)).astype(np.float32))
            t_row, t_x8, t_xla = best_time(row, x, w.data), best_time(x8, x, packed.data), best_time(xla, x, w.data)
            gflops = 2 * rows * cols * tokens / t_x8 / 1e9
            print(f"| {name} | {rows} x {cols} | {tokens} | {t_row * 1e3:.2f} | {t_x8 * 1e3:.2f} ({gflops:.0f}) | "
                  f"{t_xla * 1e3:.2f} | {t_xla / t_x8:.1f}x |", flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
