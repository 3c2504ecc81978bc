"""Process-wide JAX settings shared by every entry point."""

import gc
import os

import jax

CACHE_DIR = os.environ.get("JAXINFER_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "jaxinfer"))


def enable_compilation_cache(directory: str = os.path.join(CACHE_DIR, "xla")):
    """Persist compiled XLA executables so a second run of the same shapes starts in a fraction of the time."""
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # JAX otherwise passes XLA a GPU autotuning cache folder under `directory`, and the compile options it sits in are
    # part of every cache key: the same program behind another path (a moved cache, a folder linked to this one)
    # would miss and compile again. A cache entry holds its program's autotuned kernels already.
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")


def freeze_loaded_objects():
    """Collect, then move every object alive (a loaded model's wrappers, JAX's caches) to the garbage collector's
    permanent generation: the full collections that a decode loop's allocations set off no longer walk them (7B-shaped
    Q4_K_M decode: 2.2% -> 0.2% of the samples in gc_collect_main and its visitors). Collecting first leaves no
    garbage cycle frozen for the life of the process; reference counting frees frozen objects as before."""
    gc.collect()
    gc.freeze()
