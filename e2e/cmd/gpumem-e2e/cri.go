// The container runtime kubelet talks to: k8s.io/cri-client's fake runtime,
// wrapped to keep every CreateContainer request (what kubelet made of
// gpumem's Allocate answer) and to behave as kubelet needs of a runtime:
// real log files, images with a size.
package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"

	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/cri-client/pkg/fake"
)

type recordingRuntime struct {
	*fake.RemoteRuntime
	server *grpc.Server

	mu      sync.Mutex
	created []*runtimeapi.CreateContainerRequest
}

func startRuntime(socket string) (*recordingRuntime, error) {
	r := &recordingRuntime{RemoteRuntime: fake.NewFakeRemoteRuntime(), server: grpc.NewServer()}
	// kubelet refuses images of size 0.
	r.ImageService.SetFakeImageSize(1 << 20)
	r.RuntimeService.FakeStatus = &runtimeapi.RuntimeStatus{
		Conditions: []*runtimeapi.RuntimeCondition{
			{Type: runtimeapi.RuntimeReady, Status: true},
			{Type: runtimeapi.NetworkReady, Status: true},
		},
	}
	runtimeapi.RegisterRuntimeServiceServer(r.server, r)
	runtimeapi.RegisterImageServiceServer(r.server, r)
	_ = os.Remove(socket)
	l, err := net.Listen("unix", socket)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", socket, err)
	}
	go func() { _ = r.server.Serve(l) }()
	return r, nil
}

func (r *recordingRuntime) stop() { r.server.Stop() }

// CreateContainer records the request and gives the container a real log
// file: with an empty log path kubelet's log clean-up globs "*" in its
// working directory.
func (r *recordingRuntime) CreateContainer(ctx context.Context, req *runtimeapi.CreateContainerRequest) (*runtimeapi.CreateContainerResponse, error) {
	r.mu.Lock()
	r.created = append(r.created, req)
	r.mu.Unlock()
	resp, err := r.RemoteRuntime.CreateContainer(ctx, req)
	if err != nil {
		return nil, err
	}
	logPath := filepath.Join(req.GetSandboxConfig().GetLogDirectory(), req.GetConfig().GetLogPath())
	if err := os.MkdirAll(filepath.Dir(logPath), 0o755); err == nil {
		if f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY, 0o644); err == nil {
			_ = f.Close()
		}
	}
	r.RuntimeService.Lock()
	if c, ok := r.RuntimeService.Containers[resp.ContainerId]; ok {
		c.LogPath = logPath
	}
	r.RuntimeService.Unlock()
	return resp, nil
}

// createdFor returns the CreateContainer requests kubelet made for a pod's
// container, oldest first.
func (r *recordingRuntime) createdFor(namespace, pod, container string) []*runtimeapi.CreateContainerRequest {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []*runtimeapi.CreateContainerRequest
	for _, req := range r.created {
		meta := req.GetSandboxConfig().GetMetadata()
		if meta.GetNamespace() == namespace && meta.GetName() == pod && req.GetConfig().GetMetadata().GetName() == container {
			out = append(out, req)
		}
	}
	return out
}

// forget drops the requests recorded so far: each scenario counts its own.
func (r *recordingRuntime) forget() {
	r.mu.Lock()
	r.created = nil
	r.mu.Unlock()
}
