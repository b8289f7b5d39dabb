"""jetson/install.sh: shellcheck-clean, --dry-run changes nothing, DESTDIR installs are idempotent, and on
a Jetson it never pip-installs torch."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "jetson" / "install.sh"


def install(*args: str, destdir: Path | None = None, python: str = sys.executable, **env: str):
    e = {k: v for k, v in os.environ.items() if k not in ("DESTDIR", "PIP_OPTS")}
    e["PYTHON"] = python
    e.update(env)
    if destdir is not None:
        e["DESTDIR"] = str(destdir)
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=e, timeout=300, cwd=ROOT
    )


def commands(out: str) -> list[str]:
    """The `+ cmd` lines a --dry-run prints, with bash's %q escapes undone."""
    return [re.sub(r"\\(.)", r"\1", ln[2:]) for ln in out.splitlines() if ln.startswith("+ ")]


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    proc = subprocess.run(["shellcheck", "--severity=style", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_script_is_executable_and_parses():
    assert os.access(SCRIPT, os.X_OK)
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_dry_run_generic_prints_every_step_and_changes_nothing(tmp_path):
    stage = tmp_path / "stage"
    proc = install("--dry-run", "--platform", "generic", destdir=stage)
    assert proc.returncode == 0, proc.stderr
    assert not stage.exists()
    cmds = commands(proc.stdout)
    venv = f"{stage}/opt/edgevlm/venv"
    assert cmds[0] == f"{sys.executable} -m venv --system-site-packages {venv}"
    pip = cmds[1].split()
    assert pip[:5] == [f"{venv}/bin/python", "-m", "pip", "install", "--upgrade"]
    assert pip[5] == "--constraint" and pip[-1] == f"{ROOT}[runtime,metrics,audio]"
    assert cmds[2:] == [
        f"install -D -m 0644 <generated> {stage}/etc/systemd/system/edgevlm.service",
        f"install -D -m 0640 <generated> {stage}/etc/edgevlm/config.example.yaml",
        f"install -D -m 0640 <generated> {stage}/etc/edgevlm/config.yaml",
        f"install -D -m 0640 <generated> {stage}/etc/edgevlm/environment",
    ]
    assert "not creating the 'edgevlm' user (DESTDIR is set)" in proc.stdout
    assert proc.stdout.rstrip().endswith("dry run: nothing was changed")


def test_dry_run_on_a_jetson_reuses_torch_and_never_installs_it(tmp_path):
    proc = install("--dry-run", "--platform", "jetson", destdir=tmp_path / "stage")
    assert proc.returncode == 0, proc.stderr
    import torch

    # the interpreter's torch (JetPack's on a Jetson) is pinned in the constraints and reused
    assert f"torch=={torch.__version__}" in proc.stdout
    assert f"reusing JetPack's torch {torch.__version__}" in proc.stdout
    pip = next(c for c in commands(proc.stdout) if " -m pip install " in c).split()
    packages = pip[pip.index("--constraint") + 2 :]
    assert packages[0] == f"{ROOT}[metrics,audio]"  # no "runtime" extra: it lists torch
    assert not any(p.split("[")[0].split(">")[0].split("=")[0] == "torch" for p in packages)
    assert not any("runtime" in p for p in packages)


def test_jetson_runtime_deps_match_pyproject():
    tomllib = pytest.importorskip("tomllib")
    runtime = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "runtime"
    ]
    expected = sorted(d for d in runtime if not d.startswith(("torch", "opencv-python-headless")))
    m = re.search(r"^JETSON_RUNTIME_DEPS=\((.*)\)$", SCRIPT.read_text(), re.M)
    assert m is not None
    assert sorted(re.findall(r'"([^"]+)"', m.group(1))) == expected


def test_jetson_refuses_the_runtime_extra(tmp_path):
    proc = install("--dry-run", "--platform", "jetson", "--extras", "runtime,metrics", destdir=tmp_path)
    assert proc.returncode == 2  # a mistake in the options: exit 2, as an unknown option
    assert "would pull torch from PyPI on a Jetson" in proc.stderr


def test_jetson_without_torch_warns_and_continues(tmp_path):
    base = shutil.which("python3.11") or shutil.which("python3")
    probe = subprocess.run([base, "-c", "import torch"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("the base python3 has torch")
    proc = install("--dry-run", "--platform", "jetson", destdir=tmp_path, python=base)
    assert proc.returncode == 0, proc.stderr
    assert "never pip-installs torch on a Jetson" in proc.stdout
    pip = next(c for c in commands(proc.stdout) if " -m pip install " in c)
    assert "torch" not in pip.split("--constraint")[1].split(maxsplit=1)[1]


def test_real_destdir_install_is_idempotent(tmp_path):
    stage = tmp_path / "stage"
    first = install("--skip-pip", "--prefix", "/srv/edgevlm", destdir=stage)
    assert first.returncode == 0, first.stderr
    unit = stage / "etc/systemd/system/edgevlm.service"
    config = stage / "etc/edgevlm/config.yaml"
    example = stage / "etc/edgevlm/config.example.yaml"
    venv = stage / "srv/edgevlm/venv"
    assert "include-system-site-packages = true" in (venv / "pyvenv.cfg").read_text()
    assert (venv / "bin" / "python").exists()
    source_unit = (ROOT / "jetson/edgevlm.service").read_text()
    assert unit.read_text() == source_unit.replace("/opt/edgevlm/venv/", "/srv/edgevlm/venv/")
    assert (
        "ExecStart=/srv/edgevlm/venv/bin/edgevlm serve --config /etc/edgevlm/config.yaml" in unit.read_text()
    )
    assert config.read_text() == example.read_text() == (ROOT / "jetson/config.example.yaml").read_text()
    assert (unit.stat().st_mode & 0o777, config.stat().st_mode & 0o777) == (0o644, 0o640)
    assert "edgevlm is installed." in first.stdout

    config.write_text(config.read_text().replace("device_id: robot-1", "device_id: robot-42"))
    unit_mtime = unit.stat().st_mtime_ns
    second = install("--skip-pip", "--prefix", "/srv/edgevlm", destdir=stage)
    assert second.returncode == 0, second.stderr
    assert f"reusing virtualenv {venv}" in second.stdout
    assert f"unchanged: {unit}" in second.stdout
    assert f"kept existing {config}" in second.stdout
    assert "device_id: robot-42" in config.read_text()  # the user's edit survives
    assert unit.stat().st_mtime_ns == unit_mtime


def test_existing_venv_without_system_site_packages_is_refused(tmp_path):
    venv = tmp_path / "opt/edgevlm/venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/python").write_text("#!/bin/sh\n")
    (venv / "bin/python").chmod(0o755)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\n")
    proc = install("--skip-pip", destdir=tmp_path)
    assert proc.returncode == 1
    assert "exists without --system-site-packages" in proc.stderr


@pytest.mark.parametrize(
    ("args", "env", "code", "message"),
    [
        (["--bogus"], {}, 2, "unknown option --bogus"),
        (["--prefix"], {}, 2, "--prefix needs a value"),
        (["--prefix", "relative/dir"], {}, 2, "--prefix must be an absolute path"),
        (["--platform", "mars"], {}, 2, "--platform must be auto, jetson or generic"),
        (["--source", "/nonexistent/edgevlm"], {}, 2, "--source not found"),
        ([], {"DESTDIR": "relative"}, 2, "DESTDIR must be an absolute path"),
        ([], {"PYTHON": "/nonexistent/python3"}, 1, "/nonexistent/python3 not found"),
    ],
)
def test_bad_arguments(args, env, code, message):
    proc = install("--dry-run", *args, **env)
    # a mistake in the options or environment: one line naming the flag, exit 2 (was 1 for all but an
    # unknown option)
    assert proc.returncode == code
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr


def test_help():
    proc = install("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("Usage: install.sh")


def _unit_values(text: str, key: str) -> list[str]:
    return [w for ln in text.splitlines() if ln.startswith(f"{key}=") for w in ln.split("=", 1)[1].split()]


TRY_LOCK = (
    "import sys; from torch.utils.file_baton import FileBaton\n"
    "b = FileBaton(sys.argv[1] + '/lock')\n"
    "try:\n    b.try_acquire(); b.release(); print('LOCKED')\n"
    "except OSError as e:\n    print('REFUSED', e.strerror)\n"
)


def test_kernel_cache_stays_writable_under_protect_system_strict(tmp_path):
    # Was: install.sh builds the W4A16 kernel into <venv>/var/cache/edgevlm-kernels, but the unit's
    # ProtectSystem=strict made /opt read-only and torch's extension loader creates a lock file there at every
    # load (FileBaton), so the service never used the prebuilt kernel (INT4 decode fell back to tinygemm).
    proc = install("--skip-pip", "--prefix", "/srv/evlm", destdir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    unit = (tmp_path / "etc/systemd/system/edgevlm.service").read_text()
    assert "/opt/edgevlm" not in unit  # every venv path follows --prefix
    assert _unit_values(unit, "ProtectSystem") == ["strict"]
    cache = "/srv/evlm/venv/var/cache/edgevlm-kernels"  # install.sh's KERNEL_CACHE, the runtime's venv cache
    assert "KERNEL_CACHE=$VENV_DIR/var/cache/edgevlm-kernels" in SCRIPT.read_text()
    assert f"-{cache}" in _unit_values(unit, "ReadWritePaths")
    assert '"var" / "cache" / "edgevlm-kernels"' in (ROOT / "runtime/kernels/w4a16_mma.py").read_text()
    # What systemd does with those two settings, in a mount namespace: the prefix read-only, the unit's
    # ReadWritePaths under it bound read-write again; then torch's own lock, as the service would take it.
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a mount namespace")
    venv = tmp_path / "srv/evlm/venv"
    (venv / "var/cache/edgevlm-kernels/ext").mkdir(parents=True)
    binds = [p[1:] if p.startswith("-") else p for p in _unit_values(unit, "ReadWritePaths")]
    rw = " && ".join(f"mount --bind {tmp_path}{p} {tmp_path}{p} && mount -o remount,bind,rw {tmp_path}{p}"
                    for p in binds if p.startswith("/srv/"))
    script = (f"mount --bind {tmp_path}/srv {tmp_path}/srv && mount -o remount,bind,ro {tmp_path}/srv"
              f"{' && ' + rw if rw else ''} && {sys.executable} -c \"$1\" {venv}/var/cache/edgevlm-kernels/ext")
    ns = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", TRY_LOCK], capture_output=True, text=True,
                        timeout=60)
    if "Operation not permitted" in ns.stderr:
        pytest.skip(f"no mount namespace here: {ns.stderr.strip()}")
    assert ns.stdout.strip() == "LOCKED", ns.stdout + ns.stderr
    # and without that line the lock is refused, as it was
    ro = script.replace(rw, "true") if rw else script
    ns = subprocess.run(["unshare", "-m", "sh", "-c", ro, "sh", TRY_LOCK], capture_output=True, text=True, timeout=60)
    assert ns.stdout.strip() == "REFUSED Read-only file system", ns.stdout + ns.stderr


def test_environment_file_for_secrets_is_installed_once_and_read_by_the_unit(tmp_path):
    # Was: no EnvironmentFile= in the unit, so EDGEVLM_HTTP_API_KEY (http.api_key_env) could not reach the
    # service without hand-writing a drop-in; the secret belongs in a root:edgevlm 0640 file, not the unit.
    first = install("--skip-pip", destdir=tmp_path)
    assert first.returncode == 0, first.stderr
    unit = (tmp_path / "etc/systemd/system/edgevlm.service").read_text()
    env_file = tmp_path / "etc/edgevlm/environment"
    assert _unit_values(unit, "EnvironmentFile") == ["-/etc/edgevlm/environment"]
    assert env_file.stat().st_mode & 0o777 == 0o640
    text = env_file.read_text()
    assert "EDGEVLM_HTTP_API_KEY" in text
    # nothing set by default: an empty EDGEVLM_HTTP_API_KEY= would switch the daemon's empty-token warning on
    assert [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")] == []
    env_file.write_text("EDGEVLM_HTTP_API_KEY=s3cret\n")
    second = install("--skip-pip", destdir=tmp_path)
    assert second.returncode == 0, second.stderr
    assert f"kept existing {env_file}" in second.stdout
    assert env_file.read_text() == "EDGEVLM_HTTP_API_KEY=s3cret\n"  # the deployer's secret survives
    dry = install("--dry-run", "--platform", "generic")
    assert any(c.startswith("chown root:edgevlm ") and c.endswith(" /etc/edgevlm/environment")
               for c in commands(dry.stdout)), dry.stdout
