"""No 40 ms stall per answer on a broker that keeps Nagle's algorithm on (mosquitto's defaults).

Such a broker holds a small PUBLISH while its previous small packet to the same peer (a PUBACK)
is unacknowledged, and Linux delays that ACK by 40 ms: without a work-around every answer (and every
request that follows an answer) waits 40 ms in the broker. The SDK and the daemon acknowledge at once
(``edgevlm.client.request_quick_ack``); this test runs a real daemon and the SDK against a real
mosquitto started with its defaults and checks the round trip minus the engine's own e2e time stays
far below the stall. (Speed targets are in ``bench/daemon_latency.py``; this only checks that the
40 ms signature is gone.)
"""

from __future__ import annotations

import socket
import statistics
import sys
import time

import numpy as np
import pytest

from edgevlm.client import Client

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK"), reason="TCP_QUICKACK is Linux-only")


def test_no_delayed_ack_stall_against_mosquitto_defaults(tiny_engine) -> None:
    from edgevlm.config import DaemonConfig
    from edgevlm.daemon.app import Daemon
    from edgevlm.daemon.demo_processes import start_private_broker

    broker = start_private_broker("edgevlm-test-", tuned=False)
    if broker is None:
        pytest.fail("mosquitto not installed: apt-get install mosquitto mosquitto-clients", pytrace=False)
    assert "set_tcp_nodelay" not in (broker.workdir / "mosquitto.conf").read_text()
    cfg = DaemonConfig.model_validate({"mqtt": {"host": "127.0.0.1", "port": broker.port, "device_id": "lat"},
                                       "metrics": {"listen": None}})
    daemon = Daemon(cfg, engine=tiny_engine)
    image = np.full((48, 64, 3), 90, np.uint8)
    try:
        daemon.start()
        assert daemon.wait_ready(10)
        overhead = []
        with Client("127.0.0.1", broker.port, "lat") as client:
            client.ask("hi", image=image, max_new_tokens=2, timeout_s=30)  # warm-up
            for _ in range(9):
                t0 = time.perf_counter()
                answer = client.ask("hi", image=image, max_new_tokens=2, timeout_s=30)
                overhead.append((time.perf_counter() - t0) * 1000 - answer.stats.e2e_ms)
    finally:
        daemon.stop()
        broker.stop()
    print(f"rtt - e2e: median {statistics.median(overhead):.1f} ms", file=sys.stderr)
    assert statistics.median(overhead) < 25.0, overhead  # the stall alone is >= 40 ms
