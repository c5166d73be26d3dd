"""`alignedserve bench transfer`: KV transfer vs raw ucxx send/recv between the same two processes.

A holder process serves one payload per size twice: through a TransferEndpoint (pull: offer, ready,
chunked payload into the destination, xxh3-64 verify, done) and through a bare ucxx listener that answers
an 8-byte request with one tagged send of the same bytes. The measuring process alternates the two,
same sizes, same destination buffer, same UCX context, and reports medians:
{"cases": [{"bytes", "raw_gbps", "kv_gbps", "ratio", "copy_gbps"}, ...], "ucx": {...}}.

`--device cuda[:N]` puts both processes' buffers in device memory (torch uint8 tensors, which UCX sees
through `__cuda_array_interface__`): the GPU check's KV-over-UCX figure. `copy_gbps` is a plain copy of
the same bytes within the measuring process (device to device, or host memcpy): payload bytes per
second, like the transfer figures. "ucx" is what the UCX context activated (`transfer.negotiation`) and
the bytes the KV client moved by memory type.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from multiprocessing.connection import Connection as Pipe
from typing import Any

import numpy as np

from alignedserve.transfer.address import PeerAddress
from alignedserve.transfer.buffers import byte_view
from alignedserve.transfer.endpoint import TransferEndpoint
from alignedserve.transfer.negotiation import negotiation
from alignedserve.transfer.runtime import UCX
from alignedserve.transfer.server import DEFAULT_CHUNK_BYTES

RAW_REQUEST_TAG = 1
RAW_PAYLOAD_TAG = 2


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="alignedserve bench transfer", description=__doc__)
    parser.add_argument("--sizes-mb", default="1,16,64", help="comma-separated payload sizes in MiB")
    parser.add_argument("--repeats", type=int, default=7, help="timed transfers per size and method")
    parser.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_BYTES / (1 << 20))
    parser.add_argument("--device", default="cpu", help="cpu (host buffers) or cuda[:N] (device buffers)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    sizes = [int(float(mb) * (1 << 20)) for mb in args.sizes_mb.split(",")]
    chunk_bytes = int(args.chunk_mb * (1 << 20))
    if args.repeats < 1 or chunk_bytes < 1 or min(sizes) < 1:
        raise SystemExit("sizes, repeats and chunk size must be positive")
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    holder = context.Process(target=_hold, args=(sizes, chunk_bytes, child_end, args.device), daemon=True)
    holder.start()
    try:
        kv_port, raw_port = parent_end.recv()
        result = asyncio.run(_measure(sizes, args.repeats, chunk_bytes, kv_port, raw_port, args.device))
    finally:
        holder.kill()
        holder.join()
    if not args.json:
        for case in result["cases"]:
            print(
                f"{case['bytes'] / (1 << 20):8.1f} MiB  raw {case['raw_gbps']:6.2f} GB/s"
                f"  kv {case['kv_gbps']:6.2f} GB/s  ratio {case['ratio']:.2f}"
            )
    print(json.dumps(result))
    return 0


def _buffer(nbytes: int, device: str, seed: int | None = None) -> Any:
    """[nbytes] uint8: numpy in host memory, a torch tensor on a device; random bytes when seeded."""
    if device == "cpu":
        if seed is None:
            return np.empty(nbytes, np.uint8)
        return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    import torch

    if seed is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=generator)


def _copy_gbps(nbytes: int, device: str, repeats: int) -> float:
    """A plain copy of the same bytes in this process: payload bytes per second (median)."""
    source, target = _buffer(nbytes, device, seed=1), _buffer(nbytes, device)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        if device == "cpu":
            np.copyto(target, source)
        else:
            import torch

            target.copy_(source)
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return round(nbytes / statistics.median(times[1:]) / 1e9, 3)


def _hold(sizes: list[int], chunk_bytes: int, pipe: Pipe, device: str = "cpu") -> None:
    asyncio.run(_serve(sizes, chunk_bytes, pipe, device))


async def _serve(sizes: list[int], chunk_bytes: int, pipe: Pipe, device: str) -> None:
    endpoint = TransferEndpoint(chunk_bytes=chunk_bytes)
    payloads = {n: _buffer(n, device, seed=n) for n in sizes}
    for n, payload in payloads.items():
        endpoint.registry.publish(f"bench/{n}", b"bench", payload, release_after_pull=False)
    address = await endpoint.start()
    ucxx = UCX.acquire()

    async def answer_raw(ucx_endpoint: Any) -> None:
        request = np.empty(1, np.uint64)
        try:
            while True:
                await ucx_endpoint.recv(request, tag=RAW_REQUEST_TAG)
                await ucx_endpoint.send(byte_view(payloads[int(request[0])]).array, tag=RAW_PAYLOAD_TAG)
        except Exception:  # the measuring side closed its endpoint: done
            return

    raw_listener = ucxx.create_listener(answer_raw)
    pipe.send((address.port, raw_listener.port))
    await asyncio.Event().wait()


async def _measure(
    sizes: list[int], repeats: int, chunk_bytes: int, kv_port: int, raw_port: int, device: str = "cpu"
) -> dict[str, Any]:
    peer = PeerAddress("127.0.0.1", kv_port)
    endpoint = TransferEndpoint(chunk_bytes=chunk_bytes)
    ucxx = UCX.acquire()
    raw = await ucxx.create_endpoint("127.0.0.1", raw_port)
    cases = []
    try:
        for nbytes in sizes:
            destination = _buffer(nbytes, device)

            async def raw_once(n: int = nbytes, into: Any = destination) -> None:
                await raw.send(np.array([n], np.uint64), tag=RAW_REQUEST_TAG)
                await raw.recv(byte_view(into, writable=True).array, tag=RAW_PAYLOAD_TAG)

            async def kv_once(n: int = nbytes, into: Any = destination) -> None:
                await endpoint.pull(peer, f"bench/{n}", into)

            raw_s, kv_s = await _alternate(raw_once, kv_once, repeats)
            cases.append(
                {
                    "bytes": nbytes,
                    "raw_gbps": round(nbytes / raw_s / 1e9, 3),
                    "kv_gbps": round(nbytes / kv_s / 1e9, 3),
                    "ratio": round(raw_s / kv_s, 3),
                    "copy_gbps": _copy_gbps(nbytes, device, repeats),
                }
            )
        # Read while the context lives: after the release a query of ucxx would start a new context,
        # whose notifier thread nothing stops, and the process would never exit.
        negotiated = negotiation(ucxx)
    finally:
        await raw.close()
        await endpoint.close()
        UCX.release()
    memory = {f"{d}:{m}": n for (d, m), n in endpoint.client.stats.bytes_by_memory.items()}
    return {
        "device": device,
        "cases": cases,
        "repeats": repeats,
        "chunk_bytes": chunk_bytes,
        "transport": list(negotiated.transports),
        "ucx": {**negotiated.describe(), "kv_bytes_by_memory": memory},
    }


async def _alternate(raw_once: Any, kv_once: Any, repeats: int) -> tuple[float, float]:
    """Median seconds of each, interleaved (raw, kv, raw, kv, ...) after one warm-up of each, so that
    load on the machine hits both alike."""
    await raw_once()
    await kv_once()
    raw_times: list[float] = []
    kv_times: list[float] = []
    for _ in range(repeats):
        for once, times in ((raw_once, raw_times), (kv_once, kv_times)):
            start = time.perf_counter()
            await once()
            times.append(time.perf_counter() - start)
    return statistics.median(raw_times), statistics.median(kv_times)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
