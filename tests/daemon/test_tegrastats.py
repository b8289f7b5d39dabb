"""tegrastats parser on every real line, throttling detection, and the reader (real subprocess, real files)."""

from __future__ import annotations

import os
import sys
import threading
from datetime import datetime
from pathlib import Path

import pytest

from edgevlm.daemon.tegrastats import (
    TegrastatsReader,
    ThrottleDetector,
    iter_samples,
    parse_line,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tegrastats"


def _lines(name: str) -> list[str]:
    return [ln for ln in (FIXTURES / name).read_text().splitlines() if ln.strip()]


R35 = _lines("orin_r35.txt")
R36 = _lines("orin_r36.txt")
OTHER = _lines("other_generations.txt")


def test_fixture_counts():
    assert (len(R35), len(R36), len(OTHER)) == (2, 3, 5)


@pytest.mark.parametrize("line", R35 + R36 + OTHER)
def test_every_line_parses_completely(line):
    s = parse_line(line, received_s=123.0)
    assert s is not None
    assert s.unparsed == ()
    assert s.received_s == 123.0
    assert s.ram_used_mb is not None and s.ram_total_mb > s.ram_used_mb
    assert s.cpu and s.rails


@pytest.mark.parametrize("line", R35 + R36 + OTHER)
def test_every_prefix_of_every_line_never_raises(line):
    for cut in range(0, len(line), 7):
        s = parse_line(line[:cut])
        assert s is None or s.unparsed is not None


def test_r35_orin_nx_offline_cores_and_second_gpc():
    s = parse_line(R35[0])
    assert s.printed_at == datetime(2023, 6, 16, 10, 45, 9)
    assert s.memory["RAM"].used_mb == 6334 and s.memory["RAM"].total_mb == 15388
    assert (s.memory["RAM"].lfb_blocks, s.memory["RAM"].lfb_block_mb) == (1770, 4.0)
    assert (s.swap_used_mb, s.swap_total_mb, s.memory["SWAP"].cached_mb) == (491, 7694, 0)
    assert [c.online for c in s.cpu] == [True] * 4 + [False] * 4
    assert [c.load_pct for c in s.cpu[:4]] == [6, 9, 5, 16]
    assert s.cpu_load_pct == pytest.approx(9.0)
    assert s.cpu_freq_mhz == 729
    assert s.engines["GR3D"].freq_mhz == (611,) and s.engines["GR3D2"].freq_mhz == (0,)
    assert s.gpu_freq_mhz == 611 and s.gpu_load_pct == 0
    assert (s.emc_load_pct, s.emc_freq_mhz) == (0, 2133)
    assert s.engines["VIC"].freq_mhz == (729,) and s.engines["VIC"].load_pct is None
    assert s.engines["APE"].max_freq_mhz == 174
    assert s.temps_c["tj"] == 48.875 and s.temps_c["cv2"] == 45.75
    assert s.max_temp_c == 48.875
    assert s.rails["VDD_IN"].power_mw == 5299 and s.rails["VDD_SOC"].avg_power_mw == 1424
    assert s.total_power_mw == 5299  # VDD_IN is the module input


def test_r35_agx_missing_emc_and_gpu_clock_are_absent():
    s = parse_line(R35[1])
    assert s.printed_at is None
    assert "EMC" not in s.engines and s.emc_freq_mhz is None and s.emc_load_pct is None
    assert s.gpu_load_pct == 0 and s.gpu_freq_mhz is None
    assert len(s.cpu) == 12 and all(c.freq_mhz == 2201 for c in s.cpu)
    assert s.temps_c["cpu"] == 42.0  # integer temperature
    # no input rail printed on AGX Orin: total is the sum of the rails
    assert s.total_power_mw == 4940 + 988 + 4442


def test_r36_agx_no_reading_sensors_and_per_gpc_clocks():
    s = parse_line(R36[0])
    assert s.printed_at == datetime(2025, 4, 11, 10, 36, 27)
    assert s.engines["GR3D"].freq_mhz == (0, 0) and s.gpu_freq_mhz == 0
    # -256C = no reading: CV0, CV1, GPU, CV2 are absent, not -256
    assert set(s.temps_c) == {"cpu", "tboard", "soc2", "tdiode", "soc0", "tj", "soc1"}
    assert "gpu" not in s.temps_c and s.max_temp_c == 44.562
    assert "NC" not in s.rails  # not-connected channels are dropped
    assert s.rails["VDDQ_VDD2_1V8AO"].power_mw == 301
    assert s.total_power_mw == 2340 + 390 + 4025 + 301


def test_r36_irregular_spaces_and_engines_off():
    s = parse_line(R36[1])
    assert s.memory["RAM"].used_mb == 29114 and s.swap_used_mb == 4915 and s.memory["SWAP"].cached_mb == 1
    assert s.engines["GR3D"].freq_mhz == (305, 305) and s.gpu_freq_mhz == 305
    for name in ("NVENC", "NVDEC", "NVJPG", "NVJPG1", "VIC", "OFA", "NVDLA0", "NVDLA1", "PVA0"):
        assert s.engines[name].online is False and s.engines[name].freq_mhz == ()
    assert [c.load_pct for c in s.cpu].count(100.0) == 2
    assert s.cpu_freq_mhz == 2201
    assert s.temps_c["gpu"] == 47.812


def test_r36_orin_8gb_under_load():
    s = parse_line(R36[2])
    assert s.ram_total_mb == 7620 and s.memory["RAM"].lfb_block_mb == 1.0
    assert len(s.cpu) == 6 and s.cpu[5].freq_mhz == 247
    assert (s.gpu_load_pct, s.gpu_freq_mhz) == (84, 713)
    assert (s.emc_load_pct, s.emc_freq_mhz) == (18, 3199)
    assert s.engines["NVDEC"].load_pct == 40 and s.engines["NVDEC"].freq_mhz == (115,)
    assert s.rails["VDD_IN"].power_mw == 17946 and s.rails["VDD_IN"].avg_power_mw == 15710
    assert s.max_temp_c == 65.562


def test_nano_iram_rails_without_units_and_pmic_placeholder():
    s = parse_line(OTHER[0])
    assert s.memory["IRAM"].used_mb == 0 and s.memory["IRAM"].total_mb == pytest.approx(252 / 1024)
    assert s.memory["IRAM"].lfb_block_mb == pytest.approx(252 / 1024) and s.memory["IRAM"].lfb_blocks == 1
    assert s.rails["POM_5V_IN"].power_mw == 1212 and s.total_power_mw == 1212
    assert s.temps_c["pmic"] == 100.0 and s.max_temp_c == 30.5  # PMIC@100C is not a real reading
    assert s.gpu_freq_mhz == 76


def test_xavier_rails_named_like_sensors_and_mts():
    s = parse_line(OTHER[1])
    assert (
        s.rails["GPU"].power_mw == 0 and s.rails["CPU"].power_mw == 310 and s.rails["SYS5V"].power_mw == 1477
    )
    assert s.temps_c["gpu"] == 38.5 and s.temps_c["cpu"] == 39.5
    assert s.engines["MTS_FG"].load_pct == 0 and s.engines["MTS_BG"].load_pct == 0
    assert [c.online for c in s.cpu] == [True, True, False, False, True, True, False, False]
    assert s.total_power_mw == 0 + 310 + 931 + 0 + 155 + 1477


def test_tx1_shared_cpu_clock_and_short_engine_names():
    s = parse_line(OTHER[2])
    assert [(c.online, c.load_pct, c.freq_mhz) for c in s.cpu] == [
        (True, 2, 102), (True, 1, 102), (False, None, None), (False, None, None)
    ]  # fmt: skip
    assert s.emc_freq_mhz == 1600 and s.emc_load_pct == 3
    assert s.gpu_freq_mhz == 76 and s.engines["MSENC"].freq_mhz == (192,)
    assert s.swap_used_mb is None  # no SWAP field: absent
    assert s.total_power_mw == 3523


def test_jetpack7_two_value_temperatures():
    s = parse_line(OTHER[3])
    assert s.temps_c == {"cpu": 52.968, "tj": 54.5}
    assert s.gpu_freq_mhz == 1300 and s.gpu_load_pct == 0
    assert s.engines["NVENC0"].online is False
    assert s.memory["RAM"].lfb_blocks == 1 and s.memory["RAM"].lfb_block_mb == 2.0


def test_thor_gpu_clocks_without_load():
    s = parse_line(OTHER[4])
    assert s.engines["GR3D"].freq_mhz == (1000, 1000, 1000)
    assert s.gpu_freq_mhz == 1000 and s.gpu_load_pct is None
    assert s.swap_total_mb == 0
    assert s.total_power_mw == 20100  # VIN


@pytest.mark.parametrize(
    "line",
    ["", "   ", "tegrastats: Permission denied", "Usage: tegrastats [-option]", "\x00\xff garbage 12/ @@"],
)
def test_lines_without_known_fields_give_none(line):
    assert parse_line(line) is None


def test_unknown_tokens_are_kept_not_fatal():
    s = parse_line("RAM 100/200MB FOO WIDGET=3 GR3D_FREQ 5%@300 tj@50C")
    assert s.ram_used_mb == 100 and s.gpu_freq_mhz == 300 and s.max_temp_c == 50
    assert s.unparsed == ("FOO", "WIDGET=3")


def test_malformed_values_do_not_fail_the_line():
    s = parse_line("RAM 10/20MB (lfb garbage) CPU [x%@1,off] GR3D_FREQ ??? tj@-256C VDD_IN 5mW/")
    assert s.ram_used_mb == 10 and s.memory["RAM"].lfb_blocks is None
    assert [c.online for c in s.cpu] == [True, False] and s.cpu[0].load_pct is None
    assert "GR3D" not in s.engines and s.temps_c == {} and s.rails == {}
    assert s.max_temp_c is None and s.total_power_mw is None


def test_iter_samples_skips_noise():
    samples = list(iter_samples(["junk", R36[0], "", R35[0]]))
    assert [s.gpu_freq_mhz for s in samples] == [0, 611]


# -- throttling ------------------------------------------------------------------------------------
def test_busy_gpu_below_reference_clock_is_throttled():
    det = ThrottleDetector(reference_gpu_freq_mhz=1300)
    st = det.update(parse_line(R36[2]))  # 84% load at 713 MHz
    assert st.throttled and st.gpu_freq_mhz == 713 and st.reference_gpu_freq_mhz == 1300
    assert st.gpu_clock_ratio == pytest.approx(713 / 1300)
    assert st.slowdown_hint == pytest.approx(1300 / 713)
    assert "GPU clock 713 MHz" in st.reasons[0]


def test_idle_gpu_at_low_clock_is_not_throttled():
    det = ThrottleDetector(reference_gpu_freq_mhz=1300)
    st = det.update(parse_line(R36[1]))  # 0% load at 305 MHz: DVFS idling
    assert not st.throttled and st.slowdown_hint == 1.0 and st.max_temp_c == 53.062


def test_hot_sensor_is_throttled_and_reference_is_learned():
    det = ThrottleDetector(temp_limit_c=60.0)
    st = det.update(parse_line(R36[2]))
    assert st.throttled and st.reasons == ("temperature 65.6 C >= 60.0 C",)
    assert st.reference_gpu_freq_mhz == 713 and st.gpu_clock_ratio == 1.0
    busy_slow = parse_line("GR3D_FREQ 90%@[356,356] tj@50C")
    st2 = det.update(busy_slow)
    assert (
        st2.throttled and st2.reference_gpu_freq_mhz == 713 and st2.slowdown_hint == pytest.approx(713 / 356)
    )


def test_sample_without_gpu_or_temps_is_not_throttled():
    st = ThrottleDetector().update(parse_line("RAM 1/2MB"))
    assert (st.throttled, st.max_temp_c, st.gpu_freq_mhz, st.gpu_clock_ratio) == (False, None, None, None)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clock_ratio_limit": 0},
        {"clock_ratio_limit": 1.5},
        {"busy_load_pct": 101},
        {"reference_gpu_freq_mhz": 0},
    ],
)
def test_throttle_detector_rejects_bad_parameters(kwargs):
    with pytest.raises(ValueError):
        ThrottleDetector(**kwargs)


# -- reader ----------------------------------------------------------------------------------------
FAKE_TEGRASTATS = """#!{python}
import sys, time
args = sys.argv[1:]
open({argfile!r}, "a").write(" ".join(args) + "\\n")
lines = open({linefile!r}).read().splitlines()
interval = int(args[args.index("--interval") + 1]) / 1000
for line in lines[:{count}]:
    print(line, flush=True)
    time.sleep(interval)
print("tegrastats: sensor bus error", file=sys.stderr)
sys.exit(3)
"""


def _fake_binary(tmp_path: Path, count: int) -> tuple[Path, Path]:
    argfile = tmp_path / "args.txt"
    binary = tmp_path / "tegrastats"
    binary.write_text(
        FAKE_TEGRASTATS.format(
            python=sys.executable, argfile=str(argfile), linefile=str(FIXTURES / "orin_r36.txt"), count=count
        )
    )
    binary.chmod(0o755)
    return binary, argfile


def test_reader_runs_tegrastats_and_restarts_it_when_it_dies(tmp_path):
    binary, argfile = _fake_binary(tmp_path, count=3)
    got: list = []
    enough = threading.Event()

    def on_sample(s):
        got.append(s)
        if len(got) >= 4:  # 3 lines from the first run, then at least one after the restart
            enough.set()

    reader = TegrastatsReader(
        interval_ms=20, binary=str(binary), on_sample=on_sample, restart_max_delay_s=0.2
    )
    assert reader.available()
    assert reader.start()
    try:
        assert enough.wait(20), f"only {len(got)} samples"
    finally:
        reader.stop()
    assert [s.gpu_freq_mhz for s in got[:4]] == [0, 305, 713, 0]
    assert reader.restarts >= 1
    assert argfile.read_text().splitlines()[0] == "--interval 20"
    assert reader.latest().gpu_freq_mhz in (0, 305, 713)
    assert reader.latest(max_age_s=-1) is None  # older than any age


def test_reader_stop_terminates_the_process(tmp_path):
    binary, _ = _fake_binary(tmp_path, count=10_000)
    first = threading.Event()
    reader = TegrastatsReader(interval_ms=10, binary=str(binary), on_sample=lambda s: first.set())
    assert reader.start()
    assert first.wait(20)
    proc = reader._proc
    reader.stop()
    assert proc.poll() is not None


def test_reader_without_binary_does_not_start(tmp_path):
    reader = TegrastatsReader(binary=str(tmp_path / "no-such-tegrastats"))
    assert not reader.available()
    assert reader.start() is False
    assert reader.latest() is None


def test_reader_rejects_bad_interval():
    with pytest.raises(ValueError, match="interval_ms"):
        TegrastatsReader(interval_ms=0)


def test_reader_counts_unparsed_lines_and_survives_a_bad_callback():
    def boom(_s):
        raise RuntimeError("consumer bug")

    reader = TegrastatsReader(on_sample=boom)
    assert reader.feed("not tegrastats") is None
    assert reader.feed(R35[0]).gpu_freq_mhz == 611
    assert (reader.lines_read, reader.lines_unparsed) == (2, 1)
    assert reader.latest().gpu_freq_mhz == 611


def _wait_for(cond, timeout_s: float = 20.0) -> bool:
    ev = threading.Event()
    for _ in range(int(timeout_s / 0.02)):
        if cond():
            return True
        ev.wait(0.02)
    return cond()


def test_reader_tails_a_log_file_across_rotation_and_truncation(tmp_path):
    log = tmp_path / "tegrastats.log"
    log.write_text(R35[0] + "\n")  # an old line: not current, skipped
    seen: list = []
    reader = TegrastatsReader(interval_ms=20, log_path=log, on_sample=seen.append, restart_max_delay_s=0.1)
    assert reader.start()
    try:
        with open(log, "a") as f:
            f.write(R36[0] + "\n")
            f.write(R36[2][:40])  # half a line: waits for the rest
            f.flush()
            assert _wait_for(lambda: len(seen) == 1)
            f.write(R36[2][40:] + "\n")
        assert _wait_for(lambda: len(seen) == 2)
        assert [s.gpu_freq_mhz for s in seen] == [0, 713]
        # rotation: the file is renamed and a new one starts
        os.rename(log, tmp_path / "tegrastats.log.1")
        log.write_text(R36[1] + "\n")
        assert _wait_for(lambda: len(seen) == 3)
        assert seen[-1].gpu_freq_mhz == 305
        # truncation in place
        log.write_text(R35[1] + "\n")
        assert _wait_for(lambda: len(seen) == 4)
        assert seen[-1].gpu_freq_mhz is None and seen[-1].ram_total_mb == 62840
    finally:
        reader.stop()


def test_reader_waits_for_a_log_file_that_appears_later(tmp_path):
    log = tmp_path / "later.log"
    seen: list = []
    reader = TegrastatsReader(interval_ms=20, log_path=log, on_sample=seen.append, restart_max_delay_s=0.1)
    assert reader.start()
    try:
        log.write_text(R35[0] + "\n")  # created after start: read from its beginning
        assert _wait_for(lambda: len(seen) == 1)
        assert seen[0].gpu_freq_mhz == 611
    finally:
        reader.stop()
