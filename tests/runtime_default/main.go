// Prints containerd's RuntimeDefault seccomp profile for the default capability set of
// containerd's default spec (the set a CRI container gets without
// `capabilities.add`), on amd64 and arm64, as one JSON object: see generate.sh.
package main

import (
	"context"
	"encoding/json"
	"os"

	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/oci"

	seccomp "runtimedefault/profile"
)

func main() {
	ctx := namespaces.WithNamespace(context.Background(), "k8s.io")
	spec, err := oci.GenerateSpecWithPlatform(ctx, nil, "linux/amd64", &containers.Container{ID: "c"})
	if err != nil {
		panic(err)
	}
	caps := spec.Process.Capabilities.Bounding
	out := map[string]any{"containerd": os.Args[1], "capabilities": caps}
	for _, arch := range []string{"amd64", "arm64"} {
		seccomp.GOARCH = arch
		out[arch] = seccomp.DefaultProfile(spec)
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", " ")
	if err := enc.Encode(out); err != nil {
		panic(err)
	}
}
