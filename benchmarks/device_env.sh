#!/usr/bin/env bash
# The device tool's GPU machines (README's `device`) hold jax, torch and transformers but none of kiln's serving
# packages, and reach no registry. Here, once a checkout (the wheels are git-ignored, so each new one needs them):
#     bash benchmarks/device_env.sh fetch        # kiln's missing packages as cp312 wheels in .whl/
# There, at the start of a call that carries .whl (run's carry: [".whl"]):
#     source benchmarks/device_env.sh install    # installs them to /tmp/site; kiln importable; left() = seconds left
# DEADLINE (seconds, default 580) is what left() counts down from: each phase of a device script asks it first.
# Versions: those this machine's `pip install -e .[test]` chose (pydantic and pydantic-core must be a pair).
wheels=(starlette==1.10.0 uvicorn==0.55.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
  typing-inspection==0.4.2 gguf==0.19.0 llguidance==1.9.1)
if [[ ${1:-} == fetch ]]; then
  set -euo pipefail
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  rm -rf .whl && mkdir .whl
  plats=()
  for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do plats+=(--platform "$p"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plats[@]}" \
    -d .whl "${wheels[@]}"
  ls .whl && du -sh .whl
  exit 0
fi
_start=$SECONDS
left() { local s=$((${DEADLINE:-580} - (SECONDS - _start))); echo $((s > 1 ? s : 1)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "device_env: the wheels in .whl did not install (here: device_env.sh fetch)"; exit 1; }
mkdir -p /tmp/kp && ln -sfn "$PWD" /tmp/kp/kiln  # the checkout is the package kiln (pyproject's package-dir)
export PYTHONPATH=/tmp/kp:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import jax, kiln.serving.cli; print('device_env:', jax.__version__, jax.devices()[0].device_kind)"
