"""What the kubelet's side of the device-plugin API fixes: one home for these facts.

The plugin and the kubelet simulator both speak this API, as the Go plugins and the kubelet both
import ``k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1`` (constants.go); the limits below come from
the kubelet's gRPC client and from the kernel.
"""

from __future__ import annotations

API_VERSION = "v1beta1"  # constants.go Version
KUBELET_SOCKET = "kubelet.sock"  # constants.go KubeletSocket, in the device-plugin dir
# devicemanager manager.go kubeletDeviceManagerCheckpoint, in the same dir: rewritten (a temp file
# renamed over it, checkpointmanager FileStore) at the end of every ListAndWatch update it takes in
# (genericDeviceUpdateCallback) and every allocation.
CHECKPOINT = "kubelet_internal_checkpoint"
HEALTHY = "Healthy"  # constants.go Healthy
UNHEALTHY = "Unhealthy"  # constants.go Unhealthy
# constants.go KubeletPreStartContainerRPCTimeoutInSecs: the deadline of PreStartContainer.
PRE_START_CONTAINER_TIMEOUT_SECONDS = 30.0
# The kubelet's client (plugin/v1beta1/client.go dial) keeps grpc-go's default receive limit: a
# bigger ListAndWatch message fails the stream.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path is 108 bytes with the terminating NUL
