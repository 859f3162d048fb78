"""Mooncake as the feeder's feature sink: SpecForge's cross-node backend, read by its
``specforge.runtime.data_plane.mooncake_store.MooncakeFeatureStore`` (SpecForge 0.2.0).

Its layout, which we write with Mooncake's own client (``mooncake.store``; on this host the
``mooncake-transfer-engine-non-cuda`` wheel on TCP): one object per tensor, keyed
``<store_id>/<sample_id>/g<generation>/<name>``, whose value is the tensor's raw contiguous bytes (shape and
dtype travel on the ref), hard-pinned so the store does not evict it before the trainer reads it. The ref's
``feature_store_uri`` is ``mooncake://<store_id>/<sample_id>``.

An object lives in the memory segment of a Mooncake client: this feeder's, so the feeder must stay
up while the trainer reads (a restarted feeder puts again the objects of refs not consumed yet).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from hsx.integrations.specforge.feed_layout import EAGLE3_FEATURES, GENERATION

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MooncakeSetup:
    master: str  # host:port of mooncake_master
    metadata_server: str  # e.g. http://host:port/metadata (the master's HTTP metadata server)
    local_hostname: str = "127.0.0.1"  # how other clients reach this one
    segment_bytes: int = 1 << 30  # memory this client lends the store: what it can hold unconsumed
    buffer_bytes: int = 64 << 20
    protocol: str = "tcp"


class MooncakeFeatures:
    def __init__(self, setup: MooncakeSetup, store_id: str) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.store_id = store_id
        self._client: Any = MooncakeDistributedStore()
        rc = self._client.setup(
            local_hostname=setup.local_hostname,
            metadata_server=setup.metadata_server,
            global_segment_size=setup.segment_bytes,
            local_buffer_size=setup.buffer_bytes,
            protocol=setup.protocol,
            rdma_devices="",
            master_server_addr=setup.master,
        )
        if rc is not None and int(rc) != 0:
            raise RuntimeError(f"Mooncake setup failed (status {rc}) with master {setup.master}")
        self._config: Any = ReplicateConfig()
        self._config.replica_num = 1
        self._config.with_hard_pin = True
        self._names: dict[str, list[str]] = {}
        self._unremoved: set[str] = set()  # keys whose removal the store refused (a live read lease)

    def key(self, sid: str, name: str) -> str:
        return f"{self.store_id}/{sid}/g{GENERATION}/{name}"

    def uri(self, sid: str) -> str:
        return f"mooncake://{self.store_id}/{sid}"

    def write(self, sid: str, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            key = self.key(sid, name)
            data = tensor.detach().cpu().contiguous()
            nbytes = data.numel() * data.element_size()
            if int(self._client.is_exist(key)) == 1:
                self._client.remove(key)  # a put of a key that exists fails; this is a rewrite after restart
            self._client.register_buffer(data.data_ptr(), nbytes)
            try:
                rc = self._client.put_from(key, data.data_ptr(), nbytes, self._config)
            finally:
                self._client.unregister_buffer(data.data_ptr())
            if rc is not None and int(rc) < 0:
                raise RuntimeError(f"Mooncake put_from failed (status {rc}) for {key}")
        self._names[sid] = list(tensors)

    def exists(self, sid: str) -> bool:
        """Whether the sample's objects are still in the store. A trainer's release on Mooncake is deferred
        (the read lease must run out first), so the consumed counter is the signal that matters here."""
        names = self._names.get(sid, list(EAGLE3_FEATURES))
        return any(int(self._client.is_exist(self.key(sid, name))) == 1 for name in names)

    def remove(self, sid: str) -> None:
        keys = [self.key(sid, name) for name in self._names.pop(sid, list(EAGLE3_FEATURES))]
        self._remove(keys)

    def _remove(self, keys: list[str]) -> None:
        for key in [*keys, *self._unremoved]:
            try:
                rc = self._client.remove(key, force=True)
            except TypeError:  # bindings without force
                rc = self._client.remove(key)
            ok = rc is None or int(rc) == 0 or int(self._client.is_exist(key)) != 1
            if ok:
                self._unremoved.discard(key)
            else:
                self._unremoved.add(key)

    def sync(self) -> None:
        pass  # put_from returns once the object is in the store

    def close(self) -> None:
        if self._unremoved:
            self._remove([])
        if self._unremoved:
            log.warning("%d Mooncake objects could not be removed", len(self._unremoved))
        close = getattr(self._client, "close", None)
        if callable(close):
            close()
