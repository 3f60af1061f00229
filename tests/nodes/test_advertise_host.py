"""``--host`` binds, ``--advertise-host`` is what peers are told: a node bound to 0.0.0.0 registers and hands out
its advertised address (bootstrap, KV control and data endpoints), and a disaggregated node refuses 0.0.0.0
without an advertise host."""

from __future__ import annotations

import argparse
import socket
import time
from dataclasses import replace

import pytest

from common.config import ServerArgs, add_server_args, server_args_from_cli
from common.errors import ConfigError
from kvtransfer.backends.tcp import NONCE_BYTES
from kvtransfer.bootstrap import BootstrapClient, BootstrapError, BootstrapServer
from kvtransfer.decode_rooms import DecodeRooms
from kvtransfer.manager import KVManager
from kvtransfer.node import bootstrap_addr, kv_transfer_config
from kvtransfer.prefill_rooms import PrefillRooms
from kvtransfer.testing import DECODE_SEED, PREFILL_SEED, TOKEN, make_args

FINGERPRINT = {"architecture": "TinyLlama", "weights": "abc"}


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_binding_every_interface_without_an_advertise_host_is_refused(mode: str, host: str) -> None:
    with pytest.raises(ConfigError, match="--advertise-host"):
        ServerArgs(disaggregation_mode=mode, host=host)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--advertise-host"):
        ServerArgs(disaggregation_mode=mode, host="10.0.0.5", advertise_host=host)  # type: ignore[arg-type]
    assert ServerArgs(disaggregation_mode=mode, host=host,  # type: ignore[arg-type]
                      advertise_host="10.0.0.5").advertised_host == "10.0.0.5"


def test_the_advertised_host_defaults_to_the_bind_host_and_comes_from_the_cli() -> None:
    assert ServerArgs(disaggregation_mode="decode", host="10.0.0.7").advertised_host == "10.0.0.7"
    assert ServerArgs(host="0.0.0.0").advertised_host == "0.0.0.0"  # a colocated node advertises nothing
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    ns = parser.parse_args(["--disaggregation-mode=prefill", "--host=0.0.0.0", "--advertise-host=10.1.2.3"])
    args = server_args_from_cli(ns)
    assert (args.host, args.advertised_host) == ("0.0.0.0", "10.1.2.3")
    assert bootstrap_addr(args, "prefill") == f"10.1.2.3:{args.disaggregation_bootstrap_port}"
    assert bootstrap_addr(args, "decode") is None


def _registered(client: BootstrapClient, deadline_s: float = 10.0):
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return client.rank(0, 0)
        except BootstrapError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_node_bound_to_every_interface_advertises_its_advertise_host() -> None:
    server = BootstrapServer(secret=TOKEN)
    port = server.start("0.0.0.0", 0)
    assert port
    prefill_args = ServerArgs(disaggregation_mode="prefill", host="0.0.0.0", advertise_host="127.0.0.1",
                              disaggregation_bootstrap_port=port)
    decode_args = replace(prefill_args, disaggregation_mode="decode")
    prefill = decode = None
    client = None
    try:
        config = replace(kv_transfer_config(prefill_args, FINGERPRINT), cluster_token=TOKEN)
        assert (config.host, config.advertised_host) == ("0.0.0.0", "127.0.0.1")
        prefill = KVManager(make_args(PREFILL_SEED, 16), config, PrefillRooms,
                            bootstrap_addr=bootstrap_addr(prefill_args, "prefill"))
        assert prefill.bootstrap_addr == f"127.0.0.1:{port}"
        decode = KVManager(make_args(DECODE_SEED, 16),
                           replace(kv_transfer_config(decode_args, FINGERPRINT), cluster_token=TOKEN), DecodeRooms)
        for mgr in (prefill, decode):
            assert mgr.control.address.startswith("tcp://127.0.0.1:"), mgr.control.address
            assert "0.0.0.0" not in mgr.instance_id
        assert decode.endpoint["host"] == "127.0.0.1"

        # The bootstrap registration a decode peer looks up names the advertised control address.
        client = BootstrapClient(prefill.bootstrap_addr)
        entry = _registered(client)
        assert entry.control_addr == prefill.control.address
        assert entry.instance_id == prefill.instance_id

        # The data listener is bound to every interface and reachable at the advertised endpoint.
        with socket.create_connection((decode.endpoint["host"], int(decode.endpoint["port"])), timeout=5) as sock:
            assert len(sock.recv(NONCE_BYTES, socket.MSG_WAITALL)) == NONCE_BYTES
    finally:
        if client is not None:
            client.close()
        for mgr in (prefill, decode):
            if mgr is not None:
                mgr.close()
        server.stop()
