"""Run by tests/test_sharding.py in its own process, which needs 4 CPU devices (jax_num_cpu_devices is fixed when
JAX starts, and the test process has started it with one):

    python tests/sharded_run.py OUT.npz MODEL SPARSITY EXACT TP...

For each --tp in TP...: logits of model.prefill (two rows of a three-row cache from row 1, at different prompt
lengths), of two model.decode_steps (the second with one row sitting out), and the greedy token ids of
engine.generate_tokens (its compiled prefill and decode-chunk programs), and whether model.forward observes the
FFNs (one device only), and the share of layer 0's experts' gate (else its attn_q) one device holds, saved as
OUT.npz["{tp}/{what}"]."""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxinfer import engine, model, runtime, sparsity  # noqa: E402
from jaxinfer.errors import JaxinferError  # noqa: E402
from jaxinfer.sampling import SamplingParams  # noqa: E402

PROMPT = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 0, 0, 0]]


def run(path: str, spec: str, exact: bool, tp: int) -> dict:
    m = engine.build_model(path, sparsity_spec=sparsity.parse_spec(spec), exact=exact, tp=tp)
    cache = model.init_cache(m.config, 3, 32)
    prefill, cache = model.prefill(np.asarray(PROMPT, np.int32), np.array([8, 5], np.int32), m.weights, cache,
                                   m.config, jnp.int32(1))
    first, cache = model.decode_step(jnp.array([3, 4, 5], jnp.int32), m.weights, cache, m.config)
    second, cache = model.decode_step(jnp.array([6, 7, 8], jnp.int32), m.weights, cache, m.config,
                                      jnp.array([True, False, True]))
    tokens = list(engine.generate_tokens(m, PROMPT[0], 12, 64, SamplingParams(temperature=0), seed=0,
                                         stop_ids=frozenset()))
    try:  # FFN traces are cut by neurons: observing them is for one device
        model.forward(np.asarray(PROMPT, np.int32), m.weights, m.config, observe=lambda index, trace: trace.active)
        observed = True
    except JaxinferError:
        observed = False
    layer = m.weights.layers[0]
    cut = (layer.attn_q if layer.experts is None else layer.experts.gate).data
    return {"held": cut.addressable_shards[0].data.size / cut.size, "prefill": prefill, "decode": first,
            "decode_active": np.asarray(second)[[0, 2]], "lengths": cache.length, "tokens": np.asarray(tokens),
            "observed": observed}


def main():
    runtime.enable_compilation_cache()  # the test process's cache: a rerun compiles nothing
    out, path, spec, exact, *tps = sys.argv[1:]
    results = {f"{tp}/{name}": np.asarray(value) for tp in tps
               for name, value in run(path, spec, exact == "exact", int(tp)).items()}
    np.savez(out, **results)


if __name__ == "__main__":
    main()
