//go:build tools

// Package tools pins the commands built from this module (see controlplane.mk).
package tools

import _ "github.com/ray-project/kuberay/ray-operator"
