"""Protobuf <-> internal message conversion at the gRPC boundary (servicers stay thin)."""

from __future__ import annotations

import msgspec

from common.engine.io_struct import GenerateReqInput, Timing, TokenOut
from common.engine.sampling.params import SamplingParams
from common.errors import InvalidRequestError
from common.speculative import accept_length
from pdcluster.v1 import common_pb2, worker_pb2

_OPTIONAL_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed",
                    "skip_special_tokens")
_PLAIN_FIELDS = ("min_new_tokens", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos")


def sampling_from_proto(sp: common_pb2.SamplingParams) -> SamplingParams:
    values: dict[str, object] = {name: getattr(sp, name) for name in _OPTIONAL_FIELDS if sp.HasField(name)}
    values.update({name: getattr(sp, name) for name in _PLAIN_FIELDS})
    values["stop"] = tuple(sp.stop)
    values["stop_token_ids"] = tuple(sp.stop_token_ids)
    if sp.logit_bias:
        values["logit_bias"] = dict(sp.logit_bias)
    constraint = sp.WhichOneof("constraint")
    if constraint is not None:
        values[constraint] = getattr(sp, constraint)
    params = msgspec.structs.replace(SamplingParams(), **values)
    params.verify()
    return params


def sampling_to_proto(sp: SamplingParams) -> common_pb2.SamplingParams:
    out = common_pb2.SamplingParams(
        max_new_tokens=sp.max_new_tokens, min_new_tokens=sp.min_new_tokens, temperature=sp.temperature,
        top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p, repetition_penalty=sp.repetition_penalty,
        frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty, stop=list(sp.stop),
        stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos, skip_special_tokens=sp.skip_special_tokens,
    )
    if sp.seed is not None:
        out.seed = sp.seed
    key = sp.grammar_key
    if key is not None:
        setattr(out, key[0], key[1])
    if sp.logit_bias:
        out.logit_bias.update(sp.logit_bias)
    return out


def request_from_proto(req: worker_pb2.GenerateRequest) -> GenerateReqInput:
    if not req.rid:
        raise InvalidRequestError("rid is empty; every request needs an id")
    if not req.input_ids:
        raise InvalidRequestError("input_ids is empty; send at least one prompt token")
    if req.top_logprobs_num < 0:
        raise InvalidRequestError(f"top_logprobs_num must be >= 0, got {req.top_logprobs_num}")
    if not 0 <= req.prior_output_len < len(req.input_ids):
        raise InvalidRequestError(
            f"prior_output_len must be in [0, {len(req.input_ids)}) (it leaves at least one prompt token), "
            f"got {req.prior_output_len}"
        )
    return GenerateReqInput(
        rid=req.rid,
        input_ids=list(req.input_ids),
        sampling_params=sampling_from_proto(req.sampling_params),
        return_logprob=req.return_logprob or req.top_logprobs_num > 0,
        top_logprobs_num=req.top_logprobs_num,
        prior_output_len=req.prior_output_len,
        priority=req.priority if req.HasField("priority") else None,
    )


def timing_to_proto(t: Timing | None) -> common_pb2.Timing:
    if t is None:
        return common_pb2.Timing()
    return common_pb2.Timing(
        queue=t.queue, bootstrap=t.bootstrap, prefill=t.prefill, transfer=t.transfer,
        decode_queue=t.decode_queue, ttft=t.ttft, e2e=t.e2e, transfer_bytes=t.transfer_bytes,
        cached_tokens_host=t.cached_tokens_host, cached_tokens_storage=t.cached_tokens_storage,
    )


def _fill_chunk(chunk: worker_pb2.TokenChunk, out: TokenOut) -> None:
    chunk.token_ids.extend(out.token_ids)
    if out.logprobs:
        chunk.logprobs.extend(out.logprobs)
    for top in out.top_logprobs:
        chunk.top_logprobs.add(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])


def chunk_to_proto(out: TokenOut) -> worker_pb2.TokenChunk:
    chunk = worker_pb2.TokenChunk()
    _fill_chunk(chunk, out)
    return chunk


def token_out_to_proto(out: TokenOut) -> worker_pb2.GenerateResponse:
    """A streamed chunk, or the final message when ``finish_reason`` is set (errors are raised, not sent)."""
    if out.finish_reason is None:
        resp = worker_pb2.GenerateResponse()
        _fill_chunk(resp.chunk, out)  # in place: a chunk passed to the constructor would be copied
        resp.chunk.SetInParent()  # an empty chunk (a request's first, with no tokens yet) still selects ``chunk``
        return resp
    fin = worker_pb2.Finished(
        last=chunk_to_proto(out),
        finish_reason=out.finish_reason,
        usage=common_pb2.Usage(
            prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens
        ),
        timing=timing_to_proto(out.timing),
    )
    if out.spec_verify_ct:
        fin.spec.CopyFrom(common_pb2.SpecDecoding(
            verify_steps=out.spec_verify_ct, draft_tokens=out.spec_draft_tokens,
            accepted_tokens=out.spec_accepted_tokens,
            accept_length=accept_length(out.spec_verify_ct, out.spec_accepted_tokens)))
    if isinstance(out.matched_stop, int):
        fin.matched_token = out.matched_stop
    elif isinstance(out.matched_stop, str):
        fin.matched_stop = out.matched_stop
    return worker_pb2.GenerateResponse(finished=fin)
