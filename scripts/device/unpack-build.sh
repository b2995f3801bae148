# Sourced on the GPU machine, in the repository root, after scripts/device/env.sh: unpacks the
# programs scripts/device/pack-build.sh packed on the dev machine (.device/run/bin.tar.xz, carried)
# and makes the dev machine's checkout path (LT_DEV_ROOT, /work/main by default) point at this
# checkout, because the tests have the paths of their fixtures and helper programs compiled in.
lt_dev_root=${LT_DEV_ROOT:-/work/main}
tar -xJf .device/run/bin.tar.xz
if [ "$(cd "$lt_dev_root" 2>/dev/null && pwd -P)" != "$(pwd -P)" ]; then
  [ -e "$lt_dev_root" ] && { echo "unpack-build: $lt_dev_root exists and is not this checkout" >&2; return 1; }
  mkdir -p "$(dirname "$lt_dev_root")" && ln -s "$(pwd -P)" "$lt_dev_root"
fi
