// kubelet-dm-serve: the REAL kubelet device manager of Kubernetes v1.32.10
// (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager as vendored by KubeEdge: registration gRPC server,
// endpoint clients, checkpoint) and the real Topology Manager for pod admission, driven by a
// JSON-lines protocol: one request object per line on stdin, exactly one response object per line on
// stdout. Nothing else is ever written to stdout; klog goes to the -klog file.
//
// Requests (README.md): start stop crash capacity devices admit remove hints run_options pods wait
// record_start record_stop status quit. Every response has "ok"; a request's "id" is echoed.
//
// The source of the workspace's shared kubelet-dm-serve tool (kube/README.md documents its protocol), built here
// by scripts/kube-build.sh from k8s.io/kubernetes as pinned in kube/v1.32/go.mod instead of KubeEdge's
// vendor tree, with overlay/devicemanager/zz_kubelet_dm_serve.go added to the devicemanager package
// through a go build -overlay. The tests keep it for the behaviour of kubelets 1.28-1.34 that v1.37
// no longer has (kubernetes issue 121994: re-registration while the old stream is open);
// everything else runs against kube/cmd/kubelet-managers (v1.37).
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	cadvisorapi "github.com/google/cadvisor/info/v1"
	"google.golang.org/grpc/grpclog"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/features"
	"k8s.io/kubernetes/pkg/kubelet/cm/containermap"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
	"k8s.io/kubernetes/pkg/kubelet/lifecycle"
)

const (
	checkpointName = "kubelet_internal_checkpoint" // the device manager's checkpoint file name
	maxSocketPath  = 107                           // sun_path is 108 bytes with the terminating NUL
)

// ---------------------------------------------------------------- klog

// sink is the logr sink klog writes to: one line per message to the -klog file. It also counts the
// registration requests and the ListAndWatch updates the manager processed since the last start.
type sink struct {
	l    *klogFile
	name string
	kv   []any
}

type klogFile struct {
	mu      sync.Mutex
	w       io.Writer
	regs    map[string]int   // resource -> "Got registration request" since the last start
	regMs   []map[string]any // the last 50 registration requests: resource, ms after start
	updates map[string]int   // resource -> "Processed device updates for resource" (klog -v >= 2)
	since   time.Time
}

var klogs = &klogFile{w: io.Discard, regs: map[string]int{}, updates: map[string]int{}}

func (s *sink) Init(logr.RuntimeInfo)                  {}
func (s *sink) Enabled(int) bool                       { return true }
func (s *sink) Info(_ int, msg string, kv ...any)      { s.write("I", msg, nil, kv) }
func (s *sink) Error(err error, msg string, kv ...any) { s.write("E", msg, err, kv) }
func (s *sink) WithValues(kv ...any) logr.LogSink {
	return &sink{s.l, s.name, append(append([]any{}, s.kv...), kv...)}
}
func (s *sink) WithName(n string) logr.LogSink { return &sink{s.l, s.name + "/" + n, s.kv} }

func (s *sink) write(sev, msg string, err error, kv []any) {
	var b strings.Builder
	all := append(append([]any{}, s.kv...), kv...)
	resourceName := ""
	for i := 0; i+1 < len(all); i += 2 {
		v := fmt.Sprint(all[i+1])
		if k := fmt.Sprint(all[i]); k == "resourceName" {
			resourceName = v
		}
		if len(v) > 2000 {
			v = v[:2000] + "..."
		}
		fmt.Fprintf(&b, " %v=%q", all[i], v)
	}
	if err != nil {
		fmt.Fprintf(&b, " err=%q", err.Error())
	}
	now := time.Now()
	s.l.mu.Lock()
	defer s.l.mu.Unlock()
	switch {
	case strings.HasPrefix(msg, "Got registration request from device plugin"):
		s.l.regs[resourceName]++
		s.l.regMs = append(s.l.regMs, map[string]any{"resource": resourceName, "ms": ms(now.Sub(s.l.since))})
		if len(s.l.regMs) > 50 {
			s.l.regMs = s.l.regMs[len(s.l.regMs)-50:]
		}
	case strings.HasPrefix(msg, "Processed device updates for resource"):
		s.l.updates[resourceName]++
	}
	fmt.Fprintf(s.l.w, "%s%s %s%s\n", sev, now.Format("15:04:05.000000"), msg, b.String())
}

func (l *klogFile) reset(t time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.regs, l.updates, l.regMs, l.since = map[string]int{}, map[string]int{}, nil, t
}

func (l *klogFile) counts() (map[string]int, map[string]int, []map[string]any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	r, u := map[string]int{}, map[string]int{}
	for k, v := range l.regs {
		r[k] = v
	}
	for k, v := range l.updates {
		u[k] = v
	}
	return r, u, append([]map[string]any{}, l.regMs...)
}

// ---------------------------------------------------------------- the kubelet

type readyAlways struct{}

func (readyAlways) AddSource(string) {}
func (readyAlways) AllReady() bool   { return true }

type server struct {
	mu      sync.Mutex
	dm      *devicemanager.ManagerImpl // nil while the kubelet is not running
	tm      topologymanager.Manager
	dir     string
	sock    string
	policy  string
	scope   string
	numa    int
	started time.Time
	// policyOptions: the Topology Manager policy options of the last start
	policyOptions map[string]string
	pods          map[types.UID]*v1.Pod // the node's pods (the pod manager): they survive kubelet restarts
	inactive      sets.Set[string]      // resources GetCapacity reported inactive, not yet returned by "capacity"
	rec           *recorder
}

// activePods is the kubelet's GetActivePods for the device manager.
func (s *server) activePods() []*v1.Pod {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*v1.Pod, 0, len(s.pods))
	for _, p := range s.pods {
		out = append(out, p)
	}
	return out
}

func (s *server) running() (*devicemanager.ManagerImpl, topologymanager.Manager, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dm == nil {
		return nil, nil, errors.New("the kubelet is not running (send start first)")
	}
	return s.dm, s.tm, nil
}

// ---------------------------------------------------------------- requests

type request struct {
	ID            json.RawMessage   `json:"id"`
	Op            string            `json:"op"`
	Dir           string            `json:"dir"`
	NumaNodes     *int              `json:"numa_nodes"`
	Policy        string            `json:"policy"`
	Scope         string            `json:"scope"`
	PolicyOptions map[string]string `json:"policy_options"`
	Pod           *podSpec          `json:"pod"`
	UID           string            `json:"uid"`
	All           bool              `json:"all"`
	Container     *string           `json:"container"`
	For           *waitFor          `json:"for"`
	TimeoutMs     *float64          `json:"timeout_ms"`
}

type podSpec struct {
	UID            string    `json:"uid"`
	Name           string    `json:"name"`
	Namespace      string    `json:"namespace"`
	InitContainers []ctrSpec `json:"init_containers"`
	Containers     []ctrSpec `json:"containers"`
}

type ctrSpec struct {
	Name          string                     `json:"name"`
	Requests      map[string]json.RawMessage `json:"requests"`
	Limits        map[string]json.RawMessage `json:"limits"`
	RestartPolicy string                     `json:"restart_policy"`
}

type waitFor struct {
	Capacity      map[string]json.RawMessage `json:"capacity"`
	Allocatable   map[string]json.RawMessage `json:"allocatable"`
	Registrations map[string]int             `json:"registrations"`
}

type obj = map[string]any

func quantity(raw json.RawMessage) (resource.Quantity, error) {
	t := strings.TrimSpace(string(raw))
	if strings.HasPrefix(t, "\"") {
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return resource.Quantity{}, err
		}
		t = s
	}
	return resource.ParseQuantity(t)
}

func resourceList(m map[string]json.RawMessage) (v1.ResourceList, error) {
	if m == nil {
		return nil, nil
	}
	rl := v1.ResourceList{}
	for k, raw := range m {
		q, err := quantity(raw)
		if err != nil {
			return nil, fmt.Errorf("resource %q: %v", k, err)
		}
		rl[v1.ResourceName(k)] = q
	}
	return rl, nil
}

// toPod builds the v1.Pod the kubelet would get from the API server. Requests and limits: a
// resource given in one of them only is set to the same value in the other (extended resources
// must have requests == limits; the device manager reads limits).
func (ps *podSpec) toPod() (*v1.Pod, error) {
	if ps.Name == "" {
		return nil, errors.New("pod.name is required")
	}
	p := &v1.Pod{}
	p.Name, p.Namespace, p.UID = ps.Name, ps.Namespace, types.UID(ps.UID)
	if p.Namespace == "" {
		p.Namespace = "default"
	}
	if p.UID == "" {
		p.UID = types.UID(ps.Name)
	}
	p.CreationTimestamp = metav1.Now()
	p.Spec.RestartPolicy = v1.RestartPolicyAlways
	p.Status.Phase = v1.PodPending
	seen := map[string]bool{}
	mk := func(c ctrSpec, init bool) (v1.Container, error) {
		if c.Name == "" {
			return v1.Container{}, errors.New("every container needs a name")
		}
		if seen[c.Name] {
			return v1.Container{}, fmt.Errorf("duplicate container name %q", c.Name)
		}
		seen[c.Name] = true
		req, err := resourceList(c.Requests)
		if err != nil {
			return v1.Container{}, fmt.Errorf("container %q requests: %v", c.Name, err)
		}
		lim, err := resourceList(c.Limits)
		if err != nil {
			return v1.Container{}, fmt.Errorf("container %q limits: %v", c.Name, err)
		}
		if req == nil {
			req = v1.ResourceList{}
		}
		if lim == nil {
			lim = v1.ResourceList{}
		}
		for k, q := range req {
			if _, ok := lim[k]; !ok {
				lim[k] = q.DeepCopy()
			}
		}
		for k, q := range lim {
			if _, ok := req[k]; !ok {
				req[k] = q.DeepCopy()
			}
		}
		out := v1.Container{Name: c.Name, Image: "none", Resources: v1.ResourceRequirements{Requests: req, Limits: lim}}
		switch c.RestartPolicy {
		case "":
		case string(v1.ContainerRestartPolicyAlways):
			if !init {
				return v1.Container{}, fmt.Errorf("container %q: restart_policy is for init containers only", c.Name)
			}
			rp := v1.ContainerRestartPolicyAlways
			out.RestartPolicy = &rp
		default:
			return v1.Container{}, fmt.Errorf("container %q: restart_policy must be \"Always\" or absent", c.Name)
		}
		return out, nil
	}
	for _, c := range ps.InitContainers {
		x, err := mk(c, true)
		if err != nil {
			return nil, err
		}
		p.Spec.InitContainers = append(p.Spec.InitContainers, x)
	}
	for _, c := range ps.Containers {
		x, err := mk(c, false)
		if err != nil {
			return nil, err
		}
		p.Spec.Containers = append(p.Spec.Containers, x)
	}
	if len(p.Spec.Containers) == 0 {
		return nil, errors.New("pod.containers must hold at least one container")
	}
	return p, nil
}

func allContainers(p *v1.Pod) []*v1.Container {
	var out []*v1.Container
	for i := range p.Spec.InitContainers {
		out = append(out, &p.Spec.InitContainers[i])
	}
	for i := range p.Spec.Containers {
		out = append(out, &p.Spec.Containers[i])
	}
	return out
}

func ms(d time.Duration) float64 { return math.Round(float64(d.Microseconds())/100) / 10 }

// ---------------------------------------------------------------- ops

func (s *server) opStart(r *request) (obj, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dm != nil {
		return nil, fmt.Errorf("the kubelet is already running on %s (stop or crash it first)", s.sock)
	}
	// A field left out keeps its value from the previous start (a restarted kubelet keeps its
	// configuration); on the first start: numa_nodes 2, policy none, scope container.
	if r.Dir == "" {
		r.Dir = s.dir
	}
	if r.Dir == "" {
		return nil, errors.New("start needs dir (the first time)")
	}
	dir, err := filepath.Abs(r.Dir)
	if err != nil {
		return nil, err
	}
	sock := filepath.Join(dir, "kubelet.sock")
	if len(sock) > maxSocketPath {
		return nil, fmt.Errorf("socket path %s is %d bytes; unix socket paths are limited to %d: use a shorter dir", sock, len(sock), maxSocketPath)
	}
	n := 2
	if s.numa > 0 {
		n = s.numa
	}
	if r.NumaNodes != nil {
		n = *r.NumaNodes
	}
	if n < 1 || n > 64 {
		return nil, fmt.Errorf("numa_nodes must be 1..64 (the Topology Manager itself allows at most 8 with a policy other than none), got %d", n)
	}
	policy, scope, popts := r.Policy, r.Scope, r.PolicyOptions
	if policy == "" {
		policy = s.policy
	}
	if policy == "" {
		policy = topologymanager.PolicyNone
	}
	if scope == "" {
		scope = s.scope
	}
	if scope == "" {
		scope = "container"
	}
	if popts == nil {
		popts = s.policyOptions
	}
	nodes := make([]cadvisorapi.Node, n)
	for i := range nodes {
		nodes[i].Id = i
	}
	tm, err := topologymanager.NewManager(nodes, policy, scope, popts)
	if err != nil {
		return nil, fmt.Errorf("topology manager: %v", err)
	}
	dm, err := devicemanager.ServeNewManagerImplAt(sock, nodes, tm)
	if err != nil {
		return nil, fmt.Errorf("device manager: %v", err)
	}
	tm.AddHintProvider(dm)
	_, cpErr := os.Stat(filepath.Join(dir, checkpointName))
	t0 := time.Now()
	klogs.reset(t0)
	s.mu.Unlock() // Start calls activePods
	err = dm.Start(s.activePods, readyAlways{}, containermap.NewContainerMap(), sets.New[string]())
	s.mu.Lock()
	if err != nil {
		_ = dm.Stop()
		return nil, fmt.Errorf("device manager start: %v", err)
	}
	s.dm, s.tm, s.dir, s.sock, s.policy, s.scope, s.numa, s.started = dm, tm, dir, sock, policy, scope, n, t0
	s.policyOptions = popts
	s.inactive = sets.New[string]()
	restored := obj{}
	for name, res := range dm.ServeResources() {
		restored[name] = obj{"allocated": len(res.Allocated), "endpoint_stopped": res.Stopped}
	}
	return obj{"dir": dir, "socket": sock, "checkpoint_found": cpErr == nil, "restored": restored, "pods": len(s.pods),
		"policy": policy, "scope": scope, "numa_nodes": n, "start_ms": ms(time.Since(t0))}, nil
}

func (s *server) opStop(crash bool) (obj, error) {
	s.mu.Lock()
	dm, sock := s.dm, s.sock
	s.mu.Unlock()
	if dm == nil {
		if crash {
			return nil, errors.New("the kubelet is not running")
		}
		return obj{"was_running": false}, nil
	}
	if crash {
		if err := dm.ServeKeepSocketOnStop(); err != nil {
			return nil, fmt.Errorf("crash: %v (the kubelet is still running)", err)
		}
	}
	t0 := time.Now()
	err := dm.Stop()
	dm.ServeCloseCheckpoints()
	s.mu.Lock()
	s.dm, s.tm = nil, nil
	s.mu.Unlock()
	_, statErr := os.Stat(sock)
	out := obj{"was_running": true, "socket_left": statErr == nil, "stop_ms": ms(time.Since(t0))}
	if err != nil {
		out["stop_error"] = err.Error()
	}
	return out, nil
}

func quantities(rl v1.ResourceList) obj {
	out := obj{}
	for k, q := range rl {
		out[string(k)] = q.Value()
	}
	return out
}

// capacity: GetCapacity, as the kubelet's node status sync calls it.
func (s *server) capacity(dm *devicemanager.ManagerImpl) (v1.ResourceList, v1.ResourceList) {
	c, a, inactive := dm.GetCapacity()
	if len(inactive) > 0 {
		s.mu.Lock()
		s.inactive.Insert(inactive...)
		s.mu.Unlock()
	}
	return c, a
}

func (s *server) opCapacity() (obj, error) {
	dm, _, err := s.running()
	if err != nil {
		return nil, err
	}
	c, a := s.capacity(dm)
	s.mu.Lock()
	inactive := sets.List(s.inactive)
	s.inactive = sets.New[string]()
	s.mu.Unlock()
	return obj{"capacity": quantities(c), "allocatable": quantities(a), "inactive": inactive}, nil
}

func devList(ds []devicemanager.ServeDevice) []obj {
	out := make([]obj, 0, len(ds))
	for _, d := range ds {
		var numa any
		if d.NUMA != nil {
			numa = d.NUMA
		}
		out = append(out, obj{"id": d.ID, "numa": numa})
	}
	return out
}

func (s *server) opDevices() (obj, error) {
	dm, _, err := s.running()
	if err != nil {
		return nil, err
	}
	out := obj{}
	for name, r := range dm.ServeResources() {
		var opts any
		if r.Options != nil {
			opts = obj{"pre_start_required": r.Options.PreStartRequired,
				"get_preferred_allocation_available": r.Options.GetPreferredAllocationAvailable}
		}
		allocated := r.Allocated
		if allocated == nil {
			allocated = []string{}
		}
		out[name] = obj{"healthy": devList(r.Healthy), "unhealthy": devList(r.Unhealthy), "allocated": allocated,
			"endpoint": r.Endpoint, "endpoint_stopped": r.Stopped, "options": opts}
	}
	return obj{"resources": out}, nil
}

func deviceIDs(dm *devicemanager.ManagerImpl, uid types.UID, container string) obj {
	out := obj{}
	for res, devs := range dm.GetDevices(string(uid), container) {
		ids := make([]string, 0, len(devs))
		for id := range devs {
			ids = append(ids, id)
		}
		sort.Strings(ids)
		out[res] = ids
	}
	return out
}

// runOptions: GetDeviceRunContainerOptions, as the kubelet calls it when it starts a container.
func runOptions(dm *devicemanager.ManagerImpl, p *v1.Pod, c *v1.Container) (obj, error) {
	o, err := dm.GetDeviceRunContainerOptions(p, c)
	if err != nil {
		return nil, err
	}
	devs, mounts, cdi := []obj{}, []obj{}, []string{}
	envs, annotations := map[string]string{}, map[string]string{}
	if o != nil {
		for _, d := range o.Devices {
			devs = append(devs, obj{"host": d.PathOnHost, "container": d.PathInContainer, "permissions": d.Permissions})
		}
		for _, e := range o.Envs {
			envs[e.Name] = e.Value
		}
		for _, m := range o.Mounts {
			mounts = append(mounts, obj{"host": m.HostPath, "container": m.ContainerPath, "read_only": m.ReadOnly})
		}
		for _, a := range o.Annotations {
			annotations[a.Name] = a.Value
		}
		for _, d := range o.CDIDevices {
			cdi = append(cdi, d.Name)
		}
	}
	return obj{"devices": devs, "envs": envs, "mounts": mounts, "annotations": annotations, "cdi_devices": cdi,
		"device_ids": deviceIDs(dm, p.UID, c.Name)}, nil
}

// opAdmit: the kubelet's admission for device plugin resources (the pod is in the pod manager, so
// active, while the Topology Manager's admit handler computes hints and calls the device manager's
// Allocate for every container), then GetDeviceRunContainerOptions for every container, init
// containers first, as the pod worker does when it starts them.
func (s *server) opAdmit(r *request) (obj, error) {
	dm, tm, err := s.running()
	if err != nil {
		return nil, err
	}
	if r.Pod == nil {
		return nil, errors.New("admit needs pod")
	}
	pod, err := r.Pod.toPod()
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	others := make([]*v1.Pod, 0, len(s.pods))
	for uid, p := range s.pods {
		if uid != pod.UID {
			others = append(others, p)
		}
	}
	_, readmit := s.pods[pod.UID]
	s.pods[pod.UID] = pod
	s.mu.Unlock()
	t0 := time.Now()
	res := tm.Admit(&lifecycle.PodAdmitAttributes{Pod: pod, OtherPods: others})
	admitMs := ms(time.Since(t0))
	if !res.Admit {
		// the kubelet rejects the pod (phase Failed): it is no longer active
		s.mu.Lock()
		delete(s.pods, pod.UID)
		s.mu.Unlock()
		return obj{"ok": false, "admitted": false, "readmission": readmit, "reason": res.Reason, "error": res.Message, "admit_ms": admitMs}, nil
	}
	containers := obj{}
	for _, c := range allContainers(pod) {
		o, err := runOptions(dm, pod, c)
		if err != nil {
			return obj{"ok": false, "admitted": true, "readmission": readmit, "container": c.Name, "error": err.Error(),
				"admit_ms": admitMs, "containers": containers}, nil
		}
		containers[c.Name] = o
	}
	return obj{"admitted": true, "readmission": readmit, "admit_ms": admitMs, "containers": containers}, nil
}

func (s *server) opRemove(r *request) (obj, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r.All {
		n := len(s.pods)
		s.pods = map[types.UID]*v1.Pod{}
		return obj{"removed": n}, nil
	}
	if r.UID == "" {
		return nil, errors.New("remove needs uid (or all: true)")
	}
	_, ok := s.pods[types.UID(r.UID)]
	delete(s.pods, types.UID(r.UID))
	n := 0
	if ok {
		n = 1
	}
	return obj{"removed": n}, nil
}

func (s *server) podOf(r *request) (*v1.Pod, error) {
	if r.Pod != nil {
		return r.Pod.toPod()
	}
	if r.UID == "" {
		return nil, errors.New("give pod (a pod spec) or uid (an admitted pod)")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	p, ok := s.pods[types.UID(r.UID)]
	if !ok {
		return nil, fmt.Errorf("no active pod with uid %q", r.UID)
	}
	return p, nil
}

func hintList(hs []topologymanager.TopologyHint) any {
	if hs == nil {
		return nil // no NUMA preference
	}
	out := make([]obj, 0, len(hs))
	for _, h := range hs {
		var nodes any
		if h.NUMANodeAffinity != nil {
			nodes = h.NUMANodeAffinity.GetBits()
		}
		out = append(out, obj{"numa_nodes": nodes, "preferred": h.Preferred})
	}
	return out
}

// opHints: the device manager's GetTopologyHints for one container (container scope), or
// GetPodTopologyHints when no container is given (pod scope).
func (s *server) opHints(r *request) (obj, error) {
	dm, _, err := s.running()
	if err != nil {
		return nil, err
	}
	pod, err := s.podOf(r)
	if err != nil {
		return nil, err
	}
	var hints map[string][]topologymanager.TopologyHint
	if r.Container == nil {
		hints = dm.GetPodTopologyHints(pod)
	} else {
		var c *v1.Container
		for _, x := range allContainers(pod) {
			if x.Name == *r.Container {
				c = x
			}
		}
		if c == nil {
			return nil, fmt.Errorf("pod %q has no container %q", pod.Name, *r.Container)
		}
		hints = dm.GetTopologyHints(pod, c)
	}
	out := obj{}
	for res, hs := range hints {
		out[res] = hintList(hs)
	}
	return obj{"hints": out}, nil
}

func (s *server) opRunOptions(r *request) (obj, error) {
	dm, _, err := s.running()
	if err != nil {
		return nil, err
	}
	if r.UID == "" {
		return nil, errors.New("run_options needs uid")
	}
	pod, err := s.podOf(&request{UID: r.UID})
	if err != nil {
		return nil, err
	}
	containers := obj{}
	for _, c := range allContainers(pod) {
		if r.Container != nil && c.Name != *r.Container {
			continue
		}
		o, err := runOptions(dm, pod, c)
		if err != nil {
			return obj{"ok": false, "container": c.Name, "error": err.Error(), "containers": containers}, nil
		}
		containers[c.Name] = o
	}
	if r.Container != nil && len(containers) == 0 {
		return nil, fmt.Errorf("pod %q has no container %q", pod.Name, *r.Container)
	}
	return obj{"containers": containers}, nil
}

func (s *server) opPods() (obj, error) {
	s.mu.Lock()
	dm := s.dm
	pods := make([]*v1.Pod, 0, len(s.pods))
	for _, p := range s.pods {
		pods = append(pods, p)
	}
	s.mu.Unlock()
	sort.Slice(pods, func(i, j int) bool { return pods[i].UID < pods[j].UID })
	out := []obj{}
	for _, p := range pods {
		e := obj{"uid": string(p.UID), "name": p.Name, "namespace": p.Namespace}
		if dm != nil {
			cs := obj{}
			for _, c := range allContainers(p) {
				cs[c.Name] = deviceIDs(dm, p.UID, c.Name)
			}
			e["device_ids"] = cs
		}
		out = append(out, e)
	}
	return obj{"pods": out}, nil
}

func (s *server) opWait(r *request) (obj, error) {
	dm, _, err := s.running()
	if err != nil {
		return nil, err
	}
	if r.For == nil || (len(r.For.Capacity) == 0 && len(r.For.Allocatable) == 0 && len(r.For.Registrations) == 0) {
		return nil, errors.New("wait needs for: {capacity: {...}, allocatable: {...}, registrations: {...}}")
	}
	type cond struct {
		absent bool
		n      int64
	}
	parse := func(m map[string]json.RawMessage) (map[string]cond, error) {
		out := map[string]cond{}
		for k, raw := range m {
			if strings.TrimSpace(string(raw)) == "null" {
				out[k] = cond{absent: true}
				continue
			}
			q, err := quantity(raw)
			if err != nil {
				return nil, fmt.Errorf("for %q: %v", k, err)
			}
			out[k] = cond{n: q.Value()}
		}
		return out, nil
	}
	wantC, err := parse(r.For.Capacity)
	if err != nil {
		return nil, err
	}
	wantA, err := parse(r.For.Allocatable)
	if err != nil {
		return nil, err
	}
	match := func(want map[string]cond, have v1.ResourceList) bool {
		for k, w := range want {
			q, ok := have[v1.ResourceName(k)]
			if w.absent != !ok || (ok && q.Value() != w.n) {
				return false
			}
		}
		return true
	}
	timeout := 10 * time.Second
	if r.TimeoutMs != nil {
		timeout = time.Duration(*r.TimeoutMs * float64(time.Millisecond))
	}
	t0 := time.Now()
	for {
		c, a := s.capacity(dm)
		regs, _, _ := klogs.counts()
		ok := match(wantC, c) && match(wantA, a)
		for k, n := range r.For.Registrations {
			if regs[k] < n {
				ok = false
			}
		}
		el := time.Since(t0)
		if ok || el >= timeout {
			return obj{"ok": ok, "elapsed_ms": ms(el), "capacity": quantities(c), "allocatable": quantities(a), "registrations": regs}, nil
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// recorder polls GetCapacity every 2 ms in the background (across stop, crash and start: while no
// kubelet runs it records running false) and keeps every change.
type recorder struct {
	stop, done chan struct{}
	t0         time.Time
	trans      []obj
	dropped    int
	polls      int
	minC, minA map[string]int64
}

const maxTransitions = 20000

func (s *server) opRecordStart() (obj, error) {
	s.mu.Lock()
	old := s.rec
	s.rec = nil
	s.mu.Unlock()
	if old != nil {
		close(old.stop)
		<-old.done
	}
	r := &recorder{stop: make(chan struct{}), done: make(chan struct{}), t0: time.Now(), minC: map[string]int64{}, minA: map[string]int64{}}
	go func() {
		defer close(r.done)
		last := ""
		for {
			s.mu.Lock()
			dm := s.dm
			s.mu.Unlock()
			e := obj{"running": dm != nil}
			if dm != nil {
				c, a := s.capacity(dm)
				for k, q := range c {
					if v, ok := r.minC[string(k)]; !ok || q.Value() < v {
						r.minC[string(k)] = q.Value()
					}
				}
				for k, q := range a {
					if v, ok := r.minA[string(k)]; !ok || q.Value() < v {
						r.minA[string(k)] = q.Value()
					}
				}
				e["capacity"], e["allocatable"] = quantities(c), quantities(a)
			}
			r.polls++
			key, _ := json.Marshal(e)
			if string(key) != last {
				last = string(key)
				e["ms"] = ms(time.Since(r.t0))
				if len(r.trans) < maxTransitions {
					r.trans = append(r.trans, e)
				} else {
					r.dropped++
				}
			}
			select {
			case <-r.stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
		}
	}()
	s.mu.Lock()
	s.rec = r
	s.mu.Unlock()
	return obj{}, nil
}

func (s *server) opRecordStop() (obj, error) {
	s.mu.Lock()
	r := s.rec
	s.rec = nil
	s.mu.Unlock()
	if r == nil {
		return nil, errors.New("not recording (send record_start first)")
	}
	close(r.stop)
	<-r.done
	out := obj{"transitions": r.trans, "polls": r.polls, "ms": ms(time.Since(r.t0)),
		"min_capacity": r.minC, "min_allocatable": r.minA}
	if r.dropped > 0 {
		out["transitions_dropped"] = r.dropped
	}
	return out, nil
}

func version() obj {
	k8s := "unknown"
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			if d.Path == "k8s.io/kubernetes" {
				k8s = d.Version
				if d.Replace != nil {
					k8s += " (" + d.Replace.Path + " " + d.Replace.Version + ")"
				}
			}
		}
	}
	return obj{"kubernetes": k8s, "feature_gates": obj{
		"DevicePluginCDIDevices": utilfeature.DefaultFeatureGate.Enabled(features.DevicePluginCDIDevices),
		"ResourceHealthStatus":   utilfeature.DefaultFeatureGate.Enabled(features.ResourceHealthStatus),
	}}
}

func (s *server) opStatus() (obj, error) {
	s.mu.Lock()
	out := obj{"running": s.dm != nil, "pods": len(s.pods)}
	if s.dir != "" { // the running kubelet's, or the last one's: what a bare start reuses
		out["dir"], out["socket"], out["policy"], out["scope"], out["numa_nodes"] = s.dir, s.sock, s.policy, s.scope, s.numa
	}
	if s.dm != nil {
		out["started_ms_ago"] = ms(time.Since(s.started))
	}
	s.mu.Unlock()
	regs, updates, regMs := klogs.counts()
	out["registrations"], out["updates"], out["registration_log"] = regs, updates, regMs
	for k, v := range version() {
		out[k] = v
	}
	return out, nil
}

// ---------------------------------------------------------------- main loop

func (s *server) handle(line []byte) (resp obj, quit bool) {
	var r request
	defer func() {
		if p := recover(); p != nil {
			resp = obj{"ok": false, "error": fmt.Sprintf("internal error: %v", p)}
			klog.ErrorS(nil, "kubelet-dm-serve: panic in request", "op", r.Op, "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
		}
		if r.ID != nil {
			resp["id"] = r.ID
		}
	}()
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&r); err != nil {
		return obj{"ok": false, "error": "bad request: " + err.Error()}, false
	}
	var out obj
	var err error
	switch r.Op {
	case "start":
		out, err = s.opStart(&r)
	case "stop":
		out, err = s.opStop(false)
	case "crash":
		out, err = s.opStop(true)
	case "capacity":
		out, err = s.opCapacity()
	case "devices":
		out, err = s.opDevices()
	case "admit":
		out, err = s.opAdmit(&r)
	case "remove":
		out, err = s.opRemove(&r)
	case "hints":
		out, err = s.opHints(&r)
	case "run_options":
		out, err = s.opRunOptions(&r)
	case "pods":
		out, err = s.opPods()
	case "wait":
		out, err = s.opWait(&r)
	case "status":
		out, err = s.opStatus()
	case "record_start":
		out, err = s.opRecordStart()
	case "record_stop":
		out, err = s.opRecordStop()
	case "quit":
		out, err = s.opStop(false)
		quit = true
	case "":
		err = errors.New("bad request: no op")
	default:
		err = fmt.Errorf("unknown op %q (start stop crash capacity devices admit remove hints run_options pods wait record_start record_stop status quit)", r.Op)
	}
	if err != nil {
		return obj{"ok": false, "error": err.Error()}, quit
	}
	if _, ok := out["ok"]; !ok {
		out["ok"] = true
	}
	return out, quit
}

func main() {
	klogPath := flag.String("klog", "", "write the kubelet's klog (device manager, Topology Manager, gRPC) to this file (default: discard)")
	verbosity := flag.Int("v", 4, "klog verbosity")
	showVersion := flag.Bool("version", false, "print the Kubernetes version and feature gates as one JSON line and exit")
	flag.Parse()
	if *showVersion {
		b, _ := json.Marshal(version())
		fmt.Println(string(b))
		return
	}

	// stdout belongs to the protocol: keep a private copy of it and point fd 1 at stderr, so that
	// nothing else (a library's print) can ever reach the protocol stream.
	protoFd, err := syscall.Dup(1)
	if err != nil {
		fmt.Fprintln(os.Stderr, "kubelet-dm-serve: dup stdout:", err)
		os.Exit(2)
	}
	syscall.CloseOnExec(protoFd)
	if err := syscall.Dup3(2, 1, 0); err != nil {
		fmt.Fprintln(os.Stderr, "kubelet-dm-serve: redirect stdout:", err)
		os.Exit(2)
	}
	proto := os.NewFile(uintptr(protoFd), "protocol")
	os.Stdout = os.Stderr

	kfs := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(kfs)
	_ = kfs.Set("v", fmt.Sprint(*verbosity))
	if *klogPath != "" {
		f, err := os.OpenFile(*klogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			fmt.Fprintln(os.Stderr, "kubelet-dm-serve: -klog:", err)
			os.Exit(2)
		}
		klogs.w = f
	}
	klog.SetLogger(logr.New(&sink{l: klogs}))
	gw := &klogWriter{}
	grpclog.SetLoggerV2(grpclog.NewLoggerV2(io.Discard, gw, gw))

	s := &server{pods: map[types.UID]*v1.Pod{}, inactive: sets.New[string]()}

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		<-sig
		s.mu.Lock()
		dm := s.dm
		s.mu.Unlock()
		if dm != nil {
			_ = dm.Stop()
			dm.ServeCloseCheckpoints()
		}
		os.Exit(0)
	}()

	in := bufio.NewReaderSize(os.Stdin, 1<<16)
	for {
		line, err := in.ReadBytes('\n')
		if len(bytes.TrimSpace(line)) > 0 {
			resp, quit := s.handle(line)
			var b bytes.Buffer
			enc := json.NewEncoder(&b)
			enc.SetEscapeHTML(false)
			if e := enc.Encode(resp); e != nil {
				b.Reset()
				fmt.Fprintf(&b, "{\"ok\":false,\"error\":%q}\n", "cannot encode the response: "+e.Error())
			}
			if _, e := proto.Write(b.Bytes()); e != nil {
				break // the reader is gone
			}
			if quit {
				return
			}
		} else if err == nil {
			_, _ = proto.Write([]byte("{\"ok\":false,\"error\":\"empty request\"}\n"))
		}
		if err != nil {
			break // EOF: the client is gone
		}
	}
	s.mu.Lock()
	dm := s.dm
	s.mu.Unlock()
	if dm != nil {
		_ = dm.Stop()
		dm.ServeCloseCheckpoints()
	}
}

// klogWriter sends gRPC's own warnings and errors to the klog file.
type klogWriter struct{}

func (klogWriter) Write(p []byte) (int, error) {
	klog.InfoS("grpc", "msg", strings.TrimSpace(string(p)))
	return len(p), nil
}
