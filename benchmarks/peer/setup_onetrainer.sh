#!/usr/bin/env bash
# OneTrainer beside sdtrain (the PixArt reference; CPU only, pip registry only):
#   bash benchmarks/peer/setup_onetrainer.sh ONETRAINER_GIT MGDS_GIT DIFFUSERS_GIT
# each argument a git directory (a bare mirror or a clone's .git) of Nerogar/OneTrainer, Nerogar/mgds and
# huggingface/diffusers. Lays out, under PB = $PEER_WORK (default ~/sdtrain-peer):
#   PB/onetrainer (+ .commit)   OneTrainer HEAD's tree
#   PB/otvenv                   its venv: torch 2.13.0 CPU, torchvision 0.28.0, diffusers and mgds at the commits
#                               OneTrainer's requirements-global.txt pins, transformers / accelerate / safetensors /
#                               huggingface-hub at its pins, and the rest of what its training path imports (its
#                               UI, cloud, profiling and video packages are left out)
# torchvision's PyPI wheel is built for CUDA torch: with the CPU torch its C++ ops do not load, and its
# _meta_registrations.py then fails at import (registering fakes of ops that do not exist). The two registrations are
# made conditional on the ops having loaded (as the file's other registrations already are); OneTrainer and mgds use
# torchvision's Python transforms only.
set -euo pipefail
OT_GIT=$1; MGDS_GIT=$2; DIFFUSERS_GIT=$3
PB=${PEER_WORK:-$HOME/sdtrain-peer}; mkdir -p "$PB"
rm -rf "$PB/onetrainer" "$PB/otvenv"
mkdir -p "$PB/onetrainer"
git --git-dir="$OT_GIT" archive HEAD | tar -x -C "$PB/onetrainer"
git --git-dir="$OT_GIT" rev-parse HEAD > "$PB/onetrainer.commit"
REQ="$PB/onetrainer/requirements-global.txt"
pin() { sed -n "s|.*$1\.git@\([0-9a-f]*\)#egg=$2.*|\1|p" "$REQ"; }   # REPO (owner/name) and EGG
version() { sed -n "s/^$1==\([^ #]*\).*/\1/p" "$REQ"; }
DIFFUSERS_AT=$(pin huggingface/diffusers diffusers); MGDS_AT=$(pin Nerogar/mgds mgds)
test -n "$DIFFUSERS_AT" && test -n "$MGDS_AT"
SRC=$(mktemp -d); trap 'rm -rf "$SRC"' EXIT
mkdir -p "$SRC/diffusers" "$SRC/mgds"
git --git-dir="$DIFFUSERS_GIT" archive "$DIFFUSERS_AT" | tar -x -C "$SRC/diffusers"
git --git-dir="$MGDS_GIT" archive "$MGDS_AT" | tar -x -C "$SRC/mgds"
python3 -m venv "$PB/otvenv"
PIP="$PB/otvenv/bin/pip"
$PIP install -q torch==2.13.0 torchvision==0.28.0
$PIP install -q "numpy==$(version numpy)" "transformers==$(version transformers)" "accelerate==$(version accelerate)" \
    "safetensors==$(version safetensors)" "huggingface-hub==$(version huggingface-hub)" \
    "prodigyopt==$(version prodigyopt)" "parse==$(version parse)" opencv-python-headless pillow imagesize tqdm PyYAML \
    scipy tensorboard sentencepiece omegaconf gguf dadaptation lion-pytorch schedulefree pytorch_optimizer psutil \
    requests av pooch einops "$SRC/diffusers"
SETUPTOOLS_SCM_PRETEND_VERSION=0.0.0 $PIP install -q --no-deps "$SRC/mgds"   # a tree without .git: no scm version
TV=$("$PB/otvenv/bin/python" -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('torchvision').origin))")
sed -i -E 's/^@torch\.library\.register_fake\("(torchvision::q?nms)"\)/@(torch.library.register_fake("\1") if torchvision.extension._has_ops() else (lambda f: f))/' \
    "$TV/_meta_registrations.py"
"$PB/otvenv/bin/python" -W ignore -c "import torchvision.transforms.functional, mgds, diffusers; print('otvenv ready: diffusers', diffusers.__version__)"
echo "OneTrainer $(cat "$PB/onetrainer.commit") (diffusers $DIFFUSERS_AT, mgds $MGDS_AT) in $PB/onetrainer, venv $PB/otvenv"
