#!/usr/bin/env bash
# Startup script for a Cloud TPU VM (v5e, v6e): installs kiln for TPU, fetches the artifact and runs `kiln serve` as
# the systemd service kiln.service (Restart=on-failure). Runs as root at every boot and is idempotent. See
# targets/tpu/README.md for the gcloud commands. Configured by instance metadata (--metadata KEY=VALUE):
#
#   kiln-wheel             gs:// URL or VM path of kiln's wheel (build it with `pip wheel --no-deps -w dist .`).
#                          Required. It is installed with the pins of its targets/tpu/requirements.txt (jax, libtpu).
#   kiln-artifact          gs:// URL of an artifact folder, copied once to /var/lib/kiln/artifact; or a VM path.
#                          Default /var/lib/kiln/artifact (copy one there with `gcloud compute tpus tpu-vm scp`).
#   kiln-api-key-secret    Secret Manager secret holding the API key (the VM's service account needs
#                          roles/secretmanager.secretAccessor). Else kiln-api-key, a plain metadata value (readable by
#                          whoever can read the instance). Else a random key is made; read it with
#                          `sudo cat /etc/kiln/api-key` on the VM.
#   kiln-host              address to bind: 127.0.0.1 (default; reach it through an SSH tunnel) or 0.0.0.0 (with a
#                          firewall rule that admits only your addresses).
#   kiln-port              default 8000.
#   kiln-shutdown-timeout  seconds running requests get to finish on stop (default 30; kiln.service allows 60 in all).
#   kiln-args              more `kiln serve` arguments, e.g. "--served-model-name smollm2".
#   kiln-service           the unit file: pass targets/tpu/kiln.service with --metadata-from-file.
set -euo pipefail

meta() { # meta NAME [DEFAULT]: an instance metadata attribute
  curl -sf -H "Metadata-Flavor: Google" \
    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1" || printf '%s' "${2:-}"
}
log() { echo "kiln-startup: $*" >&2; }

wheel_src="$(meta kiln-wheel)"
artifact_src="$(meta kiln-artifact /var/lib/kiln/artifact)"
unit="$(meta kiln-service)"
[[ -n "$wheel_src" ]] || { log "error: set the kiln-wheel metadata attribute"; exit 1; }
[[ -n "$unit" ]] || { log "error: pass kiln-service=targets/tpu/kiln.service with --metadata-from-file"; exit 1; }

# --- the kiln user and its folders ---
id kiln >/dev/null 2>&1 || useradd --system --create-home --home-dir /var/lib/kiln --shell /usr/sbin/nologin kiln
install -d -o kiln -g kiln -m 0750 /var/lib/kiln
install -d -o root -g root -m 0755 /etc/kiln /opt/kiln-dist

# --- Python >= 3.11 (TPU VM images on Ubuntu 22.04 have 3.10: then a standalone CPython through uv) ---
find_python() {
  local p
  for p in python3.13 python3.12 python3.11 python3; do
    if command -v "$p" >/dev/null && "$p" -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      command -v "$p"
      return 0
    fi
  done
  [[ -x /opt/kiln-uv/bin/uv ]] && UV_PYTHON_INSTALL_DIR=/opt/kiln-python /opt/kiln-uv/bin/uv python find 3.12 2>/dev/null
}
if ! python="$(find_python)"; then
  log "installing Python 3.12"
  command -v pip3 >/dev/null || { apt-get update -qq && apt-get install -y -qq python3-pip; }
  pip3 install --quiet --target /opt/kiln-uv uv
  UV_PYTHON_INSTALL_DIR=/opt/kiln-python /opt/kiln-uv/bin/uv python install 3.12
  python="$(find_python)"
fi

# --- kiln into /opt/kiln, pinned by the wheel's own targets/tpu/requirements.txt; redone only for a new wheel ---
wheel="/opt/kiln-dist/$(basename "$wheel_src")"
if [[ "$wheel_src" == gs://* ]]; then
  gcloud storage cp "$wheel_src" "$wheel"
else
  cp "$wheel_src" "$wheel"
fi
stamp="$(sha256sum "$wheel" | cut -d' ' -f1)"
if [[ "$(cat /opt/kiln/.kiln-wheel 2>/dev/null)" != "$stamp" ]]; then
  log "installing $(basename "$wheel")"
  rm -rf /opt/kiln
  "$python" -m venv /opt/kiln
  "$python" -c 'import sys, zipfile; sys.stdout.write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]).decode())' \
    "$wheel" kiln/targets/tpu/requirements.txt >/opt/kiln-dist/requirements-tpu.txt
  /opt/kiln/bin/pip install --quiet --no-cache-dir -r /opt/kiln-dist/requirements-tpu.txt "$wheel"
  echo "$stamp" >/opt/kiln/.kiln-wheel
fi

# --- the artifact ---
if [[ "$artifact_src" == gs://* ]]; then
  artifact=/var/lib/kiln/artifact
  if [[ "$(cat /var/lib/kiln/.artifact-src 2>/dev/null)" != "$artifact_src" ]]; then
    log "copying $artifact_src"
    rm -rf "$artifact" "$artifact.partial"
    mkdir -p "$artifact.partial"
    gcloud storage cp --recursive "${artifact_src%/}/*" "$artifact.partial/"
    mv "$artifact.partial" "$artifact"
    chown -R kiln:kiln "$artifact"
    echo "$artifact_src" >/var/lib/kiln/.artifact-src
  fi
else
  artifact="$artifact_src"
fi

# --- the API key: Secret Manager, else metadata, else one made here (kept across boots) ---
umask 077
secret="$(meta kiln-api-key-secret)"
if [[ -n "$secret" ]]; then
  gcloud secrets versions access latest --secret="$secret" >/etc/kiln/api-key.new
  mv /etc/kiln/api-key.new /etc/kiln/api-key
elif [[ -n "$(meta kiln-api-key)" ]]; then
  meta kiln-api-key >/etc/kiln/api-key
elif [[ ! -s /etc/kiln/api-key ]]; then
  head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >/etc/kiln/api-key
  log "made a random API key: sudo cat /etc/kiln/api-key"
fi
chmod 0600 /etc/kiln/api-key
umask 022

cat >/etc/kiln/kiln.env <<EOF
KILN_ARTIFACT=$artifact
KILN_HOST=$(meta kiln-host 127.0.0.1)
KILN_PORT=$(meta kiln-port 8000)
KILN_SHUTDOWN_TIMEOUT=$(meta kiln-shutdown-timeout 30)
KILN_ARGS=$(meta kiln-args)
EOF

printf '%s\n' "$unit" >/etc/systemd/system/kiln.service
systemctl daemon-reload
systemctl enable kiln.service
systemctl restart kiln.service
log "kiln.service started; follow it with: sudo journalctl -u kiln -f"
