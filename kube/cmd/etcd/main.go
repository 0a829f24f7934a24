// Command etcd is upstream etcd's server entry point (go.etcd.io/etcd/server/v3/etcdmain), built
// from the version pinned in this module's go.mod so the local control plane needs no download.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
