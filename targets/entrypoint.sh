#!/bin/sh
# Entrypoint of every kiln image (targets/*/Dockerfile): resolve the API key, check the model, exec `kiln serve`.
#
# Environment:
#   KILN_ARTIFACT      what to serve (default /artifacts): an artifact folder mounted there (-v DIR:/artifacts:ro) or
#                      baked in at build time; any source `kiln serve` takes (HF folder, .gguf) also works.
#   KILN_PORT          port to listen on inside the container (default 8000); the address is always 0.0.0.0.
#   KILN_API_KEY       the key clients send as "Authorization: Bearer KEY" (read by `kiln serve` itself, so it never
#                      shows in the process list).
#   KILN_API_KEY_FILE  a file holding the key, used when KILN_API_KEY is empty: a mounted Kubernetes or Docker secret.
#                      Default /run/secrets/kiln_api_key when that file exists (docker compose / swarm secrets).
#   KILN_ALLOW_NO_API_KEY=1  serve with no key at all; only behind a proxy that authenticates. Without a key and
#                      without this the container refuses to start, since it listens on every interface.
# Arguments are appended to `kiln serve` (e.g. --served-model-name NAME --shutdown-timeout 30); a later --host or
# --port overrides the ones set here.
set -eu

die() {
  echo "kiln-entrypoint: error: $*" >&2
  exit 1
}

key_file="${KILN_API_KEY_FILE:-}"
if [ -z "$key_file" ] && [ -f /run/secrets/kiln_api_key ]; then
  key_file=/run/secrets/kiln_api_key
fi
if [ -z "${KILN_API_KEY:-}" ] && [ -n "$key_file" ]; then
  [ -r "$key_file" ] || die "KILN_API_KEY_FILE=$key_file is not a readable file."
  KILN_API_KEY="$(tr -d '\r\n' <"$key_file")"
  [ -n "$KILN_API_KEY" ] || die "the API key file $key_file is empty."
fi
if [ -z "${KILN_API_KEY:-}" ]; then
  [ "${KILN_ALLOW_NO_API_KEY:-0}" = 1 ] ||
    die "no API key: set KILN_API_KEY or KILN_API_KEY_FILE (or KILN_ALLOW_NO_API_KEY=1 behind an authenticating proxy)."
  unset KILN_API_KEY
else
  export KILN_API_KEY
fi

artifact="${KILN_ARTIFACT:-/artifacts}"
if [ ! -e "$artifact" ] || { [ -d "$artifact" ] && [ -z "$(ls -A "$artifact")" ]; }; then
  die "nothing to serve at $artifact: mount an artifact there (docker run -v HOST_DIR:$artifact:ro ...)" \
    "or build the image with --build-arg KILN_MODEL=..."
fi

exec kiln serve "$artifact" --host 0.0.0.0 --port "${KILN_PORT:-8000}" "$@"
