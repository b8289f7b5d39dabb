"""Fixtures of the performance-path tests (KV precisions, batching, CUDA graphs, kernels, bench):
tiny checkpoints and backends on CPU; CUDA-only paths skip without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture
def one_torch_thread():
    """One intra-op thread for the test: on a shared, oversubscribed CPU, spinning worker threads made
    the bench runs 5 to 10 times slower (their timings are only checked for being positive)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def perf_dir(tmp_path_factory) -> Path:
    """A tiny GQA checkpoint (4 query / 2 KV heads of 32 channels), ladder 32/64 px."""
    from edgevlm.runtime.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("perf"), seed=0, text_hidden=128, num_heads=4,
                                 num_kv_heads=2, resolution_ladder=[32, 64])


@pytest.fixture(scope="session")
def perf_files(perf_dir):
    from edgevlm.runtime.loader import read_model_files

    return read_model_files(perf_dir)


@pytest.fixture
def make_backend(perf_files):
    """``make_backend(**options)`` -> a fresh float32 CPU TorchBackend (own model and caches)."""
    from edgevlm.runtime.backends.torch_backend import TorchBackend
    from edgevlm.runtime.loader import load_model

    def _make(max_seq_len: int = 160, **options):
        model = load_model(perf_files, device=torch.device("cpu"), dtype=torch.float32, max_seq_len=max_seq_len)
        return TorchBackend(model, **options)

    return _make


def make_prompt(seed: int, n_text: int, height_px: int = 64, width_px: int = 64):
    """``(input ids, (1, 3, H, W) pixels)`` with one image placeholder per vision token."""
    g = torch.Generator().manual_seed(seed)
    n_vis = (height_px // 16) * (width_px // 16)
    text = torch.randint(5, 60, (n_text,), generator=g).tolist()
    return [1] + text[:2] + [4] * n_vis + text[2:], torch.randn(1, 3, height_px, width_px, generator=g)


def run_single(be, ids, pixels, n_steps: int, forced: list[int] | None = None):
    """Prefill + ``n_steps`` greedy decode steps on a batch-1 backend: ``(logits (1 + n, V), tokens)``;
    ``forced`` feeds given tokens instead of the greedy ones (teacher forcing)."""
    logits = [be.prefill(be.embed(torch.tensor([ids]), be.encode_image(pixels))).clone()]
    tokens = [int(logits[0][0].argmax())]
    pos = len(ids)
    for i in range(n_steps):
        tok = forced[i] if forced is not None else tokens[-1]
        logits.append(be.decode(tok, pos).clone())
        tokens.append(int(logits[-1][0].argmax()))
        pos += 1
    return torch.cat(logits), tokens


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())
