package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"
)

// statusFixtures are /status bodies of gpumem's daemon, recorded and kept
// current by its tests (tests/status.rs: the device plugin; tests/dra.rs:
// the DRA driver), which fail when what the daemon serves has other fields.
const statusFixtures = "../../../tests/fixtures/status"

// TestStatusIsGpumems decodes each recorded body into status refusing
// unknown fields (gpumem serves a field status lacks, or one renamed),
// and fails on a field of status that no body has (gpumem no longer
// serves it, or never did): status is the daemon's shape, no more, no
// less.
func TestStatusIsGpumems(t *testing.T) {
	files, err := filepath.Glob(filepath.Join(statusFixtures, "*.json"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no /status fixtures in %s: %v", statusFixtures, err)
	}
	served := map[string]bool{}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.DisallowUnknownFields()
		var st status
		if err := dec.Decode(&st); err != nil {
			t.Errorf("%s: %v", filepath.Base(f), err)
		}
		var doc any
		if err := json.Unmarshal(data, &doc); err != nil {
			t.Fatalf("%s: %v", filepath.Base(f), err)
		}
		jsonPaths(doc, "", served)
	}
	var missing []string
	for _, p := range fieldPaths(reflect.TypeOf(status{}), "") {
		if !served[p] {
			missing = append(missing, p)
		}
	}
	if len(missing) > 0 {
		sort.Strings(missing)
		t.Errorf("status has fields no /status of gpumem's has: %s", strings.Join(missing, ", "))
	}
}

// jsonPaths adds the key paths of a JSON document to into: "gpus[].uuid",
// "dra.slice"; an array's elements share its path.
func jsonPaths(doc any, at string, into map[string]bool) {
	switch v := doc.(type) {
	case map[string]any:
		for k, e := range v {
			p := join(at, k)
			into[p] = true
			jsonPaths(e, p, into)
		}
	case []any:
		for _, e := range v {
			jsonPaths(e, at+"[]", into)
		}
	}
}

// fieldPaths is jsonPaths for a Go type's fields, by their json names.
func fieldPaths(t reflect.Type, at string) []string {
	switch t.Kind() {
	case reflect.Pointer:
		return fieldPaths(t.Elem(), at)
	case reflect.Slice:
		return fieldPaths(t.Elem(), at+"[]")
	case reflect.Struct:
		var paths []string
		for i := 0; i < t.NumField(); i++ {
			f := t.Field(i)
			name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
			if f.Anonymous && name == "" {
				// encoding/json puts an embedded struct's fields in its own.
				paths = append(paths, fieldPaths(f.Type, at)...)
				continue
			}
			p := join(at, name)
			paths = append(paths, p)
			paths = append(paths, fieldPaths(f.Type, p)...)
		}
		return paths
	}
	return nil
}

func join(at, key string) string {
	if at == "" {
		return key
	}
	return at + "." + key
}
