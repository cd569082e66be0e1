"""``kvtier simulate``'s ``--metrics-*`` options: the replay's Prometheus exporter, served by
:mod:`kvtier.metrics_server` within its limits. Every value is checked by argparse (a bad one is
a usage error, exit 2), so no NaN, infinity or out-of-range number reaches the server or
``time.sleep``."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from kvtier.metrics_server import (
    DEFAULT_ADDR,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    MAX_CONNECTIONS,
    MAX_IDLE_TIMEOUT_S,
    ExporterError,
    ServerLimits,
    check_addr,
)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # also an integer of more than 4,300 digits
        raise argparse.ArgumentTypeError(f"not a port number: {_echo(text)}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535: {value}")
    return value


MAX_HOLD_S = 366 * 86_400.0
"""``--metrics-hold``'s bound: a year (``time.sleep`` refuses an infinity)."""


def _ip_address(text: str) -> str:
    try:
        check_addr(text)
    except ExporterError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _echo(text: str) -> str:
    """A bad value as the error shows it: quoted, escaped, at most 40 characters."""
    return repr(text[:40]) + ("..." if len(text) > 40 else "")


def _seconds(minimum: float, maximum: float, zero_ok: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds in range (NaN and infinities refused)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {_echo(text)}") from None
        low_ok = value >= minimum if zero_ok else value > minimum
        if not (math.isfinite(value) and low_ok and value <= maximum):
            bound = "at least" if zero_ok else "above"
            raise argparse.ArgumentTypeError(
                f"seconds {bound} {minimum:g} and at most {maximum:.0f}, not {_echo(text)}"
            )
        return value

    return parse


def _int_in(minimum: int, maximum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {_echo(text)}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{minimum} to {maximum}, not {value}")
        return value

    return parse


def add_metrics_arguments(sim: argparse.ArgumentParser) -> None:
    """``--metrics-*``: the replay's Prometheus exporter (kvtier.metrics_server's limits)."""
    sim.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve kvtier's Prometheus series on http://ADDR:PORT/metrics during the replay "
        "(0: a free port; needs kvtier[prometheus])",
    )
    sim.add_argument(
        "--metrics-addr",
        type=_ip_address,
        default=DEFAULT_ADDR,
        metavar="ADDR",
        help=f"IP address to listen on (default {DEFAULT_ADDR}; 0.0.0.0 or :: for every host)",
    )
    sim.add_argument(
        "--metrics-hold",
        type=_seconds(0.0, MAX_HOLD_S, zero_ok=True),
        default=0.0,
        metavar="SECONDS",
        help="keep serving the final metrics this long after the replay (default 0)",
    )
    sim.add_argument(
        "--metrics-max-connections",
        type=_int_in(1, MAX_CONNECTIONS),
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"connections served at once; more are refused (default {DEFAULT_MAX_CONNECTIONS})",
    )
    sim.add_argument(
        "--metrics-idle-timeout",
        type=_seconds(0.0, MAX_IDLE_TIMEOUT_S, zero_ok=False),
        default=DEFAULT_IDLE_TIMEOUT_S,
        metavar="SECONDS",
        help="close a connection that has not sent its request in this time "
        f"(default {DEFAULT_IDLE_TIMEOUT_S:g})",
    )


def replay_metrics(args: argparse.Namespace) -> Any:
    from kvtier.prometheus import ReplayMetrics

    limits = ServerLimits(
        addr=args.metrics_addr,
        port=args.metrics_port,
        max_connections=args.metrics_max_connections,
        idle_timeout_s=args.metrics_idle_timeout,
    )
    return ReplayMetrics(limits)
