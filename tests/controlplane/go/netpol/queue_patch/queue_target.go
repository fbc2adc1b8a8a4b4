// Added to kube-network-policies' package networkpolicy at build time, in a copy of the
// module (see controlplane.mk); controller.patch makes its rules use it.

package networkpolicy

import (
	"encoding/binary"

	"github.com/google/nftables/expr"
	"github.com/google/nftables/xt"
)

// queueTarget sends a packet to userspace queue `num`, as nf_tables' `queue` expression
// does, but through the xtables NFQUEUE target (revision 3) that nf_tables runs by its
// compat layer: some kernels, such as the test node's, build xt_NFQUEUE in and lack the
// nft_queue module. With bypass, packets pass when nothing listens on the queue.
func queueTarget(num uint16, bypass bool) expr.Any {
	// struct xt_NFQ_info_v3 {__u16 queuenum; __u16 queues_total; __u16 flags;}, in host
	// byte order and padded to 8 bytes (XT_ALIGN), as the kernel checks its size.
	info := make([]byte, 8)
	binary.NativeEndian.PutUint16(info[0:], num)
	binary.NativeEndian.PutUint16(info[2:], 1) // one queue, no fan-out
	if bypass {
		binary.NativeEndian.PutUint16(info[4:], 0x1) // NFQ_FLAG_BYPASS
	}
	unknown := xt.Unknown(info)
	return &expr.Target{Name: "NFQUEUE", Rev: 3, Info: &unknown}
}
