"""Clock offsets of the engines' hosts against the kernel's, so worker-measured times line up.

Step times are taken with ``tf.timestamp()`` on the worker: that is the worker host's clock. On
one machine the offset is zero; across hosts NTP leaves milliseconds to seconds, enough to draw a
step before the call that started it. Each engine's clock is read with a round trip and the
reading with the shortest round trip is kept (Cristian's algorithm).
"""

from __future__ import annotations

import time


def _engine_time() -> float:
    import time as engine_time

    return engine_time.time()


def offset_from(samples: list[tuple[float, float, float]]) -> float:
    """``[(sent, remote, received), ...]`` -> remote minus local clock, from the tightest round trip."""
    sent, remote, received = min(samples, key=lambda s: s[2] - s[0])
    return remote - (sent + received) / 2


def measure_offsets(client, engine_ids: list[int], rounds: int = 3, timeout: float = 10.0) -> dict[int, float]:
    """Seconds each engine's clock is ahead of this kernel's; engines that do not answer get 0."""
    samples: dict[int, list] = {e: [] for e in engine_ids}
    deadline = time.monotonic() + timeout
    for _ in range(rounds):
        for engine in engine_ids:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            sent = time.time()
            try:
                remote = client[engine].apply_async(_engine_time).get(timeout=remaining)
            except Exception:  # noqa: BLE001 - a busy or lost engine: its times are taken as they are
                continue
            samples[engine].append((sent, remote, time.time()))
    return {e: offset_from(s) if s else 0.0 for e, s in samples.items()}
