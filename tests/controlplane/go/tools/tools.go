//go:build tools

// Package tools pins the commands built from this module (see controlplane.mk).
package tools

import (
	_ "helm.sh/helm/v3/cmd/helm"
	_ "sigs.k8s.io/kwok/cmd/kwok"
)
