"""Flags declared once: a CLI flag is a field of a process's frozen config dataclass, declared with ``flag()``.

The field carries everything about the flag — its default, help, group, choices, check — and the rest is derived
from it (as vLLM derives its argparse from its config dataclasses):

- ``add_flags(parser, Config)``: the argparse arguments (``--field-name``; ``bool`` is a switch, ``X | None`` takes
  an ``X``, ``tuple[str, ...]`` is repeatable, ``choices`` are offered);
- ``config_values(Config, ns)``: the constructor values of the flags the parser saw;
- ``check_flags(config)``: each field's choices and check, run by the config's ``__post_init__``, so a config built in
  code is held to what the CLI is, and the error names the flag;
- ``flag_argv(Config, values)``: the command line that gives a child process the same values (``pdcluster up``);
- the flag tables of ``docs/flags.md`` (``common.app.flag_docs``).

A field without ``flag()`` metadata is no flag (it is set in code, or derived from other flags by the command).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from common.errors import ConfigError

Check = Callable[[Any], str | None]  # the value -> None if fine, else what is wrong ("must be >= 1")
DECLARED_BY = "pdcluster_declared_by"  # the attribute of an argparse action naming its flag field


@dataclass(frozen=True)
class Flag:
    help: str
    group: str = ""
    name: str = ""  # the flag's name without "--"; default: the field's name with "-" for "_"
    choices: tuple[Any, ...] = ()
    check: Check | None = None
    metavar: str | None = None


def flag(default: Any, help: str, *, group: str = "", name: str = "", choices: Iterable[Any] = (),
         check: Check | None = None, metavar: str | None = None) -> Any:
    """A config field that is a CLI flag (use as the field's default: ``page_size: int = flag(16, "...")``)."""
    meta = Flag(help=help, group=group, name=name, choices=tuple(choices), check=check, metavar=metavar)
    return dataclasses.field(default=default, metadata={"flag": meta})


# -- checks ----------------------------------------------------------------------------------------------------------
def at_least(low: float) -> Check:
    return lambda v: None if v is None or v >= low else f"must be >= {low}, got {v}"


def above(low: float) -> Check:
    return lambda v: None if v is None or v > low else f"must be > {low}, got {v}"


def in_range(low: float, high: float) -> Check:
    """``low < v <= high``."""
    return lambda v: None if v is None or low < v <= high else f"must be in ({low}, {high}], got {v}"


def tcp_port(*extra: int, meaning: str = "") -> Check:
    """A TCP port (0: any free port), or one of ``extra`` (``meaning`` says what they mean)."""
    def check(v: int | None) -> str | None:
        if v is None or 0 <= v < 65536 or v in extra:
            return None
        return f"must be a TCP port{meaning}, got {v}"
    return check


# -- derivation ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlagField:
    field: dataclasses.Field[Any]
    meta: Flag
    kind: type  # bool, int, float, str (the element type of a repeatable flag)
    repeatable: bool
    choices: tuple[Any, ...]

    @property
    def dest(self) -> str:
        return self.field.name

    @property
    def option(self) -> str:
        return "--" + (self.meta.name or self.field.name.replace("_", "-"))

    @property
    def default(self) -> Any:
        return self.field.default


def arg_group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The parser's argument group of ``title`` (the one ``add_flags`` made, so a title is one group in --help and
    docs/flags.md), else a new one."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def flag_fields(cls: type) -> list[FlagField]:
    """The fields of ``cls`` declared with ``flag()``, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("flag")
        if meta is not None:
            kind, repeatable, literal = _kind(hints[f.name])
            out.append(FlagField(f, meta, kind, repeatable, meta.choices or literal))
    return out


def _kind(hint: Any) -> tuple[type, bool, tuple[Any, ...]]:
    """(element type, repeatable, Literal choices) of a field's annotation."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        assert len(args) == 1, f"a flag is one type or None, got {hint}"
        return _kind(args[0])
    if origin is tuple:
        elem, _, _ = _kind(typing.get_args(hint)[0])
        return elem, True, ()
    if origin is Literal:
        values = typing.get_args(hint)
        return type(values[0]), False, values
    assert hint in (bool, int, float, str), f"unsupported flag type {hint}"
    return hint, False, ()


def add_flags(parser: argparse.ArgumentParser, cls: type, *, exclude: Iterable[str] = (), only: Iterable[str] | None = None,
              only_given: bool = False, group_prefix: str = "", show_defaults: bool = True) -> None:
    """Add ``cls``'s flags to ``parser`` (those in ``only`` when given, but ``exclude``), grouped by ``Flag.group``
    (titles prefixed by ``group_prefix``; a title already in ``parser`` is that group). ``only_given``: a flag left
    off the command line is absent from the namespace (a launcher forwards only what it was given).
    ``show_defaults``: the help says each flag's default (off where another default applies, e.g. a spec's).
    Each argument records the field that declared it (``declared_by``)."""
    skip, keep = set(exclude), None if only is None else set(only)
    for ff in flag_fields(cls):
        if ff.dest in skip or (keep is not None and ff.dest not in keep):
            continue
        title = group_prefix + ff.meta.group if ff.meta.group else group_prefix.rstrip(": ")
        target: argparse._ActionsContainer = arg_group(parser, title) if title else parser
        kw: dict[str, Any] = {"dest": ff.dest, "help": _help(ff) if show_defaults else ff.meta.help}
        if only_given:
            kw["default"] = argparse.SUPPRESS
        if ff.kind is bool:
            assert ff.default is False, f"{ff.option}: a switch defaults to off (name it --disable-... instead)"
            action = target.add_argument(ff.option, action="store_true", **kw)
        else:
            if ff.repeatable:
                kw.update(action="append", default=kw.get("default", []))
            elif not only_given:
                kw["default"] = ff.default
            if ff.choices:
                kw["choices"] = ff.choices
            if ff.meta.metavar:
                kw["metavar"] = ff.meta.metavar
            action = target.add_argument(ff.option, type=ff.kind, **kw)
        setattr(action, DECLARED_BY, f"{cls.__module__}.{cls.__qualname__}.{ff.dest}")


def declared_by(action: argparse.Action) -> str | None:
    """``module.Class.field`` of the flag field that declared ``action`` (None: an argument added by hand)."""
    return getattr(action, DECLARED_BY, None)


def _help(ff: FlagField) -> str:
    if ff.kind is bool or ff.repeatable or ff.default is None:
        return ff.meta.help
    return f"{ff.meta.help} (default {ff.default})"


def config_values(cls: type, ns: argparse.Namespace) -> dict[str, Any]:
    """Constructor values of ``cls`` for the flags present in ``ns`` (repeatable flags as tuples)."""
    given = vars(ns)
    values = {}
    for ff in flag_fields(cls):
        if ff.dest in given:
            value = given[ff.dest]
            values[ff.dest] = tuple(value) if ff.repeatable else value
    return values


def check_flags(config: Any) -> None:
    """Each flag field's choices and check; the first violation is a ``ConfigError`` naming the flag."""
    for ff in flag_fields(type(config)):
        value = getattr(config, ff.dest)
        items = value if ff.repeatable else (value,)
        for item in items:
            if ff.choices and item is not None and item not in ff.choices:
                raise ConfigError(f"{ff.option} must be one of {', '.join(map(str, ff.choices))}, got {item!r}")
            problem = ff.meta.check(item) if ff.meta.check is not None else None
            if problem:
                raise ConfigError(f"{ff.option} {problem}")


def flag_argv(cls: type, values: dict[str, Any]) -> list[str]:
    """The command line giving a child process ``values`` (field name -> value) for ``cls``'s flags."""
    out: list[str] = []
    for ff in flag_fields(cls):
        if ff.dest not in values:
            continue
        value = values[ff.dest]
        if ff.kind is bool:
            out += [ff.option] if value else []
        elif ff.repeatable:
            for item in value:
                out += [ff.option, str(item)]
        elif value is not None:
            out += [ff.option, str(value)]
    return out
