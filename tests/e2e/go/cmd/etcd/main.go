// Command etcd is etcd's own server entry point, built from go.etcd.io/etcd/server/v3
// so the end-to-end tests run the same etcd a cluster runs.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
