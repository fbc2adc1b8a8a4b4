"""A real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, kwok, KubeRay operator) for tests; see harness.py."""
