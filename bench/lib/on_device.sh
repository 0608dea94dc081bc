#!/usr/bin/env bash
# On a device machine (the `device` tool; its image has torch, triton and grpcio but no Ray):
# make mxserve importable with the wheels carried in .whl, then run the command given.
# Build .whl here first:
#   bash ../shared/tools/gpu-wheels.sh .whl
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl msgpack xxhash gguf \
#     "protobuf>=7.35.1,<8" "grpcio>=1.84.2,<2"   # (the image's grpcio is older than proto/ needs)
# write the commit the tree is at into .whl/COMMIT (git rev-parse --short HEAD > .whl/COMMIT:
# a warm machine's copy keeps the first call's git metadata, so results would name that one),
# and move .whl/bin (redis-server, 12 MB) aside unless the run needs Redis: the tree and the
# carried folders must stay under 64 MiB (with Ray's wheel they do not: carry the Ray wheel
# alone first, the rest in a second call to the still-warm machine). Then, e.g. (carry [".whl"]):
#   bash bench/lib/on_device.sh python3 bench/serve_gpu.py --routers 2 \
#     --variants ingress_direct,ingress --out $OUT/serve_gpu.json
set -euo pipefail
cd "$(dirname "$0")/../.."
# each wheel once (.site is ignored by git, so a warm machine keeps it between calls): wheels
# over the carry limit together can come over two calls
mkdir -p .site/.installed
for whl in .whl/*.whl; do
  [ -e "$whl" ] && [ ! -e ".site/.installed/${whl##*/}" ] || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$PWD/.site" "$whl"
  touch ".site/.installed/${whl##*/}"
done
mkdir -p /tmp/pk && ln -sfn "$PWD" /tmp/pk/mxserve  # the repository root is the package
export PYTHONPATH="/tmp/pk:$PWD/.site${PYTHONPATH:+:$PYTHONPATH}"
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
if [ -f .whl/COMMIT ]; then export MXSERVE_COMMIT="$(cat .whl/COMMIT)"; fi
"$@"
