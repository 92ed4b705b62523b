"""CallGate: a connection update waits for the chunks begun so far, and holds later ones until it is done."""

import threading
import time

from workbench.training.job.workers import CallGate


def _call(gate, chunk, log, seconds=0.0, over=lambda: False):
    with gate.call(chunk, over) as going:
        if going:
            log.append(("start", chunk, time.monotonic()))
            time.sleep(seconds)
            log.append(("end", chunk, time.monotonic()))
        else:
            log.append(("gave up", chunk, time.monotonic()))


def test_an_update_waits_for_the_chunk_in_flight_and_holds_the_next():
    gate, log = CallGate(), []
    first = threading.Thread(target=_call, args=(gate, 0, log, 0.3))
    first.start()
    time.sleep(0.05)  # chunk 0 is in flight
    late = threading.Thread(target=_call, args=(gate, 0, log))  # a slower worker's call of the same chunk
    held = threading.Thread(target=_call, args=(gate, 1, log))
    with gate.quiet(timeout=10):
        log.append(("update", None, time.monotonic()))
        late.start()
        held.start()
        time.sleep(0.2)
        log.append(("updated", None, time.monotonic()))
    for thread in (first, late, held):
        thread.join(10)
    kinds = [(kind, chunk) for kind, chunk, _ in log]
    assert kinds.index(("end", 0)) < kinds.index(("update", None))  # the call in flight ended first
    # nothing starts while the connection changes: the same chunk's late call and the next chunk wait for the end
    assert kinds.index(("updated", None)) < kinds.index(("start", 1))
    assert [k for k in kinds if k[0] == "start"].count(("start", 0)) == 2


def test_a_call_held_by_the_gate_gives_up_when_the_run_is_over():
    gate, log, over = CallGate(), [], threading.Event()
    with gate.quiet(timeout=10):
        waiting = threading.Thread(target=_call, args=(gate, 0, log, 0.0, over.is_set))
        waiting.start()
        time.sleep(0.1)
        over.set()
        waiting.join(5)
    assert [(kind, chunk) for kind, chunk, _ in log] == [("gave up", 0)]


def test_a_hung_call_holds_the_update_no_longer_than_its_timeout():
    gate, release = CallGate(), threading.Event()

    def hung():
        with gate.call(0, lambda: False):
            release.wait(10)

    thread = threading.Thread(target=hung)
    thread.start()
    time.sleep(0.05)
    started = time.monotonic()
    with gate.quiet(timeout=0.3):
        waited = time.monotonic() - started
    release.set()
    thread.join(5)
    assert 0.25 <= waited < 5
