// Command client-go-watch-fields runs a client-go ConfigMap informer that opts into
// kube-cache-proxy's field-level change filter with a transport wrapper: its handlers run for
// `data` changes (and creations and deletions), not for annotation or managedFields churn.
// See docs/watch-fields.md.
//
//	go run . -kubeconfig proxy.kubeconfig -namespace default -fields data
//
// client-go's typed clients ask for protobuf, which the proxy's cache does not serve yet: such
// watches go to the apiserver, unfiltered (the response header X-Kube-Cache-Proxy-Watch-Filter
// says so). This example asks for JSON, which the cache serves and filters.
package main

import (
	"context"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/signal"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
)

// watchFields adds the opt-in header to every request (lists ignore it).
type watchFields struct {
	next   http.RoundTripper
	fields string
}

func (w watchFields) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("X-Kube-Cache-Proxy-Watch-Fields", w.fields)
	return w.next.RoundTrip(r)
}

func main() {
	kubeconfig := flag.String("kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig pointing at kube-cache-proxy")
	namespace := flag.String("namespace", "default", "namespace to watch")
	fields := flag.String("fields", "data", "field paths, or the ignore form: -metadata.annotations,-metadata.managedFields")
	flag.Parse()

	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	cfg.ContentType = "application/json"
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return watchFields{rt, *fields} })
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	f := informers.NewSharedInformerFactoryWithOptions(cs, 0, informers.WithNamespace(*namespace))
	informer := f.Core().V1().ConfigMaps().Informer()
	_, _ = informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj interface{}) { fmt.Println("added", obj.(*corev1.ConfigMap).Name) },
		UpdateFunc: func(_, obj interface{}) {
			cm := obj.(*corev1.ConfigMap)
			fmt.Println("data changed", cm.Name, cm.ResourceVersion, cm.Data)
		},
		DeleteFunc: func(obj interface{}) { fmt.Println("deleted") },
	})
	f.Start(ctx.Done())
	<-ctx.Done()
}
