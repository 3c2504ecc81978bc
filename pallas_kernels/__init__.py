"""Pallas kernels (generic Pallas: interpret mode on CPU, Triton on NVIDIA GPUs), each with a plain-jnp reference."""
