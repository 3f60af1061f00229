"""UCP one-sided calls the ``ucxx`` Python API does not wrap (ucxx 0.52 has tag/stream/AM messages only): memory
registration, remote keys, PUT and endpoint flush, called through ``ctypes`` on the UCP handles ucxx owns.

Every call here runs on the thread that progresses the ucxx worker (the ``ucx`` backend's loop thread): ucxx
creates its worker single-threaded. The UCX context is ucxx's (features include RMA), so registrations and
endpoints are shared with the tag API.

    decode:  Registration(context, address, length) -> pack() -> bytes, published to peers
    prefill: RemoteKey(endpoint, packed) ; put(endpoint, src, length, dst, rkey) per segment ; flush(endpoint)
             -> a request polled with status() until the bytes are in the target's memory (remote completion)
"""

from __future__ import annotations

import ctypes
import os
import time

import libucx
import ucxx

libucx.load_library()
_ucp = ctypes.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so.0"))

UCS_OK, UCS_INPROGRESS = 0, 1
_ERR_LAST = -100  # UCS_ERR_LAST: status pointers in [-100, -1] are errors
_MEM_MAP_ADDRESS_LENGTH = (1 << 0) | (1 << 1)  # UCP_MEM_MAP_PARAM_FIELD_ADDRESS | _LENGTH (prot defaults to all)


class _MemMapParams(ctypes.Structure):  # ucp_mem_map_params_t (leading fields; only the masked ones are read)
    _fields_ = [("field_mask", ctypes.c_uint64), ("address", ctypes.c_void_p), ("length", ctypes.c_size_t),
                ("flags", ctypes.c_uint), ("prot", ctypes.c_uint), ("memory_type", ctypes.c_int),
                ("exported_memh_buffer", ctypes.c_void_p)]


class _RequestParam(ctypes.Structure):  # ucp_request_param_t with op_attr_mask 0: no callback, UCP allocates
    _fields_ = [("op_attr_mask", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("request", ctypes.c_void_p),
                ("cb", ctypes.c_void_p), ("datatype", ctypes.c_uint64), ("user_data", ctypes.c_void_p),
                ("reply_buffer", ctypes.c_void_p), ("memory_type", ctypes.c_int), ("recv_info", ctypes.c_size_t),
                ("memh", ctypes.c_void_p)]


_ERR_HANDLER_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)  # (arg, ep, status)
# An endpoint's failure is handled once a callback is installed: UCX then fails the endpoint's operations with the
# error, and they report it (a PUT's status, the flush request). Nothing more is needed from the callback itself.
_ERROR_HANDLED = _ERR_HANDLER_CB(lambda _arg, _ep, _status: None)


class _ErrHandler(ctypes.Structure):  # ucp_err_handler_t
    _fields_ = [("cb", _ERR_HANDLER_CB), ("arg", ctypes.c_void_p)]


class _SockAddr(ctypes.Structure):  # ucs_sock_addr_t
    _fields_ = [("addr", ctypes.c_void_p), ("addrlen", ctypes.c_uint32)]


class _EpParams(ctypes.Structure):  # ucp_ep_params_t (libucx 1.21)
    _fields_ = [("field_mask", ctypes.c_uint64), ("address", ctypes.c_void_p), ("err_mode", ctypes.c_int),
                ("err_handler", _ErrHandler), ("user_data", ctypes.c_void_p), ("flags", ctypes.c_uint),
                ("sockaddr", _SockAddr), ("conn_request", ctypes.c_void_p), ("name", ctypes.c_char_p),
                ("local_sockaddr", _SockAddr)]


_EP_REMOTE_ADDRESS_AND_ERR_HANDLER = (1 << 0) | (1 << 2)  # UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | _ERR_HANDLER
_OP_ATTR_FIELD_FLAGS, _EP_CLOSE_FLAG_FORCE = 1 << 4, 1 << 0


def _sig(name: str, restype: type | None, *argtypes: type) -> ctypes._CFuncPtr:
    fn = getattr(_ucp, name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


_vp, _sz, _u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64
_mem_map = _sig("ucp_mem_map", ctypes.c_int, _vp, ctypes.POINTER(_MemMapParams), ctypes.POINTER(_vp))
_mem_unmap = _sig("ucp_mem_unmap", ctypes.c_int, _vp, _vp)
_rkey_pack = _sig("ucp_rkey_pack", ctypes.c_int, _vp, _vp, ctypes.POINTER(_vp), ctypes.POINTER(_sz))
_rkey_buffer_release = _sig("ucp_rkey_buffer_release", None, _vp)
_rkey_unpack = _sig("ucp_ep_rkey_unpack", ctypes.c_int, _vp, ctypes.c_char_p, ctypes.POINTER(_vp))
_rkey_destroy = _sig("ucp_rkey_destroy", None, _vp)
put = _sig("ucp_put_nbi", ctypes.c_int, _vp, _vp, _sz, _u64, _vp)
"""put(ep, source address, length, destination address, rkey) -> UCS_OK / UCS_INPROGRESS / error (< 0)."""
_flush = _sig("ucp_ep_flush_nbx", _vp, _vp, ctypes.POINTER(_RequestParam))
_ep_create = _sig("ucp_ep_create", ctypes.c_int, _vp, ctypes.POINTER(_EpParams), ctypes.POINTER(_vp))
_ep_close = _sig("ucp_ep_close_nbx", _vp, _vp, ctypes.POINTER(_RequestParam))
_check = _sig("ucp_request_check_status", ctypes.c_int, _vp)
_cancel = _sig("ucp_request_cancel", None, _vp, _vp)
_free = _sig("ucp_request_free", None, _vp)
_status_string = _sig("ucs_status_string", ctypes.c_char_p, ctypes.c_int) if hasattr(_ucp, "ucs_status_string") \
    else None


class UcpError(RuntimeError):
    """A UCP call returned an error status."""


def describe(status: int) -> str:
    if _status_string is not None:
        return f"{_status_string(status).decode()} ({status})"
    return f"UCS status {status}"


def _check_ok(status: int, what: str) -> None:
    if status != UCS_OK:
        raise UcpError(f"{what}: {describe(status)}")


def _context() -> int:
    return int(ucxx.core._get_ctx().context.handle)


def worker() -> int:
    return int(ucxx.get_ucp_worker())


def progress() -> None:
    """Progress the ucxx worker once (completes PUTs, flushes and ucxx's own requests alike)."""
    ucxx.core._get_ctx().worker.progress()


class Registration:
    """One buffer registered with the UCX context for remote access (REMOTE_READ|WRITE, UCX's default)."""

    def __init__(self, address: int, length: int) -> None:
        params = _MemMapParams(field_mask=_MEM_MAP_ADDRESS_LENGTH, address=address, length=length)
        memh = _vp()
        _check_ok(_mem_map(_context(), ctypes.byref(params), ctypes.byref(memh)), "ucp_mem_map")
        self._memh: int | None = memh.value

    def pack(self) -> bytes:
        """The remote key a peer unpacks to write into this buffer."""
        buf, size = _vp(), _sz()
        _check_ok(_rkey_pack(_context(), self._memh, ctypes.byref(buf), ctypes.byref(size)), "ucp_rkey_pack")
        try:
            return ctypes.string_at(buf.value, size.value)
        finally:
            _rkey_buffer_release(buf)

    def unmap(self) -> None:
        if self._memh is not None:
            memh, self._memh = self._memh, None
            _check_ok(_mem_unmap(_context(), memh), "ucp_mem_unmap")


class RemoteKey:
    """A peer's packed remote key, unpacked for one endpoint; destroyed before that endpoint closes."""

    def __init__(self, ep: int, packed: bytes) -> None:
        rkey = _vp()
        _check_ok(_rkey_unpack(ep, packed, ctypes.byref(rkey)), "ucp_ep_rkey_unpack")
        self.handle: int | None = rkey.value

    def destroy(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            _rkey_destroy(handle)


class Endpoint:
    """An endpoint to a peer's worker address with no peer-failure error handling (so UCX may pick ``cma`` on one
    host: libucx 1.21's cma has no peer-failure support, and an endpoint that asks for it gets tcp) but with an
    error callback. Without the callback, a transport error on it (a PUT to a peer process that just died:
    ``process_vm_writev ... No such process``) is unhandled and UCX aborts the whole process; with it, the endpoint
    fails: its outstanding and later operations complete with the error. Closed with ``close``."""

    def __init__(self, worker_address: bytes) -> None:
        address = ctypes.create_string_buffer(worker_address, len(worker_address))
        params = _EpParams(field_mask=_EP_REMOTE_ADDRESS_AND_ERR_HANDLER, address=ctypes.addressof(address),
                           err_handler=_ErrHandler(_ERROR_HANDLED, None))
        ep = _vp()
        _check_ok(_ep_create(worker(), ctypes.byref(params), ctypes.byref(ep)), "ucp_ep_create")
        self.handle: int | None = ep.value

    def close(self, timeout_s: float) -> None:
        """Force-close (outstanding operations complete with an error; no flush), progressing until it is done."""
        if self.handle is None:
            return
        handle, self.handle = self.handle, None
        req = _ep_close(handle, ctypes.byref(_RequestParam(op_attr_mask=_OP_ATTR_FIELD_FLAGS,
                                                           flags=_EP_CLOSE_FLAG_FORCE)))
        if req is None or _ERR_LAST <= ctypes.c_int64(req).value < 0:
            return
        end = time.monotonic() + timeout_s
        while status(req) == UCS_INPROGRESS and time.monotonic() < end:
            progress()
        release(req)


def flush(ep: int) -> int | None:
    """Start a flush of ``ep``: None when every operation already completed remotely, else a request for
    ``status``/``release``; raises UcpError when the endpoint failed."""
    req = _flush(ep, ctypes.byref(_RequestParam()))
    if req is None:
        return None
    signed = ctypes.c_int64(req).value
    if _ERR_LAST <= signed < 0:
        raise UcpError(f"ucp_ep_flush_nbx: {describe(signed)}")
    return req


def status(req: int) -> int:
    """UCS_INPROGRESS until the request completes; then UCS_OK or its error."""
    return int(_check(req))


def cancel(req: int) -> None:
    _cancel(worker(), req)


def release(req: int) -> None:
    _free(req)
