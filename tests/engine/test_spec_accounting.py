"""Speculative decoding's counts leave the scheduler with a request's final message and reach every surface: the
Worker's ``Finished.spec``, the node's ``/metrics`` (accept-length histogram, draft / accepted tokens), SGLang's
``meta_info`` names, and the router's gRPC ``Complete.spec`` and HTTP ``pdcluster.spec_decoding``."""

from __future__ import annotations

from prometheus_client import REGISTRY

from common.engine.io_struct import TokenOut
from common.node.convert import token_out_to_proto
from common.node.metrics import observe_final
from pdcluster.v1 import common_pb2
from router.grpc_service import final_to_proto
from router.openai_protocol import extension_of
from router.request import Final


def final(verify: int, drafted: int, accepted: int) -> TokenOut:
    return TokenOut(rid="r", token_ids=[5], finish_reason="length", completion_tokens=30, spec_verify_ct=verify,
                    spec_draft_tokens=drafted, spec_accepted_tokens=accepted)


def test_the_worker_reports_a_speculating_requests_counts_and_accept_length() -> None:
    fin = token_out_to_proto(final(8, 40, 21)).finished
    assert (fin.spec.verify_steps, fin.spec.draft_tokens, fin.spec.accepted_tokens) == (8, 40, 21)
    assert fin.spec.accept_length == 1 + 21 / 8
    assert not token_out_to_proto(final(0, 0, 0)).finished.HasField("spec")  # no speculation, no field


def test_metrics_count_draft_and_accepted_tokens_and_observe_the_accept_length() -> None:
    def value(name: str, labels: dict[str, str] | None = None) -> float:
        return REGISTRY.get_sample_value(name, labels or {}) or 0.0

    before = (value("pdcluster_node_spec_draft_tokens_total"), value("pdcluster_node_spec_accepted_tokens_total"),
              value("pdcluster_node_spec_accept_length_count"), value("pdcluster_node_spec_accept_length_bucket",
                                                                       {"le": "4.0"}))
    observe_final(final(8, 40, 21))  # accept length 3.625
    observe_final(final(0, 0, 0))  # not speculated: not observed
    after = (value("pdcluster_node_spec_draft_tokens_total"), value("pdcluster_node_spec_accepted_tokens_total"),
             value("pdcluster_node_spec_accept_length_count"), value("pdcluster_node_spec_accept_length_bucket",
                                                                      {"le": "4.0"}))
    assert [a - b for a, b in zip(after, before, strict=True)] == [40, 21, 1, 1]


def test_the_router_passes_the_counts_to_grpc_and_http_clients() -> None:
    spec = common_pb2.SpecDecoding(verify_steps=4, draft_tokens=12, accepted_tokens=6, accept_length=2.5)
    f = Final(rid="r", text="x", output_ids=[1], finish_reason="length", prompt_tokens=3, completion_tokens=1,
              cached_tokens=0, served_by="decode-0", timing={}, spec=spec)
    assert final_to_proto(f).complete.spec == spec
    assert extension_of(f)["spec_decoding"] == {"verify_steps": 4, "draft_tokens": 12, "accepted_tokens": 6,
                                                "accept_length": 2.5}
    f.spec = None
    assert "spec_decoding" not in extension_of(f) and not final_to_proto(f).complete.HasField("spec")
