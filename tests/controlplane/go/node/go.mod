// Small static programs the real node runs as images (nothing can be pulled here):
// pause, the pod sandboxes' process, and nettool, the tests' network probe.
// Standard library only, so they build without downloading anything.
module rlhf-operator/tests/controlplane/node

go 1.26.0
