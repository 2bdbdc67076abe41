#!/usr/bin/env bash
# Cross-build tinycudann's PyTorch bindings and nvdiffrast as wheels for a GPU machine, on a
# machine that has no GPU (a laptop, a CI runner, a cluster's login node).
#
# Usage:
#   bash benchmarks/gpu/build_wheels.sh [--out DIR] [--work DIR] [--python PY] [--arch 90]
#                                       [--torch 2.11.0] [--cuda 13.0] [--jobs N] [--only tcnn|nvdiffrast]
#
# The wheels must match the GPU machine's Python, torch and CUDA; the defaults match an
# H100/H200 with Python 3.12 and torch 2.11.0+cu130 (the package index's torch 2.11.0 wheel is
# the CUDA 13.0 build). What it does, in order:
#   1. a build venv (--python) with torch==--torch and, from the package index, the CUDA
#      compiler and headers (nvidia-cuda-nvcc, -nvvm, -crt, -runtime, -cccl at --cuda's versions);
#   2. a CUDA_HOME of links into those packages, with a link stub libcuda.so (soname
#      libcuda.so.1) compiled from empty definitions of every cu* function cuda.h declares:
#      tinycudann links -lcuda and no package ships the driver's stub. At run time the real
#      driver's libcuda.so.1 is loaded; the stub is never packaged;
#   3. sources: tiny-cuda-nn at TCNN_COMMIT with its cutlass and fmt submodules at the commits
#      tiny-cuda-nn pins, and nvdiffrast at NVDIFFRAST_COMMIT. Each comes from a git repository
#      given by TCNN_GIT / CUTLASS_GIT / FMT_GIT / NVDIFFRAST_GIT (a local clone, bare or not, or
#      a URL; default: GitHub);
#   4. `setup.py bdist_wheel` for tinycudann (TCNN_CUDA_ARCHITECTURES=--arch) and
#      `pip wheel --no-build-isolation` for nvdiffrast (TORCH_CUDA_ARCH_LIST=--arch as X.Y);
#   5. a check: readelf's NEEDED libraries and, with the stub on LD_LIBRARY_PATH,
#      `import torch, tinycudann_bindings._<arch>_C, nvdiffrast.torch` in the build venv (every
#      torch symbol the extensions use resolves). `import tinycudann` itself asks torch for the
#      GPU's compute capability, so it needs a GPU.
# Build times on a 2-core machine with MAX_JOBS=2: docs/gpu.md.
# Outputs: the wheels and SHA256SUMS in --out (default: gpu-wheels/ of the checkout, git-ignored);
# build files in --work (default: .gpu-build/, git-ignored; delete it when done, ~6 GB).
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
out="$repo/gpu-wheels"
work="$repo/.gpu-build"
python_exe=python3.12
arch=90
torch_version=2.11.0
cuda=13.0
jobs=${MAX_JOBS:-2}
only=all
: "${TCNN_COMMIT:=6ee3546bda615f51abe684ce9edefeb414689135}"
: "${NVDIFFRAST_COMMIT:=253ac4fcea7de5f396371124af597e6cc957bfae}"
: "${TCNN_GIT:=https://github.com/NVlabs/tiny-cuda-nn}"
: "${CUTLASS_GIT:=https://github.com/NVIDIA/cutlass}"
: "${FMT_GIT:=https://github.com/fmtlib/fmt}"
: "${NVDIFFRAST_GIT:=https://github.com/NVlabs/nvdiffrast}"

die() { echo "build_wheels.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$(realpath -m "$2"); shift 2 ;;
    --work) work=$(realpath -m "$2"); shift 2 ;;
    --python) python_exe=$2; shift 2 ;;
    --arch) arch=$2; shift 2 ;;
    --torch) torch_version=$2; shift 2 ;;
    --cuda) cuda=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ "$arch" =~ ^[0-9]{2,3}$ ]] || die "--arch must be a compute capability like 90, got '$arch'"
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || die "--jobs must be a positive integer, got '$jobs'"
case "$only" in all|tcnn|nvdiffrast) ;; *) die "--only must be tcnn or nvdiffrast, got '$only'" ;; esac
# The CUDA packages' versions for each supported CUDA release (the package index's 13.0.x set
# that torch 2.11.0+cu130 was built with).
case "$cuda" in
  13.0) nvcc_v=13.0.88; nvvm_v=13.0.88; crt_v=13.0.88; cudart_v=13.0.96; cccl_v=13.0.85 ;;
  *) die "--cuda must be 13.0 (the CUDA package versions of other releases are not listed here), got '$cuda'" ;;
esac
"$python_exe" -c 'import sys; assert sys.version_info >= (3, 8)' 2>/dev/null \
  || die "--python '$python_exe' does not run (give the interpreter's path, e.g. --python ~/.pyenv/versions/3.12.1/bin/python3.12)"
arch_dotted="${arch:0:${#arch}-1}.${arch: -1}"
mkdir -p "$out" "$work"
log() { printf '[build_wheels %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
t_start=$(date +%s)

# 1. The build venv.
venv="$work/venv"
if [ ! -x "$venv/bin/python" ]; then
  log "venv: $python_exe, torch==$torch_version"
  "$python_exe" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel ninja
  "$venv/bin/python" -m pip install -q "torch==$torch_version" numpy
  "$venv/bin/python" -m pip install -q --no-deps "nvidia-cuda-nvcc==$nvcc_v" "nvidia-nvvm==$nvvm_v" \
    "nvidia-cuda-crt==$crt_v" "nvidia-cuda-runtime==$cudart_v" "nvidia-cuda-cccl==$cccl_v"
fi
py="$venv/bin/python"
torch_cuda=$("$py" -c 'import torch; print(torch.version.cuda)')
[ "$torch_cuda" = "$cuda" ] || die "torch==$torch_version in the build venv is built for CUDA '$torch_cuda', not $cuda"
cu=$("$py" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu" + "'"${cuda%%.*}"'"))')
[ -x "$cu/bin/nvcc" ] || die "no nvcc in $cu/bin (the nvidia-cuda-nvcc package did not install)"

# 2. CUDA_HOME and the link stub.
cuda_home="$work/cuda"
rm -rf "$cuda_home"; mkdir -p "$cuda_home/lib64"
ln -s "$cu/bin" "$cuda_home/bin"; ln -s "$cu/include" "$cuda_home/include"; ln -s "$cu/nvvm" "$cuda_home/nvvm"
for f in "$cu"/lib/*; do ln -s "$f" "$cuda_home/lib64/"; done
for lib in cudart nvrtc; do
  so=$(ls "$cu"/lib/lib$lib.so.* 2>/dev/null | head -1) || true
  [ -n "$so" ] && ln -sf "$(basename "$so")" "$cuda_home/lib64/lib$lib.so"
done
stub_dir="$work/stub"; mkdir -p "$stub_dir"
# Every cu* function cuda.h declares, under its exported name (after the _v2 macros) and its
# plain name: the stub only has to satisfy the linker, never to run.
"$py" - "$cu/include/cuda.h" "$stub_dir/libcuda_stub.c" <<'EOF'
import re, subprocess, sys
header, target = sys.argv[1], sys.argv[2]
raw = open(header).read()
pre = subprocess.run(["gcc", "-E", "-P", "-D__CUDA_API_VERSION_INTERNAL=0", "-I", header.rsplit("/", 1)[0], header],
                     capture_output=True, text=True, check=True).stdout
names = set()
for text in (raw, pre):
    names.update(re.findall(r"\b(?:CUresult|CUdeviceptr|void|int)\s+(?:CUDAAPI\s+)?(cu[A-Z]\w*)\s*\(", text))
with open(target, "w") as f:
    f.write("/* Link stub for libcuda.so.1: empty definitions, never loaded at run time. */\n")
    f.writelines(f"void {n}(void) {{}}\n" for n in sorted(names))
print(len(names))
EOF
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stub_dir/libcuda.so.1" "$stub_dir/libcuda_stub.c"
ln -sf libcuda.so.1 "$stub_dir/libcuda.so"
ln -sf "$stub_dir/libcuda.so" "$cuda_home/lib64/libcuda.so"
export CUDA_HOME="$cuda_home" PATH="$cuda_home/bin:$PATH" MAX_JOBS="$jobs"
log "CUDA_HOME=$cuda_home ($("$cuda_home/bin/nvcc" --version | grep -o 'release [0-9.]*')), stub with $(grep -c '^void' "$stub_dir/libcuda_stub.c") symbols"

# 3. Sources: a git repository (local or URL) and a commit, exported into a plain tree.
git_dir_of() {  # $1 = name, $2 = local path or URL -> prints a git dir
  if [ -d "$2" ]; then git -C "$2" rev-parse --absolute-git-dir
  else
    local mirror="$work/git/$1.git"
    [ -d "$mirror" ] || git clone -q --bare --filter=blob:none "$2" "$mirror"
    echo "$mirror"
  fi
}
export_tree() {  # $1 = git dir, $2 = commit, $3 = destination, $4... = paths (default: all)
  local gd=$1 commit=$2 dest=$3; shift 3
  git --git-dir="$gd" cat-file -e "$commit^{commit}" 2>/dev/null || die "commit $commit is not in $gd"
  rm -rf "$dest"; mkdir -p "$dest"
  set -o pipefail
  git --git-dir="$gd" archive --format=tar "$commit" "$@" | tar -x -C "$dest" \
    || die "could not export $* at $commit from $gd"
}

build_tcnn() {
  local gd src t0 cutlass_commit fmt_commit
  gd=$(git_dir_of tiny-cuda-nn "$TCNN_GIT")
  src="$work/src/tiny-cuda-nn"
  # What the bindings build from (a mirror may lack the large images under data/).
  export_tree "$gd" "$TCNN_COMMIT" "$src" bindings include src dependencies CMakeLists.txt LICENSE.txt
  cutlass_commit=$(git --git-dir="$gd" ls-tree "$TCNN_COMMIT" dependencies/cutlass | awk '{print $3}')
  fmt_commit=$(git --git-dir="$gd" ls-tree "$TCNN_COMMIT" dependencies/fmt | awk '{print $3}')
  log "tiny-cuda-nn ${TCNN_COMMIT:0:7}: cutlass ${cutlass_commit:0:7}, fmt ${fmt_commit:0:7}"
  # Only the parts the bindings compile: cutlass's headers, fmt's headers and sources.
  export_tree "$(git_dir_of cutlass "$CUTLASS_GIT")" "$cutlass_commit" "$src/dependencies/cutlass" include tools/util/include
  export_tree "$(git_dir_of fmt "$FMT_GIT")" "$fmt_commit" "$src/dependencies/fmt" include src
  t0=$(date +%s)
  (cd "$src/bindings/torch" && TCNN_CUDA_ARCHITECTURES="$arch" "$py" setup.py -q bdist_wheel -d "$out") \
    > "$work/tcnn-build.log" 2>&1 || { tail -40 "$work/tcnn-build.log"; die "tinycudann build failed (log: $work/tcnn-build.log)"; }
  log "tinycudann built in $(( ($(date +%s) - t0) / 60 )) min $(( ($(date +%s) - t0) % 60 )) s"
}

build_nvdiffrast() {
  local src t0
  src="$work/src/nvdiffrast"
  export_tree "$(git_dir_of nvdiffrast "$NVDIFFRAST_GIT")" "$NVDIFFRAST_COMMIT" "$src" \
    csrc nvdiffrast setup.py pyproject.toml MANIFEST.in README.md LICENSE.txt
  log "nvdiffrast ${NVDIFFRAST_COMMIT:0:7}"
  t0=$(date +%s)
  (cd "$src" && TORCH_CUDA_ARCH_LIST="$arch_dotted" "$py" -m pip wheel -q --no-build-isolation --no-deps -w "$out" .) \
    > "$work/nvdiffrast-build.log" 2>&1 || { tail -40 "$work/nvdiffrast-build.log"; die "nvdiffrast build failed (log: $work/nvdiffrast-build.log)"; }
  log "nvdiffrast built in $(( ($(date +%s) - t0) / 60 )) min $(( ($(date +%s) - t0) % 60 )) s"
}

[ "$only" = nvdiffrast ] || build_tcnn
[ "$only" = tcnn ] || build_nvdiffrast

# 5. Check what was built, in a scratch install inside the build venv.
check="$work/check"; rm -rf "$check"; mkdir -p "$check"
for whl in "$out"/*.whl; do "$py" -m pip install -q --no-deps --target "$check" "$whl"; done
for so in $(find "$check" -name '*.so'); do
  log "$(basename "$so") needs: $(readelf -d "$so" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')"
done
imports="import torch"
[ "$only" = nvdiffrast ] || imports="$imports; import tinycudann_bindings._${arch}_C"
[ "$only" = tcnn ] || imports="$imports; import nvdiffrast.torch"
LD_LIBRARY_PATH="$stub_dir:${LD_LIBRARY_PATH:-}" PYTHONPATH="$check" "$py" -c "$imports; print('imports ok: $imports')"
(cd "$out" && sha256sum *.whl > SHA256SUMS)
log "done in $(( ($(date +%s) - t_start) / 60 )) min; wheels in $out:"
cat "$out/SHA256SUMS"
