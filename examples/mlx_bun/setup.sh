#!/usr/bin/env bash
# Gets bun and libmlxc on Linux for the mlx-bun shim (port.ts), outside the repository:
# bun from npm, and copies of a user's mlx-c and mlx-bun clones with our patches applied,
# mlx-c built against the pip MLX's CMake package. Idempotent: a second run reuses what the
# first built. Prints the environment port.ts needs.
#
#   examples/mlx_bun/setup.sh [MLX_BUN_SRC [MLX_C_SRC]]
#
# MLX_BUN_SRC / MLX_C_SRC: the clones (mlx-bun c2e1d46, mlx-c fba4470);
# MLX_BUN_BUILD: where everything lands (default ~/.cache/spec-parity/mlx-bun);
# PYTHON: the interpreter whose mlx package libmlxc links against (default python3).
set -euo pipefail

BUN_VERSION=1.4.5
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MLX_BUN_SRC=${1:-${MLX_BUN_SRC:-}}
MLX_C_SRC=${2:-${MLX_C_SRC:-}}
BUILD=${MLX_BUN_BUILD:-${XDG_CACHE_HOME:-$HOME/.cache}/spec-parity/mlx-bun}
PYTHON=${PYTHON:-python3}

die() { echo "setup.sh: $*" >&2; exit 2; }

[ -n "$MLX_BUN_SRC" ] || die "no mlx-bun tree: pass it as the first argument or set MLX_BUN_SRC"
[ -n "$MLX_C_SRC" ] || die "no mlx-c tree: pass it as the second argument or set MLX_C_SRC"
[ -f "$MLX_BUN_SRC/src/spec/drafter.ts" ] || die "$MLX_BUN_SRC is not an mlx-bun tree (no src/spec/drafter.ts)"
[ -f "$MLX_C_SRC/mlx/c/array.cpp" ] || die "$MLX_C_SRC is not an mlx-c tree (no mlx/c/array.cpp)"
command -v npm >/dev/null || die "npm not found: install Node.js (npm fetches bun)"
command -v cmake >/dev/null || die "cmake not found: install cmake (it builds libmlxc)"
command -v patch >/dev/null || die "patch not found: install patch"
CXX=${CXX:-$(command -v c++ || command -v g++ || command -v clang++ || true)}
[ -n "$CXX" ] || die "no C++ compiler found: install g++ or clang++, or set CXX"
MLX_PKG=$("$PYTHON" -c "import mlx; print(list(mlx.__path__)[0])" \
  2>/dev/null) || die "$PYTHON cannot import mlx: pip install mlx, or set PYTHON"
[ -d "$MLX_PKG/share/cmake/MLX" ] || die "$MLX_PKG has no share/cmake/MLX: this mlx wheel ships no CMake package"

mkdir -p "$BUILD"
BUN="$BUILD/bun/node_modules/bun/bin/bun.exe"
if [ ! -x "$BUN" ] || [ "$("$BUN" --version)" != "$BUN_VERSION" ]; then
  npm install --silent --no-audit --no-fund --prefix "$BUILD/bun" "bun@$BUN_VERSION" >&2 \
    || die "npm install bun@$BUN_VERSION failed (a registry must be reachable)"
fi
[ -x "$BUN" ] || die "npm installed no bun binary at $BUN"

# A tree is copied and patched once per (source, patches) pair; the stamp says which.
prepare() {  # name src patch-glob
  local dst="$BUILD/src/$1" stamp
  stamp=$( (cat "$2/COMMIT" 2>/dev/null || echo "$2"; cat "$HERE"/patches/$3) | sha256sum | cut -c1-16)
  if [ "$(cat "$dst.stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$dst" "$dst.stamp"
    mkdir -p "$dst"
    cp -r "$2"/. "$dst"/
    rm -rf "$dst/build" "$dst/node_modules"
    for p in "$HERE"/patches/$3; do
      patch -s -d "$dst" -p1 <"$p" || die "$(basename "$p") does not apply to $2"
    done
    echo "$stamp" >"$dst.stamp"
  fi
}
prepare mlx-c "$MLX_C_SRC" 'mlx-c-*.patch'
prepare mlx-bun "$MLX_BUN_SRC" 'mlx-bun-*.patch'

LIB="$BUILD/src/mlx-c/build/libmlxc.so"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$BUILD/src/mlx-c" -B "$BUILD/src/mlx-c/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_COMPILER="$CXX" -DMLX_C_USE_SYSTEM_MLX=ON -DMLX_DIR="$MLX_PKG/share/cmake/MLX" \
  -DBUILD_SHARED_LIBS=ON -DMLX_C_BUILD_EXAMPLES=OFF >"$BUILD/cmake.log" 2>&1 \
  || die "cmake could not configure mlx-c (see $BUILD/cmake.log)"
cmake --build "$BUILD/src/mlx-c/build" -j "${JOBS:-2}" >"$BUILD/build.log" 2>&1 \
  || die "libmlxc did not build (see $BUILD/build.log)"
[ -f "$LIB" ] || die "the build made no $LIB"

cat <<EOF
export BUN=$BUN
export MLX_BUN_DIR=$BUILD/src/mlx-bun
export MLX_BUN_LIBMLXC=$LIB
export MLX_BUN_FUSED_GELU=0
EOF
