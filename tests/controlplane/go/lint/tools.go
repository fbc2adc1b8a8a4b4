//go:build tools

// Package tools pins kube-score as a build dependency of this module.
package tools

import _ "github.com/zegl/kube-score/cmd/kube-score"
