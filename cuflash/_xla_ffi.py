"""The few parts of XLA's typed FFI C API (``xla/ffi/api/c_api.h``) that ``cuflash.jax`` needs, in ctypes.

An FFI handler is a C function ``XLA_FFI_Error* handler(XLA_FFI_CallFrame*)``. Here it is a ctypes
callback into Python: :func:`make_handler` wraps a Python function ``run(frame)`` that reads buffers,
attributes and the stream from the call frame, answers XLA's metadata query at registration, and turns a
Python exception into an ``XLA_FFI_Error`` (so it surfaces as a ``JaxRuntimeError`` with our message
instead of crashing the process).

Only ctypes is imported: the layouts are plain C structs, and field order is ABI (XLA only ever appends).
"""
from __future__ import annotations

import ctypes
import re
import traceback
from pathlib import Path

import numpy as np

c_int64_p = ctypes.POINTER(ctypes.c_int64)

EXTENSION_METADATA = 1          # XLA_FFI_Extension_Type
ATTR_SCALAR, ATTR_STRING = 3, 4  # XLA_FFI_AttrType
ERROR_INVALID_ARGUMENT, ERROR_INTERNAL = 3, 13  # XLA_FFI_Error_Code

# XLA_FFI_DataType -> NumPy dtype name (bfloat16 and float8_e4m3fn are ml_dtypes')
DATA_TYPES = {6: "uint8", 4: "int32", 8: "uint32", 10: "float16", 11: "float32", 16: "bfloat16",
              20: "float8_e4m3fn"}


class ExtensionBase(ctypes.Structure):
    pass


ExtensionBase._fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int),
                          ("next", ctypes.POINTER(ExtensionBase))]


class ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("major_version", ctypes.c_int), ("minor_version", ctypes.c_int)]


class Metadata(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", ApiVersion), ("traits", ctypes.c_uint32)]


class MetadataExtension(ctypes.Structure):
    _fields_ = [("extension_base", ExtensionBase), ("metadata", ctypes.POINTER(Metadata))]


class Buffer(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("dtype", ctypes.c_int), ("data", ctypes.c_void_p), ("rank", ctypes.c_int64), ("dims", c_int64_p)]


class ByteSpan(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class Scalar(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("value", ctypes.c_void_p)]


class Args(ctypes.Structure):  # also the layout of XLA_FFI_Rets
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.POINTER(ctypes.c_int)),
                ("ptrs", ctypes.POINTER(ctypes.POINTER(Buffer)))]


class Attrs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.POINTER(ctypes.c_int)),
                ("names", ctypes.POINTER(ctypes.POINTER(ByteSpan))), ("attrs", ctypes.POINTER(ctypes.c_void_p))]


class ErrorCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("message", ctypes.c_char_p), ("errc", ctypes.c_int)]


class StreamGetArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("ctx", ctypes.c_void_p), ("stream", ctypes.c_void_p)]


_ErrorCreate = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(ErrorCreateArgs))
_StreamGet = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(StreamGetArgs))


class Api(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("api_version", ApiVersion), ("internal_api", ctypes.c_void_p),
                ("error_create", _ErrorCreate), ("error_get_message", ctypes.c_void_p),
                ("error_destroy", ctypes.c_void_p), ("handler_register", ctypes.c_void_p),
                ("stream_get", _StreamGet)]  # more functions follow; none used here


class CallFrame(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.POINTER(ExtensionBase)),
                ("api", ctypes.POINTER(Api)), ("ctx", ctypes.c_void_p), ("stage", ctypes.c_int),
                ("args", Args), ("rets", Args), ("attrs", Attrs), ("future", ctypes.c_void_p)]


HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(CallFrame))


# --------------------------------------------------------------------------------------------
# Reading a call frame
# --------------------------------------------------------------------------------------------

def buffers(args: Args) -> list:
    """``(data pointer, shape, dtype name)`` of each argument or result buffer."""
    out = []
    for i in range(args.size):
        b = args.ptrs[i].contents
        out.append((b.data or 0, tuple(b.dims[j] for j in range(b.rank)), DATA_TYPES.get(b.dtype, str(b.dtype))))
    return out


def string_attr(frame: CallFrame, name: str) -> bytes:
    """The string attribute ``name`` (a keyword argument of ``jax.ffi.ffi_call``)."""
    attrs = frame.attrs
    for i in range(attrs.size):
        span = attrs.names[i].contents
        if ctypes.string_at(span.ptr, span.len).decode() == name:
            if attrs.types[i] != ATTR_STRING:
                raise TypeError(f"FFI attribute {name!r} is not a string")
            value = ctypes.cast(attrs.attrs[i], ctypes.POINTER(ByteSpan)).contents
            return ctypes.string_at(value.ptr, value.len)
    raise KeyError(f"FFI attribute {name!r} missing")


def stream(frame: CallFrame) -> int:
    """The platform stream XLA runs this call on (a ``cudaStream_t`` on CUDA)."""
    args = StreamGetArgs(ctypes.sizeof(StreamGetArgs), None, frame.ctx, None)
    err = frame.api.contents.stream_get(ctypes.byref(args))
    if err:
        raise RuntimeError("XLA_FFI_Stream_Get failed (is this call running on a GPU?)")
    return args.stream or 0


# --------------------------------------------------------------------------------------------
# The handler
# --------------------------------------------------------------------------------------------

def framework_api_version() -> tuple[int, int]:
    """XLA's FFI API version, read from the header jaxlib ships (the handler must report it exactly)."""
    try:
        import jaxlib
        text = (Path(jaxlib.__file__).parent / "include/xla/ffi/api/c_api.h").read_text()
        major = int(re.search(r"#define XLA_FFI_API_MAJOR (\d+)", text).group(1))
        minor = int(re.search(r"#define XLA_FFI_API_MINOR (\d+)", text).group(1))
        return major, minor
    except Exception:
        return 0, 1


def make_handler(run, api_version: tuple[int, int] | None = None):
    """A ctypes FFI handler calling ``run(frame)``; keep the returned object alive as long as XLA may call it.

    ``run`` raising ``ValueError``/``TypeError`` gives XLA an INVALID_ARGUMENT error, anything else INTERNAL;
    the message carries the Python exception (with traceback for unexpected errors).
    """
    major, minor = api_version or framework_api_version()

    def handler(frame_ptr):
        frame = frame_ptr.contents
        ext = frame.extension_start
        while ext:  # XLA asks for the API version and traits once, at registration
            if ext.contents.type == EXTENSION_METADATA:
                metadata = ctypes.cast(ext, ctypes.POINTER(MetadataExtension)).contents.metadata.contents
                api = frame.api.contents.api_version if frame.api else None
                metadata.api_version.major_version = api.major_version if api else major
                metadata.api_version.minor_version = api.minor_version if api else minor
                metadata.traits = 0  # not command-buffer compatible: XLA calls us on a live stream
                return None
            ext = ext.contents.next
        try:
            run(frame)
            return None
        except Exception as err:
            known = isinstance(err, (ValueError, TypeError, NotImplementedError))
            message = f"cuflash: {type(err).__name__}: {err}"
            if not known:
                message += "\n" + traceback.format_exc()
            args = ErrorCreateArgs(ctypes.sizeof(ErrorCreateArgs), None, message.encode(),
                                   ERROR_INVALID_ARGUMENT if known else ERROR_INTERNAL)
            return frame.api.contents.error_create(ctypes.byref(args))

    return HANDLER(handler)


def capsule(handler):
    """The PyCapsule ``jax.ffi.register_ffi_target`` takes."""
    import jax
    return jax.ffi.pycapsule(ctypes.cast(handler, ctypes.c_void_p).value)


def nbytes(shape: tuple, dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
