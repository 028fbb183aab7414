"""The gate that keeps a sync check's probe out of generation batches
(plugins/vllm/probe_gate.py), with real threads."""

from __future__ import annotations

import threading
import time

from grpo_plugins.vllm.probe_gate import ProbeGate


def test_a_probe_waits_for_generation_in_flight_and_holds_new_generation_back() -> None:
    gate, events = ProbeGate(), []
    release_first = threading.Event()

    def first_generation() -> None:
        with gate.generation():
            events.append("generation 1 starts")
            release_first.wait(10)
            events.append("generation 1 ends")

    def probe() -> None:
        with gate.probe():
            events.append("probe")
            time.sleep(0.2)
        events.append("probe done")

    def second_generation() -> None:
        with gate.generation():
            events.append("generation 2 starts")

    threads = [threading.Thread(target=first_generation)]
    threads[0].start()
    while not events:
        time.sleep(0.01)
    threads.append(threading.Thread(target=probe))
    threads[1].start()
    time.sleep(0.2)
    assert events == ["generation 1 starts"], "the probe ran beside a generation request"
    threads.append(threading.Thread(target=second_generation))
    threads[2].start()
    time.sleep(0.2)
    assert events == ["generation 1 starts"], "a new generation request started while a probe waited"
    release_first.set()
    for thread in threads:
        thread.join(10)
    assert events.index("generation 1 ends") < events.index("probe") < events.index("generation 2 starts")
