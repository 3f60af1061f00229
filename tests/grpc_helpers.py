"""What a gRPC server says about itself through server reflection (what ``grpcurl list`` / ``describe`` use)."""

from __future__ import annotations

import grpc
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase


def reflected_services(address: str, timeout_s: float = 10.0) -> dict[str, list[str]]:
    """Service name -> its method names, as listed and described through reflection on ``address`` (plaintext).
    Blocking: from async code, call it in a thread."""
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        db = ProtoReflectionDescriptorDatabase(channel)
        pool = DescriptorPool(db)
        return {name: [m.name for m in pool.FindServiceByName(name).methods] for name in db.get_services()}
