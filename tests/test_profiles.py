"""Every shipped profile validates; bad profiles are rejected with the key path named."""

from __future__ import annotations

import pytest

from edgevlm.errors import ConfigError
from edgevlm.profile import load_profile, profiles_dir

SHIPPED = sorted(p.stem for p in profiles_dir().glob("*.yaml"))


def test_expected_profiles_are_shipped():
    assert {"jetson-agx-orin-64gb", "jetson-agx-orin-32gb", "jetson-orin-nx-16gb", "a100", "h100", "cpu"} <= set(
        SHIPPED
    )


@pytest.mark.parametrize("name", SHIPPED)
def test_every_profile_validates(name):
    profile = load_profile(name)
    assert profile.name == name
    assert profile.resolution_ladder_px == sorted(profile.resolution_ladder_px, reverse=True)
    if profile.device_class == "jetson":
        assert profile.kv_cache_dtype != "fp8_e4m3"
        assert profile.weights.scheme == "W4A16"


def _write(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


BASE = (
    "name: bad\ndevice_class: cpu\ndevice: cpu\ndtype: float32\nbackends: [torch]\nmemory_mb: 1\n"
    "memory_bandwidth_gbps: 1\nresolution_ladder_px: [384, 256]\ndefault_budget_ms: 100\n"
)


def test_valid_base_profile(tmp_path):
    assert load_profile(_write(tmp_path, BASE)).resolution_ladder_px == [384, 256]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ("weights: {scheme: W4A16, group_sz: 128}\n", "weights.group_sz: unknown key"),
        ("weights: {group_size: 100}\n", "weights.group_size"),
        ("kv_cache_dtype: int3\n", "kv_cache_dtype"),
        ("colour: red\n", "colour: unknown key"),
        ("default_budget_ms: 200\n", "duplicate key 'default_budget_ms' at line 10 column 1 (first at line 9)"),
        ("runtime: {max_batch_size: '4'}\n", "runtime.max_batch_size: Input should be a valid integer"),
        ("runtime: {cuda_graphs: 'no'}\n", "runtime.cuda_graphs: Input should be a valid boolean"),
    ],
)
def test_bad_profile_names_the_key(tmp_path, extra, needle):
    with pytest.raises(ConfigError) as exc:
        load_profile(_write(tmp_path, BASE + extra))
    assert needle in str(exc.value)


def test_ladder_must_descend(tmp_path):
    with pytest.raises(ConfigError, match="descending"):
        load_profile(_write(tmp_path, BASE.replace("[384, 256]", "[256, 384]")))


def test_fp8_refused_on_jetson(tmp_path):
    text = BASE.replace("device_class: cpu", "device_class: jetson") + "kv_cache_dtype: fp8_e4m3\n"
    with pytest.raises(ConfigError, match="FP8"):
        load_profile(_write(tmp_path, text))


def test_unknown_profile_lists_known():
    with pytest.raises(ConfigError, match="jetson-agx-orin-64gb"):
        load_profile("no-such-device")


def test_existing_file_without_a_yaml_suffix_is_named_as_such(tmp_path):
    """A path to a file that exists but does not end in .yaml / .yml is not reported as "not found"."""
    other = tmp_path / "passwd"
    other.write_text("root:x:0:0\n")
    with pytest.raises(ConfigError, match=r"'.*passwd': a profile file ends in \.yaml or \.yml") as info:
        load_profile(str(other))
    assert "not found" not in str(info.value)


def test_not_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_profile(_write(tmp_path, "name: [unclosed\n"))


def test_cloud_and_jetson_profiles_choose_the_gpu_runtime():
    from edgevlm.profile import load_profile

    h100 = load_profile("h100").backend_options("torch", "cuda")
    assert h100["cuda_graphs"] is True and h100["fused_decode"] is True
    assert h100["max_batch_size"] == 32 and h100["kv_cache_dtype"] == "bf16" and h100["int4_kernel"] == "auto"
    nx = load_profile("jetson-orin-nx-16gb").backend_options("torch", "cuda:0")
    assert nx["kv_cache_dtype"] == "int4" and nx["max_batch_size"] == 1 and nx["fused_vision_stem"] is False
    # CPU models, other backends and CPU profiles get no GPU options
    assert load_profile("h100").backend_options("torch", "cpu") == {}
    assert load_profile("h100").backend_options("onnx", "cuda") == {}
    assert load_profile("cpu").backend_options("torch", "cuda") == {}


def test_profile_runtime_section_rejects_unknown_keys_and_bad_values(tmp_path):
    import yaml

    from edgevlm.errors import ConfigError
    from edgevlm.profile import load_profile, profiles_dir

    data = yaml.safe_load((profiles_dir() / "h100.yaml").read_text())
    data["runtime"]["int4_kernel"] = "marlin"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="runtime.int4_kernel"):
        load_profile(bad)
    data["runtime"]["int4_kernel"] = "auto"
    data["runtime"]["cuda_graph"] = True
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="runtime.cuda_graph"):
        load_profile(bad)
