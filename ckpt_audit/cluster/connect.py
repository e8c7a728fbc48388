"""Reaching a Ray cluster, for every --ray command (scan, prune, export): the one place that imports Ray for the
driver and calls ray.init.

Ray's own init retries a host:port nobody answers for minutes, printing a warning every few seconds; a command in
cron would hang there, and its client (ray://) for 30 s. An explicit host:port, ray:// or not, is therefore tried
with a plain TCP connect first, then with the gRPC call Ray makes first (a port that answers but is no Ray
cluster hung the same way), and a failure is one line; so is the address "auto" resolves to (RAY_ADDRESS, else
the cluster `ray start` last recorded here, which may be long gone). With nothing recorded, Ray fails at once.
"""

from __future__ import annotations

import logging
import os
import socket

RAY_MISSING = "--ray needs the optional extra: pip install 'ckpt-audit[ray]'"  # the CLI puts the command before it
CONNECT_TIMEOUT_S = 5.0


class RayUnavailable(RuntimeError):
    """Ray is not installed: RAY_MISSING."""


class RayConnectError(RuntimeError):
    """The cluster could not be reached: one line."""


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a HOST:PORT or ray://HOST:PORT address (port 1-65535; an IPv6 host without its brackets), or
    None for anything else ("auto", a path, "host:notaport")."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if host and port.isdigit() and 0 < int(port) < 65536:
        return host.strip("[]"), int(port)
    return None


def import_ray():
    """The ray module, or RayUnavailable."""
    try:
        import ray  # noqa: PLC0415 - optional extra, loaded only for --ray
    except ImportError:
        raise RayUnavailable(RAY_MISSING) from None
    return ray


def connect(address: str | None):
    """The ray module, initialised against `address` (None or "auto": the running cluster) unless it is already.
    Raises RayUnavailable or RayConnectError."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    target = _resolved(ray, address)
    if (where := host_port(target)) is not None:
        try:
            socket.create_connection(where, timeout=CONNECT_TIMEOUT_S).close()
        except OSError as exc:
            raise RayConnectError(f"cannot reach the Ray cluster at {target} ({exc.strerror or exc})") from None
        if (why := _not_ray(*where, client=target.startswith("ray://"))) is not None:
            raise RayConnectError(f"cannot reach the Ray cluster at {target}: the server there {why}")
    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError for a bad address
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RayConnectError(f"cannot connect to the Ray cluster at {address}: {why}") from None
    return ray


def _resolved(ray, address: str | None) -> str:
    """The host:port Ray will connect to for `address`: "auto" (or None) as Ray resolves it, else as given."""
    if address not in (None, "auto"):
        return address
    try:
        return ray._private.services.get_ray_address_from_environment(address, None) or ""
    except Exception:  # noqa: BLE001 - nothing recorded, or Ray's lookup changed: ray.init says why
        return ""


def _not_ray(host: str, port: int, *, client: bool) -> str | None:
    """Why the server at host:port is not what Ray connects to, or None. Ray's own connect retries a port that
    answers TCP but not Ray for minutes (its client, ray://, for 30 s): here the gRPC handshake and the first call
    Ray makes (a GCS's GetClusterId, a client server's PING), each within CONNECT_TIMEOUT_S. A server that refuses
    the call (authentication) is left to Ray, and so is TLS (RAY_USE_TLS)."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None
    import grpc  # noqa: PLC0415 - Ray's dependency, loaded with it
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc, ray_client_pb2, ray_client_pb2_grpc  # noqa: PLC0415

    with grpc.insecure_channel(f"[{host}]:{port}" if ":" in host else f"{host}:{port}") as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
        except grpc.FutureTimeoutError:
            return f"does not speak gRPC (no handshake in {CONNECT_TIMEOUT_S:g} s)"
        if client:
            what, call = "a Ray client server", ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo
            request = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING)
        else:
            what, call = "a Ray GCS", gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId
            request = gcs_service_pb2.GetClusterIdRequest()
        try:
            call(request, timeout=CONNECT_TIMEOUT_S)
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return f"is not {what} (Ray's first call: {code.name})"
    return None
