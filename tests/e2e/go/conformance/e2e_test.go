// Package conformance is the upstream e2e test binary of the conformance tier
// (tests/e2e/conformance.rs), built with `go test -c` by tests/e2e/build-control-plane.sh.
//
// It wires the e2e framework as k8s.io/kubernetes test/e2e/e2e_test.go and test/e2e/e2e.go do
// (flags, framework.AfterReadingAllFlags, one ginkgo entry point), but links in only the
// API tests the tier runs: test/e2e/apimachinery and test/e2e/common/node (whose
// kubelet-dependent tests the runner's skip list filters out). The suite setup skips what
// needs nodes or system pods: the control plane under test has neither.
package conformance

import (
	"context"
	"flag"
	"fmt"
	"os"
	"testing"

	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"

	"k8s.io/component-base/logs"
	"k8s.io/component-base/version"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/test/e2e/framework"
	"k8s.io/kubernetes/test/e2e/framework/config"

	// Define and freeze the feature and label constants, as the upstream suite does.
	_ "k8s.io/kubernetes/test/e2e/feature"

	// The tests.
	_ "k8s.io/kubernetes/test/e2e/apimachinery"
	_ "k8s.io/kubernetes/test/e2e/common/node"

	// Client auth plugins and the test-only logging defaults, as upstream.
	_ "k8s.io/client-go/plugin/pkg/client/auth"
	_ "k8s.io/component-base/logs/testinit"
)

func handleFlags() {
	config.CopyFlags(config.Flags, flag.CommandLine)
	framework.RegisterCommonFlags(flag.CommandLine)
	framework.RegisterClusterFlags(flag.CommandLine)
	flag.Parse()
}

func TestMain(m *testing.M) {
	var versionFlag bool
	flag.CommandLine.BoolVar(&versionFlag, "version", false, "Displays version information.")
	handleFlags()
	if versionFlag {
		fmt.Printf("%s\n", version.Get())
		os.Exit(0)
	}
	if flag.CommandLine.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "unknown additional command line arguments: %s", flag.CommandLine.Args())
		os.Exit(1)
	}
	framework.AfterReadingAllFlags(&framework.TestContext)
	os.Exit(m.Run())
}

func TestE2E(t *testing.T) {
	logs.InitLogs()
	defer logs.FlushLogs()
	klog.EnableContextualLogging(true)
	gomega.RegisterFailHandler(framework.Fail)
	suiteConfig, reporterConfig := framework.CreateGinkgoConfig()
	klog.Infof("Starting e2e run %q on Ginkgo node %d", framework.RunID, suiteConfig.ParallelProcess)
	ginkgo.RunSpecs(t, "Kubernetes e2e suite", suiteConfig, reporterConfig)
}

// The upstream suite setup waits for schedulable nodes and running system pods; here there
// are none, so it only checks that the API server answers and logs both versions.
var _ = ginkgo.SynchronizedBeforeSuite(func(ctx context.Context) []byte {
	c, err := framework.LoadClientset()
	framework.ExpectNoError(err, "Error loading client")
	framework.Logf("e2e test version: %s", version.Get().GitVersion)
	serverVersion, err := c.Discovery().ServerVersion()
	framework.ExpectNoError(err, "Error reading the server version")
	framework.Logf("kube-apiserver version: %s", serverVersion.GitVersion)
	return nil
}, func(ctx context.Context, data []byte) {
	framework.TestContext.IPFamily = "ipv4"
})
