#!/usr/bin/env bash
# Install kiln and one target's accelerator stack into a Python environment.
#
#   targets/install.sh TARGET [KILN_SOURCE]
#
# TARGET       cpu | cuda | rocm | tpu: installs targets/TARGET/requirements.txt (jax, jaxlib and the target's plugin,
#              pinned) together with kiln in one pip resolution, so both agree.
# KILN_SOURCE  what pip installs as kiln: a source tree (default: the repository holding this script), a wheel, or a
#              requirement such as "kiln==0.1.0". Installed as a regular (not editable) package.
#
# The environment is the one of $PYTHON (default: python3 on PATH); the Dockerfiles and tests/test_deploy.py pass the
# python of a fresh venv. Other pip settings come from the environment as usual (the Dockerfiles set
# PIP_NO_CACHE_DIR=1 so no wheel cache lands in the image). Every dependency is a wheel; a C++ compiler (g++) builds kiln's
# CPU kernels (setup.py), and without one they are skipped and GGUF matmuls and CPU attention run as XLA ops.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
target="${1:-}"
source_spec="${2:-$(dirname "$here")}"
python="${PYTHON:-python3}"

if [[ -z "$target" || ! -f "$here/$target/requirements.txt" ]]; then
  echo "usage: targets/install.sh {cpu|cuda|rocm|tpu} [KILN_SOURCE]" >&2
  exit 2
fi
if [[ -e "$source_spec" ]]; then # a folder or wheel on disk: absolute, or pip would take "src" for a package name
  source_spec="$(cd "$(dirname "$source_spec")" && pwd)/$(basename "$source_spec")"
fi

"$python" -m pip install --only-binary=:all: --no-binary=kiln -r "$here/$target/requirements.txt" "$source_spec"
