#!/usr/bin/env bash
# Pack the GPU kit: everything benchmarks/gpu/validate.py installs on a GPU machine that has no
# network, in one git-ignored folder of the checkout to carry there.
#
# Usage:
#   bash benchmarks/gpu/pack_kit.sh [--wheels DIR] [--kit DIR]
#
#   --wheels DIR  tinycudann and nvdiffrast wheels from build_wheels.sh (default: gpu-wheels/ of
#                 the checkout); checked against DIR/SHA256SUMS when it is there
#   --kit DIR     the kit folder to (re)make (default: gpu-kit/ of the checkout, git-ignored)
#
# The kit holds:
#   - the native wheels;
#   - wheels of the pure-Python packages mptex needs that a bare GPU image may lack (Hydra,
#     OmegaConf and its ANTLR runtime, the joblib and submitit launchers), at the versions
#     installed here;
#   - libdevice/cuda-13.0/: the libdevice of the GPU machines' CUDA release, from a CUDA 13.0
#     toolkit here, for the fused logl1 loss where the GPU machine has no such toolkit;
#   - assets/duck/: the real-asset suite's duck (OBJ, MTL, texture) from pybullet_data, for the
#     rasterizer stage's mesh, when pybullet is installed here;
#   - manifest.json: the commit, the date and each file's sha256.
# It must stay under the device tool's 64 MiB (with the working tree); the script says its size.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
wheels="$repo/gpu-wheels"
kit="$repo/gpu-kit"
die() { echo "pack_kit.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels=$(realpath -m "$2"); shift 2 ;;
    --kit) kit=$(realpath -m "$2"); shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
native=$(ls "$wheels"/tinycudann-*.whl "$wheels"/nvdiffrast-*.whl 2>/dev/null || true)
[ -n "$native" ] || die "--wheels $wheels: no tinycudann-*.whl or nvdiffrast-*.whl (run build_wheels.sh)"
if [ -f "$wheels/SHA256SUMS" ]; then
  (cd "$wheels" && sha256sum --quiet -c SHA256SUMS) || die "--wheels $wheels: a wheel does not match SHA256SUMS"
fi
# The folder is remade: refuse one that is not an earlier kit (an existing folder with other
# files, the checkout or a folder above it), which would be deleted.
case "$repo/" in "$kit"/*) die "--kit $kit: the checkout or a folder above it" ;; esac
if [ -d "$kit" ] && [ -n "$(ls -A "$kit")" ] && [ ! -f "$kit/manifest.json" ]; then
  die "--kit $kit: exists and holds no kit (no manifest.json); name a new or empty folder"
fi
rm -rf "$kit"; mkdir -p "$kit"
cp $native "$kit/"

# Pure-Python dependencies, at the versions this checkout is tested with here.
pins=()
for dist in hydra-core omegaconf antlr4-python3-runtime hydra-joblib-launcher hydra-submitit-launcher submitit; do
  version=$(python -c "import importlib.metadata as m; print(m.version('$dist'))" 2>/dev/null) \
    || die "$dist is not installed here (pip install -e '.[test]' first)"
  pins+=("$dist==$version")
done
# pip wheel takes a published wheel where there is one and builds the pure-Python sdists
# (antlr4-python3-runtime 4.9.3 has no wheel).
python -m pip wheel -q --no-deps -w "$kit" "${pins[@]}"

# The libdevice of the GPU machines' CUDA release (torch 2.11.0's wheel is CUDA 13.0's): the fused
# logl1 loss links torch's CUDA libdevice, and a GPU image without a CUDA toolkit of that release
# has none (validate.py then points MPTEX_LIBDEVICE at this copy).
cuda_release=13.0
libdevice=$(python -c "from mptex.train._loss_triton import toolkit_libdevice
print(toolkit_libdevice('$cuda_release')[0] or '')" 2>/dev/null || true)
if [ -n "$libdevice" ]; then
  mkdir -p "$kit/libdevice/cuda-$cuda_release"
  cp "$libdevice" "$kit/libdevice/cuda-$cuda_release/"
else
  echo "pack_kit.sh: no CUDA $cuda_release toolkit here (CUDA_HOME): the kit carries no libdevice" >&2
fi

assets=$(python -c "import pybullet_data; print(pybullet_data.getDataPath())" 2>/dev/null || true)
if [ -n "$assets" ]; then
  mkdir -p "$kit/assets/duck"
  cp "$assets/duck.obj" "$assets/duck.mtl" "$assets/duckCM.png" "$kit/assets/duck/"
else
  echo "pack_kit.sh: pybullet_data is not installed here: the raster stage will use the built-in mesh only" >&2
fi

python - "$kit" "$repo" <<'EOF'
import hashlib, json, subprocess, sys, time
from pathlib import Path
kit, repo = Path(sys.argv[1]), sys.argv[2]
def git(*a):
    return subprocess.run(["git", "-C", repo, *a], capture_output=True, text=True).stdout.strip()
files = {str(p.relative_to(kit)): hashlib.sha256(p.read_bytes()).hexdigest()
         for p in sorted(kit.rglob("*")) if p.is_file()}
manifest = {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain")),
            "packed": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "files": files}
(kit / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
EOF
size=$(du -sm "$kit" | cut -f1)
echo "kit: $kit, ${size} MiB:"
ls -1 "$kit"
[ "$size" -lt 60 ] || echo "pack_kit.sh: warning: ${size} MiB is close to the device tool's 64 MiB limit" >&2
