"""Row-sparse cpu_ext kernels against the dense quantized matmul of the same weights, on FFN shapes:

    up/gate  dense: quantized_matmul(x [m, d], W [n_ff, d])     sparse: masked_matmul(x, W, mask [m, n_ff])
    down     dense: quantized_matmul(h [m, n_ff], W [d, n_ff])  sparse: masked_axpy(h, W_t [n_ff, d], mask)
                                                                 and, for Q4_0/Q4_1 (`nm_axpy`, else -):
                                                                 neuron_major_axpy(h, pack_neuron_major(W), mask)

    python scripts/bench_sparse_kernels.py [--types Q4_1,Q8_0] [--shapes 576x1536,4096x11008] [--tokens 1,8]
        [--sparsity 0,0.5,0.9] [--isa best] [--copies 1]

Masks are random: each (token, neuron) is active with probability 1 - sparsity, so with several tokens the rows
active for any token (the `rows read` column) are many more than each token's. Each timing is one jitted call that
runs the kernel `--calls` times in a lax.fori_loop (each call's input depends on the previous output, so XLA cannot
hoist it; this adds a one-element update per call), so Python's dispatch is not in the numbers; the table shows the
median over `--repeats` timings, the kernels timed round-robin so that load from other processes hits them alike.
With one copy of each weight its rows stay in the caches from call to call; a model's layers do not (the default
model's FFN weights are 50 MB, the L3 here 32 MB): `--copies 30` cycles through 30 copies, so that, as in a decode
step, each call reads its weight from memory.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

import cpu_ext
from jaxinfer import quant
from jaxinfer.cli import check_list, check_range, parse_flags, parse_shape
from jaxinfer.errors import JaxinferError, exit_on_error
from jaxinfer.synthetic import encode_tensor

flags.DEFINE_list("types", ["Q4_1", "Q8_0"], "GGML weight types")
flags.DEFINE_list("shapes", ["576x1536", "4096x11008"], "d_model x n_ff (SmolLM2-135M, a 7B model)")
flags.DEFINE_list("tokens", ["1", "8"], "tokens per call")
flags.DEFINE_list("sparsity", ["0", "0.5", "0.9"], "share of inactive neurons per token")
flags.DEFINE_integer("calls", 50, "kernel calls per timing")
flags.DEFINE_integer("repeats", 15, "timings per kernel; the median is shown")
flags.DEFINE_string("isa", "best", "cpu_ext kernels: best, avx512, avx2 or scalar")
flags.DEFINE_integer("seed", 0, "random weights, inputs and masks")
flags.DEFINE_integer("copies", 1, "copies of each weight, used in turn (30: weights come from memory, as in a model)")
check_list("tokens", 1)
check_list("sparsity", 0, 1, high_open=True, number=float)
check_range("calls", 1)
check_range("repeats", 1)
check_range("seed", 0)
check_range("copies", 1)
FLAGS = flags.FLAGS


def looped(fn, n_calls: int):
    """jit of n_calls calls of fn(a, w, *rest) -> y in a loop, each a depending on the previous y, w taking the
    copies in `ws` (a list) in turn: n_calls / len(ws) rounds of one call per copy."""

    def run(a, ws, *rest):
        def body(_, carry):
            for w in ws:
                a, total = carry
                y = fn(a, w, *rest)
                carry = a.at[..., 0].add(1e-30 * y[..., 0]), total + y[..., 0]
            return carry

        return jax.lax.fori_loop(0, n_calls // len(ws), body, (a, jnp.zeros(a.shape[:-1], jnp.float32)))[1]

    return jax.jit(run)


def median_us(runs: dict, repeats: int, n_calls: int) -> dict:
    """Times every (name -> (jitted fn, args)) `repeats` times, round-robin; median µs per kernel call."""
    for fn, args in runs.values():
        jax.block_until_ready(fn(*args))  # compiles
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (fn, args) in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append((time.perf_counter() - start) / n_calls * 1e6)
    return {name: float(np.median(t)) for name, t in times.items()}


def parse_cases() -> list[tuple[GGMLQuantizationType, int, int]]:
    """(type, d, n_ff) for every --types and --shapes pair; JaxinferError on a name, shape or size the kernels do not
    take (both dimensions are a row length: up is [n_ff, d], down [d, n_ff]), or on no pair at all."""
    if not FLAGS.types or not FLAGS.shapes:
        raise JaxinferError("--types and --shapes must each name at least one")
    cases = []
    for type_name in FLAGS.types:
        qtype = GGMLQuantizationType.__members__.get(type_name.upper())
        if qtype not in cpu_ext.SUPPORTED_TYPES:
            raise JaxinferError(f"--types: {type_name!r} is not one of "
                                f"{', '.join(sorted(t.name for t in cpu_ext.SUPPORTED_TYPES))}")
        for shape in FLAGS.shapes:
            d, n_ff = parse_shape(shape, "DxN_FF", "576x1536")
            block = GGML_QUANT_SIZES[qtype][0]
            if d % block or n_ff % block:
                raise JaxinferError(f"--shapes {shape}: {qtype.name} needs both sizes to be positive multiples of "
                                    f"{block}")
            cases.append((qtype, d, n_ff))
    return cases


@exit_on_error
def main(_):
    cases = parse_cases()
    try:
        cpu_ext.select_isa(FLAGS.isa)
    except ValueError as e:
        raise JaxinferError(f"--isa: {e}") from None
    n_calls = max(1, FLAGS.calls // FLAGS.copies) * FLAGS.copies
    rng = np.random.default_rng(FLAGS.seed)
    print(f"cpu_ext kernels: {cpu_ext.isa()}; µs per call, median of {FLAGS.repeats} timings of {n_calls} calls"
          f" ({FLAGS.copies} {'copy' if FLAGS.copies == 1 else 'copies'} of each weight)")
    header = (f"{'type':5} {'d x n_ff':>11} {'tok':>3} {'sparse':>6} {'rows read':>9} | {'dense up':>9} "
              f"{'masked_mm':>9} {'ratio':>5} | {'dense down':>10} {'masked_axpy':>11} {'ratio':>5} {'nm_axpy':>8} "
              f"{'ratio':>5}")
    print(header + "\n" + "-" * len(header))
    for qtype, d, n_ff in cases:
        w_up, w_down, w_down_t = ([jnp.asarray(encode_tensor(rng.normal(size=s).astype(np.float32), qtype, rng))
                                   for _ in range(FLAGS.copies)] for s in ((n_ff, d), (d, n_ff), (n_ff, d)))
        packed = [quant.pack_neuron_major(quant.QuantArray(w, qtype, (d, n_ff))).data for w in w_down
                  if quant.can_pack_neuron_major(quant.QuantArray(w, qtype, (d, n_ff)))]
        up = dict(qtype=qtype, rows=n_ff, cols=d)
        down = dict(qtype=qtype, rows=d, cols=n_ff)
        dense_up = looped(lambda x, w: cpu_ext.quantized_matmul(x, w, **up), n_calls)
        dense_down = looped(lambda h, w: cpu_ext.quantized_matmul(h, w, **down), n_calls)
        masked_mm = looped(lambda x, w, mask: cpu_ext.masked_matmul(x, w, mask, **up), n_calls)
        masked_axpy = looped(lambda h, w, mask: cpu_ext.masked_axpy(h, w, mask, **up), n_calls)
        nm_axpy = looped(lambda h, w, mask: cpu_ext.neuron_major_axpy(h, w, mask, **up,
                                                                      span=quant.neuron_span(d, qtype)), n_calls)
        for m in map(int, FLAGS.tokens):
            x = jnp.asarray(rng.normal(size=(m, d)).astype(np.float32))
            h = jnp.asarray(rng.normal(size=(m, n_ff)).astype(np.float32))
            for sparsity in map(float, FLAGS.sparsity):
                mask = rng.random((m, n_ff)) >= sparsity
                runs = {
                    "dense_up": (dense_up, (x, w_up)),
                    "masked_mm": (masked_mm, (x, w_up, jnp.asarray(mask))),
                    "dense_down": (dense_down, (h, w_down)),
                    "masked_axpy": (masked_axpy, (h, w_down_t, jnp.asarray(mask))),
                }
                if packed:
                    runs["nm_axpy"] = (nm_axpy, (h, packed, jnp.asarray(mask)))
                t = median_us(runs, FLAGS.repeats, n_calls)
                nm = (f"{t['nm_axpy']:>8.1f} {t['nm_axpy'] / t['dense_down']:>5.2f}" if packed
                      else f"{'-':>8} {'-':>5}")
                print(f"{qtype.name:5} {d:>5}x{n_ff:<5} {m:>3} {sparsity:>6.0%} {mask.any(0).mean():>9.0%} | "
                      f"{t['dense_up']:>9.1f} {t['masked_mm']:>9.1f} {t['masked_mm'] / t['dense_up']:>5.2f} | "
                      f"{t['dense_down']:>10.1f} {t['masked_axpy']:>11.1f} "
                      f"{t['masked_axpy'] / t['dense_down']:>5.2f} {nm}", flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
