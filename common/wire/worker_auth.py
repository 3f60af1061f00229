"""The cluster credential on node RPCs: every ``pdcluster.v1.Worker`` call (Prefill, Decode, Abort, GetRank,
GetServerInfo, GetLoad, ...) carries ``x-pdcluster-credential`` metadata; health and reflection stay open.

The credential is derived from the cluster secret (HMAC-SHA256 under a fixed label), never the secret itself, so a
node or proxy that sees it learns nothing that opens the KV control plane or the Bootstrap service.

Before the router sends a worker the credential (or any request), the worker proves membership: ``ProveMembership``
(the one Worker RPC served without the credential) answers a router nonce with
HMAC-SHA256(membership key, label || len(nonce) || nonce || address), the membership key being the cluster secret's
HMAC under its own label. A node answers only for an address naming its own gRPC port.

Relays that remain without (m)TLS: a process on another host listening on the *same port number* as a real node, or
a transparent TCP proxy, can forward the challenge to that node and pass; it then sees the credential and prompts in
clear. ``--tls-ca`` (mTLS, the router checks the node's certificate) closes that: a relay can only forward ciphertext.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import struct
from collections.abc import Callable

import grpc

from common import env
from common.wire.security import same_secret

METADATA_KEY = "x-pdcluster-credential"
WORKER_SERVICE = "/pdcluster.v1.Worker/"
MEMBERSHIP_RPC = WORKER_SERVICE + "ProveMembership"
NONCE_BYTES = 32
MIN_NONCE_BYTES = 16
_MEMBERSHIP_KEY_LABEL = b"pdcluster membership key v1"
_PROOF_LABEL = b"pdcluster membership proof v1"
REFUSED = "node RPCs need the cluster credential (the router and nodes must share PDCLUSTER_CLUSTER_TOKEN)"


def worker_credential(secret: str | None = None) -> str:
    secret = env.cluster_token() if secret is None else secret
    return hmac.new(secret.encode(), b"pdcluster worker rpc", hashlib.sha256).hexdigest() if secret else ""


def credential_metadata(secret: str | None = None) -> tuple[tuple[str, str], ...]:
    return ((METADATA_KEY, worker_credential(secret)),)


class ChallengeRefused(ValueError):
    """A membership challenge this node does not answer (the message says why; it names no secret)."""


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def membership_proof(nonce: bytes, address: str, secret: str | None = None) -> bytes:
    """The proof that the holder of ``secret`` was challenged with ``nonce`` at ``address``; b"" without a secret."""
    secret = env.cluster_token() if secret is None else secret
    if not secret:
        return b""
    key = hmac.new(secret.encode(), _MEMBERSHIP_KEY_LABEL, hashlib.sha256).digest()
    message = _PROOF_LABEL + struct.pack(">I", len(nonce)) + nonce + address.encode()
    return hmac.new(key, message, hashlib.sha256).digest()


def answer_challenge(nonce: bytes, address: str, own_port: int, secret: str | None = None) -> bytes:
    """Node side of ``ProveMembership``: the proof for (``nonce``, ``address``) when ``address`` names ``own_port``."""
    if len(nonce) < MIN_NONCE_BYTES:
        raise ChallengeRefused(f"the challenge nonce must be >= {MIN_NONCE_BYTES} bytes")
    _, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) != own_port:
        raise ChallengeRefused("the challenged address does not name this node's gRPC port")
    return membership_proof(nonce, address, secret)


def proof_matches(proof: bytes, nonce: bytes, address: str, secret: str | None = None) -> bool:
    """Router side: constant-time check of a node's answer to our ``nonce`` at ``address``."""
    return same_secret(proof, membership_proof(nonce, address, secret))


class WorkerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Node side: refuses Worker RPCs without the credential (UNAUTHENTICATED); ``ProveMembership`` needs none."""

    def __init__(self, secret: str | None = None) -> None:
        self._credential = worker_credential(secret)

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        method = handler_call_details.method
        if not method.startswith(WORKER_SERVICE) or method == MEMBERSHIP_RPC:
            return await continuation(handler_call_details)
        presented = dict(handler_call_details.invocation_metadata or ()).get(METADATA_KEY, "")
        if same_secret(presented if isinstance(presented, str) else "", self._credential):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends every call with UNAUTHENTICATED (a handler of another
    shape would leave a streaming caller hanging)."""
    de, ser = handler.request_deserializer, handler.response_serializer

    async def refuse(request_or_iterator, context):  # type: ignore[no-untyped-def]
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)

    async def refuse_stream(request_or_iterator, context):  # type: ignore[no-untyped-def]
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)
        yield  # pragma: no cover  (an async generator, as a streaming handler must be)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, de, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, de, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, de, ser)
    return grpc.unary_unary_rpc_method_handler(refuse, de, ser)


class _AioCredential:
    """Adds the credential to a call, except to ``ProveMembership`` and while ``admitted()`` is False."""

    def __init__(self, metadata: tuple[tuple[str, str], ...], admitted: Callable[[], bool] | None) -> None:
        self._metadata = metadata
        self._admitted = admitted

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        method = d.method.decode() if isinstance(d.method, bytes) else d.method
        if method == MEMBERSHIP_RPC or (self._admitted is not None and not self._admitted()):
            return d
        metadata = grpc.aio.Metadata(*(tuple(d.metadata) if d.metadata else ()), *self._metadata)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)


# NOTE: grpc.aio files each interceptor under its first matching kind only, so each kind is its own class.
class _AioUnaryCredential(_AioCredential, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request)


class _AioStreamCredential(_AioCredential, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request)


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                   "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class _SyncCredential(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, d):  # type: ignore[no-untyped-def]
        return _Details(d.method, d.timeout, [*(d.metadata or ()), *self._metadata], d.credentials,
                        d.wait_for_ready, getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)


def aio_worker_channel(address: str, options: list | tuple = (), tls: grpc.ChannelCredentials | None = None,
                       admitted: Callable[[], bool] | None = None) -> grpc.aio.Channel:
    """The router's channel to a node, over (m)TLS with ``tls``. Calls carry the cluster credential, except
    ``ProveMembership`` and any call made while ``admitted()`` is False (the node has not proven membership yet), so
    the challenge and the later calls share the channel (one connection while it stays up) without the credential
    going out first."""
    metadata = credential_metadata()
    interceptors = [_AioUnaryCredential(metadata, admitted), _AioStreamCredential(metadata, admitted)]
    if tls is not None:
        return grpc.aio.secure_channel(address, tls, options=list(options), interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)


def worker_channel(address: str, tls: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A blocking channel to a node carrying the cluster credential (tools, tests)."""
    channel = grpc.secure_channel(address, tls) if tls is not None else grpc.insecure_channel(address)
    return grpc.intercept_channel(channel, _SyncCredential(credential_metadata()))
