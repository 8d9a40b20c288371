"""How long does a restarted scheduler take to rebuild its prefix index by replay?

Three measurements: (1) in-process, msgpack-decode + `PrefixIndex.apply` of ``--events`` KV events
(the CPU floor of any replay); (2) the snapshot cost of the index that built (``state()`` +
msgpack to save, msgpack + ``from_state()`` to load, and the snapshot's size); (3) a real
JetStream replay: ``--js-events`` events published to
the `STRATA_KV_EVENTS` stream of a private nats-server, then `follow_kv_events` into a fresh
`SchedulerCore` until the replay reached the stream's end (what `run_scheduler` waits for before
it is ready). Events look like live ones: 16 instances, each event storing 4 blocks or removing
4 old ones.

    .venv/bin/python -m loadtests.simulator.replay --events 1000000 --js-events 100000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.prefix_index import PrefixIndex
from shared.protocol.codec import decode, encode
from shared.protocol.kv import KVEvent


def events(n: int, instances: int = 16, seed: int = 0) -> list[bytes]:
    """``n`` encoded events: mostly stores of 4 new blocks, a third removals of old ones."""
    rng = random.Random(seed)
    seq = [0] * instances
    held: list[list[str]] = [[] for _ in range(instances)]
    out = []
    for k in range(n):
        i = rng.randrange(instances)
        seq[i] += 1
        if held[i] and rng.random() < 0.33:
            gone, held[i] = held[i][:4], held[i][4:]
            kind, hashes = "removed", gone
        else:
            hashes = [f"{k:012x}{j:020x}" for j in range(4)]
            held[i].extend(hashes)
            kind = "stored"
        out.append(
            encode(
                KVEvent(
                    instance_id=f"prefill-{i}",
                    incarnation="a",
                    seq=seq[i],
                    tier="engine",
                    kind=kind,
                    hashes=hashes,
                )
            )
        )
    return out


def in_process(raw: list[bytes]) -> tuple[dict[str, float], PrefixIndex]:
    idx = PrefixIndex()
    t0 = time.perf_counter()
    for b in raw:
        idx.apply(decode(b, KVEvent))
    dt = time.perf_counter() - t0
    return {
        "events": len(raw),
        "seconds": dt,
        "us_per_event": dt / len(raw) * 1e6,
        "blocks": len(idx),
    }, idx


def snapshot_cost(idx: PrefixIndex) -> dict[str, float]:
    """Save and load of a snapshot the way `services.scheduler.snapshots` does (msgpack)."""
    import msgpack

    t0 = time.perf_counter()
    blob = msgpack.packb(idx.state())
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = PrefixIndex.from_state(msgpack.unpackb(blob, strict_map_key=False))
    load_s = time.perf_counter() - t0
    assert back.digest() == idx.digest()
    return {"save_s": save_s, "load_s": load_s, "mb": len(blob) / 1e6, "blocks": len(idx)}


async def jetstream(raw: list[bytes]) -> dict[str, float]:
    from services.infra.nats_server import start_nats
    from services.scheduler.app import follow_kv_events
    from shared.bus import connect
    from shared.kv_events_stream import ensure_kv_events_stream
    from shared.protocol import subjects

    server = start_nats()
    try:
        nc = await connect(server.url, name="replay-bench")
        js = nc.jetstream()
        await ensure_kv_events_stream(js)
        t0 = time.perf_counter()
        # each event on its own instance's subject (the scheduler checks they match)
        subj = [subjects.kv_events(decode(b, KVEvent).instance_id) for b in raw]
        for i in range(0, len(raw), 1000):  # publish in windows of 1000 acks
            await asyncio.gather(
                *(
                    js.publish(s, b)
                    for s, b in zip(subj[i : i + 1000], raw[i : i + 1000], strict=True)
                )
            )
        publish_s = time.perf_counter() - t0
        core = SchedulerCore(SchedulerConfig.load([], role="scheduler"))
        t0 = time.perf_counter()
        sub, replayed = await follow_kv_events(js, core)
        await replayed.wait()
        replay_s = time.perf_counter() - t0
        await sub.unsubscribe()
        await nc.drain()
    finally:
        server.stop()
    return {
        "events": len(raw),
        "publish_s": publish_s,
        "seconds": replay_s,
        "us_per_event": replay_s / len(raw) * 1e6,
        "blocks": len(core.index),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--js-events", type=int, default=100_000)
    a = ap.parse_args(argv)
    raw = events(max(a.events, a.js_events))
    r, idx = in_process(raw[: a.events])
    print(
        f"in-process decode+apply: {r['events']} events in {r['seconds']:.2f}s "
        f"({r['us_per_event']:.1f} us/event), {r['blocks']} blocks"
    )
    c = snapshot_cost(idx)
    print(
        f"snapshot of {c['blocks']} blocks: save (state + msgpack) {c['save_s']:.2f}s, "
        f"load (msgpack + from_state) {c['load_s']:.2f}s, {c['mb']:.1f} MB"
    )
    if a.js_events:
        j = asyncio.run(jetstream(raw[: a.js_events]))
        print(
            f"JetStream replay: {j['events']} events in {j['seconds']:.2f}s "
            f"({j['us_per_event']:.1f} us/event; publish took {j['publish_s']:.1f}s), "
            f"{j['blocks']} blocks -> 1M events ~ {j['us_per_event']:.0f} s"
        )


if __name__ == "__main__":
    main()
