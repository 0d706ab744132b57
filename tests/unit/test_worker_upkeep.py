"""The worker's two queues (daemon/worker.py): jobs run in order, upkeep in steps only while no
job is queued, and ``drain``-like upkeep (``last``) behind all other upkeep - what jobs still
running queue too.  Every wait is for a condition (tests/model_stall.py ``until``)."""

from __future__ import annotations

import asyncio
import threading

from model_stall import PATIENCE, until

from nri_cpuplugin.daemon.worker import Worker


def test_a_queued_job_goes_before_the_rest_of_the_upkeep():
    order: list[str] = []
    held = threading.Event()

    async def scenario() -> None:
        worker = Worker()
        steps = iter(range(4))

        def step() -> bool:
            n = next(steps)
            if n == 0:
                order.append("step 0 starts")
                assert held.wait(PATIENCE)
                order.append(f"step 0 sees a job waiting: {worker.waiting()}")
            else:
                order.append(f"step {n}")
            return n < 3

        worker.upkeep("irq", step)
        await until(lambda: bool(order))
        assert not worker.idle()  # (a step runs: no creation answered on the event loop now)
        job = worker.submit("request", order.append, "request")
        held.set()
        assert await worker.finished(job, None)
        drain = worker.upkeep("drain", lambda: order.append("drain"), awaited=True, last=True)
        assert await worker.finished(drain, None)
        assert worker.settled()

    asyncio.run(scenario())
    assert order == [
        "step 0 starts",
        "step 0 sees a job waiting: True",
        "request",
        "step 1",
        "step 2",
        "step 3",
        "drain",
    ]


def test_drain_waits_for_the_upkeep_a_running_job_queues_after_it():
    order: list[str] = []
    held = threading.Event()

    async def scenario() -> None:
        worker = Worker()

        def request() -> None:
            order.append("request")
            assert held.wait(PATIENCE)
            worker.upkeep("irq", lambda: order.append("irq"))  # (from the worker thread)

        worker.submit("request", request)
        await until(lambda: bool(order))
        drain = worker.upkeep("drain", lambda: order.append("drain"), awaited=True, last=True)
        held.set()
        assert await worker.finished(drain, None)

    asyncio.run(scenario())
    assert order == ["request", "irq", "drain"]
