"""common/event_loop.py: which loop a server process runs on."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from common.errors import ConfigError
from common.event_loop import loop_factory, run


def test_auto_and_uvloop_pick_uvloop_asyncio_picks_the_default() -> None:
    assert loop_factory("auto") is uvloop.new_event_loop
    assert loop_factory("uvloop") is uvloop.new_event_loop
    assert loop_factory("asyncio") is None


def test_an_unknown_loop_is_a_config_error_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match="auto, uvloop, asyncio"):
        loop_factory("trio")


def test_uvloop_without_the_package_is_an_error_auto_falls_back(monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_uvloop(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "uvloop":
            raise ImportError("no uvloop")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    with pytest.raises(ConfigError, match="pip install uvloop"):
        loop_factory("uvloop")
    assert loop_factory("auto") is None


@pytest.mark.parametrize("choice, loop_type", [("uvloop", uvloop.Loop), ("asyncio", asyncio.BaseEventLoop)])
def test_run_runs_the_coroutine_on_the_chosen_loop(choice: str, loop_type: type) -> None:
    async def which() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    assert isinstance(run(which(), choice), loop_type)


@pytest.mark.parametrize("flags, on_uvloop", [([], True), (["--event-loop", "asyncio"], False)])
def test_a_node_front_serves_on_the_loop_its_flag_names(monkeypatch, flags: list[str], on_uvloop: bool) -> None:
    import common.node.serve
    from common.app.cli import build_parser, run_serve

    async def serve(_args: object) -> int:
        return int(isinstance(asyncio.get_running_loop(), uvloop.Loop))

    monkeypatch.setattr(common.node.serve, "serve", serve)
    assert run_serve(build_parser().parse_args(["serve", *flags])) == int(on_uvloop)
