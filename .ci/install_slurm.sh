#!/usr/bin/env bash
# Install a single-node SLURM (Debian slurmctld, slurmd, slurm-client, munge) if it is missing.
# Idempotent: does nothing when every daemon and client is already on PATH. Needs root (or sudo).
# Exits non-zero when apt cannot install them: the SLURM tests must then fail, not skip.
set -euo pipefail

NEEDED_BINARIES=(slurmctld slurmd sbatch srun scontrol sinfo munged)
PACKAGES=(slurmctld slurmd slurm-client munge)
# sbatch --version needs a slurm.conf; ask dpkg instead.
VERSION_CMD=(dpkg-query -W -f "\${Package} \${Version}" slurm-client)

missing=()
for bin in "${NEEDED_BINARIES[@]}"; do
    PATH="${PATH}:/usr/sbin:/sbin" command -v "${bin}" >/dev/null 2>&1 || missing+=("${bin}")
done
if [[ ${#missing[@]} -eq 0 ]]; then
    echo "install_slurm: already installed ($("${VERSION_CMD[@]}" 2>/dev/null || true))"
    exit 0
fi
echo "install_slurm: missing ${missing[*]}; installing ${PACKAGES[*]}"

SUDO=()
if [[ "$(id -u)" -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || { echo "install_slurm: need root or sudo" >&2; exit 1; }
    SUDO=(sudo -n)
fi
export DEBIAN_FRONTEND=noninteractive
# Package lists may be absent on a fresh image; refresh them once if the install cannot resolve.
if ! "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"; then
    "${SUDO[@]}" apt-get update -q
    "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"
fi
# Debian's postinst may start the packaged services with the packaged config; our tests run their own
# daemons from a generated config, so stop the packaged ones where a service manager started them.
if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
    "${SUDO[@]}" systemctl disable --now slurmctld slurmd >/dev/null 2>&1 || true
fi
for bin in "${NEEDED_BINARIES[@]}"; do
    PATH="${PATH}:/usr/sbin:/sbin" command -v "${bin}" >/dev/null 2>&1 || {
        echo "install_slurm: ${bin} still missing after apt-get install" >&2
        exit 1
    }
done
echo "install_slurm: installed ($("${VERSION_CMD[@]}" 2>/dev/null || true))"
