// Added to the package k8s.io/kubernetes/pkg/kubelet/cm/devicemanager (the version pinned in
// kube/go.mod) when kubelet-managers is built: scripts/kube-build.sh adds it with `go build -overlay`,
// so the module's own source is never modified. Ported from kubelet-dm-serve's file for v1.32.10
// (kube/v1.32/overlay), with v1.37's explicit loggers.
//
// It adds no behaviour to the device manager. It exposes:
//   - the unexported constructor, so the registration socket can live outside
//     /var/lib/kubelet/device-plugins;
//   - read-only views of the manager's state (devices, endpoints, allocations);
//   - one switch for a crash-like stop: the registration socket file is left in place, as after a
//     SIGKILL, instead of being unlinked when the listener closes;
//   - a gate around the manager's checkpoint writer that closes after Stop: a write in flight is
//     finished, later ones (from a plugin callback still running) are dropped, as they would be
//     once the kubelet process is gone. Otherwise an old manager could overwrite the checkpoint of
//     the next one in the same process, which a real kubelet restart cannot do.
//
// Every name starts with Serve, so the file can sit next to other harness files in the package.

package devicemanager

import (
	"fmt"
	"net"
	"reflect"
	"sort"
	"sync"
	"time"
	"unsafe"

	cadvisorapi "github.com/google/cadvisor/lib/model"
	"google.golang.org/grpc"
	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	"k8s.io/kubernetes/pkg/kubelet/checkpointmanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
)

// ServeNewManagerImplAt is newManagerImpl with a chosen registration socket path (absolute; the
// checkpoint goes to the same directory), exactly as NewManagerImpl calls it with
// /var/lib/kubelet/device-plugins/kubelet.sock. Its checkpoint manager is wrapped in a gate that
// ServeCloseCheckpoints closes.
func ServeNewManagerImplAt(logger klog.Logger, socketPath string, topology []cadvisorapi.Node, store topologymanager.Store) (*ManagerImpl, error) {
	m, err := newManagerImpl(logger, socketPath, topology, store)
	if err != nil {
		return nil, err
	}
	m.checkpointManager = &serveCheckpointGate{CheckpointManager: m.checkpointManager}
	return m, nil
}

type serveCheckpointGate struct {
	checkpointmanager.CheckpointManager
	mu       sync.Mutex
	closed   bool
	inflight sync.WaitGroup
}

func (g *serveCheckpointGate) CreateCheckpoint(key string, cp checkpointmanager.Checkpoint) error {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return fmt.Errorf("kubelet-managers: this kubelet was stopped, its checkpoint write is dropped")
	}
	g.inflight.Add(1)
	g.mu.Unlock()
	defer g.inflight.Done()
	return g.CheckpointManager.CreateCheckpoint(key, cp)
}

func (g *serveCheckpointGate) RemoveCheckpoint(key string) error {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return fmt.Errorf("kubelet-managers: this kubelet was stopped, its checkpoint removal is dropped")
	}
	g.inflight.Add(1)
	g.mu.Unlock()
	defer g.inflight.Done()
	return g.CheckpointManager.RemoveCheckpoint(key)
}

// ServeCloseCheckpoints, called after Stop, waits for a checkpoint write in flight and drops any
// later one: from then on this manager writes nothing to its directory.
func (m *ManagerImpl) ServeCloseCheckpoints() {
	g, ok := m.checkpointManager.(*serveCheckpointGate)
	if !ok {
		return
	}
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
	g.inflight.Wait()
}

// ServeDevice is one device as the manager holds it.
type ServeDevice struct {
	ID   string
	NUMA []int64 // the plugin's TopologyInfo node IDs; nil when it gave none (or the device is unknown)
}

// ServeResource is the manager's view of one resource.
type ServeResource struct {
	Healthy   []ServeDevice                  // m.healthyDevices: what capacity and allocatable count
	Unhealthy []ServeDevice                  // m.unhealthyDevices: counted in capacity only
	Allocated []string                       // m.allocatedDevices: in use by pods (freed at the next allocation when a pod is gone)
	Endpoint  bool                           // the manager holds an endpoint for the resource
	Stopped   bool                           // that endpoint is stopped: the plugin disconnected, or it was restored from the checkpoint
	Options   *pluginapi.DevicePluginOptions // copy of the options the plugin gave at registration; nil if none
}

// ServeResources returns a copy of the manager's per-resource state.
func (m *ManagerImpl) ServeResources() map[string]ServeResource {
	m.mutex.Lock()
	defer m.mutex.Unlock()
	names := map[string]bool{}
	for r := range m.healthyDevices {
		names[r] = true
	}
	for r := range m.unhealthyDevices {
		names[r] = true
	}
	for r := range m.endpoints {
		names[r] = true
	}
	for r, s := range m.allocatedDevices {
		if s.Len() > 0 {
			names[r] = true
		}
	}
	devs := func(r string, ids []string) []ServeDevice {
		sort.Strings(ids)
		out := make([]ServeDevice, 0, len(ids))
		for _, id := range ids {
			d := ServeDevice{ID: id}
			if dev, ok := m.allDevices[r][id]; ok && dev.Topology != nil {
				for _, n := range dev.Topology.Nodes {
					if n != nil {
						d.NUMA = append(d.NUMA, n.ID)
					}
				}
			}
			out = append(out, d)
		}
		return out
	}
	res := map[string]ServeResource{}
	for r := range names {
		s := ServeResource{
			Healthy:   devs(r, m.healthyDevices[r].UnsortedList()),
			Unhealthy: devs(r, m.unhealthyDevices[r].UnsortedList()),
			Allocated: m.allocatedDevices[r].UnsortedList(),
		}
		sort.Strings(s.Allocated)
		if e, ok := m.endpoints[r]; ok {
			s.Endpoint = true
			s.Stopped = e.e.isStopped()
			if e.opts != nil {
				s.Options = &pluginapi.DevicePluginOptions{
					PreStartRequired:                e.opts.PreStartRequired,
					GetPreferredAllocationAvailable: e.opts.GetPreferredAllocationAvailable,
				}
			}
		}
		res[r] = s
	}
	return res
}

// ServeKeepSocketOnStop makes the next Stop leave the registration socket file (kubelet.sock) in
// place, as a killed kubelet does: the listening socket closes, the file stays (same inode), and no
// file system event is generated. Without it, Stop unlinks the file (Go's net.UnixListener does that
// on Close). It reaches the listener through the registration server's gRPC server; it waits up to
// 1 s for that server to have taken its listener (it does so in a goroutine right after Start).
func (m *ManagerImpl) ServeKeepSocketOnStop() error {
	deadline := time.Now().Add(time.Second)
	for {
		n, err := m.keepSocketOnStop()
		if err != nil {
			return err
		}
		if n > 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the registration server holds no unix listener")
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// field returns an addressable, usable view of struct field name of v (a struct value reached
// through a pointer), unexported or not.
func serveField(v reflect.Value, name string) (reflect.Value, error) {
	f := v.FieldByName(name)
	if !f.IsValid() || !f.CanAddr() {
		return reflect.Value{}, fmt.Errorf("no addressable field %q in %v", name, v.Type())
	}
	return reflect.NewAt(f.Type(), unsafe.Pointer(f.UnsafeAddr())).Elem(), nil
}

func (m *ManagerImpl) keepSocketOnStop() (int, error) {
	sv := reflect.ValueOf(m.server)
	if sv.Kind() != reflect.Pointer || sv.IsNil() || sv.Elem().Kind() != reflect.Struct {
		return 0, fmt.Errorf("unexpected registration server type %T", m.server)
	}
	gf, err := serveField(sv.Elem(), "grpc")
	if err != nil {
		return 0, err
	}
	gs, ok := gf.Interface().(*grpc.Server)
	if !ok {
		return 0, fmt.Errorf("unexpected gRPC server field type %v", gf.Type())
	}
	if gs == nil {
		return 0, fmt.Errorf("the registration server is not running")
	}
	g := reflect.ValueOf(gs).Elem()
	muf, err := serveField(g, "mu")
	if err != nil {
		return 0, err
	}
	mu, ok := muf.Addr().Interface().(*sync.Mutex)
	if !ok {
		return 0, fmt.Errorf("unexpected gRPC server mutex type %v", muf.Type())
	}
	lisf, err := serveField(g, "lis")
	if err != nil {
		return 0, err
	}
	if lisf.Kind() != reflect.Map {
		return 0, fmt.Errorf("unexpected gRPC listener set type %v", lisf.Type())
	}
	mu.Lock()
	defer mu.Unlock()
	n := 0
	for _, k := range lisf.MapKeys() {
		l, _ := k.Interface().(net.Listener)
		// gRPC wraps the listener: listenSocket{net.Listener; channelz}
		if v := reflect.ValueOf(l); v.Kind() == reflect.Pointer && !v.IsNil() && v.Elem().Kind() == reflect.Struct {
			if f, err := serveField(v.Elem(), "Listener"); err == nil {
				l, _ = f.Interface().(net.Listener)
			}
		}
		if ul, ok := l.(*net.UnixListener); ok {
			ul.SetUnlinkOnClose(false)
			n++
		}
	}
	return n, nil
}
