# Real Kubernetes control plane for tests, built from pinned Go modules.
#
# Include this fragment from the top-level Makefile (`include tests/controlplane/controlplane.mk`)
# or use it alone: `make -f tests/controlplane/controlplane.mk controlplane`.
#
#   make controlplane   build etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
#                       kubectl, kwok, helm, KubeRay's operator, Kueue's manager and kube-score into tests/controlplane/bin/,
#                       and Prometheus with Kubernetes discovery (the dashboards' tests query it);
#                       for the real node: kubelet, kube-proxy, CoreDNS, the pause and nettool
#                       programs, the NetworkPolicy enforcer (kube-network-policies), and (as
#                       root) Debian's containerd, runc and CNI plugins
#   make cluster        start that control plane for a person; prints KUBECONFIG; Ctrl-C stops it
#
# Binaries are rebuilt only when a module's go.mod/go.sum is newer than them, and the
# Go build cache makes even a forced rebuild a matter of seconds (mostly linking).

# Not PYTHON: the top Makefile's PYTHON is the interpreter that creates the venv.
CP_PYTHON ?= .venv/bin/python
GO ?= go

# Directory of this fragment, relative to where make runs (the repository root).
CP_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))
CP_BIN := $(CP_DIR)/bin
CP_GO := $(CP_DIR)/go
# Binaries also depend on this file: changing a build flag here rebuilds them.
CP_MK := $(CP_DIR)/controlplane.mk
# Test binaries need no debug information: without DWARF and the symbol table (-s -w)
# linking takes less, and -trimpath keeps this checkout's path out of them. The compiler
# need not write the DWARF the linker drops: -dwarf=false took 8-16% less CPU (KubeRay's
# operator from an empty build cache, two interleaved pairs: 188 and 188 CPU-s against
# 204 and 225). Panics still print their stacks (from the pc tables, not DWARF).
CP_GO_BUILD := $(GO) build -trimpath -gcflags=all=-dwarf=false
CP_STRIP := -s -w

CP_KUBE_VERSION := v1.36.3
# Without these the binaries report v0.0.0-master, which kubectl, helm and charts'
# kubeVersion constraints treat as an ancient server.
CP_KUBE_LDFLAGS := $(CP_STRIP) \
	-X k8s.io/component-base/version.gitVersion=$(CP_KUBE_VERSION) \
	-X k8s.io/component-base/version.gitMajor=1 \
	-X k8s.io/component-base/version.gitMinor=36 \
	-X k8s.io/component-base/version.gitTreeState=clean \
	-X k8s.io/client-go/pkg/version.gitVersion=$(CP_KUBE_VERSION) \
	-X k8s.io/client-go/pkg/version.gitMajor=1 \
	-X k8s.io/client-go/pkg/version.gitMinor=36 \
	-X k8s.io/client-go/pkg/version.gitTreeState=clean

CP_KUBE_BINS := $(addprefix $(CP_BIN)/,kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy etcd)
CP_TOOLS_BINS := $(addprefix $(CP_BIN)/,kwok helm)
# The real node's own programs, run as its images (static: the images hold nothing else).
CP_NODE_PROGRAMS := $(addprefix $(CP_BIN)/,pause nettool)
# Installs wait for another's dpkg lock (CI installs packages in parallel make jobs).
APT_GET ?= apt-get -o DPkg::Lock::Timeout=600
CP_NODE_DEBS := containerd runc containernetworking-plugins iptables
CP_BINARIES := $(CP_KUBE_BINS) $(CP_TOOLS_BINS) $(CP_BIN)/kuberay-operator $(CP_BIN)/kueue-manager \
	$(CP_BIN)/kube-score \
	$(CP_BIN)/prometheus \
	$(CP_BIN)/coredns $(CP_NODE_PROGRAMS) $(CP_BIN)/kube-network-policies $(CP_BIN)/.node-packages

.PHONY: controlplane cluster

controlplane: $(CP_BINARIES)  ## build the test control plane (kube, etcd, kwok, helm, KubeRay, Kueue) from pinned Go modules

# Grouped target (&:): one `go build` makes all seven, sharing compiled packages. etcd is
# at the version k8s.io/kubernetes itself requires (go.etcd.io/etcd/server/v3 is a main
# package, so its binary is named `server`).
$(CP_KUBE_BINS) &: $(CP_GO)/kube/go.mod $(CP_GO)/kube/go.sum $(CP_MK)
	@mkdir -p $(CP_BIN)
	cd $(CP_GO)/kube && $(CP_GO_BUILD) -ldflags '$(CP_KUBE_LDFLAGS)' -o $(abspath $(CP_BIN))/ \
		k8s.io/kubernetes/cmd/kube-apiserver \
		k8s.io/kubernetes/cmd/kube-controller-manager \
		k8s.io/kubernetes/cmd/kube-scheduler \
		k8s.io/kubernetes/cmd/kubectl \
		k8s.io/kubernetes/cmd/kubelet \
		k8s.io/kubernetes/cmd/kube-proxy \
		go.etcd.io/etcd/server/v3
	mv $(abspath $(CP_BIN))/server $(abspath $(CP_BIN))/etcd
	@touch $(CP_KUBE_BINS)

$(CP_TOOLS_BINS) &: $(CP_GO)/tools/go.mod $(CP_GO)/tools/go.sum $(CP_MK)
	@mkdir -p $(CP_BIN)
	cd $(CP_GO)/tools && $(CP_GO_BUILD) -ldflags '$(CP_STRIP) -X helm.sh/helm/v3/internal/version.version=v3.21.4' \
		-o $(abspath $(CP_BIN))/ \
		sigs.k8s.io/kwok/cmd/kwok \
		helm.sh/helm/v3/cmd/helm
	@touch $(CP_TOOLS_BINS)

# The manifest scanner of `make lint` (and of the test that it finds what it should).
$(CP_BIN)/kube-score: $(CP_GO)/lint/go.mod $(CP_GO)/lint/go.sum $(CP_MK)
	@mkdir -p $(CP_BIN)
	cd $(CP_GO)/lint && $(CP_GO_BUILD) -ldflags '$(CP_STRIP)' -o $(abspath $@) github.com/zegl/kube-score/cmd/kube-score
	@touch $@

# Prometheus from its module, with Kubernetes service discovery and no other (the build
# tags leave out every cloud SDK): the tests' Prometheus finds pods through the API server.
# Debian's build has no Kubernetes discovery. Prometheus 3.16.0 (module v0.316.0).
CP_PROMETHEUS_VERSION := 3.16.0
$(CP_BIN)/prometheus: $(CP_GO)/prometheus/go.mod $(CP_GO)/prometheus/go.sum $(CP_MK)
	@mkdir -p $(CP_BIN)
	cd $(CP_GO)/prometheus && $(CP_GO_BUILD) -tags remove_all_sd,enable_kubernetes_sd \
		-ldflags '$(CP_STRIP) -X github.com/prometheus/common/version.Version=$(CP_PROMETHEUS_VERSION)' \
		-o $(abspath $@) github.com/prometheus/prometheus/cmd/prometheus
	@touch $@

# CoreDNS with only the plugins the cluster DNS uses (go/coredns/main.go).
$(CP_BIN)/coredns: $(CP_GO)/coredns/go.mod $(CP_GO)/coredns/go.sum $(CP_GO)/coredns/main.go $(CP_MK)
	@mkdir -p $(CP_BIN)
	cd $(CP_GO)/coredns && $(CP_GO_BUILD) -ldflags '$(CP_STRIP)' -o $(abspath $@) .
	@touch $@

# Static and reproducible (-trimpath, no build ID): the same source makes the same image.
$(CP_NODE_PROGRAMS) &: $(CP_GO)/node/go.mod $(wildcard $(CP_GO)/node/*/*.go) $(CP_MK)
	@mkdir -p $(CP_BIN)
	cd $(CP_GO)/node && CGO_ENABLED=0 $(CP_GO_BUILD) -ldflags '$(CP_STRIP) -buildid=' \
		-o $(abspath $(CP_BIN))/ ./pause ./nettool
	@touch $(CP_NODE_PROGRAMS)

# The real node's NetworkPolicy enforcer: kube-network-policies, static (an image of the
# one file runs it), with one change this kernel needs. Its rules send new connections to
# a userspace queue with nf_tables' `queue` expression, which this kernel lacks (no
# nft_queue); go/netpol/queue_patch makes them use the xtables NFQUEUE target, built in
# here, through nf_tables' compat layer. The build copies the pinned module, patches the
# copy (git apply, as outside any repository: inside this one it would skip the files)
# and builds against it with a go.mod of its own (-modfile, with a replace line): the
# module cache and go/netpol stay as they are.
CP_NETPOL := $(CP_GO)/netpol
CP_NETPOL_BUILD := $(abspath $(CP_BIN))/.netpol-build
$(CP_BIN)/kube-network-policies: $(CP_NETPOL)/go.mod $(CP_NETPOL)/go.sum $(wildcard $(CP_NETPOL)/queue_patch/*) $(CP_MK)
	rm -rf $(CP_NETPOL_BUILD) && mkdir -p $(CP_NETPOL_BUILD)
	cd $(CP_NETPOL) && $(GO) mod download sigs.k8s.io/kube-network-policies && \
	cp -r "$$($(GO) list -m -f '{{.Dir}}' sigs.k8s.io/kube-network-policies)" $(CP_NETPOL_BUILD)/src && \
	chmod -R u+w $(CP_NETPOL_BUILD)/src && \
	(cd $(CP_NETPOL_BUILD)/src && GIT_CEILING_DIRECTORIES=$(CP_NETPOL_BUILD) \
		git apply -p1 $(abspath $(CP_NETPOL))/queue_patch/controller.patch) && \
	cp queue_patch/queue_target.go $(CP_NETPOL_BUILD)/src/pkg/networkpolicy/ && \
	cp go.mod go.sum $(CP_NETPOL_BUILD)/ && \
	echo 'replace sigs.k8s.io/kube-network-policies => $(CP_NETPOL_BUILD)/src' >> $(CP_NETPOL_BUILD)/go.mod && \
	CGO_ENABLED=0 $(CP_GO_BUILD) -modfile $(CP_NETPOL_BUILD)/go.mod -ldflags '$(CP_STRIP)' \
		-o $(abspath $@) sigs.k8s.io/kube-network-policies/cmd
	@touch $@

# Debian's container runtime and CNI plugins, for the real node. Installing needs root;
# elsewhere the node does not start (and its tests skip), so this only says so.
# No service is started here: the tests run containerd with a configuration of their own.
$(CP_BIN)/.node-packages: $(CP_MK)
	@mkdir -p $(CP_BIN)
	@if command -v containerd >/dev/null && command -v runc >/dev/null && [ -x /usr/lib/cni/bridge ]; then \
		touch $@; \
	elif [ "$$(id -u)" != 0 ]; then \
		echo "not root: $(CP_NODE_DEBS) not installed, so the tests' real node will not start"; \
	else \
		export DEBIAN_FRONTEND=noninteractive; \
		$(APT_GET) install -y -qq --no-install-recommends $(CP_NODE_DEBS) || \
			{ $(APT_GET) update -qq && $(APT_GET) install -y -qq --no-install-recommends $(CP_NODE_DEBS); } && \
		touch $@; \
	fi

# Static (no cgo), as KubeRay's own image builds it: the same binary runs here and, as an
# image of itself alone, inside the cluster (the walk-through's KubeRay).
$(CP_BIN)/kuberay-operator: $(CP_GO)/kuberay/go.mod $(CP_GO)/kuberay/go.sum $(CP_MK)
	@mkdir -p $(CP_BIN)
	cd $(CP_GO)/kuberay && CGO_ENABLED=0 $(CP_GO_BUILD) -ldflags '$(CP_STRIP)' -o $(abspath $@) github.com/ray-project/kuberay/ray-operator
	@touch $@

$(CP_BIN)/kueue-manager: $(CP_GO)/kueue/go.mod $(CP_GO)/kueue/go.sum $(CP_MK)
	@mkdir -p $(CP_BIN)
	cd $(CP_GO)/kueue && $(CP_GO_BUILD) -ldflags '$(CP_STRIP)' -o $(abspath $@) sigs.k8s.io/kueue/cmd/kueue
	@touch $@

cluster: controlplane  ## start that control plane for you to use with kubectl (Ctrl-C stops it)
	$(CP_PYTHON) -m tests.controlplane --no-build
