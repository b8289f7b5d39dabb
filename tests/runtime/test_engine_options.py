"""Engine.load's torch backend options that profiles set (edgevlm.profile.RuntimeConfig)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_int4_kernel_option_is_applied_and_checked(tmp_path):
    from edgevlm.errors import InvalidRequestError
    from edgevlm.runtime import Engine
    from edgevlm.runtime.testing import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "m")
    eng = Engine.load(ckpt, backend_options={"int4_kernel": "dequant", "fused_decode": True})
    # no CUDA and no interpreter here: the fused decode kernels stay off
    assert eng.backend.model.language_model.fused_decode is False
    with pytest.raises(InvalidRequestError, match="int4_kernel must be one of"):
        Engine.load(ckpt, backend_options={"int4_kernel": "marlin"})
    with pytest.raises(InvalidRequestError, match="unknown torch backend option"):
        Engine.load(ckpt, backend_options={"int4_kernels": "auto"})
