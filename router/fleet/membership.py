"""The router's side of the membership proof: before a worker gets the cluster credential or any request, it answers
a fresh nonce with a proof that only a holder of the cluster secret can compute (``common.wire.worker_auth``).

Outcomes: proven; rejected (a wrong proof, or a refusal/unknown RPC: not a pdcluster node of this cluster; or the
router itself has no secret); unreachable (UNAVAILABLE, DEADLINE_EXCEEDED: retried by the monitor, not counted as a failure).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from common import env
from common.wire.worker_auth import new_nonce, proof_matches
from pdcluster.v1 import worker_pb2, worker_pb2_grpc

TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(frozen=True, slots=True)
class Verdict:
    proven: bool
    reason: str = ""  # "" when proven; else "wrong_proof", "refused", "no_secret" or "unreachable"
    detail: str = ""  # a sentence for logs and ListWorkers (names no secret)

    @property
    def unreachable(self) -> bool:
        return self.reason == "unreachable"


async def challenge(stub: worker_pb2_grpc.WorkerStub, address: str, timeout: float) -> Verdict:
    """Ask the worker at ``address`` to prove membership (``stub``'s channel sends this call without the credential)."""
    if not env.cluster_token():
        return Verdict(False, "no_secret", "the router has no cluster secret to check membership with: set "
                                           "PDCLUSTER_CLUSTER_TOKEN (or PDCLUSTER_CLUSTER_TOKEN_FILE)")
    nonce = new_nonce()
    try:
        resp = await stub.ProveMembership(worker_pb2.ProveMembershipRequest(nonce=nonce, address=address),
                                          timeout=timeout)
    except grpc.aio.AioRpcError as e:
        if e.code() in TRANSIENT:
            return Verdict(False, "unreachable", f"not reachable ({e.code().name})")
        return Verdict(False, "refused", f"membership proof refused ({e.code().name}): not a node of this cluster, "
                                         "or it runs an older pdcluster")
    if proof_matches(resp.proof, nonce, address):
        return Verdict(True)
    return Verdict(False, "wrong_proof", "membership proof does not match: the worker does not hold this "
                                         "cluster's secret (PDCLUSTER_CLUSTER_TOKEN)")
