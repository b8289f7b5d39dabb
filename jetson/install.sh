#!/usr/bin/env bash
# Install the edgevlm daemon as a systemd service on a Jetson (or any systemd Linux host).
#
#   sudo jetson/install.sh                 # install into /opt/edgevlm, /etc/edgevlm, /etc/systemd/system
#   jetson/install.sh --dry-run            # print every step, change nothing
#   DESTDIR=/tmp/stage jetson/install.sh   # stage the files under a root (no user, no systemctl)
#
# Safe to run again: an existing virtualenv is reused, an existing /etc/edgevlm/config.yaml is kept (the
# example is refreshed beside it as config.example.yaml), the unit is only rewritten when it changed.
#
# On a Jetson the virtualenv is created with --system-site-packages so JetPack's PyTorch, TensorRT and
# GStreamer-enabled OpenCV are reused. This script never pip-installs torch there: the packages already
# present (torch, numpy, tensorrt, ...) are pinned with a pip constraints file, and the torch-free extras
# are installed. A DESTDIR venv is for inspection or packaging only: venvs are not relocatable.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: install.sh [options]
  --dry-run            print what would be done, change nothing
  --prefix DIR         installation folder of the virtualenv (default /opt/edgevlm)
  --source DIR         edgevlm source tree or wheel to install (default: this repository)
  --platform P         auto (default), jetson or generic
  --extras LIST        pip extras (default: jetson: metrics,audio + torch-free runtime deps;
                       generic: runtime,metrics,audio)
  --skip-pip           create the venv and files, do not pip-install edgevlm
  --no-user            do not create the edgevlm system user
  --enable             systemctl enable --now edgevlm after installing
  -h, --help           this help
Environment: DESTDIR (stage under a root), PYTHON (base interpreter, default python3),
             PIP_OPTS (extra pip install options, e.g. "--no-index --find-links DIR").
EOF
}

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SOURCE=$(dirname "$SCRIPT_DIR")
PREFIX=/opt/edgevlm
PLATFORM=auto
EXTRAS=""
DRY_RUN=0
SKIP_PIP=0
CREATE_USER=1
ENABLE=0
DESTDIR=${DESTDIR:-}
PYTHON=${PYTHON:-python3}
PIP_OPTS=${PIP_OPTS:-}
SERVICE_USER=edgevlm
SERVICE_GROUPS=(video render audio)
DEFAULT_VENV=/opt/edgevlm/venv
# The "runtime" extra of pyproject.toml minus torch and opencv-python-headless (tests/jetson checks this).
JETSON_RUNTIME_DEPS=("safetensors>=0.4" "tokenizers>=0.15" "jinja2>=3.1" "pillow>=10")

log() { printf 'install.sh: %s\n' "$*"; }
die() {
    printf 'install.sh: error: %s\n' "$*" >&2
    exit 1
}
# bad_usage MESSAGE: a mistake in the options or environment given: one line, exit 2 (as an unknown option).
bad_usage() {
    printf 'install.sh: error: %s\n' "$*" >&2
    exit 2
}

while (($#)); do
    case $1 in
        --prefix | --source | --platform | --extras) [[ $# -ge 2 && -n $2 ]] || bad_usage "$1 needs a value" ;;
    esac
    case $1 in
        --dry-run) DRY_RUN=1 ;;
        --prefix) PREFIX=${2:?--prefix needs a folder}; shift ;;
        --source) SOURCE=${2:?--source needs a folder or wheel}; shift ;;
        --platform) PLATFORM=${2:?--platform needs auto, jetson or generic}; shift ;;
        --extras) EXTRAS=${2:?--extras needs a list}; shift ;;
        --skip-pip) SKIP_PIP=1 ;;
        --no-user) CREATE_USER=0 ;;
        --enable) ENABLE=1 ;;
        -h | --help) usage; exit 0 ;;
        *) bad_usage "unknown option $1 (install.sh --help lists them)" ;;
    esac
    shift
done

case $PLATFORM in auto | jetson | generic) ;; *) bad_usage "--platform must be auto, jetson or generic, got '$PLATFORM'" ;; esac
[[ $PREFIX == /* ]] || bad_usage "--prefix must be an absolute path, got '$PREFIX'"
[[ -z $DESTDIR || $DESTDIR == /* ]] || bad_usage "DESTDIR must be an absolute path, got '$DESTDIR'"
[[ -e $SOURCE ]] || bad_usage "--source not found: $SOURCE"
[[ -f $SCRIPT_DIR/edgevlm.service && -f $SCRIPT_DIR/config.example.yaml ]] ||
    die "jetson/edgevlm.service and jetson/config.example.yaml must sit beside this script"

# run CMD...: execute, or print it with --dry-run.
run() {
    if ((DRY_RUN)); then
        printf '+'
        printf ' %q' "$@"
        printf '\n'
    else
        "$@"
    fi
}

TMP_FILES=()
cleanup() { ((${#TMP_FILES[@]} == 0)) || rm -f "${TMP_FILES[@]}"; }
trap cleanup EXIT

# install_content MODE DEST: install stdin as DEST when it differs from what is there.
install_content() {
    local mode=$1 dest=$2 tmp
    tmp=$(mktemp)
    TMP_FILES+=("$tmp")
    cat >"$tmp"
    if [[ -f $dest ]] && cmp -s "$tmp" "$dest"; then
        log "unchanged: $dest"
        return 0
    fi
    if ((DRY_RUN)); then
        printf '+ install -D -m %s <generated> %q\n' "$mode" "$dest"
        return 0
    fi
    install -D -m "$mode" "$tmp" "$dest"
    log "installed: $dest"
}

is_jetson() {
    [[ -f /etc/nv_tegra_release ]] && return 0
    [[ -r /proc/device-tree/model ]] && tr -d '\0' </proc/device-tree/model | grep -qi 'jetson'
}

if [[ $PLATFORM == auto ]]; then
    if is_jetson; then PLATFORM=jetson; else PLATFORM=generic; fi
fi
log "platform: $PLATFORM; prefix: $PREFIX; DESTDIR: ${DESTDIR:-(none)}; source: $SOURCE"

if [[ -z $DESTDIR && $EUID -ne 0 && $DRY_RUN -eq 0 ]]; then
    die "run as root (sudo $0), or stage with DESTDIR=/some/root, or look first with --dry-run"
fi

if [[ $PLATFORM == jetson && ,$EXTRAS, == *,runtime,* ]]; then
    bad_usage "--extras runtime would pull torch from PyPI on a Jetson; leave it out (its torch-free deps are added)"
fi

# -- the base interpreter ---------------------------------------------------------------------------
command -v "$PYTHON" >/dev/null || die "$PYTHON not found (sudo apt-get install python3)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
    die "edgevlm needs Python >= 3.10; $PYTHON is $("$PYTHON" -c 'import platform; print(platform.python_version())')"
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null ||
    die "the venv module is missing for $PYTHON (sudo apt-get install python3-venv)"

VENV=$PREFIX/venv
VENV_DIR=$DESTDIR$VENV
CONSTRAINTS=$(mktemp)
TMP_FILES+=("$CONSTRAINTS")

# Pin what the base interpreter already provides so pip reuses it instead of replacing it.
"$PYTHON" - >"$CONSTRAINTS" <<'PY'
import importlib.metadata as md
for dist in ("torch", "torchvision", "numpy", "tensorrt", "onnxruntime-gpu", "opencv-python",
             "opencv-python-headless"):
    try:
        print(f"{dist}=={md.version(dist)}")
    except md.PackageNotFoundError:
        pass
PY

PINS=$(tr '\n' ' ' <"$CONSTRAINTS")
log "pip constraints (already installed for $PYTHON, never replaced): ${PINS:-none}"

if [[ $PLATFORM == jetson ]]; then
    if TORCH_VERSION=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
        log "reusing JetPack's torch $TORCH_VERSION"
    else
        log "WARNING: $PYTHON has no torch. Install NVIDIA's PyTorch wheel for your JetPack first"
        log "  (https://docs.nvidia.com/deeplearning/frameworks/install-pytorch-jetson-platform/);"
        log "  this script never pip-installs torch on a Jetson. Continuing without it."
    fi
    PACKAGES=("${SOURCE}[${EXTRAS:-metrics,audio}]" "${JETSON_RUNTIME_DEPS[@]}")
    if "$PYTHON" -c 'import cv2' 2>/dev/null; then
        log "reusing the system OpenCV ($("$PYTHON" -c 'import cv2; print(cv2.__version__)'))"
    else
        log "no system OpenCV: installing opencv-python-headless (no GStreamer: CSI cameras use gst-launch-1.0)"
        PACKAGES+=("opencv-python-headless>=4.8")
    fi
else
    PACKAGES=("${SOURCE}[${EXTRAS:-runtime,metrics,audio}]")
fi

# -- virtualenv -------------------------------------------------------------------------------------
if [[ -x $VENV_DIR/bin/python ]]; then
    grep -qi '^include-system-site-packages *= *true' "$VENV_DIR/pyvenv.cfg" ||
        die "$VENV_DIR exists without --system-site-packages; remove it and run again"
    log "reusing virtualenv $VENV_DIR"
else
    run "$PYTHON" -m venv --system-site-packages "$VENV_DIR"
fi

if ((SKIP_PIP)); then
    log "--skip-pip: not installing edgevlm into $VENV_DIR"
else
    # shellcheck disable=SC2086 # PIP_OPTS is a list of options on purpose
    run "$VENV_DIR/bin/python" -m pip install --upgrade --constraint "$CONSTRAINTS" $PIP_OPTS "${PACKAGES[@]}"
    if ((!DRY_RUN)) && [[ $PLATFORM == jetson ]]; then
        TORCH_AT=$("$VENV_DIR/bin/python" -c 'import torch; print(torch.__file__)' 2>/dev/null || true)
        [[ -z $TORCH_AT || $TORCH_AT != "$VENV_DIR"/* ]] ||
            die "torch was installed into the venv ($TORCH_AT), shadowing JetPack's: remove it with $VENV_DIR/bin/pip uninstall torch"
    fi
fi

# -- files ------------------------------------------------------------------------------------------
# Every venv path of the unit (ExecStart, the kernel cache's ReadWritePaths) follows --prefix.
sed "s#$DEFAULT_VENV/#$VENV/#g" "$SCRIPT_DIR/edgevlm.service" |
    install_content 0644 "$DESTDIR/etc/systemd/system/edgevlm.service"
install_content 0640 "$DESTDIR/etc/edgevlm/config.example.yaml" <"$SCRIPT_DIR/config.example.yaml"
if [[ -e $DESTDIR/etc/edgevlm/config.yaml ]]; then
    log "kept existing $DESTDIR/etc/edgevlm/config.yaml (compare with config.example.yaml)"
else
    install_content 0640 "$DESTDIR/etc/edgevlm/config.yaml" <"$SCRIPT_DIR/config.example.yaml"
fi

# Secrets the daemon reads from its environment (the unit's EnvironmentFile=): created once, never overwritten.
if [[ -e $DESTDIR/etc/edgevlm/environment ]]; then
    log "kept existing $DESTDIR/etc/edgevlm/environment"
else
    install_content 0640 "$DESTDIR/etc/edgevlm/environment" <<'EOF'
# Environment of the edgevlm service (EnvironmentFile= of edgevlm.service), root:edgevlm 0640.
# KEY=value lines; after an edit: sudo systemctl restart edgevlm
# The HTTP API's bearer token (http.api_key_env); unset = no token asked (an empty value is warned about):
#EDGEVLM_HTTP_API_KEY=change-me
EOF
fi

# -- user and groups --------------------------------------------------------------------------------
if [[ -n $DESTDIR ]]; then
    log "not creating the '$SERVICE_USER' user (DESTDIR is set)"
elif ((!CREATE_USER)); then
    log "not creating the '$SERVICE_USER' user (--no-user)"
else
    for group in "${SERVICE_GROUPS[@]}"; do
        getent group "$group" >/dev/null || run groupadd --system "$group"
    done
    if getent passwd "$SERVICE_USER" >/dev/null; then
        log "user $SERVICE_USER exists"
    else
        run useradd --system --user-group --home-dir /var/lib/edgevlm --no-create-home \
            --shell /usr/sbin/nologin "$SERVICE_USER"
    fi
    GROUP_LIST=$(IFS=, && echo "${SERVICE_GROUPS[*]}")
    run usermod --append --groups "$GROUP_LIST" "$SERVICE_USER"
    run chown "root:$SERVICE_USER" /etc/edgevlm /etc/edgevlm/config.yaml /etc/edgevlm/config.example.yaml \
        /etc/edgevlm/environment
    run chmod 0750 /etc/edgevlm
fi

# -- W4A16 tensor-core kernel (runtime/kernels/w4a16_*.cu) -----------------------------------------
# The decode kernels (w4a16_lean.cu, the default, and w4a16_mma.cu, its fallback; EDGEVLM_W4A16_LEAN=0
# builds without the lean one), the sm_90 variant (w4a16_bulk.cu; a stub on an Orin) and the prefill
# dequantizer (w4a16_dequant.cu), one extension. Compiled here for this GPU (sm_87 on an AGX Orin, with
# JetPack's nvcc) into the venv's kernel cache,
# where the runtime looks first; otherwise it compiles on the first INT4 decode, and without nvcc INT4
# decode falls back to torch's tinygemm kernel (one log line).
KERNEL_CACHE=$VENV_DIR/var/cache/edgevlm-kernels
if [[ $PLATFORM != jetson || -n $DESTDIR ]] || ((SKIP_PIP)); then
    log "W4A16 kernel: not built here (compiled on first use)"
elif [[ -x ${CUDA_HOME:-/usr/local/cuda}/bin/nvcc ]]; then
    run install -d -m 2775 "$KERNEL_CACHE"
    if ! run env CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" EDGEVLM_KERNEL_CACHE="$KERNEL_CACHE" \
        "$VENV_DIR/bin/python" -m edgevlm.runtime.kernels.w4a16_mma --build; then
        log "WARNING: building the W4A16 kernel failed; INT4 decode falls back to tinygemm"
    fi
    if getent group "$SERVICE_USER" >/dev/null; then
        run chgrp -R "$SERVICE_USER" "$KERNEL_CACHE"
        run chmod -R g+w "$KERNEL_CACHE"
    fi
else
    log "W4A16 kernel: no nvcc in ${CUDA_HOME:-/usr/local/cuda}/bin (JetPack's cuda-toolkit); INT4 decode uses tinygemm"
fi

if [[ -z $DESTDIR && -d /run/systemd/system ]]; then
    run systemctl daemon-reload
    if ((ENABLE)); then
        run systemctl enable --now edgevlm.service
    fi
fi

if ((DRY_RUN)); then
    log "dry run: nothing was changed"
    exit 0
fi
cat <<EOF

edgevlm is installed.
  1. Edit $DESTDIR/etc/edgevlm/config.yaml (broker, device_id, cameras, model).
  2. Check the machine:   sudo -u $SERVICE_USER $VENV/bin/edgevlm doctor --config /etc/edgevlm/config.yaml
  3. Enable and start:    sudo systemctl daemon-reload && sudo systemctl enable --now edgevlm
  4. Follow the logs:     journalctl -u edgevlm -f
     New model.path:      sudo systemctl reload edgevlm   (loads it; the old model serves until then)
     Other edits:         sudo systemctl restart edgevlm
EOF
