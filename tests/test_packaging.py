"""Packaging: the package-dir mapping, the built wheel's contents, and a light ``import edgevlm``.

The repository keeps ``runtime/``, ``quantize/`` and ``daemon/`` at the top level, but they install
as ``edgevlm.runtime``, ``edgevlm.quantize`` and ``edgevlm.daemon`` (pyproject's package-dir
mapping). Nothing named ``runtime``, ``quantize`` or ``daemon`` may land at the top of
site-packages (python-daemon ships a top-level ``daemon``).
"""

from __future__ import annotations

import fnmatch
import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
# The folders the issue names, and the package each must install as.
REQUIRED_ROOTS = {
    "edgevlm": "edgevlm",
    "runtime": "edgevlm.runtime",
    "quantize": "edgevlm.quantize",
    "daemon": "edgevlm.daemon",
}
HEAVY = ("torch", "cv2", "transformers", "safetensors", "tokenizers")


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _roots() -> dict[str, str]:
    """Source folder -> package, from pyproject's package-dir (top-level folders only)."""
    mapping = _pyproject()["tool"]["setuptools"]["package-dir"]
    return {folder: pkg for pkg, folder in mapping.items() if "/" not in folder.strip("/")}


ROOTS = _roots()


def _source_packages() -> dict[str, Path]:
    """Every folder with an __init__.py under the four roots, as {package name: folder}."""
    out = {}
    for root, pkg in ROOTS.items():
        for init in sorted((REPO / root).rglob("__init__.py")):
            rel = init.parent.relative_to(REPO / root)
            if "__pycache__" in rel.parts:
                continue
            out[".".join([pkg, *rel.parts]) if rel.parts else pkg] = init.parent
    return out


def _source_files() -> list[tuple[Path, str]]:
    """Every file under the four roots (no caches) with its path inside the wheel."""
    out = []
    for root, pkg in ROOTS.items():
        for path in sorted((REPO / root).rglob("*")):
            rel = path.relative_to(REPO / root)
            if not path.is_file() or "__pycache__" in rel.parts or path.suffix in (".pyc", ".pyo"):
                continue
            out.append((path, "/".join([*pkg.split("."), *rel.parts])))
    return out


def test_every_package_folder_is_listed_in_pyproject() -> None:
    tool = _pyproject()["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = _source_packages()
    missing = sorted(set(found) - listed)
    assert not missing, f"add these packages to [tool.setuptools] packages in pyproject.toml: {missing}"
    stale = sorted(p for p in listed if p not in found)
    assert not stale, f"pyproject lists packages with no __init__.py folder: {stale}"
    mapping = tool["package-dir"]
    for root, pkg in REQUIRED_ROOTS.items():
        assert mapping.get(pkg) == root, f"package-dir must map {pkg!r} to {root!r}"


def test_every_python_file_is_in_a_package() -> None:
    """A .py file in a folder without __init__.py would silently be left out of the wheel."""
    packages = {folder for folder in _source_packages().values()}
    orphans = [
        str(p.relative_to(REPO)) for p, _ in _source_files() if p.suffix == ".py" and p.parent not in packages
    ]
    assert not orphans, f"these modules are in folders without __init__.py: {orphans}"


def test_editable_install_maps_the_folders() -> None:
    code = textwrap.dedent(
        """
        import importlib, importlib.util, json
        out = {}
        for name in ("edgevlm", "edgevlm.runtime", "edgevlm.quantize", "edgevlm.daemon"):
            out[name] = importlib.import_module(name).__file__
        for name in ("runtime", "quantize"):
            out[name] = importlib.util.find_spec(name) is not None
        spec = importlib.util.find_spec("daemon")  # python-daemon may own it; ours must not
        out["daemon"] = spec.origin if spec else None
        print(json.dumps(out))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert Path(out["edgevlm"]) == REPO / "edgevlm" / "__init__.py"
    assert Path(out["edgevlm.runtime"]) == REPO / "runtime" / "__init__.py"
    assert Path(out["edgevlm.quantize"]) == REPO / "quantize" / "__init__.py"
    assert Path(out["edgevlm.daemon"]) == REPO / "daemon" / "__init__.py"
    assert out["runtime"] is False and out["quantize"] is False
    assert out["daemon"] is None or not str(out["daemon"]).startswith(str(REPO))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """Build the wheel from a copy of the sources (the work tree gets no build/ or egg-info)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in (*ROOTS, "pyproject.toml", "README.md", "LICENSE"):
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        elif path.exists():
            shutil.copy2(path, src / name)
    out = tmp / "dist"
    try:
        import build  # noqa: F401

        cmd = [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--skip-dependency-check",
            "--outdir",
            str(out),
            str(src),
        ]
    except ImportError:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(src),
        ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"wheel build failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    wheels = list(out.glob("edgevlm-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as zf:
        yield zf


def test_wheel_top_level_is_only_edgevlm(wheel: zipfile.ZipFile) -> None:
    version = _pyproject()["project"]["version"]
    top = {name.split("/", 1)[0] for name in wheel.namelist()}
    assert top == {"edgevlm", f"edgevlm-{version}.dist-info"}, top
    dist_info = f"edgevlm-{version}.dist-info"
    top_level = (
        wheel.read(f"{dist_info}/top_level.txt").decode().split()
        if (f"{dist_info}/top_level.txt" in wheel.namelist())
        else ["edgevlm"]
    )
    assert top_level == ["edgevlm"]
    entry_points = wheel.read(f"{dist_info}/entry_points.txt").decode()
    assert "edgevlm = edgevlm.cli:main" in entry_points


def test_wheel_holds_every_module_and_package_file(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    # Every file whose name matches a package-data pattern, in any sub-folder, must ship.
    patterns = [p.rsplit("/", 1)[-1] for p in _pyproject()["tool"]["setuptools"]["package-data"]["*"]]
    missing_py, missing_data = [], []
    for path, wheel_path in _source_files():
        if path.suffix == ".py":
            if wheel_path not in names:
                missing_py.append(wheel_path)
        elif any(fnmatch.fnmatch(path.name, pat) for pat in patterns) and wheel_path not in names:
            missing_data.append(wheel_path)
    assert not missing_py, f"modules missing from the wheel: {missing_py}"
    assert not missing_data, f"package data missing from the wheel: {missing_data}"
    assert "edgevlm/runtime/image.py" in names and "edgevlm/cli.py" in names
    assert not any(n.startswith(("runtime/", "daemon/", "quantize/", "tests/")) for n in names)


def test_wheel_modules_are_byte_identical(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for path, wheel_path in _source_files():
        if path.suffix == ".py" and wheel_path in names:  # missing ones: the test above
            assert wheel.read(wheel_path) == path.read_bytes(), wheel_path


def _imported_modules(code: str) -> list[str]:
    probe = (
        "import sys, json\n"
        + code
        + textwrap.dedent(
            f"""
        heavy = {HEAVY!r}
        subs = ("edgevlm.runtime", "edgevlm.quantize", "edgevlm.daemon")
        print(json.dumps(sorted(m for m in sys.modules
                                if m.split(".")[0] in heavy or m.startswith(subs))))
        """
        )
    )
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd="/", timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_import_edgevlm_is_light() -> None:
    assert _imported_modules("import edgevlm") == []
    core = [
        m
        for m in ("protocol", "config", "client", "cli", "types", "errors")
        if (REPO / "edgevlm" / f"{m}.py").exists()
    ]
    code = "import edgevlm\n" + "\n".join(f"import edgevlm.{m}" for m in core)
    code += "\nedgevlm.Answer, edgevlm.ErrorCode, edgevlm.OperatingPoint"
    if "client" in core:
        code += ", edgevlm.Client"
    assert _imported_modules(code) == []


def test_cli_help_and_check_config_are_light(tmp_path) -> None:
    code = textwrap.dedent(
        """
        import contextlib, io
        from edgevlm.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                main(["--help"])
            except SystemExit:
                pass
        """
    )
    assert _imported_modules(code) == []
    # --check-config runs the daemon's start-up checks (edgevlm.daemon.preflight): the tokenizer and
    # chat template are loaded (tokenizers), but a CPU model without video files needs no torch or OpenCV.
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text("mqtt:\n  host: localhost\n  device_id: robot-1\n")
    code = textwrap.dedent(
        f"""
        import contextlib, io
        from edgevlm.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["serve", "--check-config", {str(cfg)!r}]) == 0
        """
    )
    imported = _imported_modules(code)
    assert "edgevlm.daemon.preflight" in imported
    assert not [m for m in imported if m.split(".")[0] in ("torch", "cv2", "transformers", "safetensors")]
    assert not [m for m in imported if m.startswith(("edgevlm.quantize", "edgevlm.runtime.engine",
                                                     "edgevlm.runtime.loader"))]
