"""``argparse`` types that check the values of ``opmux`` options at the command line.

A bad value ends the command with one line naming the option, the value and the range
(``opmux generate: error: argument --block-size: must be an integer in 1..65536, got
'100000000'``), before anything is loaded or allocated. :func:`run_device` checks a
``--device`` the same way when the command starts, before any work or write.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

__all__ = ["OneLineParser", "finite_float", "int_in", "run_device", "utf8_text"]


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (no usage block), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message.splitlines()[0]}\n")


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An option type: an integer in ``low..high``."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be an integer in {low}..{high}, got {text[:40]!r}")
        return value

    return parse


def finite_float(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """An option type: a finite number in ``[low, high]`` (``(low, high]`` when
    ``low_open``)."""
    bracket = "(" if low_open else "["

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (low < value if low_open else low <= value)
                and value <= high):
            raise argparse.ArgumentTypeError(
                f"must be a finite number in {bracket}{low:g}, {high:g}], got {text[:40]!r}")
        return value

    return parse


def utf8_text(text: str) -> str:
    """An option type: text that is valid UTF-8 (a command line may carry any bytes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = text.encode("utf-8", "surrogateescape")[:40]
        raise argparse.ArgumentTypeError(f"is not valid UTF-8 text: {shown!r}") from None
    return text


def run_device(text: str, command: str, *, meta: bool = False) -> str:
    """``text`` when it names a torch device that exists here (``meta`` only when ``meta``:
    a command that runs or times ops needs values).

    :param command: the ``opmux`` command, for the message.
    :raises opmux.ConfigError: one line naming the option, the value and what to use.
    """
    import torch

    from opmux.core.errors import ConfigError

    where = f"opmux {command}: --device {text[:40]!r}"
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise ConfigError(f"{where} is not a torch device; use e.g. cpu or cuda") from None
    if dev.type == "meta":
        if meta:
            return text
        raise ConfigError(f"{where}: meta tensors hold no values to run, check or time; use "
                          f"--device cpu")
    if dev.type == "cpu":
        return text
    module = getattr(torch, dev.type, None)
    available = (module is not None and hasattr(module, "is_available")
                 and bool(module.is_available()))
    if not available:
        raise ConfigError(f"{where}: no {dev.type} device here; use --device cpu")
    count = getattr(module, "device_count", None)
    if dev.index is not None and callable(count) and dev.index >= int(count()):
        raise ConfigError(f"{where}: there are {int(count())} {dev.type} device(s) here; use "
                          f"an index below that")
    return text
