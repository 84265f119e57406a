"""The Redis backend's rebuild leases: acquire, renew, release and commit as Lua scripts on the namespace's coordinator slot, each acknowledged by every connected replica."""

from __future__ import annotations

from typing import Any

from . import schema
from .leases import CommittedGeneration, Lease, check_lease_args, check_ttl, lease_held, lease_lost, not_newer
from .namespace import validate_namespace
from .redis_connection import RedisConnection
from .redis_scripts import ACQUIRE, COMMIT, FORGET_BASE, RELEASE, RENEW, Script

__all__ = ["RedisLeases"]


class RedisLeases:
    """Rebuild leases and committed generations in Redis, with the rules of `leases`. Thread-safe.

    A lease is the string "<holder>|<token>" with a PX expiry; the token comes from INCR on
    the namespace's fence key, so it grows with every acquisition, across drops too.

    Every step is answered only once every replica the master has connected holds it
    (`RedisConnection.for_leases`): a replica promoted after a failover never hands out a
    fencing token or a generation number again, nor forgets a lease it acknowledged.

    Args:
        conn: the store's connection (it runs the scripts acknowledged by the connected replicas).
        prefix: the store's key prefix.
    """

    def __init__(self, conn: RedisConnection, prefix: str) -> None:
        self._conn = conn
        self._prefix = prefix

    def _run(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        return self._conn.for_leases([(script, keys, args)])[0]

    def acquire(self, namespace: str, holder: str, ttl_ms: int) -> Lease:
        check_lease_args(namespace, holder, ttl_ms)
        lease, fence, _ = schema.lease_keys(self._prefix, namespace)
        token, other, left = self._run(ACQUIRE, [lease, fence], [holder, ttl_ms])
        if int(token) == 0:
            raise lease_held(namespace, other.decode() if isinstance(other, bytes) else str(other), int(left))
        return Lease(namespace, holder, int(token))

    def renew(self, lease: Lease, ttl_ms: int) -> bool:
        check_ttl(ttl_ms)
        key = schema.lease_keys(self._prefix, lease.namespace)[0]
        return bool(self._run(RENEW, [key], [f"{lease.holder}|{lease.token}", ttl_ms]))

    def release(self, lease: Lease) -> bool:
        key = schema.lease_keys(self._prefix, lease.namespace)[0]
        return bool(self._run(RELEASE, [key], [f"{lease.holder}|{lease.token}"]))

    def commit(self, lease: Lease, generation: int, location: str, kind: str = "rebuild", *,
               keep_base: bool = True) -> None:
        key, _, gen = schema.lease_keys(self._prefix, lease.namespace)
        ok, why = self._run(COMMIT, [key, gen], [f"{lease.holder}|{lease.token}", generation, location,
                                                 lease.token, kind, "1" if keep_base else "0"])
        if int(ok) == 0:
            why = why.decode() if isinstance(why, bytes) else str(why)
            if why == "lease":
                raise lease_lost(lease)
            raise not_newer(lease.namespace, generation, int(why))

    def committed(self, namespace: str) -> CommittedGeneration:
        validate_namespace(namespace)
        gen = schema.lease_keys(self._prefix, namespace)[2]
        with self._conn.errors():
            raw = self._conn.client.hgetall(gen)
        if not raw:
            return CommittedGeneration(0, "", 0)
        d = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in raw.items()}
        kind = d.get("kind", "rebuild")
        if "base" in d:
            base, base_location = int(d["base"]), d.get("base_location", "")
        elif kind == "publish":  # stored before bases: a publish is its own
            base, base_location = int(d["generation"]), d.get("location", "")
        else:
            base, base_location = 0, ""
        return CommittedGeneration(int(d["generation"]), d.get("location", ""), int(d.get("token", 0)), kind, base,
                                   base_location)

    def forget_base(self, namespace: str) -> None:
        """The namespace was dropped: its base file is gone (its numbers keep growing)."""
        self._run(FORGET_BASE, [schema.lease_keys(self._prefix, namespace)[2]], [])
