"""How a model runs on this machine, decided once at load: the `Plan`.

A frozen, static value built from the devices, the flags and the model's shapes; model code reads the one it is given
(`Config.plan`) and has no backend checks of its own: `jax.default_backend()` is read here and nowhere else.

                       CPU backend                                   GPU backend
    products           cpu_ext (8-bit activations, integer dots)     XLA: decode fused with the dequantization
                                                                     (a multiply-and-reduce), prompts dequantize +
                                                                     GEMM (f32 operands, TF32 tensor cores)
                       on weights repacked eight rows to a group
                       (repack.py) for any number of tokens, on
                       GGUF's rows up to quant.CPU_KERNEL_MAX_TOKENS
                       a call, XLA beyond; "exact" weights always XLA
    attention          XLA in key steps; cpu_ext against the cache   Pallas flash kernels
                       for decode-sized steps
    split FFN, hot     on the device, the products above             Pallas masked sparse FFN (predictor models)
    split FFN, cold    host memory (pinned_host), compute_on("device_host"), cpu_ext's row-sparse kernels
    down projection    neuron-major where cpu_ext's kernel is fast,  transposed, one row per neuron
      when sparse      else one row per neuron, scales first
                       (Q4_0/Q8_0: cpu_ext's integer axpy)

With `tp` > 1 (--tp) the weights are cut over the first `tp` devices, the same on either backend (sharding.py); with
`dp` > 1 (perplexity's --dp) the windows of an evaluation batch are spread over the first `dp` devices instead. Over
several processes (distributed.py) the devices are all of theirs, and a plan uses every one.

On a CPU-only machine the "device" and the "host" are the same cores: a split runs the same one program that it runs
beside a GPU, which is how CI tests it.
"""

import dataclasses
import functools
import glob
import importlib.util
import os
from collections.abc import Iterable

import jax

from jaxinfer import jax_compat, quant
from jaxinfer.errors import JaxinferError

SPARSITY_MODES = ("dense", "predictor", "gate", "hidden")  # which FFN neurons run for a token (sparse_ffn.py)
PRODUCTS = ("cpu_ext", "xla", "xla_fused")
ATTENTION = ("xla", "cpu_ext", "pallas", "pallas_interpret")
SOFT_CAPPING_ATTENTION = ("xla", "cpu_ext")  # those that soft-cap attention scores (Gemma 2); Pallas's kernels do not
HOT_FFN = ("xla", "pallas", "pallas_interpret")
# A type read from the file -> the type a plan that repacks holds it as (repack.held_type): TQ1_0 always, Q5_0 where
# it is repacked.
HELD_AS = {"TQ1_0": "TQ2_0", "Q5_0": "Q8_0"}


@dataclasses.dataclass(frozen=True)
class Plan:
    backend: str = "cpu"  # the accelerator's platform ("cpu", "gpu")
    ffn_sparsity: str = "dense"  # one of SPARSITY_MODES (--sparsity; sparse_ffn.py)
    products: str = "xla"  # quantized products in device memory, one of PRODUCTS (quant.products)
    host_products: str = "xla"  # the same for the FFN parts a split keeps in host memory
    attention: str = "xla"  # one of ATTENTION (model.attention_kernel)
    attn_max_batch_mib: float | None = None  # bound on XLA attention's K·Q scores per step (attention.py); None: none
    hot_ffn: str = "xla"  # a split's device part with a predictor, one of HOT_FFN (sparse_ffn.ffn)
    neuron_major: bool = False  # a neuron-major down projection runs fast here (sparsity.packs_neuron_major)
    down_rows: bool = False  # a Q4_0/Q8_0 down projection held one row per neuron takes cpu_ext's integer axpy
    # The layers whose mixture of ReLU experts holds its down projection a row per neuron (repack.holds_expert_rows):
    # set at load (engine._experts) only for experts with natural zeros where down_rows is, and layer by layer where
    # their activation profile measured few enough of the routed experts' neurons nonzero for that to pay.
    expert_rows: tuple[int, ...] = ()
    repack: bool = False  # dense products' weights repacked eight rows to a group at load (repack.py)
    host_memory_kind: str = "pinned_host"  # where a split's cold parts live
    tp: int = 1  # devices the weights are cut over (tensor parallelism, sharding.py); 1: one device, no mesh
    dp: int = 1  # devices an evaluation batch's windows are spread over, the weights whole on each (perplexity)

    def describe(self, repacked: Iterable[str] | None = None, widened: Iterable[str] | None = None,
                 split: bool = True, down: str | None = None, experts: bool = False) -> str:
        """The `plan:` line the CLIs print, naming what a run of this plan uses: `repacked`, the names of the weight
        types the model holds repacked (None: every type this plan repacks); `widened`, the names of the file's
        types it holds as others (HELD_AS; None: every one this plan may); `split`, whether its FFN is split between
        device and host; `down`, the layout its down projections are held in ("neuron-major", "rows per neuron";
        None: the one this plan packs), named for a sparse FFN only (engine.LoadedModel.describe_plan passes a loaded
        model's); `experts`, whether the FFN is a mixture of experts (cut by whole experts, not neurons)."""
        bounded = self.attn_max_batch_mib is not None and self.attention == "xla"  # the kernels hold a block a task
        bound = f" (K·Q ≤ {self.attn_max_batch_mib:g} MiB a step)" if bounded else ""
        parts = [f"plan: {self.backend} backend", f"FFN {self.ffn_sparsity}", f"products {self.products}",
                 f"attention {self.attention}{bound}"]
        if split:
            parts.append(f"split FFN hot {self.hot_ffn} / cold {self.host_products} in {self.host_memory_kind}")
        if self.ffn_sparsity != "dense":
            parts.append(f"down projection {down or ('neuron-major' if self.neuron_major else 'rows per neuron')}")
        if self.repack:
            names = [t.name for t in sorted(quant.REPACKED_TYPES)] if repacked is None else list(repacked)
            if names:
                parts.append(f"{'/'.join(names)} weights repacked eight rows to a group")
            parts += [f"{name} held as {HELD_AS[name]}" for name in (HELD_AS if widened is None else widened)]
        if self.tp > 1:
            ffn = "experts" if experts else "neurons"
            parts.append(f"tensor-parallel over {self.tp} devices (heads, {ffn} and vocabulary cut {self.tp} ways, "
                         f"an all-reduce after attention and after the FFN)")
        if self.dp > 1:
            parts.append(f"data-parallel over {self.dp} devices (the windows of a batch spread over them)")
        processes = jax.process_count()
        if processes > 1:
            parts.append(f"{processes} processes")
        return ", ".join(parts)


def soft_capping(plan: Plan, attn_softcap: float) -> Plan:
    """The plan for a model whose attention scores are soft-capped at `attn_softcap` (0: not capped): XLA's attention
    where the plan's kernels do not cap them."""
    if not attn_softcap or plan.attention in SOFT_CAPPING_ATTENTION:
        return plan
    return dataclasses.replace(plan, attention="xla")


def make_plan(attn_max_batch_mib: float | None = None, tp: int = 1, dp: int = 1) -> Plan:
    """The plan for the devices, for a dense FFN (sparsity.apply sets the mode), with the weights cut over the first
    `tp` devices (sharding.py) or evaluation windows spread over the first `dp` (a JaxinferError when there are
    fewer)."""
    check_devices(tp, dp)
    return dataclasses.replace(_device_plan(attn_max_batch_mib), tp=tp, dp=dp)


def check_devices(tp: int, dp: int = 1) -> None:
    """`tp` devices are there to cut the weights over (`dp` to spread windows over), all of them when several
    processes share the run: a process without a device in the mesh would have nothing to compute."""
    for flag, count in (("--tp", tp), ("--dp", dp)):
        if count < 1:
            raise JaxinferError(f"{flag} must be at least 1, got {count}")
    if tp > 1 and dp > 1:
        raise JaxinferError(f"--tp {tp} and --dp {dp} do not combine yet: give one of them")
    flag, count = ("--dp", dp) if dp > 1 else ("--tp", tp)
    have, processes = len(jax.devices()), jax.process_count()
    if processes > 1 and count != have:
        raise JaxinferError(f"{flag} {count} over {processes} processes must use all their {have} devices "
                            f"({jax.local_device_count()} a process)")
    if count > have:
        raise JaxinferError(f"{flag} {count} needs {count} devices, this process has {have} "
                            f"({jax.default_backend()}); on a CPU, set jax_num_cpu_devices before JAX starts (the CLIs "
                            f"set it from {flag})")


def _device_plan(attn_max_batch_mib: float | None) -> Plan:
    backend = jax.default_backend()
    kernels = quant.cpu_kernels()
    host_products = "cpu_ext" if kernels is not None else "xla"
    if backend == "cpu":
        # Repacking reads every weight whole: over several processes each reads only its own shards, so not there.
        return Plan(backend, products=host_products, host_products=host_products, attention=host_products,
                    attn_max_batch_mib=attn_max_batch_mib,
                    neuron_major=kernels is not None and kernels.fast_neuron_major(), down_rows=kernels is not None,
                    repack=kernels is not None and jax.process_count() == 1)
    host_products = host_products if kernels is not None and _register_host_kernels() else "xla"
    return accelerator_plan(backend, host_products, attn_max_batch_mib)


def accelerator_plan(backend: str, host_products: str = "xla", attn_max_batch_mib: float | None = None) -> Plan:
    """The plan on an accelerator: XLA's products fused with the dequantization, Pallas's kernels for attention and
    a hot FFN part on a GPU (XLA's on other accelerators), `host_products` for the parts in host memory."""
    kernels = "pallas" if backend == "gpu" else "xla"
    return Plan(backend, products="xla_fused", host_products=host_products, attention=kernels,
                attn_max_batch_mib=attn_max_batch_mib, hot_ffn=kernels)


@functools.cache
def _register_host_kernels() -> bool:
    """Register cpu_ext's handlers in the GPU plugin's own host compiler (jax_compat: its registry is not jaxlib's);
    False where no CUDA plugin library is found (the host parts then use XLA's products)."""
    import cpu_ext

    if importlib.util.find_spec("jax_plugins") is None:
        return False
    for package in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
        spec = importlib.util.find_spec(package)
        libraries = sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.so"))) if spec else []
        if libraries:
            jax_compat.register_host_handlers(jax_compat.pjrt_api(libraries[0]), cpu_ext.handlers())
            return True
    return False
