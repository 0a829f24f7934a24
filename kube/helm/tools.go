//go:build tools

// Package helm pins the Helm v4 command (helm.sh/helm/v4/cmd/helm) in its own module, so its
// dependency versions never move the pins of the Kubernetes components in ../go.mod.
package helm

import _ "helm.sh/helm/v4/cmd/helm"
