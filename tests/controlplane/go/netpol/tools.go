//go:build tools

// Package tools pins the commands built from this module (see controlplane.mk).
package tools

import _ "sigs.k8s.io/kube-network-policies/cmd"
