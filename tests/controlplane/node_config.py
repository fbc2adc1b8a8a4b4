"""The real node's configuration files, as pure functions of its addresses and paths.

Every setting that departs from upstream's defaults says why: this machine is a VM with
cgroup v1, no systemd, and root without CAP_SYS_RESOURCE.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CNI_BIN_DIR = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
CLUSTER_DOMAIN = "cluster.local"


@dataclass(frozen=True)
class NodeLayout:
    """Where the node's addresses and files are."""

    name: str
    node_ip: str  # on a link of its own: the API server, kubelet and cluster DNS listen here
    pod_subnet: str  # this node's pods, behind the CNI bridge
    cluster_pod_cidr: str  # every pod address in the cluster, kwok's fake ones included
    service_cidr: str
    bridge: str
    state_dir: Path  # containerd's state and socket, runc's root, netns, IPAM
    data_dir: Path  # containerd's images (kept between runs), the kubelet's root
    run_dir: Path  # this run's configuration files and pod logs

    @property
    def containerd_socket(self) -> Path:
        return self.state_dir / "containerd.sock"

    @property
    def cni_conf_dir(self) -> Path:
        return self.run_dir / "cni"

    @property
    def kubelet_root(self) -> Path:
        return self.data_dir / "kubelet"


def containerd_toml(layout: NodeLayout, sandbox_image: str) -> str:
    state = layout.state_dir
    return f"""version = 2
root = "{layout.data_dir / "containerd"}"
state = "{state / "containerd"}"
# Plugins that would only log that they cannot run here.
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{layout.containerd_socket}"

[ttrpc]
  address = "{state / "containerd.sock.ttrpc"}"

[plugins."io.containerd.grpc.v1.cri"]
  # Built from go/node/pause and imported: registry.k8s.io cannot be reached.
  sandbox_image = "{sandbox_image}"
  # Without CAP_SYS_RESOURCE every sandbox fails ("can't get final child's PID from pipe").
  restrict_oom_score_adj = true
  # Under our state dir, so that a stop (or the next start) finds and unmounts them.
  netns_mounts_under_state_dir = true
  enable_cdi = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{layout.cni_conf_dir}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "{state / "runc"}"
        SystemdCgroup = false

[plugins."io.containerd.internal.v1.opt"]
  path = "{layout.data_dir / "opt"}"
"""


def cni_conflist(layout: NodeLayout) -> dict[str, Any]:
    gateway = layout.pod_subnet.rsplit(".", 1)[0] + ".1"
    return {
        "cniVersion": "0.4.0",
        "name": "rlhf-test-pods",
        "plugins": [
            {
                "type": "bridge",
                "bridge": layout.bridge,
                "isGateway": True,
                # No masquerade: nothing a pod sends may leave the machine (node_host's
                # FORWARD guard drops it), so there is nothing to translate.
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": layout.pod_subnet, "gateway": gateway}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(layout.state_dir / "cni-ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
            {"type": "loopback"},
        ],
    }


def write_cni_conf(layout: NodeLayout) -> None:
    layout.cni_conf_dir.mkdir(parents=True, exist_ok=True)
    path = layout.cni_conf_dir / "10-rlhf-test.conflist"
    path.write_text(json.dumps(cni_conflist(layout), indent=2))


def kubelet_config(
    layout: NodeLayout, ca_file: Path, healthz_port: int, taints: list[dict[str, str]]
) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # cgroup v1 and no systemd here; no QoS cgroups nor node-allocatable enforcement,
        # which need a cgroup hierarchy of the kubelet's own.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "containerRuntimeEndpoint": f"unix://{layout.containerd_socket}",
        "address": layout.node_ip,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        # The API server calls in (logs, exec) with the admin client certificate.
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca_file)},
        },
        "authorization": {"mode": "Webhook"},
        "clusterDNS": [layout.node_ip],
        "clusterDomain": CLUSTER_DOMAIN,
        # Pods with dnsPolicy Default get cluster DNS too: the host's resolver is outside.
        "resolvConf": str(layout.run_dir / "resolv.conf"),
        "registerWithTaints": taints,
        "podLogsDir": str(layout.run_dir / "pod-logs"),
        "failSwapOn": False,
        # Lowering its own OOM score needs CAP_SYS_RESOURCE, which root lacks here.
        "oomScoreAdj": 0,
        # The tests' images are imported, never pulled: the image GC must not drop them.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi"},
        "serializeImagePulls": False,
    }


def kube_proxy_config(
    layout: NodeLayout, kubeconfig: Path, healthz_port: int, metrics_port: int
) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": layout.name,
        "mode": "iptables",
        "clusterCIDR": layout.cluster_pod_cidr,
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        # NodePorts answer on the node's own address only, never on the external link.
        "nodePortAddresses": [f"{layout.node_ip}/32"],
        "iptables": {"localhostNodePorts": False},
        # Lowering it needs CAP_SYS_RESOURCE; 0 leaves the machine's conntrack sysctls be.
        "oomScoreAdj": 0,
        "conntrack": {"maxPerCore": 0, "min": 0},
    }


def corefile(layout: NodeLayout, kubeconfig: Path, ready_port: int) -> str:
    """Cluster names from the API server; every other name is NXDOMAIN, never forwarded."""
    return f"""{CLUSTER_DOMAIN}:53 in-addr.arpa:53 ip6.arpa:53 {{
    bind {layout.node_ip}
    ready 127.0.0.1:{ready_port}
    errors
    cache 5
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
}}
.:53 {{
    bind {layout.node_ip}
    errors
    template ANY ANY {{
        rcode NXDOMAIN
    }}
}}
"""


def dump_yaml(path: Path, obj: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(obj, sort_keys=False))
    return path
