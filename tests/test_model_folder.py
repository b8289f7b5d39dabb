"""edgevlm.model_folder: the torch-free check of a model folder that ``edgevlm serve`` runs on
``model.path`` before anything starts (and the loader runs on every weight file)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from edgevlm.errors import ModelLoadError
from edgevlm.model_folder import check_model_folder, check_safetensors


def _safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    """A safetensors file written by the format's rules (8-byte header size, JSON header, data)."""
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def _folder(tmp_path, weights: bytes, config: str = '{"model_type": "llava"}'):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(config)
    (d / "model.safetensors").write_bytes(weights)
    return d


GOOD = _safetensors({"a": np.ones((4, 4)), "b": np.zeros(3)})


def test_good_folder_passes_and_matches_the_reference_reader(tmp_path) -> None:
    d = _folder(tmp_path, GOOD)
    assert check_model_folder(d) == [d / "model.safetensors"]
    assert check_safetensors(d / "model.safetensors") == ["a", "b"]
    from safetensors.numpy import load_file  # the reference implementation reads the same file

    assert load_file(d / "model.safetensors")["a"].shape == (4, 4)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (b"\x01\x02", "not a safetensors file (2 bytes, shorter than its 8-byte header size)"),
        (b"<html>not weights</html>", "not a safetensors file (header size field "),
        (GOOD[: len(GOOD) - 5], "truncated safetensors file: the header declares 76 bytes of tensor data, the "
                                "file holds 71"),
        (GOOD[:20], "truncated safetensors file: "),
        (GOOD + b"\x00" * 4, "corrupt safetensors file: 4 bytes after the last tensor's data"),
        (struct.pack("<Q", 8) + b"{nope!!}", "corrupt safetensors header (not JSON: "),
        (struct.pack("<Q", 8) + b"[1, 2]  ", "corrupt safetensors header (not a JSON object)"),
        (struct.pack("<Q", 24) + b'{"a": {"dtype": "F32"}} ', "corrupt safetensors header (tensor 'a' has no valid "
                                                               "data_offsets)"),
        # a header whose dtype or shape does not fill the tensor's bytes: safetensors' reader refused it only
        # when the tensor was read, as an internal error in `edgevlm quantize` (exit 1)
        (GOOD.replace(b'"F32", "shape": [4, 4]', b'"F64", "shape": [4, 4]'), "corrupt safetensors header (tensor "
                                                                            "'a' is F64 [4, 4], 128 bytes, but its "
                                                                            "data_offsets span 64 bytes)"),
        (GOOD.replace(b'"shape": [4, 4]', b'"shape": [4, 8]'), "corrupt safetensors header (tensor 'a' is F32 "
                                                              "[4, 8], 128 bytes, but its data_offsets span 64"),
        (GOOD.replace(b'"F32", "shape": [4, 4]', b'"F99", "shape": [4, 4]'), "corrupt safetensors header (tensor "
                                                                            "'a' has an unknown dtype 'F99')"),
        (GOOD.replace(b'"shape": [4, 4]', b'"shape": [-4,4]'), "corrupt safetensors header (tensor 'a' has no "
                                                               "valid shape)"),
    ],
)
def test_damaged_weights_are_named(tmp_path, weights: bytes, message: str) -> None:
    d = _folder(tmp_path, weights)
    with pytest.raises(ModelLoadError) as info:
        check_model_folder(d)
    assert info.value.message.startswith(f"{d / 'model.safetensors'}: {message}"), info.value.message


def test_folder_problems(tmp_path) -> None:
    with pytest.raises(ModelLoadError) as info:
        check_model_folder(tmp_path / "nope")
    assert info.value.message == f"model folder {tmp_path / 'nope'} does not exist"
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ModelLoadError, match="is not a folder"):
        check_model_folder(f)
    d = _folder(tmp_path, GOOD, config="[1]")
    with pytest.raises(ModelLoadError) as info:
        check_model_folder(d)
    assert info.value.message == f"{d / 'config.json'}: expected a JSON object, got an array"
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelLoadError, match="holds pytorch_model.bin: only safetensors weights are accepted"):
        check_model_folder(d)


def test_truncated_exit_heads_are_named(tmp_path) -> None:
    """exits.safetensors loads with the model: `serve --check-config` must catch it damaged too."""
    d = _folder(tmp_path, GOOD)
    (d / "exits.safetensors").write_bytes(GOOD[: len(GOOD) - 5])
    with pytest.raises(ModelLoadError) as info:
        check_model_folder(d)
    assert info.value.message.startswith(f"{d / 'exits.safetensors'}: truncated safetensors file"), info.value.message
    (d / "exits.safetensors").write_bytes(GOOD)
    assert check_model_folder(d) == [d / "model.safetensors"]


def test_int4_weights_without_a_manifest_are_refused_before_loading(tmp_path) -> None:
    # a bundle copied without manifest.json: `serve --check-config` passed it, then the daemon refused to load
    d = _folder(tmp_path, _safetensors({
        "language_model.model.layers.0.mlp.down_proj.qweight": np.zeros((4, 2), np.uint8),
        "language_model.model.layers.0.mlp.down_proj.scales": np.ones((4, 1), np.float16),
        "language_model.model.layers.0.mlp.up_proj.qweight": np.zeros((4, 2), np.uint8),
        "language_model.model.layers.1.mlp.up_proj.qweight": np.zeros((4, 2), np.uint8),
        "language_model.model.norm.weight": np.ones(4, np.float32),
    }))
    with pytest.raises(ModelLoadError) as info:
        check_model_folder(d)
    assert str(info.value) == (
        f"{d} holds INT4 layers (language_model.model.layers.0.mlp.down_proj, "
        "language_model.model.layers.0.mlp.up_proj and 1 more) but no manifest.json: an engine bundle whose "
        "manifest.json is missing (copy the whole bundle again, or rebuild it with `edgevlm quantize`)")
    # with one, the bundle's own checks (hashes, the layers it declares) take over when it loads
    listed = [{"path": n, "sha256": "0" * 64, "size_bytes": (d / n).stat().st_size}
              for n in ("config.json", "model.safetensors")]
    (d / "manifest.json").write_text(json.dumps({"files": listed}))
    assert check_model_folder(d) == [d / "model.safetensors"]
