//go:build tools

// Package node pins the container runtime of the tests' real node in a module of its own, so its
// dependency versions never move the Kubernetes pins in ../go.mod: containerd 2.x with its runc
// shim and ctr, runc (cgo, libseccomp), and the CNI plugins the node's pod network uses.
package node

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
	_ "github.com/containernetworking/plugins/plugins/ipam/host-local"
	_ "github.com/containernetworking/plugins/plugins/main/bridge"
	_ "github.com/containernetworking/plugins/plugins/main/loopback"
	_ "github.com/opencontainers/runc"
)
