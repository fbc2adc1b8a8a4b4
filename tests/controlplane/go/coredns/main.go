// Command coredns is CoreDNS with only the plugins the real node's cluster DNS needs:
// the kubernetes plugin answers cluster.local from the test API server, template
// refuses every other name (nothing is forwarded outside the machine).
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/template"
)

// The order in which plugins see a query: plugin.cfg's order, less the plugins left out.
var directives = []string{
	"bind", "ready", "health", "errors", "log",
	"loadbalance", "cache", "template", "kubernetes",
}

func init() {
	dnsserver.Directives = directives
}

func main() {
	coremain.Run()
}
