// gpumem's status socket (GET /status), as the scenarios read it. The
// shape is gpumem's: status_test.go decodes the bodies gpumem's own tests
// record from the daemon (tests/fixtures/status, checked there against
// what it serves) with unknown fields refused, and fails on a field here
// that none of them has.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"
)

// status is ops::status::NodeStatus, every field it serializes but
// api_server_error, which it writes only while the API server is out of
// reach and nothing here reads.
type status struct {
	Version           string            `json:"version"`
	Commit            string            `json:"commit"`
	Resource          string            `json:"resource"`
	Unit              string            `json:"unit"`
	Registered        bool              `json:"registered"`
	Gpus              []gpuStatus       `json:"gpus"`
	Containers        []containerStatus `json:"containers"`
	PodResourcesError *string           `json:"pod_resources_error"`
	Claims            []claimStatus     `json:"claims"`
	Dra               *draStatus        `json:"dra"`
}

type gpuStatus struct {
	Index          uint32  `json:"index"`
	Name           string  `json:"name"`
	UUID           string  `json:"uuid"`
	Healthy        bool    `json:"healthy"`
	MemoryMiB      uint64  `json:"memory_mib"`
	Units          uint32  `json:"units"`
	AllocatedUnits uint32  `json:"allocated_units"`
	AllocatedMiB   uint64  `json:"allocated_mib"`
	UnmanagedMiB   *uint64 `json:"unmanaged_mib"`
}

type containerStatus struct {
	Namespace *string `json:"namespace"`
	Pod       *string `json:"pod"`
	Container *string `json:"container"`
	Gpu       uint32  `json:"gpu"`
	Units     uint32  `json:"units"`
	CapMiB    uint64  `json:"cap_mib"`
	accountingStatus
}

type claimStatus struct {
	Namespace  string   `json:"namespace"`
	Name       string   `json:"name"`
	UID        string   `json:"uid"`
	Gpu        uint32   `json:"gpu"`
	CapMiB     uint64   `json:"cap_mib"`
	Containers []string `json:"containers"`
	accountingStatus
}

// accountingStatus is what a container and a claim both report from
// their accounting directory.
type accountingStatus struct {
	AccountingDir      *string `json:"accounting_dir"`
	UsedMiB            *uint64 `json:"used_mib"`
	UntrackedMiB       *uint64 `json:"untracked_mib"`
	PeakMiB            *uint64 `json:"peak_mib"`
	RefusedAllocations *uint64 `json:"refused_allocations"`
}

type draStatus struct {
	Driver             string  `json:"driver"`
	Registration       string  `json:"registration"`
	Slice              *string `json:"slice"`
	SliceDevices       uint64  `json:"slice_devices"`
	ConsumableCapacity *bool   `json:"consumable_capacity"`
	SliceError         *string `json:"slice_error"`
}

func (s *suite) gpumemStatus() (*status, error) {
	client := http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", s.c.statusSocket)
		}},
	}
	resp, err := client.Get("http://localhost/status")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != 200 {
		return nil, fmt.Errorf("gpumem /status: %s: %s", resp.Status, body)
	}
	var st status
	if err := json.Unmarshal(body, &st); err != nil {
		return nil, fmt.Errorf("gpumem /status: %w", err)
	}
	return &st, nil
}
