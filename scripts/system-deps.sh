#!/usr/bin/env bash
# The system packages edgevlm's two commands need (Debian/Ubuntu/JetPack), in one list, and their
# install. `make test` runs `scripts/system-deps.sh test`, `make demo` runs `scripts/system-deps.sh demo`,
# CI (.ci/run) runs `make test`.
#
# One dpkg-query call checks the packages; when all are installed the script does nothing else (no
# apt-get, no sudo). Missing ones are installed with apt-get as root or with passwordless sudo;
# otherwise the script prints the exact `sudo apt-get ...` command and exits 1. Without dpkg-query
# (not a Debian system) it prints the list and goes on: install the equivalents yourself.
# EDGEVLM_SYSTEM_DEPS=skip skips the check.
set -euo pipefail

group=${1:-test}
# package                     groups     what needs it
table='
mosquitto                     test,demo  the real broker of the MQTT tests and of the demo
mosquitto-clients             test,demo  mosquitto_rr (demo, tests) and mosquitto_passwd (ACL/TLS tests)
make                          test,demo  the two commands themselves
python3-venv                  test,demo  python3 -m venv for .venv
systemd                       test       systemd-analyze verify lints jetson/edgevlm.service
shellcheck                    test       lints jetson/install.sh
openssl                       test       the CA and certificates of the TLS tests
libportaudio2                 test       PortAudio: microphone capture (sounddevice)
alsa-utils                    test       ALSA file plugin device of the microphone test
gstreamer1.0-tools            test       gst-launch-1.0 capture path
gstreamer1.0-plugins-base     test       videotestsrc, videoconvert for the gst-launch-1.0 tests
'

case $group in test|demo) ;; *) echo "usage: $0 [test|demo]" >&2; exit 2 ;; esac
if [ "${EDGEVLM_SYSTEM_DEPS:-}" = skip ]; then exit 0; fi

packages=()
while read -r pkg groups _; do
    [ -n "${pkg:-}" ] || continue
    case ",$groups," in *",$group,"*) packages+=("$pkg") ;; esac
done <<<"$table"

if ! command -v dpkg-query >/dev/null 2>&1; then
    echo "note: not a Debian system (no dpkg-query); make sure the equivalents of these are installed: ${packages[*]}" >&2
    exit 0
fi

# One call; a package never seen prints nothing on stdout (its error goes to stderr).
installed=$(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "${packages[@]}" 2>/dev/null || true)
missing=()
for p in "${packages[@]}"; do
    grep -qE "^$p(:[a-z0-9]+)? ii" <<<"$installed" || missing+=("$p")
done
[ "${#missing[@]}" -eq 0 ] && exit 0

command_line="sudo apt-get update && sudo apt-get install -y ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
    prefix=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true </dev/null >/dev/null 2>&1; then
    prefix=(sudo -n)
else
    echo "error: missing system packages: ${missing[*]}" >&2
    echo "install them with: $command_line" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "error: missing system packages (${missing[*]}) and no apt-get; install them with your package manager" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
for cmd in "apt-get update" "apt-get install -y --no-install-recommends ${missing[*]}"; do
    echo "+ ${prefix[*]:+${prefix[*]} }$cmd"
    # shellcheck disable=SC2086  # $cmd is split on purpose
    if ! "${prefix[@]}" $cmd </dev/null; then
        echo "error: '$cmd' failed; run: $command_line" >&2
        exit 1
    fi
done
