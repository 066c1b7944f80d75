"""One side of a store-then-load across processes, through LMCache's ``StorageManager``.

``store``: a storage manager built from the same arguments as LMCache's server (``--l2-adapter`` JSON
with a ``"serde"`` entry) writes chunks into L1, which its store controller serializes and hands to the
L2 adapter; the process exits once nothing is pending. ``load``: a fresh storage manager in another
process prefetches the keys from L2 (the adapter loads, the codec deserializes) and saves what it read.

Usage::

    python storage_worker.py store --adapter JSON --chunks chunks.pt
    python storage_worker.py load --adapter JSON --chunks chunks.pt --out loaded.pt
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ["LMCACHE_TRACK_USAGE"] = "false"

import torch


def manager(adapter: str):
    import kvpolicy_lmcache  # noqa: F401 - registers the codecs, as the launcher does in LMCache's server
    from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
    from lmcache.v1.distributed.storage_manager import StorageManager

    parser = argparse.ArgumentParser()
    add_storage_manager_args(parser)
    args = parser.parse_args(["--l1-size-gb", "0.25", "--eviction-policy", "LRU", "--l2-adapter", adapter])
    return StorageManager(parse_args_to_config(args))


def keys_and_layouts(chunks: list[dict]):
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey

    out = []
    for c in chunks:
        key = ObjectKey(chunk_hash=c["hash"], model_name=c["model"], kv_rank=0)
        layout = MemoryLayoutDesc(shapes=[g.shape for g in c["groups"]], dtypes=[g.dtype for g in c["groups"]])
        out.append((key, layout))
    return out


def store(adapter: str, chunks: list[dict]) -> None:
    sm = manager(adapter)
    for (key, layout), c in zip(keys_and_layouts(chunks), chunks, strict=True):
        reserved = sm.reserve_write([key], layout)
        obj = reserved[key]
        for i, g in enumerate(c["groups"]):
            obj.get_tensor(i).copy_(g)
        sm.finish_write([key])
        # one chunk at a time: LMCache's serde wrapper sizes the buffers of one store batch from the first
        # object's layout, so chunks of different layouts must not share a batch (with any codec)
        settle(sm)
    sm.close()


def settle(sm) -> None:
    """Wait until the store controller has nothing pending nor in flight (for five polls in a row)."""
    settled = 0
    deadline = time.monotonic() + 120
    while settled < 5:  # nothing pending nor in flight for five polls in a row
        status = sm.report_status()["store_controller"]
        settled = settled + 1 if status["pending_keys_count"] == 0 and status["in_flight_task_count"] == 0 else 0
        if time.monotonic() > deadline:
            raise TimeoutError(f"the store controller did not settle: {status}")
        time.sleep(0.2)


def load(adapter: str, chunks: list[dict], out: str) -> None:
    from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec

    sm = manager(adapter)
    loaded = []
    for key, layout in keys_and_layouts(chunks):
        spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=[key], object_group_id=0, layout_desc=layout)])
        handle = sm.submit_prefetch_task(spec)
        if not sm.wait_prefetch_status(handle, timeout=120):
            raise TimeoutError("the prefetch did not finish")
        result = sm.query_prefetch_status(handle)
        if result.l2_hit_cells[0].popcount() != 1:
            loaded.append(None)  # not loaded from L2: a miss, or a payload the codec refused
            continue
        with sm.read_prefetched_results([key]) as objs:
            loaded.append([objs[0].get_tensor(i).clone() for i in range(len(layout.shapes))])
        sm.finish_read_prefetched([key])
    torch.save(loaded, out)
    sm.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["store", "load"])
    p.add_argument("--adapter", required=True, help="the --l2-adapter JSON of LMCache's server")
    p.add_argument("--chunks", required=True, help="torch.save'd list of {'hash', 'model', 'groups'}")
    p.add_argument("--out", help="where load saves what it read")
    a = p.parse_args()
    json.loads(a.adapter)  # fail early on a malformed spec
    chunks = torch.load(a.chunks)
    if a.mode == "store":
        store(a.adapter, chunks)
    else:
        load(a.adapter, chunks, a.out)
    sys.exit(0)


if __name__ == "__main__":
    main()
