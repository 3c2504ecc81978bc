import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import jax_compat


def test_on_host_runs_a_host_region_inside_the_jit_and_returns_device_memory():
    device = jax.devices()[0]
    weight = jax.device_put(np.arange(12.0, dtype=np.float32).reshape(3, 4),
                            jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"))

    def cold(x, mask, w):
        return jax_compat.where_zero(mask, jnp.einsum("...i,oi->...o", x, w))  # 0.0 broadcast on the host

    @jax.jit
    def step(w, x):
        mask = jnp.array([True, False, True])
        return jax_compat.on_host(cold)(*jax_compat.to_host((x, mask)), w) + 1.0  # + 1 in device memory

    x = np.ones((2, 4), np.float32)
    np.testing.assert_allclose(step(weight, x), np.where([True, False, True], x @ np.asarray(weight).T, 0.0) + 1.0)
    text = step.lower(weight, x).as_text()
    assert '_xla_compute_type = "host"' in text and 'mhlo.memory_kind = "pinned_host"' in text


def test_host_handlers_are_registered_through_the_plugins_ffi_extension():
    """A PJRT_Api laid out as JAX 0.11.2's, with another extension before the FFI one: each handler is registered for
    platform "Host" under its name, the address passed through."""
    calls = []

    @jax_compat._REGISTER_HANDLER
    def register(args):
        a = args.contents
        calls.append((ctypes.string_at(a.target_name, a.target_name_size).decode(), a.handler,
                      ctypes.string_at(a.platform_name, a.platform_name_size).decode(),
                      a.struct_size == ctypes.sizeof(jax_compat._RegisterHandlerArgs)))
        return None

    ffi = jax_compat._FFIExtension(jax_compat._ExtensionBase(ctypes.sizeof(jax_compat._FFIExtension), 5, None),
                                   None, None, register)
    ffi_base = ctypes.cast(ctypes.pointer(ffi), ctypes.POINTER(jax_compat._ExtensionBase))
    other = jax_compat._ExtensionBase(24, 2, ffi_base)
    api = jax_compat._Api(ctypes.sizeof(jax_compat._Api), ctypes.pointer(other))
    jax_compat.register_host_handlers(ctypes.addressof(api), {"jaxinfer_a": 0x1000, "jaxinfer_b": 0x2000})
    assert calls == [("jaxinfer_a", 0x1000, "Host", True), ("jaxinfer_b", 0x2000, "Host", True)]
    lonely = jax_compat._Api(ctypes.sizeof(jax_compat._Api), None)
    with pytest.raises(RuntimeError, match="no FFI extension"):
        jax_compat.register_host_handlers(ctypes.addressof(lonely), {"jaxinfer_a": 0x1000})
