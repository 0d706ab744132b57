"""A plugin that subscribes to CreateContainer and changes nothing: the benchmarks' floor.
Prints "ready" once registered."""

from __future__ import annotations

import asyncio
import sys

from nri_cpuplugin.nri.stub import Stub


class NoOp:
    def create_container(self, pod, container):
        return None, []


async def main(socket: str) -> None:
    stub = Stub(NoOp(), "noop", "50", socket_path=socket)
    task = asyncio.create_task(stub.run())
    await stub.connected.wait()
    print("ready", flush=True)
    await task


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
