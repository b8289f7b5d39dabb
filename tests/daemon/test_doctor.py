"""`edgevlm doctor`: the rows on this machine, a real broker (anonymous and with passwords), a prepared
Jetson-like host tree, and every failure path."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from edgevlm.daemon import doctor
from edgevlm.daemon.doctor import Verdict, main, mqtt_probe, run_checks

MOSQUITTO = "/usr/sbin/mosquitto"
EXPECTED_ROWS = [
    "python", "edgevlm", "torch", "cuda", "int4 kernels", "tensorrt", "onnxruntime", "opencv", "capture path",
    "cameras", "microphones", "broker", "jetson", "power mode", "clocks", "tegrastats",
]  # fmt: skip


def rows_by_name(rows):
    return {r.check: r for r in rows}


def run_main(capsys, *argv: str) -> tuple[int, list[dict]]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- this machine --------------------------------------------------------------------------------------
def test_rows_on_this_machine_with_a_real_broker(mosquitto, capsys):
    code, rows = run_main(capsys, "--broker", f"127.0.0.1:{mosquitto.port}")
    assert [r["check"] for r in rows] == EXPECTED_ROWS
    by = {r["check"]: r for r in rows}
    assert all(r["verdict"] in ("OK", "WARN", "FAIL") for r in rows)
    import cv2
    import torch

    assert by["python"]["verdict"] == "OK" and sys.executable in by["python"]["detail"]
    assert by["torch"] == {"check": "torch", "verdict": "OK", "detail": by["torch"]["detail"]}
    assert by["torch"]["detail"].startswith(torch.__version__)
    assert by["int4 kernels"]["verdict"] == "OK" and "cpu=cpu_for_cpu" in by["int4 kernels"]["detail"]
    assert "_weight_int4pack_mm_for_cpu" in by["int4 kernels"]["detail"]
    assert by["opencv"]["detail"].startswith(cv2.__version__)
    assert by["broker"]["verdict"] == "OK"
    assert by["broker"]["detail"].startswith(f"127.0.0.1:{mosquitto.port}: MQTT v5 CONNACK in ")
    if not torch.cuda.is_available():
        assert by["cuda"] == {
            "check": "cuda",
            "verdict": "WARN",
            "detail": "no CUDA device: the model runs on the CPU",
        }
    if not Path("/etc/nv_tegra_release").exists():
        assert by["jetson"]["detail"] == "not a Jetson (Jetson checks skipped)"
    assert code == (1 if any(r["verdict"] == "FAIL" for r in rows) else 0)
    # the doctor's client id must not take over anyone's session: it is random
    assert "edgevlm-doctor-" in mosquitto.log()


def test_text_report(mosquitto, capsys):
    code = main(["--broker", f"127.0.0.1:{mosquitto.port}"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("OK    python ")
    assert any(ln.startswith("OK    broker ") for ln in lines)
    assert lines[-1].startswith("16 checks: ")
    assert code in (0, 1)


def test_config_drives_the_broker_and_source_checks(mosquitto, tmp_path, capsys):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        f"mqtt:\n  host: 127.0.0.1\n  port: {mosquitto.port}\n  device_id: r1\n"
        "sources:\n  - name: front\n    uri: /dev/video97\n  - name: dock\n    uri: rtsp://10.0.0.5/x\n"
    )
    code, rows = run_main(capsys, "--config", str(cfg))
    by = {r["check"]: r for r in rows}
    assert [r["check"] for r in rows][:3] == ["python", "edgevlm", "config"]
    assert by["config"] == {"check": "config", "verdict": "OK", "detail": f"{cfg}: valid"}
    assert by["broker"]["verdict"] == "OK" and f":{mosquitto.port}:" in by["broker"]["detail"]
    assert by["source front"] == {
        "check": "source front",
        "verdict": "FAIL",
        "detail": "/dev/video97 does not exist",
    }
    assert (
        by["source dock"]["verdict"] == "OK" and by["source dock"]["detail"] == "stream source (not probed)"
    )
    assert code == 1


def test_invalid_config_is_a_fail_row_not_a_traceback(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("mqtt:\n  prot: 1883\n")
    code, rows = run_main(
        capsys, "--config", str(cfg), "--broker", f"127.0.0.1:{_free_port()}", "--timeout", "0.5"
    )
    by = {r["check"]: r for r in rows}
    assert by["config"]["verdict"] == "FAIL" and "mqtt.prot: unknown key" in by["config"]["detail"]
    assert code == 1
    missing_model = tmp_path / "nomodel.yaml"
    missing_model.write_text(f"model:\n  path: {tmp_path / 'nope'}\n")
    code, rows = run_main(capsys, "--config", str(missing_model), "--broker", f"127.0.0.1:{_free_port()}",
                          "--timeout", "0.5")
    detail = {r["check"]: r for r in rows}["config"]
    assert detail["verdict"] == "FAIL" and "model.path: model folder" in detail["detail"] and code == 1
    code, rows = run_main(capsys, "--config", str(tmp_path / "missing.yaml"), "--broker", "127.0.0.1:1")
    assert {r["check"]: r for r in rows}["config"]["detail"].endswith(
        "config file not found: " + str(tmp_path / "missing.yaml")
    )


@pytest.mark.parametrize(
    "argv",
    [["--broker", "host:99999"], ["--broker", "a b"], ["--timeout", "0"], ["--timeout", "x"], ["--timeout", "nan"],
     ["--timeout", "inf"], ["--timeout", "-1"], ["--bogus"]],
)
def test_bad_arguments_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("edgevlm: error:"), err  # one line, no usage block


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "--broker" in capsys.readouterr().out


# -- broker probe ----------------------------------------------------------------------------------------
def test_broker_refused_port():
    port = _free_port()
    r = mqtt_probe("127.0.0.1", port, timeout_s=1)
    assert r.verdict is Verdict.FAIL and r.detail.startswith(f"127.0.0.1:{port}: cannot connect: ")


def _serve_once(reply: bytes | None) -> tuple[int, threading.Thread]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(1024)
            if reply is None:
                time.sleep(0.8)  # never answer (the probe times out first)
            else:
                conn.sendall(reply)
        srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv.getsockname()[1], t


def test_broker_that_is_not_mqtt():
    port, t = _serve_once(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    r = mqtt_probe("127.0.0.1", port, timeout_s=2)
    t.join(5)
    assert (
        r.verdict is Verdict.FAIL
        and r.detail == f"127.0.0.1:{port}: not an MQTT broker (first reply byte 0x48)"
    )


def test_broker_that_never_answers():
    port, t = _serve_once(None)
    r = mqtt_probe("127.0.0.1", port, timeout_s=0.3)
    t.join(5)
    assert r.verdict is Verdict.FAIL and r.detail.startswith(f"127.0.0.1:{port}: no MQTT answer: ")


def test_broker_that_speaks_only_mqtt_3_1_1():
    port, t = _serve_once(bytes([0x20, 0x02, 0x00, 0x01]))  # CONNACK, unacceptable protocol version
    r = mqtt_probe("127.0.0.1", port, timeout_s=2)
    t.join(5)
    assert r.verdict is Verdict.FAIL and r.detail.endswith("does not speak MQTT v5 (3.1.1 only)")


def test_broker_tls_handshake_failure():
    class Tls:  # a TLS config pointing at a plain-TCP server
        ca_certs = certfile = keyfile = None
        insecure = True

    port, t = _serve_once(b"\x20\x03\x00\x00\x00")
    r = mqtt_probe("127.0.0.1", port, timeout_s=2, tls=Tls())
    t.join(5)
    assert r.verdict is Verdict.FAIL and ("TLS handshake failed" in r.detail or "no MQTT answer" in r.detail)


@pytest.fixture
def auth_broker(tmp_path):
    if not (os.path.exists(MOSQUITTO) and shutil.which("mosquitto_passwd")):
        pytest.fail("mosquitto not installed: apt-get install mosquitto mosquitto-clients", pytrace=False)
    pw = tmp_path / "passwd"
    subprocess.run(
        ["mosquitto_passwd", "-b", "-c", str(pw), "robot", "s3cret"], check=True, capture_output=True
    )
    port = _free_port()
    conf = tmp_path / "m.conf"
    lines = [
        f"listener {port} 127.0.0.1",
        "allow_anonymous false",
        f"password_file {pw}",
        "persistence false",
        "set_tcp_nodelay true",
    ]
    if os.geteuid() == 0:
        lines.append("user root")
    conf.write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen(
        [MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for _ in range(500):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.02)
        yield port
    finally:
        proc.terminate()
        proc.wait(5)


def test_broker_credentials(auth_broker):
    ok = mqtt_probe("127.0.0.1", auth_broker, username="robot", password="s3cret")
    assert ok.verdict is Verdict.OK, ok.detail
    bad = mqtt_probe("127.0.0.1", auth_broker, username="robot", password="wrong")
    assert bad.verdict is Verdict.FAIL
    assert bad.detail.split(": CONNACK ")[1] in ("bad user name or password", "not authorized")
    anon = mqtt_probe("127.0.0.1", auth_broker)
    assert anon.verdict is Verdict.FAIL and "CONNACK" in anon.detail


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=cwd, timeout=60)


@pytest.fixture
def tls_broker(tmp_path):
    if not shutil.which("openssl") or not os.path.exists(MOSQUITTO):
        pytest.skip("needs openssl and mosquitto")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=tmp_path)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "srv.key",
             "-out", "srv.csr", cwd=tmp_path)  # fmt: skip
    (tmp_path / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "ext.cnf", "-out", "srv.crt", cwd=tmp_path)  # fmt: skip
    port = _free_port()
    lines = [f"listener {port} 127.0.0.1", "allow_anonymous true", "persistence false", "set_tcp_nodelay true",
             f"cafile {tmp_path / 'ca.crt'}", f"certfile {tmp_path / 'srv.crt'}", f"keyfile {tmp_path / 'srv.key'}"]  # fmt: skip
    if os.geteuid() == 0:
        lines.append("user root")
    (tmp_path / "m.conf").write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen(
        [MOSQUITTO, "-c", str(tmp_path / "m.conf")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for _ in range(500):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.02)
        yield port, tmp_path / "ca.crt"
    finally:
        proc.terminate()
        proc.wait(5)


def test_broker_over_tls(tls_broker):
    port, ca = tls_broker

    class Tls:
        ca_certs, certfile, keyfile, insecure = ca, None, None, False

    ok = mqtt_probe("127.0.0.1", port, tls=Tls(), timeout_s=5)
    assert ok.verdict is Verdict.OK and ", TLS, QoS 1 request/response round trip " in ok.detail, ok.detail

    class UnknownCa(Tls):
        ca_certs = None  # the system trust store does not know the test CA

    bad = mqtt_probe("127.0.0.1", port, tls=UnknownCa(), timeout_s=5)
    assert bad.verdict is Verdict.FAIL and "TLS handshake failed" in bad.detail
    assert "CERTIFICATE_VERIFY_FAILED" in bad.detail


# -- a Jetson-like host tree -----------------------------------------------------------------------------
def _write(path: Path, text: str | bytes, mode: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    if mode is not None:
        path.chmod(mode)


@pytest.fixture
def jetson_root(tmp_path, monkeypatch):
    root = tmp_path / "root"
    _write(root / "proc/device-tree/model", b"NVIDIA Jetson AGX Orin Developer Kit\0")
    _write(
        root / "etc/nv_tegra_release",
        "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64\n",
    )
    _write(root / "dev/video0", "")
    _write(root / "sys/class/video4linux/video0/name", "USB 2.0 Camera: HD USB Camera\n")
    _write(root / "proc/asound/cards", " 0 [tegrahdaxnx   ]: tegra-hda-xnx - NVIDIA Jetson AGX Orin HDA\n"
           " 1 [Device         ]: USB-Audio - USB PnP Sound Device\n")  # fmt: skip
    _write(root / "dev/snd/pcmC1D0c", "")
    _write(root / "dev/snd/pcmC0D3p", "")  # playback only: not a microphone
    gpu = root / "sys/class/devfreq/17000000.gpu"
    _write(gpu / "cur_freq", "306000000\n")
    _write(gpu / "max_freq", "1300500000\n")
    _write(gpu / "governor", "nvhost_podgov\n")
    _write(root / "sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq", "729600\n")
    _write(root / "sys/devices/system/cpu/cpu0/cpufreq/scaling_max_freq", "2201600\n")
    bindir = tmp_path / "bin"
    _write(
        bindir / "nvpmodel",
        "#!/bin/sh\necho 'NVPM WARN: fan mode is not set!'\necho 'NV Power Mode: MAXN'\necho 0\n",
        0o755,
    )
    _write(bindir / "tegrastats", "#!/bin/sh\n", 0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return root


def test_jetson_rows_from_a_prepared_tree(jetson_root):
    by = rows_by_name(run_checks(root=jetson_root, broker=("127.0.0.1", 1), timeout_s=0.5))
    assert by["jetson"].verdict is Verdict.OK
    assert by["jetson"].detail == "NVIDIA Jetson AGX Orin Developer Kit, L4T R36.4.3"
    assert (by["power mode"].verdict, by["power mode"].detail) == (Verdict.OK, "MAXN (mode 0)")
    assert by["clocks"].verdict is Verdict.WARN
    assert by["clocks"].detail.startswith(
        "GPU 306/1300 MHz (nvhost_podgov), CPU0 729/2201 MHz: GPU not at its maximum"
    )
    assert by["tegrastats"].verdict is Verdict.OK and by["tegrastats"].detail.endswith(
        "(Jetson telemetry available)"
    )
    assert by["cameras"].verdict is Verdict.OK
    assert by["cameras"].detail == "1 found: /dev/video0 (USB 2.0 Camera: HD USB Camera)"
    assert by["microphones"].verdict is Verdict.OK
    assert by["microphones"].detail.endswith("ALSA: 1 capture device(s): pcmC1D0c (USB PnP Sound Device)")
    import torch

    if torch.version.cuda is None:  # a CPU-only torch on a Jetson means JetPack's torch was replaced
        assert by["cuda"].verdict is Verdict.FAIL and "was JetPack's torch replaced" in by["cuda"].detail
    # optional backends on a Jetson point at JetPack's packages
    if by["tensorrt"].verdict is Verdict.WARN:
        assert by["tensorrt"].detail.endswith("install JetPack's python3-libnvinfer")


def test_jetson_without_nvpmodel_and_tegrastats_warns(jetson_root, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    for tool in ("nvpmodel", "tegrastats"):
        if shutil.which(tool):
            pytest.skip(f"{tool} installed on this machine")
    by = rows_by_name(run_checks(root=jetson_root, broker=("127.0.0.1", 1), timeout_s=0.5))
    assert by["power mode"].verdict is Verdict.WARN and "nvpmodel not found" in by["power mode"].detail
    assert by["tegrastats"].verdict is Verdict.WARN


def test_nvpmodel_failure_is_a_warning(jetson_root, tmp_path):
    _write(
        tmp_path / "bin/nvpmodel",
        "#!/bin/sh\necho 'NVPM ERROR: failed to read /var/lib/nvpmodel/status' >&2\nexit 1\n",
        0o755,
    )
    by = rows_by_name(run_checks(root=jetson_root, broker=("127.0.0.1", 1), timeout_s=0.5))
    assert by["power mode"].verdict is Verdict.WARN
    assert by["power mode"].detail == "nvpmodel -q: NVPM ERROR: failed to read /var/lib/nvpmodel/status"


def test_clocks_at_maximum_are_ok(jetson_root):
    (jetson_root / "sys/class/devfreq/17000000.gpu/cur_freq").write_text("1300500000\n")
    by = rows_by_name(run_checks(root=jetson_root, broker=("127.0.0.1", 1), timeout_s=0.5))
    assert by["clocks"].verdict is Verdict.OK and by["clocks"].detail.startswith("GPU 1300/1300 MHz")


def test_empty_host_tree(tmp_path):
    by = rows_by_name(run_checks(root=tmp_path, broker=("127.0.0.1", 1), timeout_s=0.5))
    assert (by["cameras"].verdict, by["cameras"].detail) == (
        Verdict.WARN,
        "no /dev/video* devices (USB/CSI cameras)",
    )
    assert by["microphones"].verdict in (Verdict.WARN, Verdict.OK)  # OK only if PortAudio sees an input
    assert by["clocks"].detail == "no GPU devfreq or CPU cpufreq readings (not a Jetson)"


def test_a_crashing_check_becomes_a_fail_row(monkeypatch):
    def boom(_h):
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(doctor, "_check_cameras", boom)
    by = rows_by_name(run_checks(root="/nonexistent", broker=("127.0.0.1", 1), timeout_s=0.5))
    assert (by["cameras"].verdict, by["cameras"].detail) == (
        Verdict.FAIL,
        "check crashed: RuntimeError: driver exploded",
    )


SNIPPET = """
import site, sys
site.addsitedir({site!r})
from pathlib import Path
from edgevlm.daemon.doctor import _Host, _check_cameras, _check_microphones
h = _Host(Path({root!r}), None)
for r in _check_cameras(h) + [_check_microphones(h)]:
    print(r.verdict.value + "|" + r.detail)
"""


def test_devices_the_user_cannot_open_fail():
    """Run the device checks as an unprivileged user (root bypasses file permissions)."""
    system_python = "/usr/bin/python3.11"
    site_dir = (
        Path(sys.prefix)
        / "lib"
        / f"python{sys.version_info.major}.{sys.version_info.minor}"
        / "site-packages"
    )
    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(system_python):
        pytest.skip("needs root, setpriv and /usr/bin/python3.11 to act as an unprivileged user")
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the system python must match the venv's minor version")
    root = Path(tempfile.mkdtemp(prefix="edgevlm-doctor-"))
    try:
        root.chmod(0o755)
        _write(root / "dev/video0", "", 0o600)
        _write(root / "dev/snd/pcmC0D0c", "", 0o600)
        for d in (root / "dev", root / "dev/snd"):
            d.chmod(0o755)
        code = SNIPPET.format(site=str(site_dir), root=str(root))
        proc = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", system_python, "-c", code],
            capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        if proc.returncode != 0 and "Permission denied" in proc.stderr and "site-packages" in proc.stderr:
            pytest.skip("the venv is not readable by an unprivileged user")
        assert proc.returncode == 0, proc.stderr
        cams, mics = proc.stdout.strip().splitlines()
        assert (
            cams == "FAIL|1 found: /dev/video0 (?); not accessible: /dev/video0 (add the user to group video)"
        )
        assert mics.startswith("FAIL|") and mics.endswith(
            "not accessible: pcmC0D0c (add the user to group audio)"
        )
    finally:
        shutil.rmtree(root)


MIC_SNIPPET = """
import ctypes.util, sys
from pathlib import Path
{fault}
from edgevlm.daemon.doctor import _Host, _check_microphones
r = _check_microphones(_Host(Path({root!r}), None))
print(r.verdict.value + "|" + r.detail)
"""


@pytest.mark.parametrize(
    ("fault", "hint"),
    [
        # the PortAudio library missing: sounddevice's own import raises OSError
        ("ctypes.util.find_library = lambda name: None",
         "microphones need PortAudio (PortAudio library not found): apt-get install libportaudio2"),
        # the pip extra missing
        ("sys.modules['sounddevice'] = None", "microphones need sounddevice: pip install 'edgevlm[audio]'"),
    ],
)
def test_microphone_warning_says_what_to_install(tmp_path, fault, hint):
    out = subprocess.run([sys.executable, "-c", MIC_SNIPPET.format(fault=fault, root=str(tmp_path))],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    verdict, detail = out.stdout.strip().splitlines()[-1].split("|", 1)
    assert verdict == "WARN" and detail.startswith(hint), detail


@pytest.mark.parametrize("tuned", [True, False], ids=["set_tcp_nodelay", "mosquitto-defaults"])
def test_broker_row_names_the_delayed_ack_fix(tmp_path, tuned):
    """A broker with Nagle's algorithm on holds each answer behind the request's PUBACK until the
    client's 40 ms delayed ACK: the doctor measures a real request/response round trip between two
    connections and, seeing that signature, names the mosquitto setting that removes it."""
    port = _free_port()
    lines = [f"listener {port} 127.0.0.1", "allow_anonymous true", "persistence false"]
    lines += ["set_tcp_nodelay true"] if tuned else []
    lines += ["user root"] if os.geteuid() == 0 else []
    (tmp_path / "m.conf").write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen([MOSQUITTO, "-c", str(tmp_path / "m.conf")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        for _ in range(500):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.02)
        r = mqtt_probe("127.0.0.1", port)
    finally:
        proc.terminate()
        proc.wait(5)
    rtt_ms = float(r.detail.split("request/response round trip ")[1].split(" ms")[0])
    if tuned:
        assert r.verdict is Verdict.OK, r.detail
        assert rtt_ms < 30.0
    else:
        assert r.verdict is Verdict.WARN, r.detail
        assert rtt_ms >= 30.0 and "'set_tcp_nodelay true' to mosquitto.conf" in r.detail


def test_a_config_that_does_not_load_probes_its_mqtt_section_never_a_default(mosquitto, tmp_path, capsys):
    """Found by a tester: with a config that fails to validate, doctor probed localhost:1883, a broker the
    config never named. The config error is a FAIL row naming the key; the broker row probes the config's
    mqtt section when that loads alone (a real mosquitto), else says it was not checked and why."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"mqtt:\n  host: 127.0.0.1\n  port: {mosquitto.port}\n"
                   "sources:\n  - {name: dock, uri: 'rtsp://10.0.0.5/x', width: 640}\n")
    code, rows = run_main(capsys, "--config", str(cfg), "--timeout", "2")
    by = {r["check"]: r for r in rows}
    assert by["config"]["verdict"] == "FAIL" and by["config"]["detail"].startswith(
        f"{cfg}: sources[0].width: a network stream is decoded at the size it is sent"), by["config"]
    assert by["broker"]["verdict"] == "OK", by["broker"]
    assert by["broker"]["detail"].startswith(f"127.0.0.1:{mosquitto.port}: MQTT v5 CONNACK in ")
    assert by["broker"]["detail"].endswith("(the config's mqtt section; the config does not load as a whole)")
    assert code == 1

    cfg.write_text(f"mqtt:\n  host: 127.0.0.1\n  prot: {mosquitto.port}\n")
    code, rows = run_main(capsys, "--config", str(cfg), "--timeout", "2")
    by = {r["check"]: r for r in rows}
    assert by["config"]["verdict"] == "FAIL" and "mqtt.prot: unknown key" in by["config"]["detail"]
    assert by["broker"] == {"check": "broker", "verdict": "WARN", "detail": "not checked: the config's mqtt section "
                            "does not load (mqtt.prot: unknown key); give --broker HOST[:PORT] to probe one"}
    code, rows = run_main(capsys, "--config", str(tmp_path / "missing.yaml"), "--timeout", "2")
    broker = {r["check"]: r for r in rows}["broker"]
    assert broker["verdict"] == "WARN" and broker["detail"].startswith(
        f"not checked: the config file does not load (config file not found: {tmp_path / 'missing.yaml'})")
    # an explicit --broker is probed as asked
    code, rows = run_main(capsys, "--config", str(cfg), "--broker", f"127.0.0.1:{mosquitto.port}", "--timeout", "2")
    assert {r["check"]: r for r in rows}["broker"]["verdict"] == "OK"


def test_audio_sources_are_listed_wav_files_checked(tmp_path, capsys):
    """WAV-file audio sources were not listed at all (video files are): each audio source is a row, a WAV file
    with its format and length, or FAIL saying why it cannot be played."""
    import wave

    good = tmp_path / "speech.wav"
    with wave.open(str(good), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\0\0" * 8000)
    bad = tmp_path / "notes.wav"
    bad.write_text("not a wav file\n")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"audio:\n  - {{name: speech, file: {good}}}\n  - {{name: notes, file: {bad}, loop: false}}\n"
                   "  - {name: mic, device: USB}\n")
    code, rows = run_main(capsys, "--config", str(cfg), "--broker", f"127.0.0.1:{_free_port()}", "--timeout", "0.5")
    names = [r["check"] for r in rows]
    assert names[names.index("microphones") + 1:names.index("broker")] == ["audio speech", "audio notes", "audio mic"]
    by = {r["check"]: r for r in rows}
    assert by["config"]["verdict"] == "OK"
    assert by["audio speech"] == {"check": "audio speech", "verdict": "OK",
                                  "detail": f"WAV file {good} (16000 Hz, 1 ch, 0.5 s, looped)"}
    assert by["audio notes"] == {"check": "audio notes", "verdict": "FAIL",
                                 "detail": f"WAV file {bad}: {bad}: not a RIFF/WAVE file"}
    assert by["audio mic"] == {"check": "audio mic", "verdict": "OK",
                               "detail": "microphone: PortAudio device 'USB' (see microphones)"}
    assert code == 1
