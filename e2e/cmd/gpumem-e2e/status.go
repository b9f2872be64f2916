// gpumem's status socket (GET /status), as the scenarios read it.
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

// status is what gpumem's status socket answers (GET /status), the fields
// the suite reads.
type status struct {
	Registered bool `json:"registered"`
	Gpus       []struct {
		Index          uint32 `json:"index"`
		UUID           string `json:"uuid"`
		MemoryMiB      uint64 `json:"memory_mib"`
		Units          uint32 `json:"units"`
		AllocatedUnits uint32 `json:"allocated_units"`
	} `json:"gpus"`
	Containers []struct {
		Namespace *string `json:"namespace"`
		Pod       *string `json:"pod"`
		Container *string `json:"container"`
		Gpu       uint32  `json:"gpu"`
		Units     uint32  `json:"units"`
		CapMiB    uint64  `json:"cap_mib"`
	} `json:"containers"`
	PodResourcesError *string `json:"pod_resources_error"`
	Claims            []struct {
		Namespace string `json:"namespace"`
		Name      string `json:"name"`
		UID       string `json:"uid"`
		Gpu       uint32 `json:"gpu"`
		CapMiB    uint64 `json:"cap_mib"`
	} `json:"claims"`
	Dra *struct {
		Driver             string  `json:"driver"`
		Registration       string  `json:"registration"`
		Slice              *string `json:"slice"`
		ConsumableCapacity *bool   `json:"consumable_capacity"`
		SliceError         *string `json:"slice_error"`
	} `json:"dra"`
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
