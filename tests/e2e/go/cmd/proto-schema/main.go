// Command proto-schema writes, as JSON on stdout, what the proxy needs to write a built-in
// object's protobuf message from its JSON: for every kind the apiserver serves in protobuf
// (client-go's scheme, apiextensions and apiregistration), the Go type, and for every struct
// type reachable from those kinds its fields with their JSON names, protobuf numbers and how
// gogo-protobuf's generated Marshal writes them (always, when set, repeated, as a map).
//
// Everything is read by reflection from the struct tags of the k8s.io/api modules pinned in
// go.mod, so the schema matches the control plane the tests run. Types whose JSON form is
// written by their own MarshalJSON and that the proxy does not know are marked "opaque": a
// kind that reaches one is not transcoded.
//
// Run from tests/e2e/go with a copy of go.mod (the command's imports are direct requirements,
// and go.mod is part of the cached builds' key):
//
//	cp go.mod /tmp/ps.mod; cp go.sum /tmp/ps.sum
//	go run -mod=mod -modfile=/tmp/ps.mod ./cmd/proto-schema > ../../../src/k8s/transcode/schema.json
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"reflect"
	"sort"
	"strconv"
	"strings"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/scheme"
	apiregistrationv1 "k8s.io/kube-aggregator/pkg/apis/apiregistration/v1"
)

// Field is one member of a struct: its JSON key ("" when inlined), its protobuf number (0
// when it has none: JSON only, skipped), the kind of value and how it is written.
type Field struct {
	JSON string `json:"j"`
	Num  int    `json:"n"`
	// Card: "one" (a Go value: always written), "ptr" (a Go pointer, []byte: written when
	// set), "rep" (a slice: each element), "map" (each entry, keys sorted), "inline" (a Go
	// value inlined in JSON: its members are the parent's, written as a message), "skip"
	// (JSON only).
	Card string `json:"c"`
	// Kind: string bool int32 int64 uint32 uint64 float32 float64 bytes msg time microtime
	// duration quantity intstr raw list opaque.
	Kind string `json:"k,omitempty"`
	Type string `json:"t,omitempty"`
	// A map's value (its key is always a string).
	Val *Field `json:"v,omitempty"`
}

// Kind is one API kind served in protobuf.
type Kind struct {
	Group   string `json:"group"`
	Version string `json:"version"`
	Kind    string `json:"kind"`
	Type    string `json:"type"`
}

type Schema struct {
	Source string             `json:"source"`
	Kinds  []Kind             `json:"kinds"`
	Types  map[string][]Field `json:"types"`
}

var special = map[string]string{
	"k8s.io/apimachinery/pkg/apis/meta/v1.Time":                     "time",
	"k8s.io/apimachinery/pkg/apis/meta/v1.MicroTime":                "microtime",
	"k8s.io/apimachinery/pkg/apis/meta/v1.Duration":                 "duration",
	"k8s.io/apimachinery/pkg/api/resource.Quantity":                 "quantity",
	"k8s.io/apimachinery/pkg/util/intstr.IntOrString":               "intstr",
	"k8s.io/apimachinery/pkg/runtime.RawExtension":                  "raw",
	"k8s.io/apimachinery/pkg/apis/meta/v1.FieldsV1":                 "raw",
	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1.JSON": "raw",
}

var jsonMarshaler = reflect.TypeOf((*json.Marshaler)(nil)).Elem()

func typeName(t reflect.Type) string { return t.PkgPath() + "." + t.Name() }

type walker struct {
	types map[string][]Field
	err   []string
}

// value describes a value of Go type t (not a pointer, slice or map) as a kind.
func (w *walker) value(t reflect.Type, wireWord string) (kind, typ string) {
	if t.Name() != "" {
		if k, ok := special[typeName(t)]; ok {
			return k, ""
		}
	}
	switch t.Kind() {
	case reflect.String:
		return "string", ""
	case reflect.Bool:
		return "bool", ""
	case reflect.Int32, reflect.Int64, reflect.Uint32, reflect.Uint64, reflect.Float32, reflect.Float64:
		return t.Kind().String(), ""
	case reflect.Int:
		return "int64", ""
	case reflect.Struct:
		if reflect.PointerTo(t).Implements(jsonMarshaler) || t.Implements(jsonMarshaler) {
			return "opaque", typeName(t)
		}
		w.walk(t)
		return "msg", typeName(t)
	case reflect.Slice:
		if t.Elem().Kind() == reflect.Uint8 {
			return "bytes", ""
		}
		// A named slice written as a message of one repeated field (ExtraValue): it has
		// its own generated Marshal.
		if isWrapper(t) {
			name := typeName(t)
			if _, seen := w.types[name]; !seen {
				w.types[name] = nil
				ek, et := w.value(t.Elem(), "")
				w.types[name] = []Field{{JSON: "items", Num: 1, Card: "rep", Kind: ek, Type: et}}
			}
			return "list", name
		}
	}
	w.err = append(w.err, fmt.Sprintf("unknown value type %s (%s)", t, t.Kind()))
	return "opaque", t.String()
}

var protoMarshaler = reflect.TypeOf((*interface{ Marshal() ([]byte, error) })(nil)).Elem()

func isWrapper(t reflect.Type) bool {
	return t.Kind() == reflect.Slice && t.Name() != "" && t.Elem().Kind() != reflect.Uint8 &&
		(t.Implements(protoMarshaler) || reflect.PointerTo(t).Implements(protoMarshaler))
}

func parseTag(tag string) (word string, num int, label string) {
	parts := strings.Split(tag, ",")
	if len(parts) < 3 {
		return "", 0, ""
	}
	n, _ := strconv.Atoi(parts[1])
	return parts[0], n, parts[2]
}

func (w *walker) walk(t reflect.Type) {
	name := typeName(t)
	if _, seen := w.types[name]; seen {
		return
	}
	w.types[name] = nil
	var fields []Field
	for i := 0; i < t.NumField(); i++ {
		sf := t.Field(i)
		jtag := sf.Tag.Get("json")
		jname := strings.Split(jtag, ",")[0]
		inline := strings.Contains(jtag, ",inline") || (sf.Anonymous && jtag == "")
		if jname == "-" {
			continue
		}
		if jname == "" && !inline {
			jname = sf.Name
		}
		ptag, ok := sf.Tag.Lookup("protobuf")
		if !ok {
			if inline {
				// Inlined without a protobuf number (TypeMeta): its keys are JSON only.
				ft := sf.Type
				for ft.Kind() == reflect.Ptr {
					ft = ft.Elem()
				}
				for j := 0; j < ft.NumField(); j++ {
					k := strings.Split(ft.Field(j).Tag.Get("json"), ",")[0]
					if k != "" && k != "-" {
						fields = append(fields, Field{JSON: k, Card: "skip"})
					}
				}
			} else if sf.IsExported() {
				fields = append(fields, Field{JSON: jname, Card: "skip"})
			}
			continue
		}
		word, num, _ := parseTag(ptag)
		f := Field{JSON: jname, Num: num}
		ft := sf.Type
		switch {
		case inline:
			f.JSON = ""
			f.Card = "inline"
			if ft.Kind() == reflect.Ptr {
				f.Card = "inlineptr"
				ft = ft.Elem()
			}
			f.Kind, f.Type = w.value(ft, word)
		case ft.Kind() == reflect.Ptr:
			f.Card = "ptr"
			f.Kind, f.Type = w.value(ft.Elem(), word)
		case ft.Kind() == reflect.Map:
			f.Card = "map"
			if ft.Key().Kind() != reflect.String {
				w.err = append(w.err, fmt.Sprintf("%s.%s: map key %s", name, sf.Name, ft.Key()))
			}
			vword, _, _ := parseTag(sf.Tag.Get("protobuf_val"))
			vt := ft.Elem()
			val := Field{Card: "one"}
			if vt.Kind() == reflect.Ptr {
				val.Card = "ptr"
				vt = vt.Elem()
			}
			val.Kind, val.Type = w.value(vt, vword)
			f.Val = &val
		case ft.Kind() == reflect.Slice && ft.Elem().Kind() != reflect.Uint8 && !isWrapper(ft):
			f.Card = "rep"
			et := ft.Elem()
			if et.Kind() == reflect.Ptr {
				w.err = append(w.err, fmt.Sprintf("%s.%s: slice of pointers", name, sf.Name))
				et = et.Elem()
			}
			f.Kind, f.Type = w.value(et, word)
		case ft.Kind() == reflect.Slice && ft.Elem().Kind() == reflect.Uint8:
			f.Card = "ptr"
			f.Kind = "bytes"
		default:
			f.Card = "one"
			f.Kind, f.Type = w.value(ft, word)
		}
		fields = append(fields, f)
	}
	sort.SliceStable(fields, func(i, j int) bool { return fields[i].Num < fields[j].Num })
	w.types[name] = fields
}

func main() {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{scheme.AddToScheme, apiextensionsv1.AddToScheme, apiregistrationv1.AddToScheme} {
		if err := add(s); err != nil {
			panic(err)
		}
	}
	w := &walker{types: map[string][]Field{}}
	var kinds []Kind
	for gvk, t := range s.AllKnownTypes() {
		if gvk.Version == runtime.APIVersionInternal || strings.HasSuffix(gvk.Kind, "List") {
			continue
		}
		// Objects with metadata only: the kinds a cache holds.
		m, ok := t.FieldByName("ObjectMeta")
		if !ok || m.Type.Name() != "ObjectMeta" {
			continue
		}
		if _, ok := t.FieldByName("TypeMeta"); !ok {
			continue
		}
		w.walk(t)
		kinds = append(kinds, Kind{Group: gvk.Group, Version: gvk.Version, Kind: gvk.Kind, Type: typeName(t)})
	}
	sort.Slice(kinds, func(i, j int) bool {
		a, b := kinds[i], kinds[j]
		return schema.GroupVersionKind{Group: a.Group, Version: a.Version, Kind: a.Kind}.String() <
			schema.GroupVersionKind{Group: b.Group, Version: b.Version, Kind: b.Kind}.String()
	})
	if len(w.err) > 0 {
		sort.Strings(w.err)
		for _, e := range w.err {
			fmt.Fprintln(os.Stderr, "proto-schema:", e)
		}
	}
	out := Schema{Source: "k8s.io/api, k8s.io/apiextensions-apiserver, k8s.io/kube-aggregator (tests/e2e/go/go.mod)", Kinds: kinds, Types: w.types}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", " ")
	if err := enc.Encode(out); err != nil {
		panic(err)
	}
}
