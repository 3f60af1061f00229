"""``RouterService``: the router's state and plain functions behind both client APIs (gRPC and HTTP)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from common.errors import InvalidRequestError
from common.text.tokenizer import load_tokenizer, resolve_model_path
from router.config import Role, RouterConfig, WorkerSpec
from router.core import RouterCore
from router.drain import Drain
from router.errors import OverloadedError
from router.inputs import InputProcessor, Tokenizer, config_context_len
from router.metrics import RouterMetrics
from router.monitor import Monitor
from router.priority_policy import PriorityPolicy
from router.request import ClientRequest, Delta, Final, GenRequest
from router.tokenize_pool import TokenizePool
from router.workers import Registry

logger = logging.getLogger(__name__)


class RouterService:
    def __init__(self, cfg: RouterConfig) -> None:
        """Loads the tokenizer (blocking, once); call ``start`` on the event loop."""
        self.cfg = cfg
        path: Path = resolve_model_path(cfg.model_path)
        hf = load_tokenizer(path)
        self.model_name = cfg.served_model_name or path.name
        self.metrics = RouterMetrics()
        self.registry = Registry(cfg)
        l0_entries = cfg.tokenizer_cache_l0_max_entries if cfg.tokenizer_cache_enable_l0 else 0
        l1_bytes = cfg.tokenizer_cache_l1_max_memory if cfg.tokenizer_cache_enable_l1 else 0
        tokenizer = Tokenizer(hf, l0_entries, l1_bytes)
        self.inputs = InputProcessor(
            tokenizer,
            self.model_name,
            config_context_len(path),
            cfg.default_max_tokens,
            cfg.request_timeout_s,
            TokenizePool(path, cfg.tokenize_workers, l1_bytes=l1_bytes) if cfg.tokenize_workers else None,
            cfg.tokenize_inline_bytes,
        )
        if tokenizer.cache is not None:
            self.metrics.watch_tokenizer_cache(tokenizer.cache)
        self.core = RouterCore(cfg, self.inputs, hf, self.metrics, self.registry)
        self.monitor = Monitor(cfg, self.registry, self.metrics, self._infos_changed)
        self.drain = Drain()
        self.priorities = PriorityPolicy(cfg)

    @property
    def client_secrets(self) -> tuple[str, ...]:
        """What a client's bearer must be when API keys are on: a key, or the admin token."""
        return tuple(k.key for k in self.cfg.api_keys) + ((self.cfg.admin_token,) if self.cfg.admin_token else ())

    async def start(self) -> None:
        for spec in self.cfg.workers:
            self.registry.add(spec)
        await self.monitor.probe_all()
        self.monitor.start()

    async def stop(self) -> None:
        await self.monitor.stop()
        await self.core.aborter.drain(self.cfg.rpc_timeout_s)
        self.core.failures.close()
        self.core.aborter.failures.close()
        await self.registry.close()
        if self.inputs.pool is not None:
            await self.inputs.pool.close()

    async def build(self, client: ClientRequest) -> GenRequest:
        """``client`` tokenized and checked, unless the router is full: then refused at once, before tokenizing
        (router/admission.py)."""
        try:
            with self.core.admission.tokenizing_one(len(self.core.active)):
                client.priority = self.priorities.admit(
                    client.priority, client.authorization, self.registry.low_priority_values_first())
                return await self.inputs.build(client)
        except OverloadedError:
            self.metrics.requests.labels(client.api, "overloaded").inc()
            raise

    def generate(self, req: GenRequest) -> AsyncIterator[Delta | Final]:
        """Deltas (streaming requests only), then exactly one Final; or raises a typed error. Refused while the
        router drains (router/drain.py)."""
        return self.drain.guard(req.rid, self.core.generate(req))

    def _infos_changed(self) -> None:
        self.inputs.worker_context_len = self.registry.context_len()

    # -- membership ------------------------------------------------------------------------------------------
    async def register(self, address: str, role: Role, bootstrap_port: int | None) -> bool:
        """Add a worker and probe it once; True when it is routable now (otherwise the monitor keeps trying)."""
        if not address:
            raise InvalidRequestError("address must be host:port of the worker's gRPC service")
        text = address if bootstrap_port is None else f"{address}:{bootstrap_port}"
        try:
            spec = WorkerSpec.parse(text, role)
            w, _ = self.registry.add(spec)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        return await self.monitor.probe(w)

    def deregister(self, address: str) -> bool:
        found = self.registry.remove(address)
        if found:
            self.core.forget_worker(address)
            self._infos_changed()
        return found

    def list_workers(self) -> list[dict[str, Any]]:
        out = []
        for w in self.registry:
            free = w.free_pages()
            out.append(
                {
                    "address": w.address,
                    "name": w.name,
                    "state": w.state,
                    "role": w.role,
                    "bootstrap_port": int(w.bootstrap_addr.rsplit(":", 1)[1]) if w.role == "prefill" else 0,
                    "healthy": w.healthy,
                    "routable": w.routable,
                    "dp_size": w.dp_size,
                    "inflight_requests": w.inflight,
                    "free_kv_pages": free if free is not None else -1,
                    "circuit_state": w.breaker.state,
                    "error": w.error,
                    "legs_transport": w.mux.transport,
                    "mux_socket_error": w.mux.socket_error,
                }
            )
        return out

    def ready(self) -> tuple[bool, str]:
        if self.drain.draining:
            return False, "the router is shutting down"
        reg = self.registry
        if reg.routable("prefill") and reg.routable("decode"):
            return True, "ok"
        if reg.routable("colocated"):
            return True, "ok"
        return False, "no routable prefill/decode pair or colocated worker"
