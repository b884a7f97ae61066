"""Experiment: what Ray's own paths cost, beside the path Ray stages take.

Why a Ray stage's actor connects back over TCP and speaks the wire protocol there,
rather than the orchestrator calling its methods or reading a streaming generator:
this times, on a local cluster with two worker nodes (127.0.0.1 only), per item:

- an actor method call's round trip (``ray.get(actor.echo.remote(b))``), to an
  actor on another node;
- a streaming generator (``num_returns="streaming"``) from an actor on another
  node, read item by item: items/s, and the driver's CPU per item;
- a two-actor chain: one actor calls the next (on the other node) per item, the
  driver waits for the first: the data path between two stages done with calls;
- a TCP round trip between two processes, the floor of the path Ray stages take (a
  frame each way on a socket; the bench's ``omni-trio bench --only ray`` measures the
  stages themselves).

Run: python tools/bench_ray_calls.py [--count 2000]   (needs the ray extra)
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import ray

from omni_trio.process.testing import local_ray_cluster


@ray.remote
class Echo:
    def echo(self, data: bytes) -> bytes:
        return data

    def chain(self, other: ray.actor.ActorHandle, data: bytes) -> bytes:
        return ray.get(other.echo.remote(data))

    def stream(self, count: int, size: int):  # type: ignore[no-untyped-def]
        payload = bytes(size)
        for _ in range(count):
            yield payload


def _p50(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e3:.3f} ms"


def calls(actor: ray.actor.ActorHandle, count: int, size: int) -> list[float]:
    data = bytes(size)
    ray.get(actor.echo.remote(data))  # warm
    times = []
    for _ in range(count):
        start = time.perf_counter()
        ray.get(actor.echo.remote(data))
        times.append(time.perf_counter() - start)
    return times


def chain(first: ray.actor.ActorHandle, second: ray.actor.ActorHandle, count: int) -> list[float]:
    data = bytes(4096)
    ray.get(first.chain.remote(second, data))
    times = []
    for _ in range(count):
        start = time.perf_counter()
        ray.get(first.chain.remote(second, data))
        times.append(time.perf_counter() - start)
    return times


def stream(actor: ray.actor.ActorHandle, count: int, size: int) -> tuple[float, float]:
    """Items/s, and the driver's CPU seconds per item."""
    gen = actor.stream.options(num_returns="streaming").remote(count, size)
    cpu, wall = time.process_time(), time.perf_counter()
    for ref in gen:
        ray.get(ref)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return count / wall, cpu / count


def tcp_round_trips(count: int, size: int) -> list[float]:
    listener = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        conn, _ = listener.accept()
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    client = socket.create_connection(listener.getsockname())
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = bytes(size)
    times = []
    for _ in range(count):
        start = time.perf_counter()
        client.sendall(data)
        got = 0
        while got < size:
            got += len(client.recv(1 << 16))
        times.append(time.perf_counter() - start)
    client.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(prog="tools/bench_ray_calls.py")
    parser.add_argument("--count", type=int, default=2000)
    args = parser.parse_args()
    with local_ray_cluster({"node_a": 2}, {"node_b": 2}):
        a = Echo.options(resources={"node_a": 1}).remote()
        b = Echo.options(resources={"node_b": 1}).remote()
        ray.get([a.echo.remote(b""), b.echo.remote(b"")])
        print(f"actor call round trip, 4 KB, other node: p50 {_p50(calls(b, args.count, 4096))}")
        print(f"two-actor chain, 4 KB (driver -> a -> b):  p50 {_p50(chain(a, b, args.count))}")
        rate, cpu = stream(b, args.count, 4096)
        print(f"streaming generator, 4 KB items: {rate:,.0f} items/s, {cpu * 1e3:.3f} ms CPU/item")
        tcp = tcp_round_trips(args.count, 4096)
        print(f"TCP round trip, 4 KB, two threads on 127.0.0.1: p50 {_p50(tcp)}")


if __name__ == "__main__":
    main()
