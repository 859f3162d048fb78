#!/usr/bin/env bash
# What the streamed row (scripts/device/drafter/streamed.sh) needs on the device beyond fetch_inputs.sh's:
# SpecForge 0.2.0's online consumer reads features from Mooncake only, so the device needs Mooncake's TCP
# store and master (PyPI mooncake-transfer-engine-non-cuda, for the device's Python 3.12) and the three
# libraries they load even without RDMA (Debian's libibverbs1, libnl-3-200, libnl-route-3-200, used only
# where the device image lacks them). About 46 MiB, so it travels in a device call of its own:
#   carry [".device/mooncake"]    bash scripts/device/drafter/streamed.sh install
# Run on a dev machine from the repository root (git-ignored output).
set -euo pipefail
mkdir -p .device/mooncake
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .device/mooncake mooncake-transfer-engine-non-cuda==0.3.13.post1
(cd .device/mooncake && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200)
du -sh .device/mooncake
