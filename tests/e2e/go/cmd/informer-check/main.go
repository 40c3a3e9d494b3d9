// Command informer-check runs one real client-go informer against a kubeconfig (usually one
// pointing at kube-cache-proxy) and reports what the informer's cache holds, so end-to-end tests
// can compare it with the apiserver's state.
//
// Modes (--mode):
//
//	legacy     typed SharedInformerFactory, WatchListClient feature OFF: paged LIST, then WATCH
//	watchlist  typed SharedInformerFactory, WatchListClient feature ON: one WATCH with
//	           sendInitialEvents=true, ended by the "k8s.io/initial-events-end" bookmark
//	metadata   metadatainformer (PartialObjectMetadata); WatchListClient OFF unless --watch-list=true
//	controller-runtime
//	           a controller-runtime cache (sigs.k8s.io/controller-runtime, what operators built
//	           with it use): its informer for the typed kind, started by the cache; cluster-wide
//	           (CACHE then lists --namespace only); WatchListClient OFF unless --watch-list=true
//
// --accept=json (any mode) drops the protobuf clauses from every Accept header the
// informer sends, so its LIST and WATCH ask for JSON only (the kind's, or
// PartialObjectMetadata(List) in metadata mode): typed clients and the metadata client put
// protobuf first, which the proxy hands to the apiserver.
//
// --content-type=protobuf sets rest.Config.ContentType to application/vnd.kubernetes.protobuf, as
// kube-controller-manager, kube-scheduler and the kubelet configure their clients (then the
// typed clients' Accept is protobuf first, JSON second); the default leaves client-go's own.
//
// --watch-fields=<spec> adds the proxy's opt-in X-Kube-Cache-Proxy-Watch-Fields header to every
// request (a transport wrapper, as a controller would; lists ignore it), and logs the
// X-Kube-Cache-Proxy-Watch-Filter response header of each watch to stderr as "WATCHFILTER <value>".
//
// client-go reads its feature gates from KUBE_FEATURE_<name> environment variables on first use;
// this program sets KUBE_FEATURE_WatchListClient itself before any informer exists (overriding
// the caller's environment) and reports the effective state, read back from client-go.
//
// Protocol, one line per message:
//
//	stdout  MODE <mode> WatchListClient=<true|false>    at start
//	stdout  SYNCED <lastSyncResourceVersion>            once the informer has synced (60 s bound)
//	stdin   WAIT <rv>                                   wait (60 s bound) until the informer's
//	                                                    LastSyncResourceVersion >= rv (numeric) and its
//	                                                    handlers have seen an object at >= rv, then
//	stdout  CACHE <json>                                the cache: a JSON array sorted by namespace,
//	                                                    name of {namespace,name,uid,resourceVersion,labels}
//	                                                    (labels always an object)
//	stdin   WAITRV <rv>                                 wait (60 s bound) until LastSyncResourceVersion >= rv
//	                                                    (events or bookmarks), then
//	stdout  RV <lastSyncResourceVersion>
//	stdin   COUNTS                                      the handlers' calls so far:
//	stdout  COUNTS <adds> <updates> <deletes>
//	stdin   EOF                                         exit 0
//
// LastSyncResourceVersion moves when the reflector has queued an event, before the informer's
// store holds it; a handler is called after the store is updated, so WAIT also waits for a
// handler to see the write. It only moves on events and bookmarks of the watched resource and
// scope, so WAIT for the RV of a write the informer sees; an unrelated write's RV is reached only at
// the next bookmark (kube-apiserver sends them about once a minute), likely past the 60 s bound.
//
// Every HTTP request the informer makes is logged to stderr as
// "REQUEST <method> <url> accept=<Accept header>", so a test can check that watchlist mode really
// streamed (sendInitialEvents=true) rather than falling back to LIST, and that metadata mode asked
// for PartialObjectMetadata. Errors go to stderr; failures exit 1, bad usage 2.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime/schema"
	clientfeatures "k8s.io/client-go/features"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/metadata/metadatainformer"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	crcache "sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// waitBound bounds both the initial sync and each WAIT.
const waitBound = 60 * time.Second

type entry struct {
	Namespace       string            `json:"namespace"`
	Name            string            `json:"name"`
	UID             string            `json:"uid"`
	ResourceVersion string            `json:"resourceVersion"`
	Labels          map[string]string `json:"labels"`
	// A ConfigMap's data (typed informers only).
	Data map[string]string `json:"data,omitempty"`
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "informer-check: %v\n", err)
		os.Exit(1)
	}
}

func run() error {
	kubeconfig := flag.String("kubeconfig", "", "path of the kubeconfig to use (required)")
	namespace := flag.String("namespace", "", "namespace to watch; empty for all namespaces")
	mode := flag.String("mode", "legacy", "legacy | watchlist | metadata | controller-runtime")
	resource := flag.String("resource", "configmaps", "configmaps | pods")
	watchList := flag.String("watch-list", "auto", "WatchListClient gate: auto (by mode) | true | false")
	accept := flag.String("accept", "client", "client (the client's own Accept) | json (protobuf clauses dropped)")
	watchFields := flag.String("watch-fields", "", "the proxy's X-Kube-Cache-Proxy-Watch-Fields header, sent with every request")
	contentType := flag.String("content-type", "default", "default (client-go's) | protobuf (rest.Config.ContentType, as kube-controller-manager sets it)")
	flag.Parse()
	if *contentType != "default" && *contentType != "protobuf" {
		usage("--content-type must be default or protobuf")
	}
	if *accept != "client" && *accept != "json" {
		usage("--accept must be client or json")
	}
	if *kubeconfig == "" {
		usage("--kubeconfig is required")
	}
	if *resource != "configmaps" && *resource != "pods" {
		usage("--resource must be configmaps or pods")
	}
	gate := ""
	switch *watchList {
	case "auto":
		switch *mode {
		case "legacy", "metadata", "controller-runtime":
			gate = "false"
		case "watchlist":
			gate = "true"
		}
	case "true", "false":
		gate = *watchList
	default:
		usage("--watch-list must be auto, true or false")
	}
	if gate == "" {
		usage("--mode must be legacy, watchlist, metadata or controller-runtime")
	}
	// Must happen before client-go first reads its gates (it caches the environment then).
	if err := os.Setenv("KUBE_FEATURE_WatchListClient", gate); err != nil {
		return err
	}
	enabled := clientfeatures.FeatureGates().Enabled(clientfeatures.WatchListClient)
	if strconv.FormatBool(enabled) != gate {
		return fmt.Errorf("WatchListClient is %v after setting it to %s", enabled, gate)
	}
	fmt.Printf("MODE %s WatchListClient=%v\n", *mode, enabled)

	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		return fmt.Errorf("loading kubeconfig: %w", err)
	}
	// The informer's own traffic is what is under test; no client-side throttling.
	cfg.QPS, cfg.Burst = 1000, 1000
	if *contentType == "protobuf" {
		cfg.ContentType = "application/vnd.kubernetes.protobuf"
	}
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return logRequests{rt, *accept == "json"} })
	if *watchFields != "" {
		// The transport wrapper a controller adds to opt in (see docs/watch-fields.md).
		cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return watchFieldsHeader{rt, *watchFields} })
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	informer, start, err := newInformer(ctx, cfg, *mode, *resource, *namespace)
	if err != nil {
		return err
	}
	if err := informer.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		fmt.Fprintf(os.Stderr, "informer-check: watch error: %v\n", err)
	}); err != nil {
		return err
	}
	// The highest resourceVersion of an object the handlers were given: the store already
	// holds every change up to it.
	var handled atomic.Uint64
	var adds, updates, deletes atomic.Uint64
	record := func(obj interface{}) {
		if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = d.Obj
		}
		m, err := meta.Accessor(obj)
		if err != nil {
			return
		}
		rv, err := strconv.ParseUint(m.GetResourceVersion(), 10, 64)
		if err != nil {
			return
		}
		for {
			cur := handled.Load()
			if rv <= cur || handled.CompareAndSwap(cur, rv) {
				return
			}
		}
	}
	if _, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj interface{}) { adds.Add(1); record(obj) },
		UpdateFunc: func(_, obj interface{}) { updates.Add(1); record(obj) },
		DeleteFunc: func(obj interface{}) { deletes.Add(1); record(obj) },
	}); err != nil {
		return err
	}
	go start(ctx)

	syncCtx, syncCancel := context.WithTimeout(ctx, waitBound)
	synced := cache.WaitForCacheSync(syncCtx.Done(), informer.HasSynced)
	syncCancel()
	if !synced {
		return fmt.Errorf("informer did not sync within %v", waitBound)
	}
	fmt.Printf("SYNCED %s\n", informer.LastSyncResourceVersion())

	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		line := strings.TrimSpace(in.Text())
		if line == "" {
			continue
		}
		cmd, arg, _ := strings.Cut(line, " ")
		switch cmd {
		case "WAIT":
			want, err := strconv.ParseUint(strings.TrimSpace(arg), 10, 64)
			if err != nil {
				return fmt.Errorf("WAIT %q: resource version is not a number", arg)
			}
			if err := waitFor(informer, &handled, want); err != nil {
				return err
			}
			out, err := dump(informer.GetStore(), *namespace)
			if err != nil {
				return err
			}
			fmt.Printf("CACHE %s\n", out)
		case "WAITRV":
			want, err := strconv.ParseUint(strings.TrimSpace(arg), 10, 64)
			if err != nil {
				return fmt.Errorf("WAITRV %q: resource version is not a number", arg)
			}
			last, err := waitForRV(informer, want)
			if err != nil {
				return err
			}
			fmt.Printf("RV %s\n", last)
		case "COUNTS":
			fmt.Printf("COUNTS %d %d %d\n", adds.Load(), updates.Load(), deletes.Load())
		default:
			return fmt.Errorf("unknown command %q", line)
		}
	}
	return in.Err()
}

func usage(msg string) {
	fmt.Fprintf(os.Stderr, "informer-check: %s\n", msg)
	flag.Usage()
	os.Exit(2)
}

// newInformer builds the informer of mode and the function that runs it (for
// controller-runtime, its cache, which starts the informers it made).
func newInformer(ctx context.Context, cfg *rest.Config, mode, resource, ns string) (cache.SharedIndexInformer, func(context.Context), error) {
	run := func(i cache.SharedIndexInformer) func(context.Context) {
		return func(ctx context.Context) { i.RunWithContext(ctx) }
	}
	switch mode {
	case "metadata":
		mc, err := metadata.NewForConfig(cfg)
		if err != nil {
			return nil, nil, fmt.Errorf("metadata client: %w", err)
		}
		gvr := schema.GroupVersionResource{Version: "v1", Resource: resource}
		f := metadatainformer.NewFilteredSharedInformerFactory(mc, 0, ns, nil)
		i := f.ForResource(gvr).Informer()
		return i, run(i), nil
	case "controller-runtime":
		// Cluster-wide: a cache restricted to namespaces wraps its informers in one that
		// is not a SharedIndexInformer; the dump is restricted to the namespace instead.
		c, err := crcache.New(cfg, crcache.Options{})
		if err != nil {
			return nil, nil, fmt.Errorf("controller-runtime cache: %w", err)
		}
		var obj client.Object = &corev1.ConfigMap{}
		if resource == "pods" {
			obj = &corev1.Pod{}
		}
		// Made before the cache starts: returned at once, started by Start.
		inf, err := c.GetInformer(ctx, obj)
		if err != nil {
			return nil, nil, fmt.Errorf("controller-runtime informer: %w", err)
		}
		i, ok := inf.(cache.SharedIndexInformer)
		if !ok {
			return nil, nil, fmt.Errorf("controller-runtime informer is a %T, not a SharedIndexInformer", inf)
		}
		return i, func(ctx context.Context) {
			if err := c.Start(ctx); err != nil {
				fmt.Fprintf(os.Stderr, "informer-check: controller-runtime cache: %v\n", err)
			}
		}, nil
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("clientset: %w", err)
	}
	f := informers.NewSharedInformerFactoryWithOptions(cs, 0, informers.WithNamespace(ns))
	if resource == "pods" {
		i := f.Core().V1().Pods().Informer()
		return i, run(i), nil
	}
	i := f.Core().V1().ConfigMaps().Informer()
	return i, run(i), nil
}

// waitFor polls until the informer has synced up to resource version want and its handlers
// (called after its store is updated) have seen an object at want or later.
func waitFor(informer cache.SharedIndexInformer, handled *atomic.Uint64, want uint64) error {
	deadline := time.Now().Add(waitBound)
	for {
		last := informer.LastSyncResourceVersion()
		if got, err := strconv.ParseUint(last, 10, 64); err == nil && got >= want && handled.Load() >= want {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("informer at resource version %q, not %d after %v", last, want, waitBound)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitForRV polls until the informer's LastSyncResourceVersion reaches want (an event or a
// bookmark); it returns that resource version.
func waitForRV(informer cache.SharedIndexInformer, want uint64) (string, error) {
	deadline := time.Now().Add(waitBound)
	for {
		last := informer.LastSyncResourceVersion()
		if got, err := strconv.ParseUint(last, 10, 64); err == nil && got >= want {
			return last, nil
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("informer at resource version %q, not %d after %v", last, want, waitBound)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// dump lists the store's objects in namespace ns (all when empty).
func dump(store cache.Store, ns string) ([]byte, error) {
	items := store.List()
	entries := make([]entry, 0, len(items))
	for _, obj := range items {
		m, err := meta.Accessor(obj)
		if err != nil {
			return nil, fmt.Errorf("cache holds %T: %w", obj, err)
		}
		if ns != "" && m.GetNamespace() != ns {
			continue
		}
		labels := m.GetLabels()
		if labels == nil {
			labels = map[string]string{}
		}
		e := entry{
			Namespace:       m.GetNamespace(),
			Name:            m.GetName(),
			UID:             string(m.GetUID()),
			ResourceVersion: m.GetResourceVersion(),
			Labels:          labels,
		}
		if cm, ok := obj.(*corev1.ConfigMap); ok {
			e.Data = cm.Data
		}
		entries = append(entries, e)
	}
	sort.Slice(entries, func(i, j int) bool {
		if entries[i].Namespace != entries[j].Namespace {
			return entries[i].Namespace < entries[j].Namespace
		}
		return entries[i].Name < entries[j].Name
	})
	return json.Marshal(entries)
}

// logRequests logs each request's method, URL, Accept header and time to stderr, then its
// outcome (status or transport error) and time; with jsonOnly it first drops the Accept
// header's protobuf clauses.
type logRequests struct {
	next     http.RoundTripper
	jsonOnly bool
}

func (l logRequests) RoundTrip(r *http.Request) (*http.Response, error) {
	if accept := r.Header.Get("Accept"); l.jsonOnly && accept != "" {
		var kept []string
		for _, clause := range strings.Split(accept, ",") {
			if !strings.HasPrefix(strings.TrimSpace(clause), "application/vnd.kubernetes.protobuf") {
				kept = append(kept, clause)
			}
		}
		r = r.Clone(r.Context())
		r.Header.Set("Accept", strings.Join(kept, ","))
	}
	// at= is the wall clock in Unix milliseconds, so a test can place each request and its
	// outcome against the moments it restarted something (the same machine's clock).
	fmt.Fprintf(os.Stderr, "REQUEST %s %s accept=%s at=%d\n", r.Method, r.URL.String(), r.Header.Get("Accept"), time.Now().UnixMilli())
	resp, err := l.next.RoundTrip(r)
	if err != nil {
		fmt.Fprintf(os.Stderr, "OUTCOME %s failed at=%d: %v\n", r.URL.Path, time.Now().UnixMilli(), err)
	} else {
		fmt.Fprintf(os.Stderr, "OUTCOME %s %d at=%d\n", r.URL.Path, resp.StatusCode, time.Now().UnixMilli())
	}
	return resp, err
}

// watchFieldsHeader adds the proxy's opt-in field-level change filter header to every request
// and logs whether a watch was filtered.
type watchFieldsHeader struct {
	next   http.RoundTripper
	fields string
}

func (w watchFieldsHeader) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("X-Kube-Cache-Proxy-Watch-Fields", w.fields)
	resp, err := w.next.RoundTrip(r)
	if err == nil && r.URL.Query().Get("watch") != "" {
		fmt.Fprintf(os.Stderr, "WATCHFILTER %s\n", resp.Header.Get("X-Kube-Cache-Proxy-Watch-Filter"))
	}
	return resp, err
}
