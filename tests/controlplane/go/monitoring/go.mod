// The Prometheus Operator, for its CRDs only (ServiceMonitor, PodMonitor): the chart's
// monitors are created against their real schemas. Nothing is built from it.
// v0.85.0 is the newest version the Go module proxy serves here.
module rlhf-operator/tests/controlplane/monitoring

go 1.26.0

require github.com/prometheus-operator/prometheus-operator v0.85.0
