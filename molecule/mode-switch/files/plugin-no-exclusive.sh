#!/bin/sh
# The plugin image of gpu-broken: this checkout's plugin, except that with an exclusive-mode config
# it exits at once (as a plugin that cannot serve its new mode on that node would), so after a
# switch to exclusive the node never advertises the exclusive shape: its container crash-loops.
config=
prev=
for arg in "$@"; do
  [ "$prev" = --config ] && config=$arg
  prev=$arg
done
if grep -qx 'mode: exclusive' "$config"; then
  echo "plugin-no-exclusive: exclusive mode does not start on this node (config $config)" >&2
  exit 1
fi
exec rdma-device-plugin "$@"
