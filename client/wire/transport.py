"""Talking to the service: TLS credentials, bearer metadata, the wire error mapping and a failover channel.

Every client of the service (`NgramClient`'s background loop, `RemoteDrafter`, the
`ngramcache rebuild` command, the demo) builds its channels, credentials and metadata here,
and turns a failed call into a library error with `error_from_rpc`, the client side's one
mapping from gRPC statuses.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import grpc
from grpc import aio

from ngramcache.client._proto.v1 import admin_pb2_grpc, counts_pb2_grpc, static_files_pb2_grpc
from ngramcache.client.kernel.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    NgramCacheError,
    OverloadedError,
    ServiceUnreachableError,
)
from ngramcache.client.kernel.retry import Backoff, retry
from ngramcache.client.wire.diagnose import diagnose
from ngramcache.client.wire.rpc_errors import REASON_KEY, error_class_for, retry_after_of

# Backoff is kernel.retry's, named here too: it was first defined here (ClientConfig.backoff is one).
__all__ = ["REASON_KEY", "Backoff", "Channel", "FailoverChannel", "auth_metadata", "channel_credentials",
           "error_from_rpc", "open_channel", "read_pem", "unreachable_error", "wait_ready"]

log = logging.getLogger("ngramcache.client.sync")

T = TypeVar("T")

Metadata = tuple[tuple[str, str], ...]


# errors


def _reason(trailing: Iterable[tuple[str, Any]] | None) -> str | None:
    for key, value in trailing or ():
        if key == REASON_KEY:
            return str(value)
    return None


def error_from_rpc(err: grpc.RpcError) -> NgramCacheError:
    """The library error for a failed call (its ``retriable`` says whether to try again).

    Derived from the wire error table (`ngramcache.client.wire.rpc_errors`): an error the service
    raised arrives as itself (`NamespaceNotFoundError`, `LeaseHeldError`, ...); UNAVAILABLE,
    DEADLINE_EXCEEDED, CANCELLED and ABORTED are otherwise `BackendUnavailableError`
    (retriable); RESOURCE_EXHAUSTED (a server limit) and the other codes a caller can fix
    `InvalidArgumentError`; anything else a non-retriable `NgramCacheError`. The error carries
    the call's ``code`` and ``reason``; an `OverloadedError` its ``retry_after`` hint too.
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    reason = _reason(trailing)
    message = f"{code.name}: {details}" if code is not None else str(details)
    if code in _AUTH_HINTS:
        message += _AUTH_HINTS[code]
    out = error_class_for(code, reason)(message)
    out.code = code  # type: ignore[attr-defined]
    out.reason = reason  # type: ignore[attr-defined]
    out.details = details  # type: ignore[attr-defined]  # the service's words alone (the CLI words its own hint)
    if isinstance(out, OverloadedError):
        out.retry_after = retry_after_of(trailing)
    return out


# What a library caller changes when the service refuses its credentials.
_AUTH_HINTS = {
    grpc.StatusCode.UNAUTHENTICATED: " (the service requires a bearer token it knows: pass token=... to the client)",
    grpc.StatusCode.PERMISSION_DENIED: " (the token lacks that role on that namespace: pass token=... with it)",
}


# credentials and metadata


def read_pem(value: str | bytes | None, what: str) -> bytes | None:
    """The PEM bytes of ``value`` (a path, or the bytes themselves); InvalidArgumentError naming ``what`` if unreadable."""
    if value is None or isinstance(value, bytes):
        return value
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidArgumentError(f"{what} {value}: {e.strerror}") from None


def channel_credentials(ca: str | bytes | None, cert: str | bytes | None = None,
                        key: str | bytes | None = None) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting the PEM CA certificates ``ca`` (a path or the bytes), with a client
    certificate for mutual TLS; None (plaintext) when ``ca`` is None."""
    if ca is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=read_pem(ca, "tls_ca"), private_key=read_pem(key, "tls_key"),
                                        certificate_chain=read_pem(cert, "tls_cert"))


def auth_metadata(token: str | None) -> Metadata:
    """The call metadata that carries a bearer token (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None,
                 options: Sequence[tuple[str, int]] = ()) -> grpc.Channel:
    """A synchronous channel to ``address``: TLS with ``credentials``, plaintext without."""
    if credentials is not None:
        return grpc.secure_channel(address, credentials, options=list(options))
    return grpc.insecure_channel(address, options=list(options))


# readiness


def unreachable_error(address: str, tls_ca: bytes | None = None, tls_cert: str | bytes | None = None,
                      tls_key: str | bytes | None = None, *, timeout: float = 2.0,
                      fallback: NgramCacheError | None = None) -> NgramCacheError:
    """The error for a service at ``address`` that gRPC could not reach: `ServiceUnreachableError` with the
    cause a probe finds (`ngramcache.client.wire.diagnose`), else ``fallback`` (or a plain BackendUnavailableError)."""
    found = diagnose(address, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, timeout=timeout)
    if found is not None:
        return ServiceUnreachableError(found)
    return fallback or BackendUnavailableError(f"cannot reach the service at {address}")


def wait_ready(channel: grpc.Channel, address: str, timeout: float, tls_ca: bytes | None = None,
               tls_cert: str | bytes | None = None, tls_key: str | bytes | None = None) -> None:
    """Returns once ``channel`` is connected; raises as soon as a failed connection attempt has a cause.

    Each time gRPC reports TRANSIENT_FAILURE the address is probed (`unreachable_error`): a refused
    connection, a TLS mismatch, a server that is not gRPC end the wait at once, with that cause. A
    probe that finds nothing wrong (a service that was just starting) lets the wait go on.

    Raises:
        ServiceUnreachableError: the cause found, at once or at the timeout.
        BackendUnavailableError: nothing answered within ``timeout`` seconds and the probe found no cause.
    """
    deadline = time.monotonic() + timeout
    wake = threading.Event()
    failures = [0]

    def watch(state: grpc.ChannelConnectivity) -> None:
        if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            failures[0] += 1
            wake.set()

    ready = grpc.channel_ready_future(channel)  # asks the channel to connect
    ready.add_done_callback(lambda _: wake.set())
    # Not try_to_connect again: that flag keeps gRPC's polling thread going after the last unsubscribe, and a
    # close() meanwhile makes it raise "Channel closed!" in that thread.
    channel.subscribe(watch, try_to_connect=False)
    try:
        seen = 0
        while not ready.done():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            wake.wait(left)
            wake.clear()
            if ready.done():
                return
            if failures[0] != seen:
                seen = failures[0]
                found = diagnose(address, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                                 timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                if found is not None:
                    raise ServiceUnreachableError(found)
        if ready.done():
            return
        raise unreachable_error(address, tls_ca, tls_cert, tls_key, timeout=2.0, fallback=BackendUnavailableError(
            f"no service answered at {address} within {timeout:g} s"))
    finally:
        channel.unsubscribe(watch)
        ready.cancel()


# the failover channel of the background loop


class Channel:
    """One grpc.aio channel to one address and its stubs; `epoch` counts the switches before it.

    Attributes:
        stored_at: when (time.monotonic()) the service last acknowledged a push on this channel
            (`stored`): proof that it took a new call and its store answered then, which the
            health check may rely on instead of a call of its own (client/sync/health.py).
    """

    OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
               ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.max_receive_message_length", 64 << 20))

    def __init__(self, address: str, epoch: int, credentials: grpc.ChannelCredentials | None = None) -> None:
        self.address = address
        self.epoch = epoch
        self.channel = (aio.secure_channel(address, credentials, options=list(self.OPTIONS)) if credentials is not None
                        else aio.insecure_channel(address, options=list(self.OPTIONS)))
        self.admin = admin_pb2_grpc.AdminStub(self.channel)  # type: ignore[no-untyped-call]  # generated, untyped
        self.counts = counts_pb2_grpc.CountsStub(self.channel)  # type: ignore[no-untyped-call]  # generated, untyped
        self.files = static_files_pb2_grpc.StaticFilesStub(self.channel)  # type: ignore[no-untyped-call]  # generated, untyped
        self.stored_at = -1e9

    def stored(self) -> None:
        """The service acknowledged a push (Push or PushHistory) on this channel now."""
        self.stored_at = time.monotonic()


class FailoverChannel:
    """The current `Channel` over a list of addresses, and calls retried across them.

    Thread-safety: none; use it from one event loop (the client's background loop).

    Args:
        addresses: ``host:port`` of each replica, tried in order.
        credentials: TLS credentials, or None for plaintext.
        backoff: the delays between retries.
        on_switch: called with the new address after every switch.
    """

    def __init__(self, addresses: Sequence[str], credentials: grpc.ChannelCredentials | None, backoff: Backoff,
                 on_switch: Callable[[str, bool], None]) -> None:
        self._addresses = tuple(addresses)
        self._credentials = credentials
        self._backoff = backoff
        self._on_switch = on_switch
        self._index = 0
        self._chan: Channel | None = None

    def current(self) -> Channel:
        """The channel calls go to now (opened on first use)."""
        if self._chan is None:
            self._chan = Channel(self._addresses[self._index], 0, self._credentials)
            self._on_switch(self._chan.address, False)
        return self._chan

    async def switch(self, epoch: int) -> None:
        """Move to the next address (a new channel to the same one when there is one), unless another task
        already did since ``epoch``."""
        old = self._chan
        if old is None or old.epoch != epoch:
            return
        self._index = (self._index + 1) % len(self._addresses)
        self._chan = Channel(self._addresses[self._index], epoch + 1, self._credentials)
        self._on_switch(self._chan.address, True)
        log.info("ngramcache client: switching to %s", self._chan.address)
        await old.channel.close(grace=0.2)

    async def retrying(self, what: str, call: Callable[[Channel], Awaitable[T]], until: float | None,
                       cancelled_by_us: Callable[[], bool],
                       overloaded: Callable[[OverloadedError], float | None] | None = None) -> T:
        """Run ``call`` until it succeeds (`retry`): a retriable failed RPC backs off, and UNAVAILABLE,
        or DEADLINE_EXCEEDED with another address to try, also moves to the next address.

        A CancelledError that is not the caller's own (``cancelled_by_us()`` false) means another
        task switched the channel under this call: the same call runs again on the new one. An
        error ``call`` raises itself (not a failed RPC) ends the retry.

        Args:
            overloaded: the wait after a shed call (`OverloadedError`, with the service's hint), or
                None to give up; without it a shed call backs off as any retriable failure does.

        Raises:
            NgramCacheError: a non-retriable failure, or a retriable one past ``until`` (monotonic).
        """
        rpc_error: NgramCacheError | None = None  # the last failed RPC's error, told apart from the call's own

        async def call_current() -> T:
            nonlocal rpc_error
            chan = self.current()
            try:
                return await call(chan)
            except grpc.RpcError as e:
                rpc_error = error_from_rpc(e)
                code = getattr(rpc_error, "code", None)
                if rpc_error.retriable and (code == grpc.StatusCode.UNAVAILABLE or (
                        code == grpc.StatusCode.DEADLINE_EXCEEDED and len(self._addresses) > 1)):
                    await self.switch(chan.epoch)  # down, or not answering in time: the next replica
                raise rpc_error from None

        def after(e: BaseException, attempt: int) -> float | None:
            if isinstance(e, asyncio.CancelledError):
                if cancelled_by_us():
                    return None
                log.debug("%s cancelled by a channel switch; retrying", what)
            elif not isinstance(e, NgramCacheError) or e is not rpc_error or not e.retriable:
                return None
            elif overloaded is not None and isinstance(e, OverloadedError):
                return overloaded(e)
            elif until is not None and time.monotonic() >= until:
                return None
            else:
                log.debug("%s failed (%s); retrying", what, e)
            delay = self._backoff.delay(attempt)
            return delay if until is None else min(delay, max(0.0, until - time.monotonic()))

        return await retry(call_current, after, errors=(NgramCacheError, asyncio.CancelledError))

    async def close(self) -> None:
        if self._chan is not None:
            await self._chan.channel.close(grace=None)
            self._chan = None
