"""Fixtures of the early-exit / pruning / controller tests: a tiny real checkpoint with 4 vision
blocks and exit heads at blocks 1 and 2 (random weights with O(1) outputs), and its engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

EXIT_BLOCKS = [1, 2]
LABELS = ["red", "green", "blue"]


def random_heads(model_dir: Path, *, seed: int = 0, exit_blocks=EXIT_BLOCKS, labels=LABELS):
    """Write random exit heads (``exits.json`` + ``exits.safetensors``) for the checkpoint in ``model_dir``."""
    from edgevlm.runtime.exits import ExitHeads, make_spec, save_exit_heads
    from edgevlm.runtime.loader import read_model_files

    cfg = read_model_files(model_dir).config
    heads = randomize(ExitHeads(make_spec(cfg, exit_blocks=list(exit_blocks), labels=list(labels), head_hidden=16)),
                      seed)
    save_exit_heads(heads, model_dir)
    return heads


def randomize(heads, seed: int = 0):
    """``heads`` with random weights (N(0, 0.2); LayerNorm gains 1), in place; returns them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in heads.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return heads


@pytest.fixture(scope="session")
def exit_model_dir(tmp_path_factory) -> Path:
    """Tiny checkpoint (4 vision blocks, 64 px, patch 16, ladder 64/32) with random exit heads."""
    from edgevlm.runtime.testing import write_tiny_checkpoint

    d = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_exits"), seed=1, vision_layers=4,
                              resolution_ladder=[64, 32])
    random_heads(d)
    return d


@pytest.fixture(scope="session")
def exit_engine(exit_model_dir):
    from edgevlm.runtime import Engine

    return Engine.load(exit_model_dir, device="cpu")


@pytest.fixture(scope="session")
def plain_model_dir(tmp_path_factory) -> Path:
    """The same tiny architecture without exit heads."""
    from edgevlm.runtime.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_plain"), seed=1, vision_layers=4,
                                 resolution_ladder=[64, 32])


@pytest.fixture(scope="session")
def plain_engine(plain_model_dir):
    from edgevlm.runtime import Engine

    return Engine.load(plain_model_dir, device="cpu")


@pytest.fixture(scope="session")
def frames() -> list[np.ndarray]:
    """Three deterministic 48x64 RGB frames with different content."""
    rng = np.random.default_rng(3)
    out = [rng.integers(0, 256, size=(48, 64, 3), dtype=np.uint8)]
    flat = np.zeros((48, 64, 3), np.uint8)
    flat[:, :32] = (200, 30, 30)
    out.append(flat)
    y, x = np.mgrid[0:48, 0:64]
    out.append(np.stack([x * 4 % 256, y * 5 % 256, (x + y) % 256], -1).astype(np.uint8))
    return out


@pytest.fixture
def run_daemon(mosquitto):
    """``run_daemon(engine, **config)`` starts an ``edgevlm.daemon.app.Daemon`` on the test broker
    with extra config keys (controller, monitors, profile, sources...); stopped at teardown."""
    from edgevlm.config import parse_daemon_config
    from edgevlm.daemon.app import Daemon

    started = []

    def _start(engine, *, device_id: str = "dev1", **extra):
        data = {
            "mqtt": {"host": mosquitto.host, "port": mosquitto.port, "device_id": device_id,
                     "reconnect_min_delay_s": 0.2, "reconnect_max_delay_s": 1.0},
            "defaults": {"max_new_tokens": 4, "timeout_ms": 60000},
            "metrics": {"listen": None},
            "telemetry": {"interval_s": None},
            "tegrastats": {"enabled": False},
            **extra,
        }
        daemon = Daemon(parse_daemon_config(data), engine=engine, notify_socket="")
        daemon.start()
        started.append(daemon)
        if not daemon.wait_ready(10.0):
            raise RuntimeError("daemon did not connect to the test broker within 10 s")
        return daemon

    yield _start
    for d in reversed(started):
        d.stop()


@pytest.fixture(scope="session")
def randomize_heads():
    """:func:`randomize`, for test modules (conftest is not importable by name)."""
    return randomize
