"""What differs between the JAX versions jaxinfer runs on, in one place.

    JAX 0.10.2 (the CPU machines)     `compute_on("device_host")` is a context manager, also used as a decorator
    JAX 0.11.2 (the GPU machine)      `compute_on(f, compute_type=..., out_memory_spaces=...)` transforms a function

and, on a GPU, the registration of cpu_ext's FFI handlers for the host part of a GPU program: the CUDA plugin compiles
a `compute_on("device_host")` region with its own embedded CPU compiler, whose FFI registry (platform "Host") is not
jaxlib's, so `jax.ffi.register_ffi_target(..., platform="cpu")` leaves the handler unknown there and the compile
aborts the process. The handler is registered through the plugin's PJRT FFI extension instead (measured on an H100,
JAX 0.11.2; the C structs below are that version's, pjrt_c_api.h and pjrt_c_api_ffi_extension.h).
"""

import ctypes
import functools
import inspect

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on

_TRANSFORM_FORM = "out_memory_spaces" in inspect.signature(compute_on).parameters


def on_host(f):
    """`f` (arrays in, arrays out; bind static arguments first) as a function whose computation runs on the host
    (`compute_on("device_host")`) inside the caller's jit, taking arguments in host memory (`to_host`) and returning
    its results in device memory."""
    if _TRANSFORM_FORM:
        return compute_on(jax.jit(f), compute_type="device_host", out_memory_spaces=jax.memory.Space.Device)
    host_f = jax.jit(f)

    @functools.wraps(f)
    def run(*args):
        with compute_on("device_host"):
            out = host_f(*args)
        return to_device(out)

    return run


def where_zero(mask, y):
    """jnp.where(mask, y, 0.0), in y's memory space: JAX 0.10 broadcasts the 0 in device memory even inside a host
    region, where select_n then rejects the mix ("memory_space of all inputs ... must be the same")."""
    return jnp.where(mask, y, like(y, jnp.zeros_like(y)))


def like(ref, value):
    """`value` in `ref`'s memory space, for the same reason: an array made inside a jit (a constant, an iota) is in
    device memory even inside a host region, as are the results of cpu_ext's kernels there."""
    want, have = (getattr(jax.typeof(a), "memory_space", None) for a in (ref, value))
    if want == have:
        return value
    return to_host(value) if want == jax.memory.Space.Host else to_device(value)


def to_host(tree):
    """The arrays of `tree` moved to host memory, inside a jit (a no-op copy on the CPU backend)."""
    return jax.device_put(tree, jax.memory.Space.Host)


def to_device(tree):
    """The arrays of `tree` moved to device memory, inside a jit."""
    return jax.device_put(tree, jax.memory.Space.Device)


# PJRT C API (JAX 0.11.2): PJRT_Api starts {size_t struct_size; PJRT_Extension_Base* extension_start; ...}; each
# extension starts {size_t struct_size; int type; PJRT_Extension_Base* next}. The FFI extension (type 5) then holds
# three function pointers: type_id_register, user_data_add, register_handler.
_FFI_EXTENSION_TYPE = 5


class _ExtensionBase(ctypes.Structure):
    pass


_ExtensionBase._fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int),
                           ("next", ctypes.POINTER(_ExtensionBase))]


class _Api(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.POINTER(_ExtensionBase))]


class _RegisterHandlerArgs(ctypes.Structure):  # PJRT_FFI_Register_Handler_Args, with no api_version field in 0.11.2
    _fields_ = [("struct_size", ctypes.c_size_t), ("target_name", ctypes.c_char_p),
                ("target_name_size", ctypes.c_size_t), ("handler", ctypes.c_void_p),
                ("platform_name", ctypes.c_char_p), ("platform_name_size", ctypes.c_size_t),
                ("traits", ctypes.c_uint32)]


_REGISTER_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_RegisterHandlerArgs))


class _FFIExtension(ctypes.Structure):
    _fields_ = [("base", _ExtensionBase), ("type_id_register", ctypes.c_void_p),
                ("user_data_add", ctypes.c_void_p), ("register_handler", _REGISTER_HANDLER)]


def pjrt_api(plugin_library: str) -> int:
    """The address of the PJRT_Api of a plugin library that JAX has loaded (dlopen returns that same copy)."""
    library = ctypes.CDLL(plugin_library)
    library.GetPjrtApi.restype = ctypes.c_void_p
    return library.GetPjrtApi()


def register_host_handlers(api: int, handlers: dict[str, int]):
    """Register FFI handlers {target name: address of the handler function} for platform "Host" through the FFI
    extension of the PJRT_Api at `api`."""
    extension = ctypes.cast(api, ctypes.POINTER(_Api)).contents.extension_start
    while extension and extension.contents.type != _FFI_EXTENSION_TYPE:
        extension = extension.contents.next
    if not extension:
        raise RuntimeError("the PJRT plugin has no FFI extension: cannot register host handlers")
    register = ctypes.cast(extension, ctypes.POINTER(_FFIExtension)).contents.register_handler
    for name, address in handlers.items():
        encoded = name.encode()
        args = _RegisterHandlerArgs(ctypes.sizeof(_RegisterHandlerArgs), encoded, len(encoded), address, b"Host", 4, 0)
        if register(ctypes.byref(args)):
            raise RuntimeError(f"the PJRT plugin refused to register {name} for the host")
