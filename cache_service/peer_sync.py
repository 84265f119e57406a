"""PeerSync: install the generations other replicas committed, fetched from the replica that built them.

Replicas without shared storage each keep their own ``<data_dir>/static``. A rebuild commits
its generation number in the counts store together with its builder's address
(`CountsStore.commit_generation`); every other replica, on its next check (every
``interval`` seconds for each live namespace, and before it rebuilds), sees a committed
generation above its own latest, fetches the file from that address (StaticFiles.Fetch; a
broken transfer starts again from byte 0, up to ``attempts`` times a check), and publishes it locally through
its `StaticStore`, which checks size, SHA-256 and the file itself (`verify()`) before the
atomic rename: a corrupt transfer is refused and fetched again on the next check. Publishing
wakes the replica's Watch subscribers, so its sessions and clients swap to the generation.
With a shared volume the file is already there and nothing is fetched. Pruning past ``keep``
spares the namespace's corpus base (`CommittedGeneration.base`), which every rebuild folds in;
a replica about to rebuild without the base's file fetches it (`fetch_base`).
"""

from __future__ import annotations

import logging

import grpc
from grpc import aio

from ngramcache.client._proto.v1 import static_files_pb2, static_files_pb2_grpc
from ngramcache.client.kernel.errors import BackendUnavailableError, NgramCacheError
from ngramcache.client.kernel.retry import retry
from ngramcache.client.wire.transport import auth_metadata, channel_credentials

from .counts import CountsStore, NamespaceRecord
from .static_store import StaticStore
from .store_runner import StoreRunner

log = logging.getLogger("ngramcache.service")


class PeerSync:
    """Fetches committed generations this replica lacks (see the module docstring).

    Args:
        runner: the executor of the counts store (where generations are committed).
        static_store: this replica's generation files.
        location: this replica's own address (generations it built are not fetched).
        token: a bearer token for the peers' StaticFiles (draft role), or None.
        tls_ca: PEM CA certificates to reach peers with TLS, or None for plaintext.
        attempts: Fetch calls per generation and check before giving up until the next one.
        keep: generations kept after installing one (older ones are deleted, as the builder does).
    """

    def __init__(self, runner: StoreRunner, static_store: StaticStore, *, location: str, token: str | None = None,
                 tls_ca: bytes | None = None, attempts: int = 3, keep: int = 3) -> None:
        self._keep = keep
        self._runner = runner
        self._store: CountsStore = runner.store
        self._static = static_store
        self.location = location
        self._metadata = auth_metadata(token)
        self._credentials = channel_credentials(tls_ca or None)
        self._attempts = attempts
        self.fetched = 0  # generations installed from peers (metrics)
        self.refused = 0  # transfers refused (corrupt, truncated)

    async def sync(self, info: NamespaceRecord) -> int:
        """Install the namespace's committed generation if it is newer than ours; return our latest after."""
        latest = self._static.latest(info.name)
        have = latest.generation if latest else 0
        committed = await self._runner.call(self._store.committed_generation, info.name)
        if committed.generation <= have or not committed.location or committed.location == self.location:
            return have

        async def install() -> None:
            await self._fetch(info, committed.generation, committed.location)
            self.fetched += 1
            await self._static.retain(info.name, self._keep, protect=committed.base)

        def failed(e: NgramCacheError, attempt: int) -> float:  # a broken transfer starts again from byte 0, at once
            self.refused += 1
            log.warning("namespace %s: fetching generation %d from %s failed (attempt %d of %d): %s", info.name,
                        committed.generation, committed.location, attempt + 1, self._attempts, e)
            return 0.0

        try:
            await retry(install, failed, errors=NgramCacheError, attempts=self._attempts)
        except NgramCacheError:
            return have  # tried again at the next check
        log.info("namespace %s: generation %d fetched from %s", info.name, committed.generation, committed.location)
        return committed.generation

    async def fetch_base(self, info: NamespaceRecord, generation: int, addresses: list[str]) -> str:
        """Install ``generation`` (the corpus base, below the latest) from the first of ``addresses`` that has it.

        Returns "" once installed, else why not (one line per address tried).
        """
        why: list[str] = []
        for address in dict.fromkeys(a for a in addresses if a and a != self.location):
            try:
                await self._fetch(info, generation, address, restore=True)
                self.fetched += 1
                log.info("namespace %s: corpus base generation %d fetched from %s", info.name, generation, address)
                return ""
            except NgramCacheError as e:
                self.refused += 1
                why.append(f"{address}: {e}")
        return "; ".join(why) or "no other replica is known to hold it"

    def _channel(self, address: str) -> aio.Channel:
        options = [("grpc.max_receive_message_length", 64 << 20)]
        if self._credentials is not None:
            return aio.secure_channel(address, self._credentials, options=options)
        return aio.insecure_channel(address, options=options)

    async def _fetch(self, info: NamespaceRecord, generation: int, address: str, restore: bool = False) -> None:
        async with self._channel(address) as channel:
            stub = static_files_pb2_grpc.StaticFilesStub(channel)  # type: ignore[no-untyped-call]  # generated, untyped
            request = static_files_pb2.FetchRequest(namespace=info.name, generation=generation)
            try:
                call = stub.Fetch(request, timeout=600, metadata=self._metadata)
                first = await call.read()
                if first is aio.EOF or not first.HasField("header"):
                    raise BackendUnavailableError(f"{address} sent no header for generation {generation}")
                header = first.header
                async with self._static.upload(info.name, generation=generation, size=header.size,
                                               sha256=header.sha256) as upload:
                    while (msg := await call.read()) is not aio.EOF:
                        await upload.write(msg.chunk.offset, msg.chunk.data)
                    await upload.publish(fingerprint=info.fingerprint, vocab_size=info.vocab_size, restore=restore)
            except grpc.RpcError as e:
                raise BackendUnavailableError(f"Fetch of generation {generation} from {address}: "
                                              f"{e.code().name}: {e.details()}") from None
