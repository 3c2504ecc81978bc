"""Process-wide JAX settings shared by every entry point."""

import os

import jax

CACHE_DIR = os.environ.get("JAXINFER_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "jaxinfer"))


def enable_compilation_cache(directory: str = os.path.join(CACHE_DIR, "xla")):
    """Persist compiled XLA executables so a second run of the same shapes starts in a fraction of the time."""
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
