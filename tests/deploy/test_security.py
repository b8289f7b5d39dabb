"""Security: MQTT over TLS with passwords or client certificates (a CA made by openssl here), the
shipped ACL example on a real mosquitto, request limits (payload, image bytes, decompression bomb),
duplicate client ids, the broker's maximum packet size, and no pickle / remote code on load."""

from __future__ import annotations

import base64
import json
import logging
import shutil
import ssl
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
OPENSSL = shutil.which("openssl")
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd")
needs_openssl = pytest.mark.skipif(OPENSSL is None, reason="openssl missing")


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(args, cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A CA, a broker certificate for 127.0.0.1, client certificates for dev1 and planner, and a
    client certificate from a CA the broker does not trust (EC P-256 keys, made by openssl)."""
    if OPENSSL is None:
        pytest.skip("openssl missing")
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "rogue_ca"):
        _run(OPENSSL, "req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2",
             "-subj", f"/CN=edgevlm test {ca}", cwd=d)  # fmt: skip
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, cn, ca, ext in (("broker", "localhost", "ca", True), ("dev1", "dev1", "ca", False),
                              ("planner", "planner", "ca", False), ("rogue", "planner", "rogue_ca", False)):  # fmt: skip
        _run(OPENSSL, "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
        _run(OPENSSL, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", *(["-extfile", "san.cnf"] if ext else []),
             cwd=d)  # fmt: skip
    return {p.stem + p.suffix.replace(".", "_"): p for p in d.iterdir()}


def _passwords(tmp_path: Path, users: dict[str, str]) -> Path:
    path = tmp_path / "passwd"
    for i, (user, pw) in enumerate(users.items()):
        _run(MOSQUITTO_PASSWD, *(["-c"] if i == 0 else []), "-b", str(path), user, pw, cwd=tmp_path)
    return path


def _example_conf(tmp_path: Path, pki: dict[str, Path], passwd: Path, acl: Path) -> list[str]:
    """jetson/mosquitto-edgevlm.conf.example with this test's files and port."""
    text = (ROOT / "jetson" / "mosquitto-edgevlm.conf.example").read_text()
    text = (text.replace("/etc/mosquitto/certs/ca.crt", str(pki["ca_crt"]))
            .replace("/etc/mosquitto/certs/broker.crt", str(pki["broker_crt"]))
            .replace("/etc/mosquitto/certs/broker.key", str(pki["broker_key"]))
            .replace("/etc/mosquitto/passwd", str(passwd)).replace("/etc/mosquitto/acl", str(acl))
            .replace("listener 8883", "listener {port} 127.0.0.1"))  # fmt: skip
    return [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def _start_example_broker(custom_broker, tmp_path, pki, users: dict[str, str]) -> int:
    passwd = _passwords(tmp_path, users)
    lines = _example_conf(tmp_path, pki, passwd, ROOT / "jetson" / "mosquitto-acl.example")
    return custom_broker.start(lines, name="example", listener=False)


def _tls(pki, **kw):
    return {"ca_certs": str(pki["ca_crt"]), **kw}


@needs_openssl
def test_tls_password_and_acl_from_the_shipped_examples(custom_broker, make_daemon, watcher, pki, tmp_path,
                                                        image_b64) -> None:  # fmt: skip
    users = {"dev1": "pw-dev1", "planner": "pw-planner", "intruder": "pw-intruder"}
    port = _start_example_broker(custom_broker, tmp_path, pki, users)
    daemon = make_daemon({"mqtt": {"port": port, "username": "dev1", "password": "pw-dev1",
                                   "tls": {"ca_certs": str(pki["ca_crt"])}}})  # fmt: skip
    planner = watcher(port, **_tls(pki, username="planner", password="pw-planner"))
    planner.subscribe("edgevlm/dev1/status")
    assert json.loads(planner.wait("edgevlm/dev1/status")[0].payload)["state"] == "online"
    request = {"prompt": "what?", "image_b64": image_b64()}
    r = planner.ask("dev1", request, response_prefix="edgevlm/dev1/response")
    assert r["ok"] is True

    intruder = watcher(port, **_tls(pki, username="intruder", password="pw-intruder"))
    intruder.subscribe("edgevlm/dev1/response/#")  # allowed to subscribe, never gets anything
    intruder.publish("edgevlm/dev1/request", json.dumps(request).encode(), response_topic="edgevlm/dev1/response/x")
    # the intruder's PUBACK came back (refused by the ACL) before the planner asks again
    assert planner.ask("dev1", request, response_prefix="edgevlm/dev1/response")["ok"] is True
    assert daemon.counters.get("messages_received") == 2  # only the planner's requests arrived
    assert intruder.messages.get("edgevlm/dev1/response/x") is None
    log = custom_broker.log("example")
    assert "Denied PUBLISH from" in log and "intruder" in log


@needs_openssl
def test_wrong_password_is_refused_and_retried_with_backoff(custom_broker, make_daemon, pki, tmp_path, caplog,
                                                            wait_until) -> None:  # fmt: skip
    port = _start_example_broker(custom_broker, tmp_path, pki, {"dev1": "right"})
    with caplog.at_level(logging.ERROR, logger="edgevlm.daemon.mqtt_bridge"):
        daemon = make_daemon({"mqtt": {"port": port, "username": "dev1", "password": "wrong",
                                       "tls": {"ca_certs": str(pki["ca_crt"])}}}, wait=False)  # fmt: skip
        wait_until(lambda: daemon.counters.get("mqtt_connect_refused") >= 2, what="two refused connects")
    assert not daemon.wait_ready(0) and not daemon.ready_sent.is_set()
    assert f"MQTT: connection refused by 127.0.0.1:{port}: Not authorized" in caplog.text


@needs_openssl
def test_client_certificates(custom_broker, make_daemon, watcher, pki, image_b64) -> None:
    port = custom_broker.start([
        f"cafile {pki['ca_crt']}", f"certfile {pki['broker_crt']}", f"keyfile {pki['broker_key']}",
        "require_certificate true", "use_identity_as_username true", "allow_anonymous false",
    ], name="mtls", listener=True)  # fmt: skip
    make_daemon({"mqtt": {"port": port, "tls": {"ca_certs": str(pki["ca_crt"]), "certfile": str(pki["dev1_crt"]),
                                                "keyfile": str(pki["dev1_key"])}}})  # fmt: skip
    planner = watcher(port, **_tls(pki, certfile=str(pki["planner_crt"]), keyfile=str(pki["planner_key"])))
    assert planner.ask("dev1", {"prompt": "what?", "image_b64": image_b64()})["ok"] is True
    assert "u'dev1'" in custom_broker.log("mtls")  # the certificate's CN is the daemon's user name
    # a certificate from another CA never gets a CONNACK
    assert _raw_connect(port, pki, "rogue") is None
    assert _raw_connect(port, pki, "planner") == 0x20  # control: the same code path with a trusted cert


def _raw_connect(port: int, pki, who: str) -> int | None:
    """TLS handshake with ``who``'s certificate, an MQTT v5 CONNECT, and the first byte back (None
    when the broker closes the connection)."""
    import socket

    ctx = ssl.create_default_context(cafile=str(pki["ca_crt"]))
    ctx.load_cert_chain(str(pki[f"{who}_crt"]), str(pki[f"{who}_key"]))
    cid = b"raw-" + who.encode()
    body = b"\x00\x04MQTT\x05\x02\x00\x1e\x00" + struct.pack(">H", len(cid)) + cid
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:  # fmt: skip
            tls.sendall(b"\x10" + bytes([len(body)]) + body)
            first = tls.recv(1)
    except (ssl.SSLError, ConnectionError):
        return None
    return first[0] if first else None


def _bomb_png(width: int, height: int) -> bytes:
    """A valid 8-bit grey PNG of zeros: tiny on the wire, width x height bytes once decoded."""
    comp = zlib.compressobj(9)
    row = bytes(width + 1)  # filter byte 0 + pixels
    idat = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_request_limits(make_daemon, watcher, image_b64) -> None:
    import cv2

    make_daemon({"mqtt": {"max_payload_bytes": 2_000_000}, "limits": {"max_image_bytes": 1_000_000}})
    w = watcher()
    big = base64.b64encode(bytes(1_600_000)).decode()
    r = w.ask("dev1", {"prompt": "q", "image_b64": big})
    assert r["error"]["code"] == "INVALID_REQUEST" and r["error"]["details"]["max_payload_bytes"] == 2_000_000
    noise = np.random.default_rng(0).integers(0, 256, (600, 700, 3), dtype=np.uint8)
    png = cv2.imencode(".png", noise)[1].tobytes()
    assert 1_000_000 < len(png) < 1_400_000
    r = w.ask("dev1", {"prompt": "q", "image_b64": base64.b64encode(png).decode()})
    assert r["error"]["code"] == "INVALID_IMAGE"
    assert r["error"]["message"] == f"inline image of {len(png)} bytes exceeds limits.max_image_bytes=1000000"
    bomb = _bomb_png(12000, 12000)
    assert len(bomb) < 200_000  # 144 MB of pixels in a few hundred kB
    r = w.ask("dev1", {"prompt": "q", "image_b64": base64.b64encode(bomb).decode()})
    assert r["error"]["code"] == "INVALID_IMAGE"
    assert r["error"]["message"] == ("PNG image is 12000 x 12000 = 144000000 pixels, over "
                                     "limits.max_image_pixels=16777216 (not decoded)")  # fmt: skip
    assert w.ask("dev1", {"prompt": "q", "image_b64": image_b64()})["ok"] is True


def test_decoder_refuses_a_bomb_on_its_own() -> None:
    from edgevlm.errors import InvalidImageError
    from edgevlm.runtime.image import decode_image

    with pytest.raises(InvalidImageError, match="over the limit"):
        decode_image(_bomb_png(9000, 9000))  # 81 M pixels > the decoder's own 2^26 limit


def _mosquitto_version() -> tuple[int, ...]:
    import os
    import re

    exe = os.environ.get("EDGEVLM_MOSQUITTO", "/usr/sbin/mosquitto")
    out = subprocess.run([exe, "-h"], capture_output=True, text=True, timeout=10).stdout
    return tuple(int(x) for x in re.search(r"mosquitto version (\d+)\.(\d+)\.(\d+)", out).groups())


def test_duplicate_client_id_backs_off_instead_of_fighting(make_daemon, caplog, wait_until) -> None:
    mqtt = {"device_id": "twin", "reconnect_min_delay_s": 0.1, "reconnect_max_delay_s": 0.8}
    with caplog.at_level(logging.ERROR, logger="edgevlm.daemon.mqtt_bridge"):
        a = make_daemon({"mqtt": mqtt})
        b = make_daemon({"mqtt": mqtt}, wait=False)
        wait_until(lambda: len(a.bridge.backoff_delays_s) >= 4 and len(b.bridge.backoff_delays_s) >= 4,
                   timeout_s=30, what="four quick closes each")  # fmt: skip
    for d in (a, b):
        delays = d.bridge.backoff_delays_s
        assert delays[:4] == [0.1, 0.2, 0.4, 0.8] and set(delays[4:]) <= {0.8}
        assert d.counters.get("mqtt_quick_disconnects") == len(delays)
    same_id = "the same client id 'edgevlm-daemon-twin' (another daemon with device_id 'twin'?)"
    if _mosquitto_version() >= (2, 0, 12):  # the broker sends DISCONNECT 0x8E Session taken over
        assert f"MQTT: session taken over by another client with {same_id}" in caplog.text
        assert a.counters.get("mqtt_session_taken_over") + b.counters.get("mqtt_session_taken_over") >= 4
    else:  # it closes the replaced connection without a DISCONNECT: the client id is named, not a takeover
        assert "times in a row: the connection broke without a DISCONNECT from the broker" in caplog.text
        assert f"another client with {same_id} would do this (mosquitto before 2.0.12" in caplog.text
        assert "taken over" not in caplog.text
        assert a.counters.get("mqtt_session_taken_over") == b.counters.get("mqtt_session_taken_over") == 0


def test_describe_disconnect_calls_only_0x8E_a_takeover() -> None:
    # the 0x8E branch: no broker at hand sends it (mosquitto 2.0.11 closes without a DISCONNECT)
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.reasoncodes import ReasonCode

    from edgevlm.daemon.mqtt_bridge import describe_disconnect

    def rc(value: int) -> ReasonCode:
        return ReasonCode(PacketTypes.DISCONNECT, identifier=value)

    args = ("edgevlm-daemon-dev1", "dev1")
    level, msg = describe_disconnect(rc(0x8E), True, None, 0.2, 1, *args)
    assert (level, msg) == (logging.ERROR, "session taken over by another client with the same client id "
                            "'edgevlm-daemon-dev1' (another daemon with device_id 'dev1'?) (the broker sent "
                            "DISCONNECT: Session taken over)")  # fmt: skip
    level, msg = describe_disconnect(rc(0x98), True, "kicked", 0.2, 3, *args)
    assert (level, msg) == (logging.WARNING, "connection closed 0.2 s after it was made, 3 times in a row: the "
                            "broker sent DISCONNECT: Administrative action (kicked)")  # fmt: skip
    level, msg = describe_disconnect(rc(0x8B), True, None, 42.0, 0, *args)
    assert level == logging.WARNING
    assert msg == "connection lost: the broker sent DISCONNECT: Server shutting down"


def test_responses_over_the_broker_packet_limit_become_errors(custom_broker, make_daemon, watcher, image_b64,
                                                              tmp_path, wait_until) -> None:  # fmt: skip
    limit = 4000
    port = custom_broker.start(["allow_anonymous true", f"max_packet_size {limit}"], name="small")
    wav = tmp_path / "a.wav"
    _write_tone_wav(wav)
    daemon = make_daemon({"mqtt": {"port": port}, "audio": [{"name": "mic", "file": str(wav)}]})
    assert daemon.bridge.max_packet_bytes == limit  # read from CONNACK
    w = watcher(port)
    request = {"prompt": "what?", "image_b64": image_b64(), "max_new_tokens": 24}
    ok = w.ask("dev1", request, raw=True)
    ok_bytes = len(ok.payload) + len(ok.topic)
    assert json.loads(ok.payload)["ok"] is True
    # correlation data that pushes the answer over the limit (an error response still fits)
    corr = b"\xff" * (limit - ok_bytes + 50)
    r = w.ask("dev1", request, correlation=corr, raw=True)
    body = json.loads(r.payload)
    assert r.properties.CorrelationData == corr and body["ok"] is False
    assert body["error"]["code"] == "INTERNAL" and body["error"]["details"]["reason"] == "response_too_large"
    assert body["error"]["details"]["max_packet_bytes"] == limit
    assert daemon.counters.get("publish_too_large") == 1 and daemon.counters.get("mqtt_disconnects") == 0

    src = daemon.audio.get("mic")
    wait_until(lambda: src.ring.written >= 16000, what="a second of audio")
    w.subscribe("test/feat")
    w.publish("edgevlm/dev1/audio/request", b'{"source": "mic", "seconds": 1}', response_topic="test/feat")
    too_big = json.loads(w.wait("test/feat")[0].payload)
    assert too_big["ok"] is False and too_big["error"]["details"]["reason"] == "response_too_large"
    assert too_big["error"]["message"].endswith(f"exceed the broker's maximum packet size ({limit} bytes); "
                                                "ask for fewer seconds")  # fmt: skip
    w.publish("edgevlm/dev1/audio/request", b'{"source": "mic", "seconds": 0.05}', response_topic="test/feat")
    assert json.loads(w.wait("test/feat", 2)[1].payload)["shape"] == [3, 64]
    assert daemon.counters.get("mqtt_disconnects") == 0 and daemon.bridge.connected


def _write_tone_wav(path: Path) -> None:
    import wave

    t = np.arange(16000) / 16000
    pcm = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(16000)
        f.writeframes(pcm.tobytes())


def test_model_folders_never_run_code_or_unpickle(tmp_path) -> None:
    from edgevlm.errors import ModelLoadError
    from edgevlm.runtime import Engine
    from edgevlm.runtime.testing import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "remote", seed=0)
    marker = tmp_path / "remote-code-ran"
    cfg = json.loads((model / "config.json").read_text())
    cfg["auto_map"] = {"AutoModel": "modeling_evil.EvilModel", "AutoConfig": "modeling_evil.EvilConfig"}
    (model / "config.json").write_text(json.dumps(cfg))
    (model / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    engine = Engine.load(model)
    assert isinstance(engine.ask(np.zeros((32, 32, 3), np.uint8), "what?", max_new_tokens=2).text, str)
    assert not marker.exists()  # trust_remote_code is never honoured

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model / f, pickled / f)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04\x95")
    with pytest.raises(ModelLoadError, match="only safetensors weights are accepted"):
        Engine.load(pickled)


@needs_openssl
def test_response_refused_by_the_acl_is_logged_with_the_puback_reason(custom_broker, make_daemon, watcher, pki,
                                                                      tmp_path, image_b64, caplog,
                                                                      wait_until) -> None:  # fmt: skip
    users = {"dev1": "pw-dev1", "planner": "pw-planner"}
    port = _start_example_broker(custom_broker, tmp_path, pki, users)
    with caplog.at_level(logging.WARNING, logger="edgevlm.daemon.mqtt_bridge"):
        daemon = make_daemon({"mqtt": {"port": port, "username": "dev1", "password": "pw-dev1",
                                       "tls": {"ca_certs": str(pki["ca_crt"])}}})  # fmt: skip
        planner = watcher(port, **_tls(pki, username="planner", password="pw-planner"))
        # dev1 may write only under edgevlm/dev1/: the response on planner/inbox is refused
        planner.publish("edgevlm/dev1/request", json.dumps({"prompt": "what?", "image_b64": image_b64()}).encode(),
                        response_topic="planner/inbox", correlation=b"acl")  # fmt: skip
        wait_until(lambda: daemon.counters.get("response_refused") == 1, what="the refused PUBACK")
    assert ("MQTT: the broker refused the response on planner/inbox: PUBACK reason 0x87 Not authorized "
            "(check its ACL)") in caplog.text
    assert 'edgevlm_requests_dropped_total{reason="response_refused"} 1.0' in daemon.metrics.exposition().decode()
    assert all(r.levelno <= logging.WARNING for r in caplog.records if "refused the response" in r.getMessage())
    # still serving the allowed address
    assert planner.ask("dev1", {"prompt": "what?", "image_b64": image_b64()},
                       response_prefix="edgevlm/dev1/response")["ok"] is True  # fmt: skip


@needs_openssl
def test_tls_certificate_failure_is_named_when_connecting(custom_broker, make_daemon, pki, caplog,
                                                          wait_until) -> None:  # fmt: skip
    port = custom_broker.start([f"cafile {pki['ca_crt']}", f"certfile {pki['broker_crt']}",
                                f"keyfile {pki['broker_key']}", "allow_anonymous true"], name="tls")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="edgevlm.daemon.mqtt_bridge"):
        daemon = make_daemon({"mqtt": {"port": port, "tls": {"ca_certs": str(pki["rogue_ca_crt"])}}}, wait=False)
        wait_until(lambda: daemon.counters.get("mqtt_connect_failures") >= 1, what="a failed connect")
    assert (f"MQTT: cannot connect to 127.0.0.1:{port}: TLS certificate verification failed: self-signed "
            "certificate in certificate chain (check the CA certificates); retrying") in caplog.text


def test_quick_disconnects_for_another_reason_are_logged_with_it_not_as_a_takeover(custom_broker, make_daemon,
                                                                                     watcher, tmp_path, caplog,
                                                                                     wait_until) -> None:  # fmt: skip
    # mosquitto's dynamic security plugin disconnects a client it disables with DISCONNECT 0x98
    # Administrative action; disabled and enabled again in one go, twice, right after each connect
    import glob

    ctrl = shutil.which("mosquitto_ctrl")
    plugin = sorted(glob.glob("/usr/lib/*/mosquitto_dynamic_security.so"))
    assert ctrl and plugin, "mosquitto_ctrl and mosquitto_dynamic_security.so ship with Debian's mosquitto"
    dynsec = tmp_path / "dynsec.json"
    _run(ctrl, "dynsec", "init", str(dynsec), "admin", "admin-pw", cwd=tmp_path)
    port = custom_broker.start(["allow_anonymous false", f"plugin {plugin[0]}", f"plugin_opt_config_file {dynsec}"],
                               name="dynsec")  # fmt: skip
    admin = watcher(port, username="admin", password="admin-pw")
    admin.subscribe("$CONTROL/dynamic-security/v1/response")

    def control(*commands: dict) -> None:
        n = admin.count("$CONTROL/dynamic-security/v1/response") + 1
        admin.publish("$CONTROL/dynamic-security/v1", json.dumps({"commands": list(commands)}).encode())
        replies = json.loads(admin.wait("$CONTROL/dynamic-security/v1/response", n)[-1].payload)["responses"]
        assert not [r for r in replies if r.get("error")], replies

    control({"command": "createClient", "username": "dev1", "password": "pw-dev1"},
            {"command": "setDefaultACLAccess", "acls": [{"acltype": "publishClientSend", "allow": True},
                                                        {"acltype": "subscribe", "allow": True}]})  # fmt: skip
    kick = ({"command": "disableClient", "username": "dev1"}, {"command": "enableClient", "username": "dev1"})
    with caplog.at_level(logging.WARNING, logger="edgevlm.daemon.mqtt_bridge"):
        daemon = make_daemon({"mqtt": {"port": port, "username": "dev1", "password": "pw-dev1"}})
        for i in (1, 2):
            control(*kick)
            wait_until(lambda i=i: daemon.counters.get("mqtt_disconnects") == i and daemon.wait_ready(0),
                       timeout_s=15, what=f"kick {i} and the reconnect")  # fmt: skip
    assert "the broker sent DISCONNECT: Administrative action" in caplog.text
    again = "s after it was made, 2 times in a row: the broker sent DISCONNECT: Administrative action"
    assert again in caplog.text
    assert "taken over" not in caplog.text and "same client id" not in caplog.text
    assert daemon.counters.get("mqtt_quick_disconnects") == 2
    assert daemon.counters.get("mqtt_session_taken_over") == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_broker_crash_is_logged_as_a_broken_connection_not_a_takeover(mosquitto, make_daemon, caplog,
                                                                       wait_until) -> None:  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="edgevlm.daemon.mqtt_bridge"):
        daemon = make_daemon()
        port = mosquitto.port
        mosquitto.stop(kill=True)
        wait_until(lambda: daemon.counters.get("mqtt_connect_failures") >= 1, what="a failed reconnect")
        mosquitto.start(port=port)
        wait_until(lambda: daemon.wait_ready(0), timeout_s=20, what="the reconnect")
    assert "the connection broke without a DISCONNECT from the broker" in caplog.text
    assert f"MQTT: cannot connect to 127.0.0.1:{port}: connection refused (no broker listening on that port)" \
        in caplog.text
    assert "taken over" not in caplog.text and "same client id" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
